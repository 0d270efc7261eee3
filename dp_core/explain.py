"""EXPLAIN and notice text of a DP query: its plan, cost and noise in words (never a value that
depends on the data, but the bounds APPROX_BOUNDS chose with DP in an answer's notice)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from pglast import prettify
from pglast.stream import RawStream

from dp_core.mechanisms import users_kept_with
from dp_core.ownership import JOIN_ROWS_PER_USER
from dp_core.partials import MEANS
from dp_core.plan import Component, DPQueryPlan, shares_clip
from dp_core.quantiles import BRANCHING, DEPTH, FoundBounds, bounds_threshold, rank_half_width_95
from dp_core.query import AggKind, AnalyzedQuery
from dp_core.release import half_width_95
from dp_core.sqlnodes import node_sql
from dp_core.tuning import SHARE_FLOOR, TunedRows, groups_threshold


@dataclass(frozen=True)
class Split:
    """How a pushdown may split by uid ranges, as EXPLAIN says it."""

    ranges: int
    table: str
    uid_column: str
    rows: int
    prefilter: bool = False
    """Whether the ranges pick each user's groups from its rows first (`pushdown_prefilter`)."""


def fmt(x: float) -> str:
    """A number as the text shows it: six significant digits."""
    return f"{x:.6g}"


def visible_name(query: AnalyzedQuery, aggregate: int) -> str:
    """An aggregate's output name, or for one released hidden (an expression's, HAVING's or
    ORDER BY's) its SQL as written."""
    name = query.aggregates[aggregate].output_name
    if not name.startswith("dp_hidden"):
        return name
    source = next((o.source for o in query.outputs
                   if o.aggregate == aggregate and o.bound is None), None)
    return str(RawStream()(source)) if source is not None else "an expression's aggregate"


def _pct(x: float) -> str:
    return f"{100 * x:.2g}%"


def explain_lines(query: AnalyzedQuery, plan: DPQueryPlan, sql: Sequence[str],
                  split: Split | None = None, tuned_from: str | None = None,
                  unpaid: str | None = None) -> list[str]:
    """EXPLAIN's rows for a DP query: its parameters and cost, partition selection, each
    noisy quantity, the split, the pushdown SQL pretty-printed (a statement's first row
    indented by two, the rest by four). Nothing here depends on the data but the bounds an
    admin tuned (`tuned_from` says whose; a DP release the analyst has paid for). `unpaid`:
    tuned bounds a run would use, which the analyst has not paid for: the plan shown is
    per-query tuning's, and EXPLAIN says that instead."""
    lines = [
        f"DP query: epsilon {fmt(float(plan.epsilon))}, delta {fmt(float(plan.delta))}, "
        f"max_groups_contributed {plan.max_groups_contributed}, noise {plan.noise_kind.value}",
        f"Cost charged when run: epsilon {fmt(float(plan.cost.epsilon))}, "
        f"delta {fmt(float(plan.cost.delta))}"
        + ("" if unpaid is None else ", and once the tuned bounds' epsilon (below)"),
    ]
    if plan.groups_per_user < plan.max_groups_contributed:
        lines.append("No GROUP BY: each user is in the one group, so the noise is calibrated "
                     "for 1 group per user")
    if plan.threshold is not None and plan.tau is not None:
        t = plan.threshold
        lines.append(f"Partition selection: noisy user count >= tau {fmt(plan.tau)} "
                     f"(laplace scale {fmt(t.spec.scale)}, epsilon {fmt(float(t.epsilon))}, "
                     f"delta {fmt(float(t.delta))})")
        if plan.selection_asked is not plan.selection:
            lines.append("  (not truncated_geometric: the noisy user count is released as a "
                         "count, and thresholding it costs nothing more)")
    elif plan.threshold is not None:
        t = plan.threshold
        args = (plan.max_groups_contributed, float(t.epsilon), float(t.delta))
        lines.append(f"Partition selection: truncated geometric (Desfontaines et al. 2022), "
                     f"epsilon {fmt(float(t.epsilon))}, delta {fmt(float(t.delta))}: a group of n "
                     f"users is kept with probability pi(n), at least 0.5 from "
                     f"{users_kept_with(0.5, *args)} users and 1 from "
                     f"{users_kept_with(1.0, *args)}")
    elif query.public_groups:
        lines.append("Public groups: every key the configuration lists for "
                     + ", ".join(node_sql(k.expr) for k in query.keys)
                     + " is released (absent ones with noise around zero), no partition "
                     "selection, nothing spent on it")
    if query.joins_capped:
        lines.append(f"Protected tables joined row by row: each reads at most "
                     f"{JOIN_ROWS_PER_USER} rows of a user (a table's chosen by a hash of "
                     "each row's place, a subquery's at random), so one user's rows cannot "
                     "multiply the work past their square")
    for q in plan.approx_bounds:
        assert q.aggregate is not None
        lines.append(f"APPROX_BOUNDS for {visible_name(query, q.aggregate)}: log-scale "
                     f"histogram of per-user values, laplace scale {fmt(q.spec.scale)}, epsilon "
                     f"{fmt(float(q.epsilon))}; bounds = outermost bins with noisy count > "
                     f"{fmt(bounds_threshold(q.spec.scale))}")
    lines.extend(_row_level_lines(query, plan))
    if tuned_from is not None:
        lines.append(f"  max_rows_contributed and the clips: from {tuned_from}; none of this "
                     "query's epsilon goes to choosing them")
    if unpaid is not None:
        lines.append(f"  when run: max_rows_contributed and the clips from {unpaid}, not "
                     "chosen per query as shown here (their values are not shown: the first "
                     "answer that uses them charges their epsilon, once)")
    for q in plan.quantities:
        owner = (", ".join(visible_name(query, j) for j in [q.aggregate, *(
            j for j, _, name in plan.same if name == q.name)])
                 if q.aggregate is not None else "user count")
        if q.noise is None and q.aggregate is not None \
                and query.aggregates[q.aggregate].row_level and plan.max_rows is None:
            noise = f"{plan.noise_kind.value} noise scaled to the max_rows_contributed chosen"
        elif q.noise is None:
            noise = f"{plan.noise_kind.value} noise scaled to the bounds APPROX_BOUNDS finds"
        else:
            noise = (f"{q.noise.kind.value} scale {fmt(q.noise.scale)}, 95% half-width "
                     f"{fmt(q.noise.half_width_95)}")
        if q.component == Component.TREE:
            noise = f"{noise} on each node's user count ({DEPTH} levels of {BRANCHING} children)"
            if q.noise is not None:
                noise += (f"; the answer within about ±{fmt(rank_half_width_95(q.noise))} users "
                          "of the wanted rank (95%)")
        sensitivity = "?" if q.sensitivity is None else fmt(q.sensitivity)
        lines.append(f"  {owner}: {q.component}, sensitivity {sensitivity}, epsilon "
                     f"{fmt(float(q.epsilon))}, delta {fmt(float(q.delta))}, {noise}")
    if split is not None:
        lines.append(f"Split: up to {split.ranges} pushdowns at once over ranges of "
                     f"{split.table}.{split.uid_column} (about {split.rows} rows), on free pool connections "
                     "in one snapshot; their rows and quantile trees add up")
        if split.prefilter:
            lines.append("  the ranges pick each user's groups from its rows before aggregating "
                         "them (pushdown_prefilter; the same choice of groups)")
    if query.outer is not None:
        lines.append("Post-processing: the query around the DP subquery runs over its released "
                     "rows only")
    lines.append("Pushdown SQL (run as the pushdown role):")
    for statement in sql:
        first, *rest = _pretty(statement)
        lines.append("  " + first)
        lines.extend("    " + line for line in rest)
    return lines


def _row_level_lines(query: AnalyzedQuery, plan: DPQueryPlan) -> list[str]:
    """What EXPLAIN says of row-level aggregates: T, how it is chosen, the rows' bounds."""
    names = [visible_name(query, i) for i, a in enumerate(query.aggregates) if a.row_level]
    if not names:
        return []
    t = "chosen per query (below)" if plan.max_rows is None else str(plan.max_rows)
    lines = [f"Row-level aggregates (rows, as Postgres counts them): {', '.join(names)}; each "
             f"user's rows weighted by min(1, T / its rows in all groups), max_rows_contributed "
             f"T {t}; the noise is calibrated for T rows per user in all groups together"]
    if query.keys:
        lines.append(f"  a user's count for partition selection goes to the "
                     f"{plan.max_groups_contributed} group(s) where it has the most rows")
    for q in plan.tuning:
        if q.aggregate is not None:  # (a value histogram: below)
            continue
        what = ("users per log-scale bin of their row count" if q.component == Component.ROWS
                else f"groups that at least {fmt(groups_threshold(plan))} users have as their "
                     "first group (of their most rows)")
        lines.append(f"max_rows_contributed from DP statistics: {what}, laplace scale "
                     f"{fmt(q.spec.scale)}, epsilon {fmt(float(q.epsilon))}")
    if plan.tuning:
        lines.append("  T = the bin edge of least estimated error: rows beyond T + groups x "
                     "the count's mean noise for T; for AVG, VAR and STDDEV, at most the "
                     "upper edge of the median user's bin; for SUM, at most T, with its "
                     "rows' mean value beyond T + groups x its noise for T")
        lines.append("  then the row-level counts', sums' and averages' noisy quantities split "
                     "their epsilon in proportion to the square root of their noise relative "
                     "to their value as T and the clips make it, each at least "
                     f"{fmt(float(SHARE_FLOOR))} of its equal share below (none with VAR or "
                     "STDDEV)")
        if plan.tau is not None and not any(q.component == Component.GROUPS
                                            for q in plan.tuning):
            lines.append("  groups: after partition selection, the released groups' noisy "
                         "user counts over the median released group's (T for the median "
                         "group's error relative to its size)")
    if plan.rows_stored is not None:
        lines.append("  T (and any clips below) chosen after partition selection from the "
                     "statistics of the table's tuned bounds, as they would be per query: the "
                     "noise weighed over the released groups' noisy user counts over the "
                     "median released group's (post-processing: none of this query's epsilon)")
    clipped = {q.aggregate for q in plan.tuning if q.aggregate is not None} \
        | set(plan.rows_stored or ())
    for q in plan.tuning:
        if q.aggregate is not None:
            lines.append(f"Clip of {visible_name(query, q.aggregate)} from DP statistics: its "
                         f"rows per bin of their user's mean in the group (each user's "
                         f"weighted by 1 / its rows), laplace scale {fmt(q.spec.scale)}, "
                         f"epsilon {fmt(float(q.epsilon))}")
    for i, a in enumerate(query.aggregates):
        if a.row_level and a.bounds is not None and a.arg is not None \
                and a.kind is not AggKind.COUNT:
            how = ("; each user's mean in a group clamped to a clip within it, of least "
                   "estimated error (value beyond it + groups x the noise its range brings)"
                   if any(shares_clip(query.aggregates[j], a) for j in clipped) else "")
            if a.row_bounds is not None:  # (a clip given: an admin's tuned bounds)
                how = (f"; each user's mean in a group clamped to [{fmt(a.bounds.lower)}, "
                       f"{fmt(a.bounds.upper)}]")
            rows = a.row_bounds or a.bounds
            lines.append(f"  {visible_name(query, i)}: each row's value clamped to "
                         f"[{fmt(rows.lower)}, {fmt(rows.upper)}]{how}")
    return lines


def _pretty(sql: str) -> list[str]:
    """`sql` on several lines (pglast's pretty printer), for EXPLAIN's rows in psql."""
    try:
        return [line for line in prettify(sql).splitlines() if line.strip()]
    except Exception:  # (a printer's gap must not fail EXPLAIN: the one-line form)
        return [sql]


def notice_text(query: AnalyzedQuery, plan: DPQueryPlan,
                spread: Mapping[int, tuple[float, float]], bounds: Mapping[int, FoundBounds],
                epsilon_left: float, delta_left: float,
                tuned: TunedRows | None = None, tuned_from: str | None = None,
                paid_once: Fraction = Fraction(0)) -> tuple[str, str | None]:
    """A DP answer's notice (message, detail): what it spent and what is left, each released
    aggregate's 95% noise half-width, the bounds APPROX_BOUNDS chose (released with DP), and
    T and the clips as chosen (`tuned`) per query or from an admin's tuning (`tuned_from`;
    `paid_once`: the ε this answer paid for it, its first)."""
    widths = []
    for col in query.outputs:
        if col.aggregate is None or col.bound is not None:
            continue
        name = visible_name(query, col.aggregate)
        if query.aggregates[col.aggregate].kind is AggKind.QUANTILE:
            # its noise is on counts of the tree, not on the value: the rank it may be off by
            tree = [q for q in plan.quantities if q.aggregate == col.aggregate and q.noise]
            if tree:
                widths.append(f"{name} rank ±{fmt(rank_half_width_95(tree[0].spec))} users")
            continue
        if col.aggregate in spread:  # AVG, VAR, STDDEV: depends on the count
            low, high = spread[col.aggregate]
            widths.append(f"{name} ±{fmt(low)}" if fmt(low) == fmt(high)
                          else f"{name} ±{fmt(low)} to ±{fmt(high)} (by group count)")
            continue
        width = half_width_95(query, plan, col.aggregate)
        if width is not None:
            widths.append(f"{name} ±{fmt(width)}")
    once = f" (and epsilon {fmt(float(paid_once))} once for tuned bounds)" if paid_once else ""
    message = (f"DP answer: spent epsilon {fmt(float(plan.cost.epsilon))}, delta "
               f"{fmt(float(plan.cost.delta))}{once}; budget left epsilon "
               f"{fmt(epsilon_left)}, delta {fmt(delta_left)}")
    details = ["95% noise half-width: " + ", ".join(widths)] if widths else []
    for q in plan.approx_bounds:
        assert q.aggregate is not None
        f = bounds[q.aggregate]
        details.append(
            f"APPROX_BOUNDS chose [{fmt(f.lower)}, {fmt(f.upper)}] for "
            f"{visible_name(query, q.aggregate)} (epsilon {fmt(float(q.epsilon))}); "
            f"about {_pct(f.clamped_fraction)} of its per-user values were clamped")
    if tuned is not None:
        spent = sum(float(q.epsilon) for q in plan.tuning)
        apart = [f", {t} for {what}" for t, kinds, what in (
            (tuned.mean_rows, MEANS, "averages and variances"),
            (tuned.sum_rows, frozenset({AggKind.SUM}), "sums"))
            if t and t != tuned.max_rows
            and any(a.row_level and a.kind in kinds for a in query.aggregates)]
        how = f"epsilon {fmt(spent)}" if tuned_from is None else f"from {tuned_from}"
        details.append(f"max_rows_contributed chose {tuned.max_rows} rows per user{''.join(apart)} "
                       f"({how}); about {_pct(tuned.rows_cut)} of the "
                       f"{'rows' if tuned_from is None else 'table rows'} (of "
                       f"{_pct(tuned.users_cut)} of the users) were weighted away, by a DP "
                       "histogram that misses users too few to show in it"
                       + ("" if tuned_from is None else " (of the whole table, when tuned)"))
        for i, b in sorted(tuned.clips.items()):
            if any(o.aggregate == i for o in query.outputs):
                details.append(f"{visible_name(query, i)}: each user's mean in a group "
                               f"clipped to [{fmt(b.lower)}, {fmt(b.upper)}], about "
                               f"{_pct(tuned.clipped[i])} of its value beyond"
                               + ("" if tuned_from is None else " (in the whole table)"))
    elif plan.max_rows is not None:
        details.append(f"max_rows_contributed {plan.max_rows} rows per user")
    return message, "; ".join(details) if details else None
