"""Accountants: the (ε, δ) an analyst has spent over a history of answers.

Basic composition adds each answer's (ε, δ). The RDP accountant composes the
Gaussian quantities of all answers with Rényi DP (Google's dp-accounting) and
converts at the δ basic composition would have charged them; the Laplace
quantities and τ-thresholding are added by basic composition. Composing the two
blocks basically is valid, and the result is never larger than basic
composition's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from dp_core.mechanisms import NoiseKind, gaussian_sigma
from dp_core.plan import DPQueryPlan, NoisyQuantity


@dataclass(frozen=True)
class AnswerCost:
    """What one answer spends, split for the accountants."""

    epsilon: Fraction
    delta: Fraction
    gaussian_multipliers: tuple[float, ...] = field(default=())
    """σ / L2-sensitivity of each Gaussian quantity (the RDP accountant's events)."""
    gaussian_epsilon: Fraction = Fraction(0)
    gaussian_delta: Fraction = Fraction(0)

    @classmethod
    def of(cls, plan: DPQueryPlan) -> AnswerCost:
        def kind(q: NoisyQuantity) -> NoiseKind:
            return q.noise.kind if q.noise is not None else plan.noise_kind

        def multiplier(q: NoisyQuantity) -> float:
            # σ is calibrated in proportion to the quantity's L2 sensitivity (√C_u·Δ, or Δ
            # for a row-level aggregate's, whose Δ bounds all groups together), so σ / L2 is
            # that of sensitivity 1, calibrated or not yet (bounds or T pending)
            return gaussian_sigma(float(q.epsilon), float(q.delta), 1.0)

        gauss = [q for q in plan.all_quantities if kind(q) is NoiseKind.GAUSSIAN]
        return cls(
            epsilon=plan.cost.epsilon, delta=plan.cost.delta,
            gaussian_multipliers=tuple(multiplier(q) for q in gauss),
            gaussian_epsilon=sum((q.epsilon for q in gauss), Fraction(0)),
            gaussian_delta=sum((q.delta for q in gauss), Fraction(0)),
        )

    def to_json(self) -> dict[str, Any]:
        return {"epsilon": str(self.epsilon), "delta": str(self.delta),
                "gaussian_multipliers": list(self.gaussian_multipliers),
                "gaussian_epsilon": str(self.gaussian_epsilon),
                "gaussian_delta": str(self.gaussian_delta)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AnswerCost:
        return cls(Fraction(data["epsilon"]), Fraction(data["delta"]),
                   tuple(float(z) for z in data.get("gaussian_multipliers", ())),
                   Fraction(data.get("gaussian_epsilon", "0")), Fraction(data.get("gaussian_delta", "0")))


def basic_total(costs: Iterable[AnswerCost]) -> tuple[Fraction, Fraction]:
    """Basic composition: the sums of ε and of δ (exact)."""
    eps, dlt = Fraction(0), Fraction(0)
    for c in costs:
        eps += c.epsilon
        dlt += c.delta
    return eps, dlt


def rdp_total(costs: Iterable[AnswerCost]) -> tuple[float, float]:
    """Basic composition for the non-Gaussian parts, RDP for all Gaussian quantities together."""
    from dp_accounting import dp_event, rdp

    costs = list(costs)
    eps_basic, dlt_basic = basic_total(costs)
    g_eps = sum((c.gaussian_epsilon for c in costs), Fraction(0))
    g_dlt = sum((c.gaussian_delta for c in costs), Fraction(0))
    multipliers = [z for c in costs for z in c.gaussian_multipliers]
    if not multipliers or g_dlt <= 0:
        return float(eps_basic), float(dlt_basic)
    accountant = rdp.RdpAccountant()
    for z in multipliers:
        accountant.compose(dp_event.GaussianDpEvent(noise_multiplier=z))
    eps_rdp = float(accountant.get_epsilon(float(g_dlt)))  # a numpy float otherwise
    gaussian_part = min(float(g_eps), eps_rdp)
    return float(eps_basic - g_eps) + gaussian_part, float(dlt_basic)
