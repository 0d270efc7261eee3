"""The paper's stochastic DP tester (Wilson et al. 2019, §5.3 and Appendix A), over the release path.

Databases are drawn from a Halton sequence (low discrepancy: they cover the space
of small databases evenly); neighbours come from removing one user at a time,
recursively. For each neighbouring pair the mechanism runs many times on each
side; the outputs are binned and every bin is checked against the DP predicate
P[M(D) ∈ b] ≤ e^ε · P[M(D') ∈ b] + δ, relaxed by Clopper–Pearson-style
confidence bounds so that sampling error alone does not count as a violation.
A mechanism passes when the share of failing bins stays under a tolerance.

The mechanism under test is fed per-user partial values, aggregated across
users the way the pushdown does (clamp to [L, U], sum, count users) and then
released by `dp_core.release.release`: the proxy's own noise and
post-processing code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Mechanism = Callable[[Sequence[float], int], NDArray[np.float64]]
"""(per-user values of one group, number of samples) → that many released outputs."""


def halton(index: int, base: int) -> float:
    """The index-th element (from 1) of the van der Corput sequence in `base`."""
    result, f, i = 0.0, 1.0, index
    while i > 0:
        f /= base
        result += f * (i % base)
        i //= base
    return result


def halton_databases(count: int, max_users: int, lower: float, upper: float) -> Iterator[list[float]]:
    """Databases of 1..max_users users with values in [lower, upper], from a Halton sequence."""
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    for k in range(1, count + 1):
        size = 1 + int(halton(k, primes[0]) * max_users)
        yield [lower + (upper - lower) * halton(k, primes[1 + j % (len(primes) - 1)]) for j in range(size)]


def neighbours_by_removal(db: list[float], depth: int = 2) -> Iterator[tuple[list[float], list[float]]]:
    """(D, D minus one user) pairs, recursing into the smaller database `depth` times."""
    if depth == 0 or not db:
        return
    for i in range(len(db)):
        smaller = db[:i] + db[i + 1:]
        yield db, smaller
        if i == 0:
            yield from neighbours_by_removal(smaller, depth - 1)


def _bounds(hits: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (a stand-in for Clopper–Pearson)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Verdict:
    bins_checked: int
    bins_failed: int

    @property
    def failure_rate(self) -> float:
        return self.bins_failed / self.bins_checked if self.bins_checked else 0.0


def compare(a: NDArray[np.float64], b: NDArray[np.float64], epsilon: float, delta: float,
            bins: int = 25, z: float = 4.0) -> Verdict:
    """Check both directions of the DP predicate on binned outputs of neighbouring databases."""
    pooled = np.concatenate([a, b])
    lo, hi = (float(x) for x in np.quantile(pooled, [0.001, 0.999]))
    if hi <= lo:
        hi = lo + 1.0
    # equal-width bins over the central range, plus one open bin for each tail
    edges = np.concatenate([[-np.inf], np.linspace(lo, hi, bins - 1), [np.inf]])
    ha, _ = np.histogram(a, edges)
    hb, _ = np.histogram(b, edges)
    failed = 0
    for x, y in ((ha, hb), (hb, ha)):
        for hx, hy in zip(x, y, strict=True):
            px_low, _ = _bounds(int(hx), len(a), z)
            _, py_high = _bounds(int(hy), len(b), z)
            if px_low > math.exp(epsilon) * py_high + delta:
                failed += 1
    return Verdict(2 * bins, failed)


def test_mechanism(mechanism: Mechanism, epsilon: float, delta: float, *, databases: int,
                   max_users: int, lower: float, upper: float, samples: int,
                   depth: int = 1) -> Verdict:
    """Run the tester over Halton databases and their neighbours; returns the pooled verdict."""
    checked = failed = 0
    for db in halton_databases(databases, max_users, lower, upper):
        for d, d_prime in neighbours_by_removal(db, depth):
            v = compare(mechanism(d, samples), mechanism(d_prime, samples), epsilon, delta)
            checked += v.bins_checked
            failed += v.bins_failed
    return Verdict(checked, failed)


test_mechanism.__test__ = False  # type: ignore[attr-defined]  # a library function, not a pytest test
