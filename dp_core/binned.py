"""One-pass row-level sums: split by the users' row-count bins, resolved once T is chosen.

Where max_rows_contributed (T) is chosen from the data (`dp_core.tuning`), the main
statement does not wait for it: for each group and each bin b of the users' row counts
(`tuning.ROW_EDGES`, as width_bucket numbers them: bin b holds [e(b-1), e(b))), it returns
per row-level quantity A_b, the sum of its users' partials, and B_b, the sum of their
partials divided by their rows n. A user weighted min(1, T / n) then adds, for T the
edge e(j), A to the bins b ≤ j (n < T) and T·B to the others, so the value for any edge T is

    Σ_{b ≤ j} A_b + T · Σ_{b > j} B_b

exactly. For a clipped aggregate (`plan.clip_tuned`) each candidate clip has its own A and
B. The same rows carry what T and the clips are chosen from (users per bin in their first
group, each group's first users, the rows per value bin weighted by 1 / n): the data is
read once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dp_core.errors import InternalError
from dp_core.partials import check_number, f8, mean_clamped, row_value, squares_clamped
from dp_core.plan import Component, DPQueryPlan, shares_clip
from dp_core.query import AnalyzedQuery, Bounds
from dp_core.splice import PH
from dp_core.tuning import ROW_EDGES, value_thresholds

BINS = len(ROW_EDGES) + 1
"""width_bucket's numbers for the users' row counts: 1 .. len(ROW_EDGES) (0 is never used)."""


@dataclass(frozen=True)
class BinnedColumn:
    """A sum over a group's (user, group) rows, per bin: "rows" (COUNT(*)), "n" (the values
    of an argument present: COUNT(x)), "s" (their sum, with the user's mean clamped to a
    candidate's bounds) or "q" (their squared distances to the candidate's midpoint, clamped
    to the values × half its range squared). `aggregate` is the first aggregate with this
    argument (and, for s and q, bounds): whose partials it reads."""

    kind: str
    aggregate: int = -1
    candidate: int = 0
    bounds: Bounds | None = None
    """The candidate's bounds (s and q)."""
    counted: int = -1
    """For s and q: the aggregate whose n column counts the argument's values."""

    @property
    def partial(self) -> str:
        """Its per-user partial's column (of rows, n, and s: the sum of the values within the
        aggregate's own bounds, which `value` clamps for a clip; q has two, `q_partials`)."""
        if self.kind == "rows":
            return "dp_rows"
        if self.kind == "n":
            return f"dp_n{self.aggregate}"
        if self.kind == "s":
            return f"dp_s{self.aggregate}c0"
        raise InternalError("q is made of two partials")

    @property
    def value(self) -> str:
        """Its value on a (user, group) row: the partial; for s of a clip, the user's sum
        with its mean clamped to the clip (`partials.mean_clamped`: rows × the clip at most);
        for q, the squared distances to the candidate's midpoint from the rows' variance and
        mean (`q_partials`), for a clip clamped to rows × half its range squared
        (`partials.squares_clamped`): as a row-level aggregate's with that clip is
        (`Aggregate.row_bounds`)."""
        if self.kind not in ("s", "q"):
            return self.partial
        assert self.bounds is not None
        n = f"dp_n{self.counted}"
        if self.kind == "s":
            return self.partial if self.candidate == 0 \
                else mean_clamped(self.partial, n, self.bounds)
        m = f8((self.bounds.lower + self.bounds.upper) / 2)
        a = self.aggregate
        squares = (f"(({n})::float8 * dp_w{a} + ({n})::float8 * (dp_m{a} - {m}) "
                   f"* (dp_m{a} - {m}))")
        return squares if self.candidate == 0 else squares_clamped(squares, n, self.bounds)

    def q_partials(self, row: str) -> list[str]:
        """For q: the per-user variance and mean of the values (`row`: within the
        aggregate's own bounds) its value is made from."""
        return [f"var_pop({row}) AS dp_w{self.aggregate}", f"avg({row}) AS dp_m{self.aggregate}"]


def candidates(bounds: Bounds, clipped: bool) -> list[Bounds]:
    """The bounds a row-level aggregate may end up with: its own and, if it is clipped,
    each of `tuning.value_thresholds` as the upper one."""
    if not clipped:
        return [bounds]
    return [bounds, *(Bounds(bounds.lower, t) for t in value_thresholds(bounds))]


def clipped_aggregates(query: AnalyzedQuery, plan: DPQueryPlan) -> set[int]:
    """The row-level aggregates whose clip is chosen with T: those of `plan.clip_tuned` (or,
    T chosen from a table's stored statistics, `plan.rows_stored`) and the ones that share
    their argument and bounds (`tuning.tune_rows` gives them its clip)."""
    tuned = [query.aggregates[q.aggregate] for q in plan.tuning
             if q.component == Component.VALUES and q.aggregate is not None]
    tuned += [query.aggregates[i] for i in sorted(plan.rows_stored or ())]
    return {i for i, a in enumerate(query.aggregates) if any(shares_clip(t, a) for t in tuned)}


def _first(query: AnalyzedQuery, i: int, same_bounds: bool) -> int:
    a = query.aggregates[i]
    return next(j for j, b in enumerate(query.aggregates) if b.row_level and b.arg == a.arg
                and (not same_bounds or b.bounds == a.bounds))


Terms = list[tuple[int, float]]
"""A quantity as a linear combination of binned columns: (column index, coefficient)."""


def binned_plan(query: AnalyzedQuery, plan: DPQueryPlan
                ) -> tuple[list[BinnedColumn], dict[str, list[tuple[Bounds | None, Terms]]]]:
    """The per-bin columns of the main statement, in order (each an A and a B sum), and for
    each row-level quantity, per candidate bounds (None: any), its terms over them. A sum
    is s; a mean's count n, its centred sum s − m·n and centred squares q − 2m·s + m²·n
    (m the candidate's midpoint) and centred squares q (summed centred, as `partial`'s): one
    set of s, q and n columns serves every aggregate of an argument."""
    clipped = clipped_aggregates(query, plan)
    columns: list[BinnedColumn] = []
    index: dict[tuple[str, int, int], int] = {}

    def col(kind: str, a: int = -1, k: int = 0, b: Bounds | None = None,
            counted: int = -1) -> int:
        key = (kind, a, k)
        if key not in index:
            index[key] = len(columns)
            columns.append(BinnedColumn(kind, a, k, b, counted))
        return index[key]

    terms: dict[str, list[tuple[Bounds | None, Terms]]] = {}
    for q in plan.quantities:
        if q.aggregate is None or not query.aggregates[q.aggregate].row_level:
            continue
        if q.component not in BINNED_COMPONENTS:
            raise InternalError(f"a row-level {q.component} cannot be binned")
        i, agg = q.aggregate, query.aggregates[q.aggregate]
        if q.component == Component.COUNT:
            c = col("rows") if agg.arg is None else col("n", _first(query, i, False))
            terms[q.name] = [(None, [(c, 1.0)])]
            continue
        if q.component == Component.N:
            terms[q.name] = [(None, [(col("n", _first(query, i, False)), 1.0)])]
            continue
        a = _first(query, i, True)
        options: list[tuple[Bounds | None, Terms]] = []
        counted = _first(query, i, False)
        for k, b in enumerate(candidates(agg.known_bounds, i in clipped)):
            m = (b.lower + b.upper) / 2
            s_ = col("s", a, k, b, counted)
            if k:  # (a clip's sums are clamped from the unclipped sum and count)
                col("n", counted)
            if q.component == Component.SUM:
                options.append((b, [(s_, 1.0)]))
                continue
            n = col("n", counted)
            if q.component == Component.CENTERED_SUM:
                options.append((b, [(s_, 1.0), (n, -m)]))
            else:  # (q is centred on m already)
                options.append((b, [(col("q", a, k, b, counted), 1.0)]))
                col("n", counted)
        terms[q.name] = options
    return columns, terms


BINNED_COMPONENTS = frozenset({Component.COUNT, Component.SUM, Component.N,
                               Component.CENTERED_SUM, Component.CENTERED_SQUARES})


def value_bin_columns(query: AnalyzedQuery, plan: DPQueryPlan) -> dict[int, list[str]]:
    """Per aggregate whose clip is chosen from the answer's statistics (`plan.clip_tuned`),
    the main statement's columns of its rows per value bin, each user's weighted by 1 / its
    rows (`tuning.choose_clip`); none where T and the clips come from a table's stored ones."""
    out = {}
    for q in plan.tuning:
        if q.component != Component.VALUES or q.aggregate is None:
            continue
        steps = len(value_thresholds(query.aggregates[q.aggregate].known_bounds)) + 1
        out[q.aggregate] = [f"dp_a{q.aggregate}_vb{j}" for j in range(steps)]
    return out


def value_bin_partials(query: AnalyzedQuery, i: int, arg_type: str | None) -> list[str]:
    """Per (user, group): the sum of aggregate i's row values within its bounds and their
    count, whose ratio is the user's mean in the group that a clip bounds
    (`Aggregate.row_bounds`)."""
    agg = query.aggregates[i]
    check_number(agg, arg_type)
    return [f"sum({row_value(i, agg, arg_type)}) AS dp_v{i}_s",
            f"count({PH}a{i}) AS dp_v{i}_n"]


def value_bin(query: AnalyzedQuery, i: int) -> str:
    """The value bin of a (user, group)'s mean of aggregate i, from `value_bin_partials`'
    (all its rows are in that bin): 0 [t1, U], j [t(j+1), t(j)), the last [L, t(last))
    (`tuning.value_thresholds`, high to low: the first threshold the mean reaches); a user
    without values is in the last, with no rows."""
    n = f"dp_v{i}_n"
    ts = value_thresholds(query.aggregates[i].known_bounds)
    if not ts:  # (a range too narrow to clip: one bin)
        return "0"
    whens = " ".join(f"WHEN dp_v{i}_s >= ({n})::float8 * {f8(t)} THEN {j}"
                     for j, t in enumerate(ts))
    return f"CASE {whens} ELSE {len(ts)} END"


def value_bin_count(query: AnalyzedQuery, i: int) -> int:
    """How many value bins aggregate i's mean has (`value_bin`)."""
    return len(value_thresholds(query.aggregates[i].known_bounds)) + 1


@dataclass(frozen=True)
class ValueClasses:
    """A clipped aggregate's candidate sums from its value bins (the main statement's
    per-(user, group) rows grouped by bin of rows and by value class, then by bin alone).

    A user's sum in a group is s, of n values within the aggregate's bounds [L, U] (so
    s ≥ n·L), and a candidate clip t makes it min(s, n·t) (`partials.mean_clamped`). The
    mean's value bin v (`value_bin`: the first of `tuning.value_thresholds` t_0 >
    t_1 > ... it reaches, else the last) tells which: n·t_k for v ≤ k, s for v > k. So every
    candidate's A and B (and the unclipped sum, the count n, and the value bins' rows) are
    sums over the classes of four sums, Σ s, Σ s/rows, Σ n, Σ n/rows, where each candidate
    of each (user, group) row would be computed and summed. `columns`: the `BinnedColumn`
    indexes made so, the others summed per row as before."""

    aggregate: int
    """The value-binned aggregate whose bin is the class (its column `dp_a{i}_vbin`)."""
    s: str
    n: str
    thresholds: tuple[float, ...]
    columns: frozenset[int]

    @classmethod
    def of(cls, query: AnalyzedQuery, columns: Sequence[BinnedColumn],
           value_bins: Mapping[int, list[str]]) -> ValueClasses | None:
        """For the first value-binned aggregate whose argument and bounds some candidate
        sums share; None where there is none (no clip is chosen from this answer's rows)."""
        for i in value_bins:
            agg = query.aggregates[i]
            ts = tuple(value_thresholds(agg.known_bounds))
            if not ts:
                continue  # (a range too narrow to clip: one candidate, no count column)

            made = frozenset(j for j, c in enumerate(columns) if (
                c.kind == "s" and query.aggregates[c.aggregate].arg == agg.arg
                and query.aggregates[c.aggregate].known_bounds == agg.known_bounds
                and query.aggregates[c.counted].arg == agg.arg
                and (c.candidate == 0 or (c.bounds is not None and c.candidate <= len(ts)
                                          and c.bounds.upper == ts[c.candidate - 1]))))
            if not made:
                continue
            counted = columns[min(made)].counted
            s = columns[min(made)].partial
            made |= {j for j, c in enumerate(columns)
                     if c.kind == "n" and query.aggregates[c.aggregate].arg == agg.arg}
            return cls(i, s, f"dp_n{counted}", ts, made)
        return None

    def per_class(self, counted: str) -> list[str]:
        """The four sums over a (group, bin, class)'s rows, and the value bins' (of the rows
        where the user's count goes: `counted`, their FILTER clause or none, `value_bin`)."""
        n = f"({self.n})::float8"
        return [f"sum({self.s}) AS dp_cs_a", f"sum({self.s} / (dp_total)::float8) AS dp_cs_b",
                f"sum({n}) AS dp_cn_a", f"sum({n} / (dp_total)::float8) AS dp_cn_b",
                f"coalesce(sum({n} / (dp_total)::float8){counted}, 0) AS dp_cn_u"]

    def column(self, c: BinnedColumn) -> tuple[str, str]:
        """A column's A and B over a (group, bin)'s classes (`dp_cls`)."""
        if c.kind == "n":
            return "coalesce(sum(dp_cn_a), 0)", "coalesce(sum(dp_cn_b), 0)"
        if c.candidate == 0:
            return "coalesce(sum(dp_cs_a), 0)", "coalesce(sum(dp_cs_b), 0)"
        k, t = c.candidate, f8(self.thresholds[c.candidate - 1])

        def clipped(x: str) -> str:
            return (f"coalesce(sum(dp_cs_{x}) FILTER (WHERE dp_cls >= {k}), 0) "
                    f"+ {t} * coalesce(sum(dp_cn_{x}) FILTER (WHERE dp_cls < {k}), 0)")
        return clipped("a"), clipped("b")

    def value_bin(self, j: int) -> str:
        """The aggregate's rows in value bin j, each user's weighted by 1 / its rows, in the
        groups its count goes to (its first C_u: all of them some user counts in, so that
        leaving out the groups no user counts in changes nothing here,
        `rewrite._candidates_only`)."""
        return f"coalesce(sum(dp_cn_u) FILTER (WHERE dp_cls = {j}), 0)"


class Binned:
    """A group's per-bin sums: `bins` (the bins some user of the group is in, ascending) and
    `sums`, one row per bin: the users first in this group, then A and B of each
    `BinnedColumn`. Groups of several uid ranges add up (`release.add_rows` uses +)."""

    __slots__ = ("bins", "sums")

    def __init__(self, bins: NDArray[np.int64], sums: NDArray[np.float64]) -> None:
        self.bins, self.sums = bins, sums

    @classmethod
    def of(cls, bins: Sequence[int] | None, sums: Sequence[Sequence[Any]] | None,
           columns: int) -> Binned:
        """From the statement's arrays (NULL entries are 0: sums over no rows)."""
        if not bins:
            return cls(np.zeros(0, dtype=np.int64), np.zeros((0, 1 + 2 * columns)))
        b = np.asarray(bins, dtype=np.int64)
        m = np.array([[0.0 if x is None else float(x) for x in row] for row in (sums or [])],
                     dtype=np.float64)
        if m.shape != (len(b), 1 + 2 * columns) or np.any(b < 1) or np.any(b >= BINS):
            raise InternalError("unexpected per-bin sums")
        return cls(b, m)

    @classmethod
    def empty(cls, columns: int) -> Binned:
        """A group no user is in."""
        return cls.of(None, None, columns)

    def __add__(self, other: Binned) -> Binned:
        bins = np.union1d(self.bins, other.bins)
        sums = np.zeros((len(bins), self.sums.shape[1]))
        for part in (self, other):
            sums[np.searchsorted(bins, part.bins)] += part.sums
        return Binned(bins, sums)

    def first_users(self) -> NDArray[np.float64]:
        """Users first in this group, per bin 1 .. BINS - 1 (index b - 1)."""
        out = np.zeros(BINS - 1)
        out[self.bins - 1] = self.sums[:, 0]
        return out

    def value(self, column: int, max_rows: int) -> float:
        """Column `column`'s sum with each user weighted min(1, T / its rows), T an edge."""
        j = ROW_EDGES.index(max_rows)
        low = self.bins <= j
        return float(self.sums[low, 1 + 2 * column].sum()
                     + max_rows * self.sums[~low, 2 + 2 * column].sum())


def binned_row(row: Mapping[str, Any], columns: int) -> dict[str, Any]:
    """A main-statement row with its per-bin arrays (`dp_bins`, `dp_sums`) as one `Binned`."""
    out = dict(row.items())
    out["dp_binned"] = Binned.of(out.pop("dp_bins"), out.pop("dp_sums"), columns)
    return out


@dataclass
class TuningStats:
    """What T and the clips are chosen from, added up over every group's row as it streams
    (before partition selection: the statistics are of all users, in the groups their
    counts go to; groups no user counts in add nothing to them, `rewrite._candidates_only`)."""

    groups_threshold: float
    histogram: NDArray[np.float64] = field(default_factory=lambda: np.zeros(BINS - 1))
    groups: int = 0
    values: dict[int, NDArray[np.float64]] = field(default_factory=dict)

    def add(self, row: Mapping[str, Any], value_bins: Mapping[int, list[str]]) -> None:
        first = row["dp_binned"].first_users()
        self.histogram += first
        if first.sum() >= self.groups_threshold:
            self.groups += 1
        for i, names in value_bins.items():
            v = np.array([float(row[n] or 0) for n in names])
            self.values[i] = self.values.get(i, np.zeros(len(names))) + v

    def rows(self) -> dict[int, int]:
        """The histogram as `tuning.choose_max_rows` takes it (users per bin number)."""
        return {b + 1: round(float(n)) for b, n in enumerate(self.histogram) if n}


def resolve(rows: Sequence[dict[str, Any]], query: AnalyzedQuery, plan: DPQueryPlan,
            terms: Mapping[str, list[tuple[Bounds | None, Terms]]],
            clips: Mapping[int, Bounds]) -> None:
    """Each row's row-level quantities (`q.name`) for the chosen T (`plan.rows_for`) and
    clips (`clips`, else each aggregate's own bounds), from its per-bin sums (`binned_plan`'s
    terms); in place. `query` has the bounds the main statement was built with."""
    chosen: dict[str, tuple[Terms, int]] = {}
    for q in plan.quantities:
        if q.name not in terms:
            continue
        assert q.aggregate is not None
        agg = query.aggregates[q.aggregate]
        want = clips.get(q.aggregate, agg.known_bounds)
        # (candidates that round to one float are the same clip: the first serves)
        found = [t for b, t in terms[q.name] if b is None or b == want]
        t = plan.rows_for(agg)
        if not found or t is None:
            raise InternalError("per-bin sums resolved for no clip, or before T")
        chosen[q.name] = (found[0], t)
    if len(chosen) != len(terms):
        raise InternalError("a binned quantity the plan does not have")
    for row in rows:
        binned = row.pop("dp_binned")
        for name, (linear, t) in chosen.items():
            row[name] = sum(coef * binned.value(c, t) for c, coef in linear)
