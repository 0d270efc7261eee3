"""Noise mechanisms: hand-computed constants, and statistical tests with stated tolerances.

Every statistical test draws fresh CSPRNG-seeded noise (no fixed seed) and
uses tolerances of at least 5 standard errors, so a correct sampler fails a
given check with probability below about 1e-6: the pass rate does not depend
on the seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp_core.mechanisms import (
    GRID_BITS,
    NoiseKind,
    NoiseSpec,
    gaussian,
    gaussian_delta,
    gaussian_sigma,
    granularity,
    laplace,
    threshold_tau,
)

N = 200_000


# ---------------------------------------------------------------------------- constants


def test_tau_hand_computed() -> None:
    # C_u = 1, ε = 1, δ = 1e-5: τ = 1 − ln(2·10⁻⁵) ≈ 11.82 (issue 4)
    assert threshold_tau(1, 1.0, 1e-5) == pytest.approx(1 - math.log(2e-5), rel=1e-9)
    assert threshold_tau(1, 1.0, 1e-5) == pytest.approx(11.8198, abs=1e-4)
    # C_u = 3, ε = 0.5, δ = 1e-6: 1 − 6·ln(2 − 2·(1 − 1e-6)^(1/3))
    expected = 1 - 6 * math.log(2 - 2 * (1 - 1e-6) ** (1 / 3))
    assert threshold_tau(3, 0.5, 1e-6) == pytest.approx(expected, rel=1e-6)
    # tiny δ does not lose precision to cancellation
    assert threshold_tau(1, 1.0, 1e-15) == pytest.approx(1 - math.log(2e-15), rel=1e-9)


def test_tau_is_monotone() -> None:
    assert threshold_tau(1, 0.5, 1e-6) > threshold_tau(1, 1.0, 1e-6)
    assert threshold_tau(1, 1.0, 1e-8) > threshold_tau(1, 1.0, 1e-6)
    assert threshold_tau(5, 1.0, 1e-6) > threshold_tau(1, 1.0, 1e-6)


def test_laplace_scale_hand_computed() -> None:
    spec = NoiseSpec.calibrate(NoiseKind.LAPLACE, epsilon=0.5, delta=0, max_groups=3, sensitivity=100)
    assert spec.scale == 600  # C_u·Δ/ε
    assert spec.half_width_95 == pytest.approx(600 * math.log(20))


def test_gaussian_calibration() -> None:
    # Balle & Wang 2018 (analytic Gaussian), ε = 1, δ = 1e-5, Δ₂ = 1: σ ≈ 3.73
    sigma = gaussian_sigma(1.0, 1e-5, 1.0)
    assert sigma == pytest.approx(3.73, abs=0.01)
    # σ is the smallest that satisfies the exact condition δ(σ) ≤ δ
    assert gaussian_delta(sigma, 1.0, 1.0) <= 1e-5
    assert gaussian_delta(sigma * 0.999, 1.0, 1.0) > 1e-5
    # it scales linearly with the sensitivity, and beats the classic bound √(2 ln(1.25/δ))/ε
    assert gaussian_sigma(1.0, 1e-5, 4.0) == pytest.approx(4 * gaussian_sigma(1.0, 1e-5, 1.0), rel=1e-6)
    assert gaussian_sigma(1.0, 1e-5, 1.0) < math.sqrt(2 * math.log(1.25 / 1e-5))
    spec = NoiseSpec.calibrate(NoiseKind.GAUSSIAN, 1.0, 1e-5, max_groups=4, sensitivity=1.0)
    assert spec.scale == pytest.approx(gaussian_sigma(1.0, 1e-5, 2.0))  # L2: √C_u·Δ


def test_granularity_is_a_power_of_two_near_scale_over_2_40() -> None:
    for scale in (1e-3, 0.7, 1.0, 3.0, 1e6):
        g = granularity(scale)
        assert math.frexp(g)[0] == 0.5
        assert scale * 2.0**-GRID_BITS <= g < 2 * scale * 2.0**-GRID_BITS
    with pytest.raises(ValueError):
        granularity(0.0)


# ---------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("scale", [0.5, 3.0, 250.0])
def test_laplace_moments_and_tails(scale: float) -> None:
    x = laplace(np.zeros(N), scale)
    # mean 0: sd of the mean is √2·b/√N; tolerance 5 sd
    assert abs(x.mean()) < 5 * math.sqrt(2) * scale / math.sqrt(N)
    # variance 2b²: the sample variance's relative sd is √(5/N) (kurtosis 6); tolerance 5 sd
    assert abs(x.var() / (2 * scale**2) - 1) < 5 * math.sqrt(5 / N)
    # tail mass P(|X| > b·ln 20) = 0.05: binomial sd √(0.05·0.95/N); tolerance 5 sd
    tail = np.mean(np.abs(x) > scale * math.log(20))
    assert abs(tail - 0.05) < 5 * math.sqrt(0.05 * 0.95 / N)
    # symmetry
    assert abs(np.mean(x > 0) - 0.5) < 5 * math.sqrt(0.25 / N)


@pytest.mark.parametrize("sigma", [0.5, 3.0, 250.0])
def test_gaussian_moments_and_tails(sigma: float) -> None:
    x = gaussian(np.zeros(N), sigma)
    assert abs(x.mean()) < 5 * sigma / math.sqrt(N)
    assert abs(x.var() / sigma**2 - 1) < 5 * math.sqrt(2 / N)
    tail = np.mean(np.abs(x) > 1.959963984540054 * sigma)
    assert abs(tail - 0.05) < 5 * math.sqrt(0.05 * 0.95 / N)


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov–Smirnov distance."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def _ks_critical(n: int, m: int, alpha: float = 1e-6) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


@pytest.mark.parametrize("kind", ["laplace", "gaussian"])
def test_sampler_matches_opendp(kind: str) -> None:
    """Our vectorised samplers against OpenDP's proven ones: two-sample KS at α = 1e-6."""
    dp = pytest.importorskip("opendp.prelude")
    dp.enable_features("contrib")
    n, scale = 20_000, 2.0
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False))
    if kind == "laplace":
        ref = np.array(dp.m.make_laplace(domain, dp.l1_distance(T=float), scale=scale)([0.0] * n))
        ours = laplace(np.zeros(n), scale)
    else:
        ref = np.array(dp.m.make_gaussian(domain, dp.l2_distance(T=float), scale=scale)([0.0] * n))
        ours = gaussian(np.zeros(n), scale)
    assert _ks_statistic(ours, ref) < _ks_critical(n, n)


def test_ks_check_detects_a_wrong_scale() -> None:
    """The KS comparison above has power: 30% too much noise is caught (KS distance ≈ 0.048)."""
    n = 20_000
    a, b = laplace(np.zeros(n), 2.0), laplace(np.zeros(n), 2.6)
    assert _ks_statistic(a, b) > _ks_critical(n, n)


# ---------------------------------------------------------------------------- floating-point safety


@pytest.mark.parametrize("noise", [laplace, gaussian])
def test_released_values_are_on_the_grid(noise: object) -> None:
    scale = 3.7
    g = granularity(scale)
    true = np.array([0.1, 1 / 3, 1e6 + 0.123456789, -42.42, math.pi])
    out = noise(np.repeat(true, 1000), scale)  # type: ignore[operator]
    steps = out / g
    assert np.all(steps == np.rint(steps)), "every released value is an exact multiple of the grid"


def test_low_bits_do_not_depend_on_the_true_value() -> None:
    """Mironov's attack reads the true value from the low mantissa bits of x + noise.

    On the grid, the set of values that can be released is the same lattice for
    every true value; the bits below the grid are always zero.
    """
    scale = 1.0
    g = granularity(scale)
    for true in (0.0, 1e-9, 0.3, 0.30000000000000004, 12345.678):
        out = laplace(np.full(5000, true), scale)
        remainders = np.mod(out, g)
        assert np.all(remainders == 0.0)


def test_true_values_are_rounded_to_the_grid_not_truncated() -> None:
    g = granularity(1.0)
    out = laplace(np.array([2.6 * g]), 1.0, rng=_ZeroNoise())
    assert out[0] == 3 * g


class _ZeroNoise(np.random.Generator):
    """A generator whose geometric draws cancel: isolates the rounding step."""

    def __init__(self) -> None:
        super().__init__(np.random.PCG64(0))

    def geometric(self, p, size=None):  # type: ignore[no-untyped-def,override]
        return np.ones(size, dtype=np.int64)


def test_each_call_is_freshly_seeded() -> None:
    a = laplace(np.zeros(8), 1.0)
    b = laplace(np.zeros(8), 1.0)
    assert not np.array_equal(a, b)
