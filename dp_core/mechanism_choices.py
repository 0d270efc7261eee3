"""The noise and partition-selection mechanisms an analyst or the config may choose, by name.

Shared with the configuration, in a module without the core's numerical dependencies (the
supervisor of `[listen] workers` loads the configuration, not numpy)."""

from enum import StrEnum


class NoiseKind(StrEnum):
    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"


class SelectionKind(StrEnum):
    """How a grouped DP query picks the groups it releases (DESIGN §3.6)."""

    LAPLACE = "laplace"
    """τ-thresholding of a Laplace-noisy user count (paper §3.5)."""
    TRUNCATED_GEOMETRIC = "truncated_geometric"
    """Desfontaines et al. 2022: keep a group of n users with the optimal probability π(n)."""
