"""The pushdown statements one DP answer runs: our SQL templates, with the query spliced in.

The pushdown's structure is our own SQL template, parsed by pglast; the user's
(validated, totalised) expressions are spliced in as AST nodes where the
template has placeholders, and the result is printed by pglast. No user text
is ever concatenated into SQL. Postgres returns one row per group:

    WITH dp_per_user AS (SELECT keys, uid, per-user partials FROM ... WHERE ...
                         GROUP BY uid, keys),
         dp_bounded AS (SELECT *, row_number() OVER (PARTITION BY dp_uid
                        ORDER BY keyed hash of (uid, keys)) AS dp_rn FROM dp_per_user)
    SELECT keys, count(*) AS dp_users, sums of clamped partials
    FROM dp_bounded WHERE dp_rn <= C_u GROUP BY keys

The pieces live in their own modules: the per-user partials and their clamping
(dp_core.partials), the rows each user keeps (dp_core.bounding), the splicing
(dp_core.splice) and the uid ranges a pushdown is split over (dp_core.uid_ranges).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from pglast import ast
from pglast.enums import BoolExprType
from pglast.stream import RawStream

from dp_core.binned import (
    ValueClasses,
    binned_plan,
    value_bin,
    value_bin_columns,
    value_bin_count,
    value_bin_partials,
)
from dp_core.bounding import Prefilter, kept_rows
from dp_core.errors import InternalError
from dp_core.group_columns import key_columns, key_hashes, per_user_sum
from dp_core.join_fence import fenced
from dp_core.partials import (
    check_number,
    f8,
    partial,
    row_value,
    value,
    weighted,
)
from dp_core.plan import Component, DPQueryPlan, reads_user_count
from dp_core.quantiles import EDGES, LEAVES, LEVEL_DIVISORS, LEVEL_OFFSETS
from dp_core.query import AggKind, AnalyzedQuery, Bounds
from dp_core.result import quoted
from dp_core.splice import PH, Splice
from dp_core.sql_parse import parse_sql
from dp_core.tuning import ROW_EDGES, groups_threshold
from dp_core.uid_ranges import UidRange, fill_range, null_uids, uid_in


def binned(plan: DPQueryPlan) -> bool:
    """Whether the main statement returns its row-level sums per bin of the users' row
    counts (`dp_core.binned`): where T is chosen from the data and every other final adds
    up over bins (COUNT(DISTINCT x, k)'s does not: the tuning statement runs first there)."""
    return plan.rows_pending and not any(q.component == Component.DISTINCT
                                         for q in plan.quantities)


def _template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
              order_seed: int, prefilter: Prefilter | None = None, whole: bool = True
              ) -> str | None:
    """The main statement; `whole`: over every user (not one of several uid ranges)."""
    if binned(plan):
        return _binned_template(query, plan, arg_types, order_seed, whole)
    partials = [partial(i, agg, arg_types.get(i)) for i, agg in enumerate(query.aggregates)
                if not reads_user_count(agg) and agg.kind is not AggKind.QUANTILE]
    finals: list[str] = []
    # COUNT(DISTINCT x): each user's values (an array per user and group) are unnested, a
    # row each (`_unnested`), and counted once per group; the other aggregates read the
    # first row of each (user, group) only
    distinct = [value(q.aggregate, query.aggregates[q.aggregate], None)
                for q in plan.quantities
                if q.component == Component.DISTINCT and q.aggregate is not None]
    first = ["(dp_o IS NULL OR dp_o = 1)"] if distinct else []
    # with row-level aggregates every (user, group) row is read: the rest read the kept ones
    row_level = bool(query.keys) and any(a.row_level for a in query.aggregates)
    kept_only = [f"dp_rn <= {int(plan.max_groups_contributed)}"] if row_level else []
    if plan.threshold is not None or plan.shared_users or query.public_groups:
        # (public groups: not released, but a row for each group with users, quantiles too)
        finals.append(f"count(*){_filter(kept_only + first)} AS dp_users")
    for q in plan.quantities:
        if q.component in (Component.USERS, Component.TREE):
            continue  # dp_users, above; trees have their own statement
        assert q.aggregate is not None
        agg = query.aggregates[q.aggregate]
        if agg.row_level:
            weight = f"LEAST((1.0)::float8, ({plan.rows_for(agg) or 1})::float8 / dp_total)"
            finals.append(f"{weighted(q.aggregate, agg, q.component, weight)}{_filter(first)} "
                          f"AS {q.name}")
            continue
        lo, hi = agg.known_bounds.lower, agg.known_bounds.upper
        p = value(q.aggregate, agg, arg_types.get(q.aggregate))
        if q.component == Component.DISTINCT:
            finals.append(f"count(DISTINCT dp_d{distinct.index(p)}){_filter(kept_only)} "
                          f"AS {q.name}")
        else:
            finals.append(f"{per_user_sum(q.component, p, lo, hi)}{_filter(kept_only + first)} "
                          f"AS {q.name}")
    if not finals:
        return None  # a global query of quantiles only: the tree statement answers it
    with_list, relation, kept = kept_rows(query, plan, partials, order_seed, prefilter)
    if row_level:
        kept = "TRUE"
    if distinct:
        # (a LEFT JOIN: a user and group without values keeps its row, dp_o NULL; unnest of
        # several arrays pads the shorter ones with NULLs, which count(DISTINCT) skips)
        names = ", ".join(f"dp_d{j}" for j in range(len(distinct)))
        relation = (f"{relation} LEFT JOIN LATERAL unnest({', '.join(distinct)}) WITH ORDINALITY "
                    f"AS dp_d({names}, dp_o) ON TRUE")
    if not query.keys:
        return f"WITH {with_list} SELECT {', '.join(finals)} FROM {relation}"
    key_cols = [f"dp_k{i}" for i in range(len(query.keys))]
    columns = [*key_columns(query), *finals]
    # with row-level aggregates, groups whose dp_users is 0 are no candidates (`release`):
    # left here, not sent (one user's rows, each its own group, made as many rows to read)
    having = f" HAVING count(*){_filter(kept_only + first)} > 0" \
        if row_level and _candidates_only(query, plan, whole) else ""
    return (f"WITH {with_list} SELECT {', '.join(columns)} "
            f"FROM {relation} WHERE {kept} GROUP BY {', '.join(key_cols)}{having}")


def _candidates_only(query: AnalyzedQuery, plan: DPQueryPlan, whole: bool) -> bool:
    """Whether a grouped row-level main statement leaves out the groups in which no user's
    count goes (`release.select` drops them): with partition selection, not public groups.
    A user whose every row is its own group (`GROUP BY CASE WHEN uid = 42 THEN duration
    END`) made that many rows for the proxy to read (14–24 µs each, 0.4 s more for 20,000
    rows where its count goes to one: red team, session 30). Only over every user (`whole`):
    a range's group without a user counting in it may be a candidate in another range, its
    rows part of the group's sums, and whether some user in one range counts in it is one
    user's doing. T's statistics, the value bins too, are of the groups users' counts go to
    (which are candidates), so leaving the others out changes none of them."""
    return whole and bool(query.keys) and not query.public_groups and (
        plan.threshold is not None or plan.shared_users)


def _filter(conditions: list[str]) -> str:
    """An aggregate's FILTER clause for these conditions (none: no clause)."""
    return f" FILTER (WHERE {' AND '.join(conditions)})" if conditions else ""


def _binned_template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                     order_seed: int, whole: bool) -> str:
    """The main statement in `dp_core.binned`'s form: per group, the sums of the other
    aggregates (as `_template`'s), and per bin of the users' row counts, the users first in
    the group and A and B of each row-level quantity and candidate clip; per clipped
    aggregate, its rows per value bin weighted by 1 / the user's rows."""
    columns, _ = binned_plan(query, plan)
    partials = [partial(i, agg, arg_types.get(i)) for i, agg in enumerate(query.aggregates)
                if not agg.row_level and not reads_user_count(agg)
                and agg.kind is not AggKind.QUANTILE]
    for c in columns:  # each argument's counts, sums and squares once (candidate 0's)
        if c.kind == "rows":
            partials.append("count(*) AS dp_rows")
        elif c.kind == "n":
            partials.append(f"count({PH}a{c.aggregate}) AS {c.partial}")
        elif c.candidate == 0:
            # a candidate clip's sums and squares are made from these per (user, group)
            # (`BinnedColumn.value`): each row's value within the aggregate's own bounds
            agg = query.aggregates[c.aggregate]
            check_number(agg, arg_types.get(c.aggregate))
            r = row_value(c.aggregate, agg, arg_types.get(c.aggregate))
            partials += [f"sum({r}) AS {c.partial}"] if c.kind == "s" else c.q_partials(r)
    value_bins = value_bin_columns(query, plan)
    for i in value_bins:
        partials += value_bin_partials(query, i, arg_types.get(i))
    # candidate sums from the value classes where they can be (`ValueClasses`), the others
    # per row: each (user, group) row's values, computed once beside its rank (`kept_rows`'
    # derived): written in each aggregate that reads them, Postgres would compute them in each
    classes = ValueClasses.of(query, columns, value_bins)
    made = classes.columns if classes is not None else frozenset()
    derived = [f"({column.value})::float8 AS dp_x{j}" for j, column in enumerate(columns)
               if j not in made]
    derived += [f"{value_bin(query, i)} AS dp_a{i}_vbin" for i in value_bins]
    with_list, relation, _ = kept_rows(query, plan, partials, order_seed, derived=derived)
    keyed = bool(query.keys)
    c_u = int(plan.max_groups_contributed)
    counted = [f"dp_rn <= {c_u}"] if keyed else []  # (the rows where the user's count goes)
    # inner: per (group, bin[, class]) over the (user, group) rows; mid (with classes): per
    # (group, bin) over the classes; outer: per group
    inner = [f"width_bucket(dp_total, ARRAY[{', '.join(str(e) for e in ROW_EDGES)}]::int8[]) "
             "AS dp_bin", "count(*) FILTER (WHERE dp_rn = 1) AS dp_first" if keyed
             else "count(*) AS dp_first"]
    mid = ["dp_bin", "sum(dp_first) AS dp_first"]
    outer = []
    if plan.threshold is not None or plan.shared_users:
        inner.append(f"count(*){_filter(counted)} AS dp_users")
        mid.append("sum(dp_users) AS dp_users")
        outer.append("(coalesce(sum(dp_users), 0))::int8 AS dp_users")
    for q in plan.quantities:
        if q.component in (Component.USERS, Component.TREE):
            continue
        assert q.aggregate is not None
        agg = query.aggregates[q.aggregate]
        if agg.row_level:
            continue
        p = value(q.aggregate, agg, arg_types.get(q.aggregate))
        b = agg.known_bounds
        inner.append(f"{per_user_sum(q.component, p, b.lower, b.upper)}{_filter(counted)} "
                     f"AS {q.name}")
        mid.append(f"sum({q.name}) AS {q.name}")
        outer.append(f"sum({q.name}) AS {q.name}")
    sums = ["dp_first"]
    for j, column in enumerate(columns):
        if classes is not None and j in made:
            a, b_ = classes.column(column)
            mid += [f"{a} AS dp_c{j}a", f"{b_} AS dp_c{j}b"]
        else:
            inner += [f"sum(dp_x{j}) AS dp_c{j}a",
                      f"sum(dp_x{j} / (dp_total)::float8) AS dp_c{j}b"]
            mid += [f"sum(dp_c{j}a) AS dp_c{j}a", f"sum(dp_c{j}b) AS dp_c{j}b"]
        sums += [f"dp_c{j}a", f"dp_c{j}b"]
    # the value bins (what the clips are chosen from) are of each user's rows in the groups
    # its count goes to, each weighted 1 / its rows (`binned.ValueClasses.value_bin`)
    for i, names in value_bins.items():
        for j, name in enumerate(names):
            if classes is not None and i == classes.aggregate:
                mid.append(f"{classes.value_bin(j)} AS {name}")
            else:
                inner.append(f"coalesce(sum((dp_v{i}_n)::float8 / (dp_total)::float8) "
                             f"{_filter([f'dp_a{i}_vbin = {j}', *counted])}, 0) AS {name}")
                mid.append(f"sum({name}) AS {name}")
            outer.append(f"sum({name}) AS {name}")
    outer += ["array_agg(dp_bin ORDER BY dp_bin) AS dp_bins",
              f"array_agg((ARRAY[{', '.join(sums)}])::float8[] ORDER BY dp_bin) AS dp_sums"]
    key_cols = [f"dp_k{i}" for i in range(len(query.keys))]
    if classes is None:
        per_bin = (f"SELECT {', '.join([*key_cols, *inner])} FROM {relation} "
                   f"GROUP BY {', '.join([*key_cols, 'dp_bin'])}")
    else:
        inner += [f"dp_a{classes.aggregate}_vbin AS dp_cls",
                  *classes.per_class(_filter(counted))]
        per_class = (f"SELECT {', '.join([*key_cols, *inner])} FROM {relation} "
                     f"GROUP BY {', '.join([*key_cols, 'dp_bin', 'dp_cls'])}")
        per_bin = (f"SELECT {', '.join([*key_cols, *mid])} FROM ({per_class}) AS dp_classed "
                   f"GROUP BY {', '.join([*key_cols, 'dp_bin'])}")
    if not keyed:
        return f"WITH {with_list} SELECT {', '.join(outer)} FROM ({per_bin}) AS dp_binned"
    # only candidate groups (`_candidates_only`): T's statistics are of the groups users'
    # counts go to
    having = " HAVING sum(dp_users) > 0" if _candidates_only(query, plan, whole) else ""
    return (f"WITH {with_list} SELECT {', '.join([*key_columns(query), *outer])} "
            f"FROM ({per_bin}) AS dp_binned GROUP BY {', '.join(key_cols)}{having}")


def _tree_template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                   order_seed: int, prefilter: Prefilter | None = None) -> str | None:
    """One row per group and quantile: the codes and user counts of the tree's non-empty nodes."""
    indexes = [i for i, a in enumerate(query.aggregates) if a.kind is AggKind.QUANTILE]
    if not indexes:
        return None
    partials = [partial(i, query.aggregates[i], arg_types.get(i)) for i in indexes]
    with_list, relation, kept = kept_rows(query, plan, partials, order_seed, prefilter)
    key_cols = [f"dp_k{i}" for i in range(len(query.keys))]
    # each quantile's value and bounds, its leaf computed once over them
    leaves = [f"({i}, dp_p{i}, {f8(query.aggregates[i].known_bounds.lower)}, "
              f"{f8(query.aggregates[i].known_bounds.upper)})" for i in indexes]
    leaf = (f"LEAST(GREATEST(floor((LEAST(GREATEST(dp_x, dp_lo), dp_hi) - dp_lo) / (dp_hi - dp_lo) "
            f"* {f8(LEAVES)}), 0), {LEAVES - 1})::int4")
    leaf_rows = _unpivoted(key_cols, relation, kept, leaves, "dp_x, dp_lo, dp_hi",
                           f"{leaf} AS dp_leaf")
    levels = ", ".join(f"({off}, {div})" for off, div in zip(LEVEL_OFFSETS, LEVEL_DIVISORS,
                                                             strict=True))
    nodes = (f"SELECT {', '.join([*key_cols, 'dp_agg'])}, lv.off + dp_leaf / lv.div AS dp_code, "
             f"count(*) AS dp_n FROM ({leaf_rows}) "
             "AS dp_leaves "
             f"CROSS JOIN (VALUES {levels}) AS lv(off, div) "
             f"GROUP BY {', '.join(str(n) for n in range(1, len(key_cols) + 3))}")
    key_text = [f"dp_k{i}::text AS dp_t{i}" for i in range(len(query.keys))]
    order = [f'dp_k{i}::text COLLATE "C"' for i in range(len(query.keys))]
    columns = [*key_text, *key_hashes(query), "dp_agg"]
    return (f"WITH {with_list}, dp_nodes AS ({nodes}) "
            # codes and counts as big-endian int4 / int8 bytes (`release.tree_arrays`): a tree
            # of 70k nodes is 840 kB instead of Python lists of ten times that
            f"SELECT {', '.join(columns)}, string_agg(int4send(dp_code), ''::bytea "
            "ORDER BY dp_code) AS dp_codes, string_agg(int8send(dp_n), ''::bytea ORDER BY dp_code) "
            "AS dp_counts FROM dp_nodes "
            f"GROUP BY {', '.join([*key_cols, 'dp_agg'])} "
            # in one order (code points; NULL last) for any collation and range of users, so
            # that the trees of several ranges merge as streams (one group at a time)
            f"ORDER BY {', '.join([*order, 'dp_agg'])}")


def _bounds_template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                     order_seed: int, prefilter: Prefilter | None = None) -> str | None:
    """APPROX_BOUNDS: per aggregate without bounds, the users per log-scale bin (all groups)."""
    indexes = sorted(plan.auto_bounds)
    if not indexes:
        return None
    for i in indexes:  # (refused as the analyst wrote it: sum(browser) is a sum)
        if query.aggregates[i].row_level:
            check_number(query.aggregates[i], arg_types.get(i))
    # a row-level aggregate's bounds are found from its users' means in each group
    aggs = tuple(replace(a, kind=AggKind.AVG, row_level=False) if a.row_level else a
                 for a in query.aggregates)
    partials = [partial(i, aggs[i], arg_types.get(i)) for i in indexes]
    with_list, relation, kept = kept_rows(query, plan, partials, order_seed, prefilter)
    edges = ", ".join(str(e) for e in EDGES)
    values = [f"({i}, ({value(i, aggs[i], arg_types.get(i))})::numeric)" for i in indexes]
    bins = f"width_bucket(dp_x, (ARRAY[{edges}])::numeric[]) AS dp_bin"
    return (f"WITH {with_list} SELECT dp_agg, dp_bin, count(*) AS dp_n "
            f"FROM ({_unpivoted([], relation, kept, values, 'dp_x', bins)}) AS dp_bins "
            "GROUP BY 1, 2")


def _unpivoted(columns: list[str], relation: str, kept: str, rows: list[str], names: str,
               out: str) -> str:
    """`columns` and `out` (over dp_agg and `names`) of each kept row of `relation` and
    each aggregate whose value (the first of `names`, dp_x) is not NULL: `rows` are an
    "(aggregate, value, ...)" row of VALUES per aggregate, over one per-user row. One read
    of the per-user rows (a UNION ALL of a read per aggregate would read their CTE twice,
    which Citus gathers on the coordinator to do so)."""
    return (f"SELECT {', '.join([*columns, 'dp_agg', out])} FROM {relation} "
            f"CROSS JOIN LATERAL (VALUES {', '.join(rows)}) AS dp_u(dp_agg, {names}) "
            f"WHERE {kept} AND dp_x IS NOT NULL")


def _tuning_template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                     order_seed: int) -> str | None:
    """The statistics max_rows_contributed is chosen from (`dp_core.tuning`): users per bin
    of their rows in all groups (dp_kind 0, by dp_bin); with GROUP BY, the groups that at
    least τ users have as their first group (of their most rows; dp_kind 1); for each
    clipped argument (`plan.clip_tuned`), its rows per value bin (`tuning.value_bins`), each
    user's weighted by 1 / its rows (dp_kind 2, dp_agg, by dp_bin)."""
    if not plan.tuning:
        return None
    clipped = [q.aggregate for q in plan.tuning if q.aggregate is not None]
    partials = [p for i in clipped for p in value_bin_partials(query, i, arg_types.get(i))]
    with_list, relation, _ = kept_rows(query, plan, partials, order_seed)
    edges = ", ".join(str(e) for e in ROW_EDGES)
    first = "dp_rn = 1" if query.keys else "TRUE"
    key_cols = [f"dp_k{i}" for i in range(len(query.keys))]
    # the per-user rows are read once (Citus would gather a CTE read twice on the
    # coordinator), into their sums per group and user total: what each part adds up
    counts = [f"count(*) FILTER (WHERE {first}) AS dp_f"]
    for i in clipped:
        vbin = value_bin(query, i)
        counts += [f"coalesce(sum(dp_v{i}_n) FILTER (WHERE {vbin} = {j}), 0) AS dp_b{i}_{j}"
                   for j in range(value_bin_count(query, i))]
    totals = (f"dp_t AS (SELECT {', '.join([*key_cols, 'dp_total', *counts])} FROM {relation} "
              f"GROUP BY {', '.join([*key_cols, 'dp_total'])})")
    parts = [f"SELECT 0 AS dp_kind, 0 AS dp_agg, width_bucket(dp_total, ARRAY[{edges}]::int8[]) "
             "AS dp_bin, (sum(dp_f))::float8 AS dp_n FROM dp_t GROUP BY 3"]
    if query.keys:
        parts.append(f"SELECT 1, 0, 0, (count(*))::float8 FROM (SELECT {', '.join(key_cols)} "
                     f"FROM dp_t GROUP BY {', '.join(key_cols)} "
                     f"HAVING sum(dp_f) >= {f8(groups_threshold(plan))}) AS dp_g")
    for i in clipped:
        bins = range(value_bin_count(query, i))
        # (counts added up per user total first: one division per distinct total, not per row)
        sums = ", ".join(f"sum(dp_b{j} / (dp_total)::float8)" for j in bins)
        per_total = ", ".join(f"sum(dp_b{i}_{j}) AS dp_b{j}" for j in bins)
        parts.append(f"SELECT 2, {i}, (dp_o - 1)::int4, dp_w FROM (SELECT ARRAY[{sums}] AS dp_a "
                     f"FROM (SELECT dp_total, {per_total} FROM dp_t GROUP BY dp_total) "
                     "AS dp_pt) AS dp_s CROSS JOIN LATERAL unnest(dp_s.dp_a) "
                     "WITH ORDINALITY AS dp_u(dp_w, dp_o)")
    return f"WITH {with_list}, {totals} {' UNION ALL '.join(parts)}"


def tuning_statement(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                     order_seed: int) -> str:
    """The tuning statistics of `plan` (T not fixed) as a statement of their own, whatever
    the main statement would be: what an admin's tuning of a table runs
    (`dp_core.table_tuning`)."""
    template = _tuning_template(query, plan, arg_types, order_seed)
    if template is None:
        raise InternalError("tuning statistics of a plan that has none (this is a bug)")
    return _build(template, query)


def _build(template: str, query: AnalyzedQuery, token: str | None = None) -> str:
    stmt = parse_sql(template)[0].stmt
    where = query.where or ast.A_Const(val=ast.Boolean(boolval=True))
    if token is not None:
        within = uid_in(query, token)
        if query.ranges_after_joins:
            within = fenced([within], query.fence_refs)
        where = ast.BoolExpr(boolop=BoolExprType.AND_EXPR, args=(where, within))
    if query.public_groups:
        # (a key's domain keeps rows by what they hold: after the joins, as WHERE's conditions)
        domains = _in_domains(query)
        if query.fence_refs:
            domains = [fenced(domains, query.fence_refs)]
        where = ast.BoolExpr(boolop=BoolExprType.AND_EXPR, args=(where, *domains))
    nodes: dict[str, Any] = {f"{PH}uid": query.uid, f"{PH}where": where}
    for i in range(len(query.keys)):
        nodes[f"{PH}k{i}"] = query.grouped_expr(i)
    for i, agg in enumerate(query.aggregates):
        if agg.arg is not None:
            nodes[f"{PH}a{i}"] = agg.arg
    Splice(nodes, query.from_clause)(stmt)
    if query.ctes:
        stmt.withClause.ctes = tuple(copy.deepcopy(query.ctes)) + tuple(stmt.withClause.ctes)
    return str(RawStream()(stmt))


def _in_domains(query: AnalyzedQuery) -> list[Any]:
    """For public groups, that each key's text is one of its domain's keys: rows of other
    keys are never released, and do not use a user's contribution bounds."""
    out = []
    for key in query.keys:
        d = key.domain
        assert d is not None
        if d.keys is not None:
            listed = ", ".join(quoted(k) for k in d.keys)
            sql = f"SELECT (dp_key)::text = ANY ((ARRAY[{listed}])::text[])"
        else:
            assert d.source is not None
            schema, table, column = ('"' + p.replace('"', '""') + '"' for p in d.source)
            sql = f"SELECT (dp_key)::text IN (SELECT ({column})::text FROM {schema}.{table})"
        cond = parse_sql(sql)[0].stmt.targetList[0].val
        cast = cond.lexpr if isinstance(cond, ast.A_Expr) else cond.testexpr
        cast.arg = copy.deepcopy(key.expr)
        out.append(cond)
    return out


@dataclass(frozen=True)
class Pushdown:
    """The statements one DP answer runs as the pushdown role (in one snapshot)."""

    main: str | None
    """One row per group: true user counts and sums (None for a global query of quantiles only)."""
    tuning: str | None
    """The statistics max_rows_contributed is chosen from (run first, when present)."""
    trees: str | None
    """One row per group and quantile: the quantile tree's non-empty nodes."""
    bounds: str | None
    """APPROX_BOUNDS: users per log-scale bin and aggregate (run first, when present)."""
    order_seed: int

    def statements(self) -> dict[str, str]:
        """The statements there are, by name, in the order they run."""
        named = (("tuning", self.tuning), ("bounds", self.bounds), ("main", self.main),
                 ("trees", self.trees))
        return {name: sql for name, sql in named if sql}


def pushdown(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None = None,
             order_seed: int | None = None, uid_range: UidRange | None = None,
             prefilter: Prefilter | None = None) -> Pushdown:
    """The pushdown statements for `plan`.

    `arg_types` maps aggregate indexes to their argument's type name (from
    `argument_probe_sql`); unknown types are summed in numeric. `order_seed`
    keys the hash that picks which groups a user keeps; a fresh secret one is
    drawn when none is given. Before APPROX_BOUNDS has run, aggregates without
    bounds get placeholder bounds [0, 1] in `main` and `trees` (prepared only,
    for their types; run them from `pushdown` with the found bounds).
    With `uid_range`, the statements read only the users in that range (see
    `RangedPushdown`). With `prefilter`, users' rows outside their kept groups are dropped
    before aggregating (`_prefiltered_rows`).
    """
    if uid_range is not None:
        return ranged_pushdown(query, plan, arg_types, order_seed, prefilter).of(uid_range)
    return build_pushdown(query, plan, arg_types, order_seed, None, prefilter)


@dataclass(frozen=True)
class RangedPushdown:
    """The pushdown for any range of the uid, printed once with marks for the range's bounds.

    The statements of the ranges of `uid_ranges(...)` together read every user once, and as
    all their columns but the keys are sums over users, their rows add up to the unsplit
    statements' rows (`release.add_rows`).
    """

    marked: Pushdown
    token: str
    null_uids: bool = True
    """Whether the query's uid can be NULL (the lowest range then holds it)."""

    def of(self, uid_range: UidRange) -> Pushdown:
        """The statements that read only the users in `uid_range`."""
        def fill(sql: str | None) -> str | None:
            return None if sql is None else fill_range(sql, self.token, uid_range, self.null_uids)

        m = self.marked
        # (the tuning statement runs unsplit: its count of groups does not add up)
        return Pushdown(fill(m.main), None, fill(m.trees), fill(m.bounds), m.order_seed)


def ranged_pushdown(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None,
                    order_seed: int | None, prefilter: Prefilter | None = None,
                    uid_not_null: bool = False) -> RangedPushdown:
    """The pushdown for any uid range (`RangedPushdown.of`). `uid_not_null`: the uid column
    is declared NOT NULL (so the query's uid is never NULL unless an outer join makes it)."""
    import secrets

    token = secrets.token_hex(8)
    return RangedPushdown(build_pushdown(query, plan, arg_types, order_seed, token, prefilter), token,
                          null_uids(query, uid_not_null))


def build_pushdown(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None,
                   order_seed: int | None, token: str | None,
                   prefilter: Prefilter | None = None) -> Pushdown:
    import secrets

    seed = secrets.randbits(62) if order_seed is None else order_seed
    types = arg_types or {}
    bounds_sql = _bounds_template(query, plan, types, seed, prefilter)
    tuning_sql = None if binned(plan) else _tuning_template(query, plan, types, seed)
    # the statements' shape needs only the plan's quantity names, which bounds do not change
    query = query.with_bounds({i: Bounds(0.0, 1.0) for i, a in enumerate(query.aggregates)
                               if a.bounds is None})
    main = _template(query, plan, types, seed, prefilter, whole=token is None)
    if main and token is not None and query.keys:
        # in one order (code points; NULL last) for any collation and range of users, as the
        # trees: the ranges' rows merge as streams, a group at a time (`release.row_order`)
        order = ", ".join(f'dp_k{i}::text COLLATE "C"' for i in range(len(query.keys)))
        main = f"{main} ORDER BY {order}"
    trees = _tree_template(query, plan, types, seed, prefilter)
    built = Pushdown(_build(main, query, token) if main else None,
                     _build(tuning_sql, query, token) if tuning_sql else None,
                     _build(trees, query, token) if trees else None,
                     _build(bounds_sql, query, token) if bounds_sql else None, seed)
    if order_seed is not None and order_seed >= SENTINELS:
        # a sentinel (`PushdownCache`): it must be in the printed statements exactly where the
        # templates put it, or the seed written in later would change something else
        digits = str(order_seed)
        for template, sql in ((main, built.main), (trees, built.trees), (bounds_sql, built.bounds),
                              (tuning_sql, built.tuning)):
            if (template or "").count(digits) != (sql or "").count(digits):
                raise NotSeedable()
    return built


SENTINELS = 1 << 62
"""Order seeds at or above this are sentinels of `PushdownCache` (real ones are 62 bits)."""


class NotSeedable(Exception):
    """A sentinel seed's digits are also elsewhere in the printed statements."""


def main_sql(query: AnalyzedQuery, plan: DPQueryPlan, order_seed: int) -> str | None:
    """The main statement alone, unsplit (as `pushdown(...).main`, without printing the
    others): what the stochastic tester runs once per choice of bounds and T."""
    query = query.with_bounds({i: Bounds(0.0, 1.0) for i, a in enumerate(query.aggregates)
                               if a.bounds is None})
    main = _template(query, plan, {}, order_seed)
    return _build(main, query) if main else None


def pushdown_sql(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None = None,
                 order_seed: int | None = None) -> str:
    """The main pushdown statement alone (queries without quantiles and APPROX_BOUNDS)."""
    pd = pushdown(query, plan, arg_types, order_seed)
    if pd.main is None or pd.trees is not None or pd.bounds is not None or pd.tuning is not None:
        raise InternalError()
    return pd.main
