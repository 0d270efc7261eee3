"""The noise mechanisms: every noisy value dp-proxy releases is drawn here.

Floating-point safety (Mironov 2012): a textbook float Laplace sample added to
a true value leaks the value through the low bits of the result. Here, as in
Google's secure noise, both the true value and the noise live on a grid of
spacing `granularity(scale)`, a power of two about 2^-40 of the noise scale:
the true value is rounded to the grid and an integer number of grid steps is
added. Every released value is then an exact multiple of the granularity,
whatever the true value was. The integer noise is a two-sided geometric
(discrete Laplace) or a rounded normal (discrete Gaussian), vectorised with
numpy and drawn from a PCG64 generator seeded with 128 bits from `secrets` for
each call.
"""

from __future__ import annotations

import math
import secrets
import sys
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from dp_core.mechanism_choices import NoiseKind as NoiseKind

GRID_BITS = 40
"""The grid is 2^-GRID_BITS of the noise scale (rounded up to a power of two)."""

MIN_SCALE = math.ldexp(sys.float_info.min, GRID_BITS)
"""The least noise scale whose grid is a normal float (about 2.4e-296): below it the grid
is subnormal and its multiples are no longer exact (the planner refuses such noise)."""

Z_95 = 1.959963984540054
"""The two-sided 95% quantile of the standard normal."""


def granularity(scale: float) -> float:
    """The grid spacing for noise of this scale: the power of two at or above scale·2^-40."""
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"noise scale must be positive and finite, not {scale}")
    return math.ldexp(1.0, math.ceil(math.log2(scale)) - GRID_BITS)


def secure_rng() -> np.random.Generator:
    """A generator seeded from the operating system's CSPRNG."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def _on_grid(values: NDArray[np.float64], g: float) -> NDArray[np.float64]:
    # values far beyond 2^53·g would lose integrality; clamped inputs never get there
    return np.rint(np.asarray(values, dtype=np.float64) / g) * g


def laplace(values: NDArray[np.float64] | float, scale: float,
            rng: np.random.Generator | None = None) -> NDArray[np.float64]:
    """values + Laplace(scale) noise, on the secure grid (discrete Laplace)."""
    g = granularity(scale)
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    rng = rng or secure_rng()
    # two-sided geometric with ratio exp(-g/scale): the difference of two geometrics
    p = -math.expm1(-g / scale)
    steps = rng.geometric(p, arr.shape).astype(np.float64) - rng.geometric(p, arr.shape)
    return _on_grid(arr, g) + steps * g


def gaussian(values: NDArray[np.float64] | float, sigma: float,
             rng: np.random.Generator | None = None) -> NDArray[np.float64]:
    """values + N(0, sigma²) noise, on the secure grid (rounded normal)."""
    g = granularity(sigma)
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    rng = rng or secure_rng()
    steps = np.rint(rng.normal(0.0, sigma / g, arr.shape))
    return _on_grid(arr, g) + steps * g


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_delta(sigma: float, epsilon: float, l2_sensitivity: float) -> float:
    """The exact δ of the Gaussian mechanism at ε (Balle & Wang 2018, Theorem 8)."""
    a = l2_sensitivity / (2 * sigma)
    b = epsilon * sigma / l2_sensitivity
    return _phi(a - b) - math.exp(epsilon) * _phi(-a - b)


def gaussian_sigma(epsilon: float, delta: float, l2_sensitivity: float) -> float:
    """The smallest σ for which N(0, σ²) noise is (ε, δ)-DP (analytic calibration)."""
    if not (epsilon > 0 and 0 < delta < 1 and l2_sensitivity > 0):
        raise ValueError("epsilon and l2_sensitivity must be positive and delta in (0, 1)")
    lo, hi = 1e-12 * l2_sensitivity, l2_sensitivity
    while gaussian_delta(hi, epsilon, l2_sensitivity) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if gaussian_delta(mid, epsilon, l2_sensitivity) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class NoiseSpec:
    """How one noisy quantity is perturbed: the kind and its scale (b, or σ)."""

    kind: NoiseKind
    scale: float

    def add(self, values: NDArray[np.float64] | float,
            rng: np.random.Generator | None = None) -> NDArray[np.float64]:
        if self.kind is NoiseKind.LAPLACE:
            return laplace(values, self.scale, rng)
        return gaussian(values, self.scale, rng)

    @property
    def std(self) -> float:
        """The noise's standard deviation (√2·b for Laplace, σ)."""
        return self.scale * math.sqrt(2.0) if self.kind is NoiseKind.LAPLACE else self.scale

    @property
    def half_width_95(self) -> float:
        """Half-width of the interval that holds the noise with probability 95%."""
        if self.kind is NoiseKind.LAPLACE:
            return self.scale * math.log(20.0)
        return self.scale * Z_95

    @classmethod
    def calibrate(cls, kind: NoiseKind, epsilon: float, delta: float,
                  max_groups: int, sensitivity: float) -> NoiseSpec:
        """Noise for a quantity to which one user adds at most `sensitivity` in each of
        `max_groups` groups: Laplace scale C_u·Δ/ε, or Gaussian with L2 sensitivity √C_u·Δ."""
        if kind is NoiseKind.LAPLACE:
            return cls(kind, max_groups * sensitivity / epsilon)
        return cls(kind, gaussian_sigma(epsilon, delta, math.sqrt(max_groups) * sensitivity))


def threshold_tau(max_groups: int, epsilon: float, delta: float) -> float:
    """τ of paper §3.5: a group whose Laplace(C_u/ε)-noisy user count is ≥ τ is released.

    τ = 1 − (C_u/ε)·ln(2 − 2·(1−δ)^(1/C_u)).
    """
    if not (epsilon > 0 and 0 < delta < 1 and max_groups >= 1):
        raise ValueError("epsilon must be positive, delta in (0, 1), max_groups at least 1")
    # 1 - (1-δ)^(1/C_u) computed without cancellation
    tail = -math.expm1(math.log1p(-delta) / max_groups)
    return 1.0 - (max_groups / epsilon) * math.log(2.0 * tail)


def keep_probability(users: NDArray[np.float64] | float, max_groups: int, epsilon: float,
                     delta: float) -> NDArray[np.float64]:
    """The probability that truncated-geometric partition selection keeps a group of
    `users` users (Desfontaines, Voss, Gipson, Mandayam 2022, "Differentially private
    partition selection", Theorem 1: the (ε, δ)-DP selection that keeps the most groups).

    For a user in at most C_u groups, each group's choice is (ε/C_u, δ/C_u)-DP. With that
    (ε', δ'): π(0) = 0 and π(n) = min(e^ε' π(n−1) + δ', 1 − e^−ε' (1 − π(n−1) − δ'), 1).
    Both maps are increasing, so π(n) is the smallest value over every order of applying
    them; the smallest applies the first k times and then the second, with k where the
    first stops being the smaller (π(k−1) ≤ (1 − δ')/(1 + e^ε')). The closed forms of the
    two runs are evaluated at that k and its neighbours, so that rounding in k cannot pick
    a larger value than the recursion's.

    Floating point: a π within 2^-53 of 1 is 1, and the draw `uniform < π` has 2^-53 steps,
    which could break the second inequality by up to e^ε'·2^-52. So π is computed with
    `selection_parameters`: δ' less a reserved 1/64 of it, and ε' no larger than makes
    e^ε'·2^-52 fit in that reserve (δ' = 1e-6: ε' ≤ 18, where π reaches 1 from 3 users).
    Smaller parameters keep fewer groups and stay (ε', δ')-DP.
    """
    eps, dlt = selection_parameters(max_groups, epsilon, delta)
    n = np.atleast_1d(np.asarray(users, dtype=np.float64))
    growth = math.expm1(eps)  # e^ε' − 1
    crossover = (1.0 - dlt) / (1.0 + math.exp(eps))
    k0 = math.floor(math.log1p(crossover * growth / dlt) / eps) + 1
    fixed = -dlt / growth  # the second map's fixed point, as 1 − π
    best = np.full(n.shape, np.inf)
    for k in range(max(0, k0 - 2), k0 + 3):
        first = np.minimum(n, k)  # the first map's steps (a group has fewer users than k)
        with np.errstate(over="ignore", invalid="ignore"):
            after_first = dlt * np.expm1(first * eps) / growth  # (inf where it overflows)
            rest = n - first
            value = 1.0 - fixed - np.exp(-rest * eps) * (1.0 - after_first - fixed)
        # at 1 or above after the first map's steps, the second map keeps it there
        best = np.minimum(best, np.where(after_first >= 1.0, np.inf, value))
    kept: NDArray[np.float64] = np.clip(best, 0.0, 1.0)
    return kept


SELECTION_RESERVE = 1 / 64
"""The share of δ' that truncated-geometric selection leaves for floating-point rounding."""


def selection_parameters(max_groups: int, epsilon: float, delta: float) -> tuple[float, float]:
    """The (ε', δ') each group's truncated-geometric choice is computed with: (ε/C_u, δ/C_u),
    less δ's reserve for rounding, with ε' capped where e^ε'·2^-52 would exceed it."""
    if not (epsilon > 0 and 0 < delta < 1 and max_groups >= 1):
        raise ValueError("epsilon must be positive, delta in (0, 1), max_groups at least 1")
    eps, dlt = epsilon / max_groups, delta / max_groups
    reserve = dlt * SELECTION_RESERVE
    cap = math.log(reserve) + 52 * math.log(2)
    if cap <= 0:
        raise ValueError(f"delta per group {dlt:g} is below what float64 selection can honour")
    return min(eps, cap), dlt - reserve


def users_kept_with(probability: float, max_groups: int, epsilon: float, delta: float) -> int:
    """The fewest users a group needs to be kept with at least `probability` by
    truncated-geometric selection (π is increasing in n; EXPLAIN's summary of it)."""
    lo, hi = 0, 1
    while keep_probability(hi, max_groups, epsilon, delta)[0] < probability:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if keep_probability(mid, max_groups, epsilon, delta)[0] < probability:
            lo = mid
        else:
            hi = mid
    return hi
