"""Quantiles from a pushed-down tree of user counts, and APPROX_BOUNDS from a log-scale histogram.

Quantiles (ANON_NTILE, ANON_MEDIAN, ANON_MIN, ANON_MAX, PERCENTILE_CONT). Each
user contributes one value per group (its own quantile of its rows, computed in
the pushdown), clamped to [L, U]. [L, U] is cut into BRANCHING^DEPTH equal leaves;
a B-ary tree over the leaves has DEPTH levels below the root. The pushdown returns,
per group, the number of users under every non-empty node (`tree_codes` is the
same computation in Python, for tests and the stochastic tester). The proxy walks
the tree from the root: at each level it takes noisy counts of the current node's
B children, finds the child holding the wanted rank, and descends; at the leaf
it interpolates linearly. A user changes one node per level, so one group's
tree has L1 sensitivity DEPTH (L2 √DEPTH) and the noise is calibrated to that;
the walk only looks at noisy counts, which is post-processing of a fully noised
tree (noising the counts not looked at would not change what is released).

APPROX_BOUNDS (paper §5.1, Appendix D). When an aggregate has neither written nor
configured bounds, a histogram of the per-user values over bins bounded by
±2^j (j = MIN_EXP … MAX_EXP) and 0 is pushed down; each bin's count gets
Laplace(C_u/ε_b) noise; the bounds are the outer edges of the lowest and the
highest bin whose noisy count exceeds t = −b·ln(2 − 2·p^(1/(k−1))), where k is
the number of bins and 1 − p the probability that an empty bin passes anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

import numpy as np
from numpy.typing import NDArray

from dp_core.errors import InternalError, InvalidParameterValue
from dp_core.mechanisms import NoiseSpec

BRANCHING = 16
DEPTH = 4
LEAVES = BRANCHING**DEPTH
LEVEL_OFFSETS = tuple(sum(BRANCHING**j for j in range(1, level)) for level in range(1, DEPTH + 1))
"""Node code = LEVEL_OFFSETS[level − 1] + the node's index within its level (levels 1…DEPTH)."""
LEVEL_DIVISORS = tuple(BRANCHING ** (DEPTH - level) for level in range(1, DEPTH + 1))
"""A leaf's ancestor at `level` has index leaf // LEVEL_DIVISORS[level − 1]."""
ALPHA = 0.0075
"""A child whose noisy count is below this share of its siblings' total counts as empty."""

MIN_EXP, MAX_EXP = -32, 95
SUCCESS_PROBABILITY = 1 - 1e-9
"""APPROX_BOUNDS: the probability that no empty bin passes the threshold."""


# ---------------------------------------------------------------------------- the tree

def leaf_of(values: NDArray[np.float64], lower: float, upper: float) -> NDArray[np.int64]:
    """The leaf of each value: the same float8 arithmetic as the pushdown's SQL (where NaN sorts
    above every number, so LEAST(GREATEST(NaN, L), U) is U)."""
    v = np.asarray(values, dtype=np.float64)
    v = np.minimum(np.maximum(np.where(np.isnan(v), np.inf, v), lower), upper)
    leaf = np.floor((v - lower) / (upper - lower) * float(LEAVES))
    return np.clip(leaf, 0, LEAVES - 1).astype(np.int64)


def tree_codes(values: Sequence[float] | NDArray[np.float64], lower: float,
               upper: float) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(node codes, user counts) of one group's tree: every non-empty node, codes ascending."""
    leaves = leaf_of(np.asarray(values, dtype=np.float64), lower, upper)
    codes = np.concatenate([off + leaves // div for off, div in zip(LEVEL_OFFSETS, LEVEL_DIVISORS,
                                                                     strict=True)])
    uniq, counts = np.unique(codes, return_counts=True)
    return uniq.astype(np.int64), counts.astype(np.int64)


def _lookup(codes: NDArray[np.int64], counts: NDArray[np.int64],
            wanted: NDArray[np.int64]) -> NDArray[np.float64]:
    if len(codes) == 0:
        return np.zeros(wanted.shape)
    pos = np.minimum(np.searchsorted(codes, wanted), len(codes) - 1)
    return np.where(codes[pos] == wanted, counts[pos], 0).astype(np.float64)


def walk(codes: NDArray[np.int64], counts: NDArray[np.int64], quantile: float, lower: float,
         upper: float, noise: NoiseSpec, rng: np.random.Generator,
         runs: int = 1) -> NDArray[np.float64]:
    """`runs` independent DP answers for the `quantile` (0…1) of one group's tree.

    (The proxy asks for one run; the stochastic tester for many, drawn in one vectorised call.)
    """
    if not 0.0 <= quantile <= 1.0:
        raise InternalError()
    return _walk(codes, counts, np.full(runs, float(quantile)), lower, upper, noise, rng)


def walk_interval(codes: NDArray[np.int64], counts: NDArray[np.int64], quantile: float,
                  lower: float, upper: float, noise: NoiseSpec,
                  rng: np.random.Generator) -> tuple[float, float, float]:
    """The DP answer for the `quantile` of one group's tree (as `walk`'s), and the values the
    same noisy tree gives at `rank_half_width_95(noise)` users below and above its rank: an
    about 95% interval of the true quantile (the low end's true rank is at most the wanted
    one unless the rank error passes its 95% bound; the high end's likewise). The three walks
    share every node's noise, drawn once as for one noisy tree, which the plan's noise is
    calibrated for whole (each user in one node per level): the ends are post-processing."""
    if not 0.0 <= quantile <= 1.0:
        raise InternalError()
    spread = rank_half_width_95(noise)
    out = _walk(codes, counts, np.full(3, float(quantile)), lower, upper, noise, rng,
                spread=spread)
    return float(out[0]), float(out[1]), float(out[2])


def _walk(codes: NDArray[np.int64], counts: NDArray[np.int64], rank: NDArray[np.float64],
          lower: float, upper: float, noise: NoiseSpec, rng: np.random.Generator,
          spread: float | None = None) -> NDArray[np.float64]:
    """Walks from the root for each wanted `rank` (a share, 0…1). Without `spread`, each walk
    draws its own noise (independent answers); with it, the three walks (the answer, its low
    and its high end) share each node's noisy counts, and the ends' ranks move `spread` users
    down and up from the answer's once the root's noisy total is known."""
    codes = np.asarray(codes, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    runs = len(rank)
    node = np.zeros(runs, dtype=np.int64)  # index of the current node within its level
    rank = rank.astype(np.float64)  # the wanted rank as a share of the current node
    children = np.arange(BRANCHING, dtype=np.int64)
    rows = np.arange(runs)
    for level in range(1, DEPTH + 1):
        # the nodes whose children are read: each run's, or (shared) each distinct one once
        parents, at = (np.unique(node, return_inverse=True) if spread is not None
                       else (node, rows))
        index = parents[:, None] * BRANCHING + children[None, :]
        true = _lookup(codes, counts, LEVEL_OFFSETS[level - 1] + index)
        drawn = np.maximum(noise.add(true.ravel(), rng).reshape(len(parents), BRANCHING), 0.0)
        drawn = np.where(drawn < ALPHA * drawn.sum(axis=1, keepdims=True), 0.0, drawn)
        noisy = drawn[np.asarray(at).reshape(-1)]
        total = noisy.sum(axis=1)
        if spread is not None and level == 1:
            shift = spread / total[0] if total[0] > 0 else 1.0
            rank = np.clip(rank + np.array([0.0, -shift, shift]), 0.0, 1.0)
        cum = np.cumsum(noisy, axis=1)
        target = rank * total
        # the first child whose cumulative count passes the target; the last non-empty one at p = 1
        chosen = (cum <= target[:, None]).sum(axis=1)
        last = BRANCHING - 1 - np.argmax(noisy[:, ::-1] > 0, axis=1)
        chosen = np.minimum(chosen, last)
        before = np.where(chosen > 0, cum[rows, np.maximum(chosen - 1, 0)], 0.0)
        width = noisy[rows, chosen]
        inside = np.clip((target - before) / np.where(width > 0, width, 1.0), 0.0, 1.0)
        # a node without signal: spread the rank evenly over its children
        empty = total <= 0
        even = np.minimum(np.floor(rank * BRANCHING), BRANCHING - 1).astype(np.int64)
        chosen = np.where(empty, even, chosen)
        rank = np.where(empty, np.clip(rank * BRANCHING - even, 0.0, 1.0), inside)
        node = node * BRANCHING + chosen
    value = lower + (node + rank) / LEAVES * (upper - lower)
    return np.asarray(np.clip(value, lower, upper), dtype=np.float64)


def rank_half_width_95(noise: NoiseSpec) -> float:
    """How far, in users, a quantile's answer may be from the wanted rank (with probability
    at least about 95%, up to one leaf of value): at each level the walk compares the wanted
    rank with a sum of the noisy counts of the siblings before it, at most B − 1 of them, so
    the rank is off by a sum of at most DEPTH·(B − 1) noises, whose 95% half-width is about
    1.96 of its standard deviation (and the children the walk drops as empty, below ALPHA of
    their siblings, are within it). The count of users in the group does not enter: the same
    ±r is a larger share of a small group. tests/core/test_quantiles.py checks it holds."""
    return 1.96 * math.sqrt(DEPTH * (BRANCHING - 1)) * noise.std


# ---------------------------------------------------------------------------- APPROX_BOUNDS

def histogram_edges() -> tuple[Decimal, ...]:
    """The ascending bin edges: −2^MAX_EXP … −2^MIN_EXP, 0, 2^MIN_EXP … 2^MAX_EXP (exact)."""
    # exact: integers, and 2^-j = 5^j / 10^j (at most 23 significant digits for j ≤ 32)
    positive = [Decimal(2**j) if j >= 0 else Decimal(5**-j).scaleb(j)
                for j in range(MIN_EXP, MAX_EXP + 1)]
    return tuple([x.copy_negate() for x in reversed(positive)] + [Decimal(0)] + positive)


EDGES = histogram_edges()
BINS = len(EDGES) + 1
"""Bins: below the first edge, between consecutive edges, at or above the last (width_bucket)."""


def bin_of(values: NDArray[np.float64]) -> NDArray[np.int64]:
    """Postgres' width_bucket(v, EDGES): the number of edges at or below v (NaN in the top bin)."""
    edges = np.array([float(e) for e in EDGES])
    v = np.where(np.isnan(values), np.inf, values)
    return np.searchsorted(edges, v, side="right").astype(np.int64)


def bin_range(b: int) -> tuple[float, float]:
    """[lower, upper) of bin b; the open-ended outer bins end at twice the outermost edge."""
    lo = float(EDGES[b - 1]) if b > 0 else 2 * float(EDGES[0])
    hi = float(EDGES[b]) if b < len(EDGES) else 2 * float(EDGES[-1])
    return lo, hi


def bounds_threshold(scale: float, bins: int = BINS,
                     success_probability: float = SUCCESS_PROBABILITY) -> float:
    """t such that an empty bin's Laplace(scale)-noisy count exceeds it in any of `bins` − 1 bins
    with probability 1 − success_probability (paper Appendix D)."""
    if not (scale > 0 and bins > 1 and 0 < success_probability < 1):
        raise InternalError()
    # 2 − 2·p^(1/(k−1)) without cancellation
    tail = -2.0 * math.expm1(math.log(success_probability) / (bins - 1))
    return -scale * math.log(tail)


@dataclass(frozen=True)
class FoundBounds:
    lower: float
    upper: float
    clamped_fraction: float
    """Approximate share of the per-user values outside [lower, upper] (from the noisy bins)."""


class NoBoundsFound(InvalidParameterValue):
    def __init__(self, aggregate: str) -> None:
        super().__init__(
            f"APPROX_BOUNDS found no value range for {aggregate}: too few users for the epsilon "
            "it was given (the privacy cost is charged)",
            hint="write the bounds in the query, e.g. ANON_SUM(x, 0, 100), or ask for more epsilon")


def choose_bounds(counts: Mapping[int, int], noise: NoiseSpec, rng: np.random.Generator,
                  aggregate: str) -> FoundBounds:
    """Bounds from the true per-bin user counts: noise every bin, keep the outermost passing ones."""
    true = np.zeros(BINS)
    for b, n in counts.items():
        if not 0 <= b < BINS:
            raise InternalError()
        true[b] = n
    noisy = noise.add(true, rng)
    passing = np.flatnonzero(noisy > bounds_threshold(noise.scale))
    if len(passing) == 0:
        raise NoBoundsFound(aggregate)
    lo_bin, hi_bin = int(passing[0]), int(passing[-1])
    lower, upper = bin_range(lo_bin)[0], bin_range(hi_bin)[1]
    total = max(float(noisy.sum()), 1.0)
    outside = float(noisy[:lo_bin].sum() + noisy[hi_bin + 1:].sum())
    return FoundBounds(lower, upper, min(max(outside / total, 0.0), 1.0))
