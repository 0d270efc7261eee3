"""Per-session DP settings (`SET dp.epsilon = 0.5`), validated against the policy's caps."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from dp_core.errors import InvalidParameterValue, UndefinedObject
from dp_core.mechanism_choices import NoiseKind, SelectionKind

SETTING_NAMES = ("epsilon", "delta", "max_groups_contributed", "noise", "partition_selection",
                 "max_rows_contributed")
AUTO = "auto"
MAX_ROWS = 1 << 20
"""The largest max_rows_contributed (as `dp_core.plan.MAX_ROWS`)."""
NOISE_KINDS = tuple(k.value for k in NoiseKind)
SELECTION_KINDS = tuple(k.value for k in SelectionKind)


@dataclass(frozen=True)
class Caps:
    max_epsilon: float
    max_delta: float
    max_groups_contributed: int
    min_epsilon: float = 0.0
    """No query may ask for less ε (config `defaults.min_epsilon`): near-free queries would
    make probing (one failure or answer per guess) cost nothing."""


@dataclass(frozen=True)
class DPSettings:
    """What a DP query uses unless its OPTIONS say otherwise."""

    epsilon: float
    delta: float
    max_groups_contributed: int
    noise: str
    partition_selection: str = "laplace"
    max_rows_contributed: int | str = AUTO
    """T of row-level aggregates (`dp_core.tuning`): a number, or 'auto' (chosen per query)."""

    def show(self, name: str) -> str:
        """The value of `dp.<name>` as SHOW prints it."""
        key = _key(name)
        value = getattr(self, key)
        return repr(value) if isinstance(value, float) else str(value)

    def with_value(self, name: str, value: object, caps: Caps) -> DPSettings:
        """A copy with `dp.<name>` set; raises 22023 for a value outside the policy."""
        key = _key(name)
        changes: dict[str, Any] = {key: validate(key, value, caps)}
        return replace(self, **changes)


def _key(name: str) -> str:
    key = name.removeprefix("dp.")
    if key not in SETTING_NAMES:
        raise UndefinedObject(
            f'unrecognized configuration parameter "dp.{key}"',
            hint=f"DP settings: {', '.join('dp.' + n for n in SETTING_NAMES)}",
        )
    return key


def validate(key: str, value: object, caps: Caps) -> float | int | str:
    """Check one DP parameter (from SET or OPTIONS) and return it normalised."""
    if key == "noise":
        text = str(value).lower()
        if text not in NOISE_KINDS:
            raise InvalidParameterValue(
                f"invalid value for dp.noise: {value!r}", hint="use 'laplace' or 'gaussian'"
            )
        return text
    if key == "partition_selection":
        text = str(value).lower()
        if text not in SELECTION_KINDS:
            raise InvalidParameterValue(
                f"invalid value for dp.partition_selection: {value!r}",
                hint="use 'laplace' (τ-thresholding) or 'truncated_geometric'")
        return text
    if key == "max_rows_contributed":
        if str(value).strip().lower() == AUTO:
            return AUTO
        number = _number(key, value)
        if number != int(number) or not 1 <= number <= MAX_ROWS:
            raise InvalidParameterValue(
                f"max_rows_contributed must be 'auto' or a whole number from 1 to {MAX_ROWS}, "
                f"not {value!r}")
        return int(number)
    if key == "max_groups_contributed":
        number = _number(key, value)
        if number != int(number) or not 1 <= number <= caps.max_groups_contributed:
            raise InvalidParameterValue(
                f"max_groups_contributed must be a whole number from 1 to "
                f"{caps.max_groups_contributed}, not {value!r}"
            )
        return int(number)
    number = _number(key, value)
    if key == "epsilon":
        if not 0 < number <= caps.max_epsilon:
            at_most = "" if math.isinf(caps.max_epsilon) else f" and at most {caps.max_epsilon}"
            raise InvalidParameterValue(f"epsilon must be above 0{at_most}, not {value!r}")
        check_finite_normal(number, "epsilon")
        if number < caps.min_epsilon:
            raise InvalidParameterValue(
                f"epsilon {number:g} is below this proxy's per-query minimum {caps.min_epsilon:g}",
                hint=f"use an epsilon of at least {caps.min_epsilon:g}")
        return number
    if key == "delta":
        if not 0 < number <= caps.max_delta:
            raise InvalidParameterValue(
                f"delta must be above 0 and at most {caps.max_delta}, not {value!r}"
            )
        return check_finite_normal(number, "delta")
    raise UndefinedObject(f'unrecognized DP parameter "{key}"')  # pragma: no cover


@dataclass(frozen=True)
class QuerySettings:
    """What one DP query runs with: the session's settings, its OPTIONS over them."""

    epsilon: float
    delta: float
    max_groups_contributed: int
    noise: NoiseKind
    selection: SelectionKind
    max_rows: int | None = None
    """max_rows_contributed, or None: chosen per query (`dp_core.tuning`)."""


def query_settings(settings: DPSettings, caps: Caps,
                   options: Iterable[tuple[str, object]] = ()) -> QuerySettings:
    """The query's settings: the session's `settings` with its OPTIONS(...) over them, each
    validated. The per-query caps are checked against the plan's cost, after the budget
    (`check_caps`); the least ε is checked here, before anything runs, wherever it was set."""
    values: dict[str, Any] = {"epsilon": settings.epsilon, "delta": settings.delta,
                              "max_groups_contributed": settings.max_groups_contributed,
                              "noise": settings.noise,
                              "partition_selection": settings.partition_selection,
                              "max_rows_contributed": settings.max_rows_contributed}
    unlimited = Caps(math.inf, 1.0 - 1e-12, 10_000, caps.min_epsilon)
    for name, value in options:
        if name != "privacy_unit_column":  # (checked by the analysis)
            values[name] = validate(name, value, unlimited)
    values["epsilon"] = validate("epsilon", values["epsilon"], unlimited)
    return QuerySettings(float(values["epsilon"]), float(values["delta"]),
                         int(values["max_groups_contributed"]), NoiseKind(values["noise"]),
                         SelectionKind(values["partition_selection"]),
                         None if values["max_rows_contributed"] == AUTO
                         else int(values["max_rows_contributed"]))


def check_caps(epsilon: float, delta: float, max_groups: int, caps: Caps) -> None:
    """22023 for a query (its plan's ε, δ and C_u) beyond this proxy's per-query caps."""
    if epsilon > caps.max_epsilon:
        raise InvalidParameterValue(
            f"epsilon {_fmt(epsilon)} is above this proxy's per-query limit "
            f"{_fmt(caps.max_epsilon)}")
    if delta > caps.max_delta:
        raise InvalidParameterValue(
            f"delta {_fmt(delta)} is above this proxy's per-query limit {_fmt(caps.max_delta)}")
    if max_groups > caps.max_groups_contributed:
        raise InvalidParameterValue(
            f"max_groups_contributed {max_groups} is above this proxy's "
            f"limit {caps.max_groups_contributed}")


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def check_finite_normal(value: float, what: str) -> float:
    """`value` if it is finite and 0 or a normal float, else 22023 naming `what`.

    Subnormal numbers (of magnitude below 2.2e-308) have lost precision: scales, shares and
    grids computed from them round to 0 or overflow, and no noise is calibrated right."""
    if not math.isfinite(value):
        raise InvalidParameterValue(f"{what} must be a finite number, not {value!r}")
    if value != 0 and abs(value) < sys.float_info.min:
        raise InvalidParameterValue(
            f"{what} {value!r} is too close to 0 (a subnormal number)",
            hint=f"use 0 or a number of magnitude at least {sys.float_info.min:g}")
    return value


def _number(key: str, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidParameterValue(f"{key} must be a number, not {value!r}") from None
    if not math.isfinite(number):
        raise InvalidParameterValue(f"{key} must be a finite number, not {value!r}")
    return number
