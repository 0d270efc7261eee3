"""From the pushdown's true per-group quantities to the released, differentially private rows.

Noise is added to every quantity of every group (vectorised, in
`dp_core.mechanisms`); grouped results keep only groups whose noisy user
count reaches τ; a global aggregate always yields exactly one row. AVG is the
midpoint plus a noisy centred sum over a noisy count, clamped to [L, U] (Li et
al.); VAR uses the noisy centred sum of squares as well, clamped to
[0, ((U−L)/2)²]; STDDEV is √VAR.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dp_core.analysis import AggKind, Aggregate, AnalyzedQuery
from dp_core.mechanisms import secure_rng
from dp_core.plan import Component, DPQueryPlan, reads_user_count

INT8 = "int8"
FLOAT8 = "float8"


def output_type(agg: Aggregate) -> str:
    """Counts are bigint, every other DP aggregate double precision."""
    return INT8 if agg.kind in (AggKind.COUNT, AggKind.COUNT_USERS) else FLOAT8


@dataclass(frozen=True)
class Released:
    """The released rows: key texts (None for NULL) and aggregate values, in select-list order."""

    rows: tuple[tuple[str | int | float | None, ...], ...]
    groups_in: int
    """Groups the pushdown returned (before thresholding); not to be shown to analysts."""


def _column(rows: Sequence[Mapping[str, Any]], name: str) -> NDArray[np.float64]:
    return np.array([float(r[name]) if r[name] is not None else 0.0 for r in rows], dtype=np.float64)


def release(query: AnalyzedQuery, plan: DPQueryPlan, rows: Sequence[Mapping[str, Any]],
            rng: np.random.Generator | None = None) -> Released:
    """Add noise to the pushdown's rows and keep what may be released."""
    rng = rng or secure_rng()
    if not query.keys and not rows:
        rows = [{q.name: 0 for q in plan.all_quantities}]  # an aggregate over no rows
    noisy: dict[str, NDArray[np.float64]] = {
        q.name: q.noise.add(_column(rows, q.name), rng) if rows else np.zeros(0)
        for q in plan.all_quantities
    }
    keep = np.ones(len(rows), dtype=bool)
    if plan.threshold is not None and plan.tau is not None:
        keep = noisy[plan.threshold.name] >= plan.tau
    values: list[list[Any]] = []
    for i, agg in enumerate(query.aggregates):
        values.append(list(_aggregate_values(i, agg, plan, noisy, len(rows))))
    out = []
    for r in (int(x) for x in np.flatnonzero(keep)):
        row: list[str | int | float | None] = []
        for col in query.outputs:
            if col.key is not None:
                row.append(rows[r][f"dp_t{col.key}"])
            else:
                assert col.aggregate is not None
                row.append(values[col.aggregate][r])
        out.append(tuple(row))
    return Released(tuple(out), len(rows))


def _aggregate_values(i: int, agg: Aggregate, plan: DPQueryPlan,
                      noisy: Mapping[str, NDArray[np.float64]], n: int) -> list[int | float]:
    if reads_user_count(agg):
        return [max(0, round(v)) for v in noisy["dp_users"]]
    if agg.kind is AggKind.COUNT:
        return [max(0, round(v)) for v in noisy[f"dp_a{i}_{Component.COUNT}"]]
    if agg.kind is AggKind.SUM:
        return [float(v) for v in noisy[f"dp_a{i}_{Component.SUM}"]]
    lo, hi = agg.bounds.lower, agg.bounds.upper
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    count = np.maximum(noisy[f"dp_a{i}_{Component.N}"], 1.0)
    mean_c = noisy[f"dp_a{i}_{Component.CENTERED_SUM}"] / count
    if agg.kind is AggKind.AVG:
        return [float(v) for v in np.clip(mid + mean_c, lo, hi)]
    var = noisy[f"dp_a{i}_{Component.CENTERED_SQUARES}"] / count - mean_c**2
    var = np.clip(var, 0.0, half * half)
    if agg.kind is AggKind.VAR:
        return [float(v) for v in var]
    return [math.sqrt(float(v)) for v in var]
