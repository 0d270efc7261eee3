"""Names the configuration shares with the core, in a module without the core's numerical
dependencies (the supervisor of `[listen] workers` loads the configuration, not numpy)."""

from enum import StrEnum


class NoiseKind(StrEnum):
    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"
