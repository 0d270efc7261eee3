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
    keep_probability,
    laplace,
    selection_parameters,
    threshold_tau,
    users_kept_with,
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


def _pi_by_recursion(n: int, max_groups: int, epsilon: float, delta: float) -> list[float]:
    """π(1..n) by the recursion of Desfontaines et al. 2022, Theorem 1, step by step."""
    e, d = epsilon / max_groups, delta / max_groups
    p, out = 0.0, []
    for _ in range(n):
        p = min(math.exp(e) * p + d, 1 - math.exp(-e) * (1 - p - d), 1.0)
        out.append(p)
    return out


def test_truncated_geometric_keep_probability_by_hand() -> None:
    # ε = ln 2, δ = 0.1 less its reserve for rounding: δ' = 0.1·63/64 = 0.0984375.
    # π(1) = δ'; π(2) = min(2·π(1) + δ', 1 − ½(1 − π(1) − δ')) = min(0.2953125, 0.5984375);
    # π(3) = min(0.6890625, 0.696875); π(4) = min(1.47…, 1 − ½·0.2125) = 0.89375;
    # π(5) = 1 − ½(1 − 0.89375 − 0.0984375) = 0.99609375; π(6) = 1
    expected = [0.0984375, 0.2953125, 0.6890625, 0.89375, 0.99609375, 1.0]
    assert selection_parameters(1, math.log(2), 0.1) == pytest.approx((math.log(2), 0.0984375))
    got = keep_probability(np.arange(1, 7), 1, math.log(2), 0.1)
    assert got == pytest.approx(expected, abs=1e-12)
    # C_u groups per user: each group's choice at (ε/C_u, δ/C_u)
    assert keep_probability(np.arange(1, 7), 3, 3 * math.log(2), 0.3) == pytest.approx(expected, abs=1e-12)
    assert keep_probability(0, 1, 1.0, 1e-6)[0] == 0.0  # (a group of no users)
    assert users_kept_with(0.5, 1, math.log(2), 0.1) == 3 and users_kept_with(1.0, 1, math.log(2), 0.1) == 6
    # ε' is capped where e^ε'·2^-52 would exceed the reserve (δ' = 1e-6: ln(1e-6/64) + 52 ln 2)
    assert selection_parameters(1, 200.0, 1e-6)[0] == pytest.approx(math.log(1e-6 / 64 * 2.0 ** 52))
    assert keep_probability(np.arange(1, 4), 1, 5000.0, 1e-6)[0] == pytest.approx(1e-6 * 63 / 64)
    with pytest.raises(ValueError):  # below 2^-46 per group, float64 cannot honour δ
        selection_parameters(2, 1.0, 2 * 2.0 ** -46)


@pytest.mark.parametrize("max_groups,epsilon,delta", [
    (1, 1.0, 1e-6), (1, 0.1, 1e-6), (5, 1.0, 1e-6), (3, 10.0, 1e-5), (1, 0.01, 1e-9), (2, 3.0, 0.3),
    (1, 200.0, 1e-6), (1, 30.0, 1e-4)])
def test_truncated_geometric_is_the_recursion_and_is_dp(max_groups: int, epsilon: float,
                                                      delta: float) -> None:
    """The closed form equals the recursion step by step (at `selection_parameters`); each
    group's choice is (ε/C_u, δ/C_u)-DP between n − 1 and n users both ways, even where π
    rounds to 1 (the reserve); π is increasing and reaches 1."""
    n = 5000
    pi = keep_probability(np.arange(1, n + 1), max_groups, epsilon, delta)
    e_used, d_used = selection_parameters(max_groups, epsilon, delta)
    assert pi == pytest.approx(_pi_by_recursion(n, 1, e_used, d_used), abs=1e-12)
    e, d = epsilon / max_groups, delta / max_groups
    prev = np.concatenate([[0.0], pi[:-1]])
    step = 2.0 ** -53  # the draw `uniform < π` keeps with probability π rounded up to a step
    assert np.all(np.ceil(pi / step) * step <= math.exp(e) * prev + d)
    assert np.all(1 - prev <= math.exp(e) * (1 - np.ceil(pi / step) * step) + d)
    assert np.all(np.diff(pi) >= 0) and pi[0] == pytest.approx(d_used)
    certain = users_kept_with(1.0, max_groups, epsilon, delta)
    assert keep_probability(certain, max_groups, epsilon, delta)[0] == 1.0
    assert keep_probability(certain - 1, max_groups, epsilon, delta)[0] < 1.0


@pytest.mark.parametrize("epsilon,delta", [(1.0, 1e-6), (0.1, 1e-6), (0.5, 1e-8)])
def test_truncated_geometric_keeps_at_least_what_laplace_thresholding_keeps(
        epsilon: float, delta: float) -> None:
    """With C_u = 1 both are (ε, δ)-DP choices of each group from its user count, and
    π is the largest such (the paper's optimality): never below P(n + Lap(1/ε) ≥ τ) at the
    same (ε, δ) (the δ π is computed with, its reserve for rounding set aside)."""
    used_delta = selection_parameters(1, epsilon, delta)[1]
    tau, b = threshold_tau(1, epsilon, used_delta), 1 / epsilon
    n = np.arange(1, int(3 * tau) + 10, dtype=np.float64)
    laplace_keep = np.where(n < tau, 0.5 * np.exp(-(tau - n) / b), 1 - 0.5 * np.exp(-(n - tau) / b))
    assert np.all(keep_probability(n, 1, epsilon, delta) >= laplace_keep - 1e-12)
    # and users needed for an even chance: fewer (ε = 0.1: 109 against τ ≈ 132)
    assert users_kept_with(0.5, 1, epsilon, delta) <= math.ceil(tau)


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
