"""A privacy budget in exact decimals (an analyst's, or a shared total): what is left, whether a cost fits.

The ledger keeps totals in Postgres `numeric`; every cost is a fraction whose
denominator is a power of two times a power of five (the plan's grid), so it
has an exact decimal value and `spent + cost <= limit` is decided exactly.
"""

from __future__ import annotations

import decimal
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dp_core.errors import BudgetExhausted

_EXACT = decimal.Context(prec=400)


def to_numeric(x: Fraction) -> decimal.Decimal:
    """The exact decimal value of `x`; its denominator must be of the form 2^a·5^b."""
    d = x.denominator
    for prime in (2, 5):
        while d % prime == 0:
            d //= prime
    if d != 1:
        raise ValueError(f"{x} has no exact decimal expansion")
    exact = _EXACT.divide(decimal.Decimal(x.numerator), decimal.Decimal(x.denominator))
    return exact.normalize(_EXACT)


TOTAL = "total:"
"""The prefix of a total budget's name (`Budget.analyst`): "total:database", "total:public.visits"
(no analyst name has a colon)."""


@dataclass(frozen=True)
class Budget:
    """An analyst's limits and what it has spent, as the ledger holds them; or a total budget's,
    named TOTAL + its scope."""

    analyst: str
    epsilon_total: decimal.Decimal
    epsilon_spent: decimal.Decimal
    delta_total: decimal.Decimal
    delta_spent: decimal.Decimal

    @property
    def epsilon_remaining(self) -> decimal.Decimal:
        return max(self.epsilon_total - self.epsilon_spent, decimal.Decimal(0))

    @property
    def delta_remaining(self) -> decimal.Decimal:
        return max(self.delta_total - self.delta_spent, decimal.Decimal(0))

    @property
    def scope(self) -> str | None:
        """A total budget's scope ("database", "public.visits"); None for an analyst's."""
        return self.analyst.removeprefix(TOTAL) if self.analyst.startswith(TOTAL) else None

    def row(self) -> tuple[Any, ...]:
        return (self.analyst, self.epsilon_total, self.epsilon_spent, self.epsilon_remaining,
                self.delta_total, self.delta_spent, self.delta_remaining)


def check_affordable(budget: Budget, epsilon: decimal.Decimal, delta: decimal.Decimal) -> None:
    """Raise BudgetExhausted (53400) if (ε, δ) does not fit in what is left."""
    for what, spent, total, cost in (("epsilon", budget.epsilon_spent, budget.epsilon_total, epsilon),
                                     ("delta", budget.delta_spent, budget.delta_total, delta)):
        if spent + cost > total:
            left = total - spent
            scope = budget.scope
            reset = f"dp_reset_budget('{budget.analyst}')" if scope is None \
                else f"dp_reset_total_budget('{scope}')"
            hint = (f"nothing is left of this {what} budget: an admin can reset it "
                    f"(SELECT {reset})" if left <= 0 else
                    f"{_fmt(left)} is left: ask for at most that (SET dp.{what} or "
                    f"OPTIONS({what}=...)), or an admin can reset the budget")
            which = "privacy budget" if scope is None else \
                f"total privacy budget of {scope} (shared by all analysts)"
            raise BudgetExhausted(
                f"{which} exhausted: {what} spent {_fmt(spent)} of {_fmt(total)}, "
                f"this query costs {_fmt(cost)}", hint=hint)


def _fmt(x: decimal.Decimal) -> str:
    return format(x.normalize(), "f") if x == x.to_integral() else format(x.normalize())
