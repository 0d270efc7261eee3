"""Contribution bounds an admin tunes once per protected table, and their use by later queries.

An admin's `SELECT * FROM dp_tune_bounds('visits')` chooses max_rows_contributed (T of
counts, of means and of sums) and a clip of each bounded numeric column from DP statistics
of the whole table: the statistics and choices of per-query tuning (`dp_core.tuning`) for
the query `SELECT count(*), sum(c), avg(c), ... FROM table` (`tuning_sql`), its noise
calibrated for the ε the admin spends (`with_tuning_epsilon`). Later plain queries that read
that table alone, where neither the query nor the session fixes T, take the stored choice as
fixed bounds (`applied`): a function of a DP release, so post-processing, and none of their
own ε goes to tuning. Who pays is the ledger's business (`server.ledger`): the admin and the
table's total budgets when it is tuned, each analyst once, with their first answer that uses
it. The choice weighs the noise of a query of the default ε over `groups` groups (1 unless
the admin says otherwise); filters and groupings of later queries are not known then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from pglast import ast
from pglast.enums import NullTestType

from dp_core.errors import InternalError
from dp_core.mechanisms import NoiseKind, NoiseSpec
from dp_core.plan import DPQueryPlan, PrivacyCost, clip_tuned, sharing_clip
from dp_core.query import AnalyzedQuery, Bounds, TablePolicy
from dp_core.sqlnodes import same_node
from dp_core.tuning import (
    TunedRows,
    answer_unit,
    clip_from,
    clip_weight,
    finished,
    rechosen,
    typical_groups,
    value_thresholds,
)


@dataclass(frozen=True)
class TableTuning:
    """The bounds an admin tuned for one protected table (`dp_tune_bounds`)."""

    table: str
    """schema.table, as `TableRef.bases` names it."""
    token: str
    """What each analyst's one charge for it is recorded under (the ledger's fingerprint)."""
    epsilon: Fraction
    """What it cost (pure ε: Laplace noise on user counts)."""
    max_rows: int
    mean_rows: int
    sum_rows: int
    clips: Mapping[str, Bounds] = field(default_factory=dict)
    """Per bounded column, [L, clip]: each user's mean in a group within it."""
    clipped: Mapping[str, float] = field(default_factory=dict)
    """Per clipped column, the share of its value beyond the clip (an estimate)."""
    rows_cut: float = 0.0
    users_cut: float = 0.0
    groups: int = 1
    """The groups the noise of T is weighed over."""
    tuned_at: str = ""
    ledger_id: int = 0
    """The ledger row of the admin's charge."""
    means: Mapping[str, float] = field(default_factory=dict)
    """Per clipped column, a row's mean value (an estimate)."""
    lost: tuple[float, ...] = ()
    """The rows beyond each candidate T (`tuning.ROW_EDGES`), estimated: with `users_over`,
    `rows_total` and `mean_cap`, what each query chooses its own T from (`Applied.chosen`)."""
    users_over: tuple[float, ...] = ()
    rows_total: float = 0.0
    mean_cap: int = 0
    bins: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Per clipped column, its value bins with their noise (over `ranges`' thresholds): what
    each query chooses its own clip from."""
    ranges: Mapping[str, Bounds] = field(default_factory=dict)
    """Per clipped column, its configured bounds when it was tuned."""

    def to_json(self) -> dict[str, Any]:
        return {"table": self.table, "token": self.token, "epsilon": str(self.epsilon),
                "max_rows": self.max_rows, "mean_rows": self.mean_rows,
                "sum_rows": self.sum_rows,
                "clips": {c: [b.lower, b.upper] for c, b in sorted(self.clips.items())},
                "clipped": dict(sorted(self.clipped.items())), "rows_cut": self.rows_cut,
                "users_cut": self.users_cut, "groups": self.groups,
                "means": dict(sorted(self.means.items())), "lost": list(self.lost),
                "users_over": list(self.users_over), "rows_total": self.rows_total,
                "mean_cap": self.mean_cap,
                "bins": {c: list(b) for c, b in sorted(self.bins.items())},
                "ranges": {c: [b.lower, b.upper] for c, b in sorted(self.ranges.items())}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], tuned_at: str = "",
                  ledger_id: int = 0) -> TableTuning:
        return cls(str(data["table"]), str(data["token"]), Fraction(data["epsilon"]),
                   int(data["max_rows"]), int(data["mean_rows"]), int(data["sum_rows"]),
                   {c: Bounds(float(b[0]), float(b[1])) for c, b in data["clips"].items()},
                   {c: float(s) for c, s in data["clipped"].items()},
                   float(data["rows_cut"]), float(data["users_cut"]), int(data["groups"]),
                   tuned_at, ledger_id, {c: float(m) for c, m in data["means"].items()},
                   tuple(float(x) for x in data["lost"]),
                   tuple(float(x) for x in data["users_over"]), float(data["rows_total"]),
                   int(data["mean_cap"]),
                   {c: tuple(float(x) for x in b) for c, b in data["bins"].items()},
                   {c: Bounds(float(b[0]), float(b[1])) for c, b in data["ranges"].items()})

    def statistics(self) -> TunedRows:
        """What T is chosen from again for each query (`tuning.rechosen`)."""
        return TunedRows(self.max_rows, self.mean_rows, self.rows_cut, self.users_cut,
                         self.rows_total, float(self.groups), lost=self.lost,
                         mean_cap=self.mean_cap, users_over=self.users_over)

    def describe(self) -> str:
        """Where the bounds come from, for EXPLAIN and the notice."""
        return (f"the bounds an admin tuned for {self.table} (ledger #{self.ledger_id}"
                f"{', ' + self.tuned_at if self.tuned_at else ''}: epsilon "
                f"{float(self.epsilon):.6g}, charged once to each analyst)")


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def tuning_sql(schema: str, table: str, columns: Sequence[str]) -> str:
    """The query whose per-query tuning statistics an admin's tuning measures: every row
    counted, and each bounded numeric column summed and averaged (T of counts, sums and
    means; each column's clip)."""
    items = ["count(*)"]
    for c in columns:
        items += [f"sum({_ident(c)})", f"avg({_ident(c)})"]
    return f"SELECT {', '.join(items)} FROM {_ident(schema)}.{_ident(table)}"


def with_tuning_epsilon(plan: DPQueryPlan, epsilon: Fraction) -> DPQueryPlan:
    """`plan` (of `tuning_sql`'s query, T not fixed) with its tuning statistics' noise
    calibrated for `epsilon`, split evenly among them (each user adds at most 1 to each:
    sensitivity 1), and that as its cost: the one statement an admin's tuning runs. The rest
    of the plan (the answer's quantities, which T's choice weighs) is unchanged."""
    if not plan.tuning or epsilon <= 0:
        raise InternalError("a table's tuning without tuning statistics (this is a bug)")
    each = epsilon / len(plan.tuning)
    spec = NoiseSpec.calibrate(NoiseKind.LAPLACE, float(each), 0, 1, 1.0)
    tuning = tuple(replace(q, epsilon=each, delta=Fraction(0), noise=spec) for q in plan.tuning)
    return replace(plan, tuning=tuning, cost=PrivacyCost(epsilon, Fraction(0)))


def column_of(agg: Any, policy: TablePolicy) -> str | None:
    """The configured column an aggregate reads as it is (its argument a plain column
    reference with that column's bounds), or None."""
    arg = agg.arg
    if not isinstance(arg, ast.ColumnRef) or not arg.fields:
        return None
    last = arg.fields[-1]
    if not isinstance(last, ast.String):
        return None
    name = str(last.sval)
    return name if policy.columns.get(name) == agg.bounds else None


def table_tuning(table: str, token: str, epsilon: Fraction, query: AnalyzedQuery,
                 policy: TablePolicy, tuned: TunedRows, groups: int) -> TableTuning:
    """What is stored of a table's tuning: T as `tuned` chose it, and its clips by column."""
    clips: dict[str, Bounds] = {}
    clipped: dict[str, float] = {}
    means: dict[str, float] = {}
    bins: dict[str, tuple[float, ...]] = {}
    ranges: dict[str, Bounds] = {}
    for i, b in tuned.clips.items():
        column = column_of(query.aggregates[i], policy)
        if column is not None and i in tuned.means:
            clips[column], clipped[column], means[column] = b, tuned.clipped[i], tuned.means[i]
            if i in tuned.value_bins:
                bins[column] = tuned.value_bins[i]
                ranges[column] = query.aggregates[i].known_bounds
    return TableTuning(table, token, epsilon, tuned.max_rows, tuned.mean_rows,
                       tuned.sum_rows or tuned.max_rows, clips, clipped, tuned.rows_cut,
                       tuned.users_cut, groups, means=means, lost=tuned.lost,
                       users_over=tuned.users_over, rows_total=tuned.rows_total,
                       mean_cap=tuned.mean_cap, bins=bins, ranges=ranges)


@dataclass(frozen=True)
class Applied:
    """A query with a table's tuned bounds: its clips filled in; T chosen for its plan."""

    query: AnalyzedQuery
    tuning: TableTuning
    tuned: TunedRows
    """The clips, and once `chosen`, T of counts, means and sums and the shares' weights."""
    unclipped: AnalyzedQuery | None = None
    """The query before its clips (which `chosen` chooses again)."""
    columns: Mapping[int, str] = field(default_factory=dict)
    """The clipped aggregates' columns (the first of each column and range)."""

    @property
    def base(self) -> AnalyzedQuery:
        """The query as asked, before the table's clips."""
        return self.query if self.unclipped is None else self.unclipped

    @property
    def clips_rechosen(self) -> bool:
        """Whether `chosen` chooses each clip again from the table's value bins (each
        clipped column was tuned under the bounds it has now, into as many bins as they
        have now), not keeping a stored one."""
        return all((bins := self._bins(i, column)) is not None
                   and len(bins) == len(value_thresholds(self.base.aggregates[i].known_bounds)) + 1
                   for i, column in self.columns.items())

    def _bins(self, i: int, column: str) -> tuple[float, ...] | None:
        """The stored value bins of aggregate i's column, where it was tuned under the bounds
        it has now (else None: the stored clip, if it fits, is what it may have)."""
        bins = self.tuning.bins.get(column)
        if bins is None or self.tuning.ranges.get(column) != self.base.aggregates[i].known_bounds:
            return None
        return bins

    def chosen(self, plan: DPQueryPlan, released: Sequence[float] | None = None,
               public: int | None = None) -> Applied:
        """T and the clips for this query's noise (`plan`: its shares, which neither
        changes), from the table's stored statistics (post-processing), as per-query tuning
        chooses them, the noise weighed over the tuning's `groups` (over 1 without GROUP
        BY), or once groups are selected, over the released groups' noisy user counts
        (`released`: `tuning.typical_groups`, as per-query tuning's one pass weighs it), or
        over the public groups the query releases, all of them (`public`: their number);
        then T of the sums and the weights of the shares (`tuning.finished`)."""
        unit = answer_unit(plan)
        groups = (typical_groups(released) if released is not None
                  else float(public) if public is not None
                  else float(self.tuning.groups) if self.query.keys else 1.0)
        again = rechosen(replace(self.tuning.statistics(), clips=self.tuned.clips,
                                 clipped=self.tuned.clipped, means=self.tuned.means),
                         groups, unit)
        query = self.query
        if self.unclipped is not None:
            clips, clipped, means = dict(again.clips), dict(again.clipped), dict(again.means)
            base = self.unclipped
            for i, column in self.columns.items():
                agg = base.aggregates[i]
                bins = self._bins(i, column)
                if bins is None:
                    continue
                upper, share, mean = clip_from(bins, agg.known_bounds, again.rows_total,
                                               clip_weight(again, agg.kind, unit))
                for j in sharing_clip(base, i):
                    clips[j] = Bounds(agg.known_bounds.lower, upper)
                    clipped[j], means[j] = share, mean
            again = replace(again, clips=clips, clipped=clipped, means=means)
            query = base.with_bounds(clips)
        return replace(self, query=query, tuned=finished(query, plan, again, unit))


def unfiltered(query: AnalyzedQuery) -> bool:
    """Whether the query reads every row of its one FROM item (no join, no WHERE but the
    `uid IS NOT NULL` the analysis adds): the rows a table's tuning measured."""
    where = query.where
    if len(query.from_clause) != 1 or not isinstance(query.from_clause[0], ast.RangeVar):
        return False
    return where is None or (isinstance(where, ast.NullTest)
                             and where.nulltesttype == NullTestType.IS_NOT_NULL
                             and same_node(where.arg, query.uid))


def may_use_tuning(query: AnalyzedQuery) -> bool:
    """Whether a table's tuned bounds could apply to the query (`applied`): it reads one
    table and has row-level aggregates (else no tuning need be read)."""
    return len(query.tables) == 1 and any(a.row_level for a in query.aggregates)


def applied(query: AnalyzedQuery, policies: Mapping[str, TablePolicy],
            tunings: Mapping[str, TableTuning]) -> Applied | None:
    """The query with the tuned bounds of the one protected table it reads, where it reads
    one (not through a subquery), has row-level aggregates and that table is tuned; None
    otherwise (T then chosen per query, or as the query or the session fixes it). Where it
    reads all the table's rows (`unfiltered`), each row-level sum or mean of a bounded column
    as it is gets a clip; a filtered or joined query's values may lie anywhere in [L, U]
    whatever the table's do, so it keeps its bounds (and T from the table's statistics:
    fewer rows per user only make it larger than it need be)."""
    if not may_use_tuning(query):
        return None
    (ref,) = query.tables
    policy = policies.get(ref.name)
    if ref.derived or policy is None or len(ref.bases) != 1:
        return None
    tuning = tunings.get(next(iter(ref.bases)))
    if tuning is None:
        return None
    if not unfiltered(query):
        return Applied(query, tuning, tuning.statistics())
    found: dict[int, Bounds] = {}
    clipped: dict[int, float] = {}
    means: dict[int, float] = {}
    columns: dict[int, str] = {}
    for i in clip_tuned(query):
        agg = query.aggregates[i]
        column = column_of(agg, policy)
        if column is None or column not in tuning.clips:
            continue
        columns[i] = column
        clip = tuning.clips[column]
        if not (agg.known_bounds.lower == clip.lower <= clip.upper <= agg.known_bounds.upper):
            continue  # (the column's bounds changed since: its clip no longer fits)
        for j in sharing_clip(query, i):
            found[j], clipped[j] = clip, tuning.clipped.get(column, 0.0)
            if column in tuning.means:
                means[j] = tuning.means[column]
    tuned = replace(tuning.statistics(), clips=found, clipped=clipped, means=means,
                    sum_rows=tuning.sum_rows)
    return Applied(query.with_bounds(found), tuning, tuned, query, columns)

