"""Contribution bounding: the per-user rows each user keeps (at most C_u groups), in SQL."""

from __future__ import annotations

import re
from collections.abc import Sequence

from dp_core.errors import InternalError
from dp_core.plan import DPQueryPlan
from dp_core.query import AnalyzedQuery
from dp_core.splice import PH

Prefilter = tuple[str, ...]
"""Type names of the uid and of each key (in order), for `kept_rows` to pick a user's groups
from its rows before aggregating them (`prefilter_types`)."""

_TYPED_HASHES: dict[str, tuple[str, str]] = {
    # type: (its own extended hash function, which equal values share; the value a NULL
    # hashes as, with another key: `_typed_hash`). Only types whose hash is cheap:
    # `hash_array_extended` works for any hashable type but costs more per row than the
    # prefilter saves.
    "text": ("hashtextextended", "''"),
    "varchar": ("hashtextextended", "''"),
    "bpchar": ("hashbpcharextended", "''"),
    "int2": ("hashint2extended", "0"),
    "int4": ("hashint4extended", "0"),
    "int8": ("hashint8extended", "0"),
    "numeric": ("hash_numeric_extended", "0"),
    "float4": ("hashfloat4extended", "0"),
    "float8": ("hashfloat8extended", "0"),
    "uuid": ("uuid_hash_extended", "'00000000-0000-0000-0000-000000000000'"),
}


def prefilter_types(uid_type: str, key_types: Sequence[str]) -> Prefilter | None:
    """The prefilter for a query whose uid and keys have these types (pg_type names), or None
    when one has no cheap hash that equal values share (`_TYPED_HASHES`; keys also need a
    `min` aggregate, which uuid lacks)."""
    types = (uid_type, *key_types)
    if not key_types or uid_type not in _TYPED_HASHES or any(
            t not in _TYPED_HASHES or t == "uuid" for t in key_types):
        return None
    return types


def _typed_hash(expr: str, type_name: str, seed: str) -> str:
    """`expr`'s hash keyed by `seed`; a NULL hashes as its type's `null` value keyed by `seed`
    with its lowest bit flipped, so that it is a group apart from '' (or 0), as in the plain
    pushdown, and ranks independently of it."""
    fn, null = _TYPED_HASHES[type_name]
    return (f"{fn}(COALESCE({expr}, ({null})::{type_name}), "
            f"({seed})::int8 # ({expr} IS NULL)::int4::int8)")


def kept_rows(query: AnalyzedQuery, plan: DPQueryPlan, partials: list[str],
              order_seed: int, prefilter: Prefilter | None = None,
              derived: Sequence[str] = ()) -> tuple[str, str, str]:
    """(WITH-list entries, relation, condition): the per-user rows each user keeps (≤ C_u groups).

    With `prefilter`, a user's rows outside its kept groups are dropped before they are
    aggregated (`_prefiltered_rows`): the same mechanism, much cheaper where users have many
    more groups than C_u, dearer where they have few (a window over every row).

    With row-level aggregates (`Aggregate.row_level`), every (user, group) row is kept, with
    `dp_total`, the user's rows in all its groups (what its weight is computed from), and the
    condition picks the C_u groups where the user has the most rows (ties broken by the
    keyed hash), which its user count goes to; no prefilter then (every group counts).

    `derived`: more columns of the relation, expressions of the per-user rows' columns
    (`expr AS name`), computed once per row: beside the rank with GROUP BY (a query with
    window functions is not merged into the one that reads it), else over the grouped
    per-user rows."""
    keys = [f"{PH}k{i} AS dp_k{i}" for i in range(len(query.keys))]
    row_level = any(a.row_level for a in query.aggregates)
    if prefilter is not None and query.keys and not row_level:
        if derived:
            raise InternalError("derived columns of prefiltered rows")
        return _prefiltered_rows(query, plan, partials, order_seed, prefilter)
    # the user first: rows read in user order (an index on the uid column, or a table
    # clustered by user) then group with small per-user sorts, and the groups come out in
    # the order the window below partitions by, so it sorts nothing but each user's groups
    group_by = ", ".join(str(n) for n in [len(keys) + 1, *range(1, len(keys) + 1)])
    rows = ["count(*) AS dp_total" if not query.keys else "count(*) AS dp_rowcount"] \
        if row_level else []
    per_user = (f"SELECT {', '.join([*keys, f'{PH}uid AS dp_uid', *partials, *rows])} "
                f"FROM {PH}from WHERE {PH}where GROUP BY {group_by}")
    more = "".join(f", {d}" for d in derived)
    if not query.keys:
        if derived:
            per_user = f"SELECT *{more} FROM ({per_user}) AS dp_p"
        return f"dp_per_user AS ({per_user})", "dp_per_user", "TRUE"
    # which groups a user keeps: a keyed hash of (user, group) with a fresh secret key per
    # query: independent across users as random() is, but parallel-safe and cheap to sort.
    # (A hash of the group alone would make every user prefer the same groups.) The same key
    # in every statement of one answer makes them all see the same kept rows.
    # The hash chains: the user's hash keys the first key's, which keys the next one's;
    # cheaper than hashing one concatenated text. A NULL key hashes as '' with its key's
    # lowest bit flipped: no tie with '' (a tie would let the statements of one answer keep
    # different groups), as in the prefiltered form (`_typed_hash`).
    rank = f"hashtextextended(coalesce(dp_uid::text, ''), {int(order_seed)})"
    for i in range(len(keys)):
        rank = (f"hashtextextended(coalesce(dp_k{i}::text, ''), "
                f"({rank}) # (dp_k{i} IS NULL)::int4::int8)")
    if row_level:
        rank = f"dp_rowcount DESC, {rank}"
    window = f"PARTITION BY dp_uid ORDER BY {rank}"
    total = ""
    if row_level:
        # one window for both, framed over the whole partition (Postgres merges equal window
        # clauses): one pass over each user's groups where two windows would be two. (int8:
        # sum() of int8 is numeric, whose divisions per row cost several times more)
        window += " ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING"
        total = f", (sum(dp_rowcount) OVER ({window}))::int8 AS dp_total"
    bounded = f"SELECT *{more}, row_number() OVER ({window}) AS dp_rn{total} FROM dp_per_user"
    return (f"dp_per_user AS ({per_user}), dp_bounded AS ({bounded})", "dp_bounded",
            f"dp_rn <= {int(plan.max_groups_contributed)}")


_ARG_PLACEHOLDER = re.compile(rf"\b{PH}a(\d+)\b")


def _prefiltered_rows(query: AnalyzedQuery, plan: DPQueryPlan, partials: list[str],
                      order_seed: int, types: Prefilter) -> tuple[str, str, str]:
    """`kept_rows` picking each user's groups from its rows:

        dp_rows AS (SELECT keys, uid, arguments, h AS dp_o,
                    dense_rank() OVER (PARTITION BY uid ORDER BY h) AS dp_r FROM ...)
        dp_per_user AS (SELECT min(key) AS key, uid, partials FROM dp_rows
                        WHERE dp_r <= C_u GROUP BY uid, dp_o)

    where h is a keyed hash of (uid, keys) by each type's own hash function, so that all rows
    of one group (equal keys, whatever their texts: numeric 1.0 = 1.00) have one h. A user's
    rows with its C_u smallest h make at most C_u per-user rows, one per h, and never two in
    one group (equal keys have equal h); the rows come out of the window in (uid, h) order,
    so grouping them sorts nothing, and Postgres stops ranking a user's rows at the first
    beyond C_u. A hash tie between two groups of one user (about 2^-64 a pair) makes one
    per-user row of both, labelled with the smaller key: still one row, clamped as any.
    With several keys a tie could label a row with a third group the user also has: there
    the rows are ranked by (h, keys) and grouped by (uid, h, keys), which is exact at the
    cost of sorting by the keys too.
    """
    n = len(query.keys)
    if len(types) != n + 1:
        raise InternalError("a prefilter needs the types of the uid and of every key")
    seed = str(int(order_seed))
    h = _typed_hash(f"{PH}uid", types[0], seed)
    for i in range(n):
        h = _typed_hash(f"{PH}k{i}", types[i + 1], h)
    # each argument once (ANON_SUM(x) and ANON_AVG(x) read one column, whose sums Postgres
    # then computes once)
    same: dict[int, int] = {}
    for i in sorted({int(m) for p in partials for m in _ARG_PLACEHOLDER.findall(p)}):
        arg = query.aggregates[i].arg
        same[i] = next((j for j in same.values() if query.aggregates[j].arg == arg), i)
    order = [h] if n == 1 else [h, *(f"{PH}k{i}" for i in range(n))]
    cols = [*(f"{PH}k{i} AS dp_k{i}" for i in range(n)), f"{PH}uid AS dp_uid",
            *(f"{PH}a{i} AS dp_a{i}" for i in sorted(set(same.values()))), f"{h} AS dp_o",
            f"dense_rank() OVER (PARTITION BY {PH}uid ORDER BY {', '.join(order)}) AS dp_r"]
    rows = f"SELECT {', '.join(cols)} FROM {PH}from WHERE {PH}where"
    keys = [f"dp_k{i}" for i in range(n)]
    labels = ["min(dp_k0) AS dp_k0"] if n == 1 else keys
    own = [_ARG_PLACEHOLDER.sub(lambda m: f"dp_a{same[int(m[1])]}", p) for p in partials]
    per_user = (f"SELECT {', '.join([*labels, 'dp_uid', *own])} FROM dp_rows "
                f"WHERE dp_r <= {int(plan.max_groups_contributed)} "
                f"GROUP BY {', '.join(['dp_uid', 'dp_o', *([] if n == 1 else keys)])}")
    return f"dp_rows AS ({rows}), dp_per_user AS ({per_user})", "dp_per_user", "TRUE"
