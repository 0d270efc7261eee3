"""Accountants: basic composition is exact; RDP is tighter for Gaussian answers, never looser."""

from __future__ import annotations

import math
from fractions import Fraction

import psycopg
import pytest

from config import Accountant, Config
from dp_core.accounting import AnswerCost, basic_total, rdp_total
from dp_core.mechanisms import NoiseKind, gaussian_sigma
from tests.support.backend import Backend
from tests.support.engine import build
from tests.support.proxy import LoopThread, running_proxy, spent


def test_basic_composition_is_exact() -> None:
    costs = [AnswerCost(Fraction(1, 10), Fraction(1, 10**6))] * 10
    assert basic_total(costs) == (Fraction(1), Fraction(1, 10**5))


def test_seed_004_example() -> None:
    """N = 100,000, δ = 1/(N√N), ε = 3 gives σ ≈ 2.04 by seed 004's formula (12) for a budget of
    t = 2,000 queries, each answered with N(0, t·σ²). The RDP accountant confirms ε ≤ 3."""
    n, t = 100_000, 2000
    delta = 1 / (n * math.sqrt(n))
    sigma = (math.sqrt(math.log(1 / delta)) + math.sqrt(math.log(1 / delta) + 3)) / (math.sqrt(2) * 3)
    assert sigma == pytest.approx(2.04, abs=0.005)
    per_answer = AnswerCost(Fraction(3, t), Fraction(delta) / t, (math.sqrt(t) * sigma,),
                            Fraction(3, t), Fraction(delta) / t)
    eps, dlt = rdp_total([per_answer] * t)
    assert eps <= 3.0 and eps == pytest.approx(2.70, abs=0.02)
    assert dlt == pytest.approx(delta)


def test_rdp_is_never_looser_than_basic() -> None:
    for count in (1, 3, 30):
        _, plan, _ = build("SELECT WITH ANONYMIZATION OPTIONS(noise='gaussian', epsilon=0.5, delta=1e-6) "
                           "ANON_SUM(duration, 0, 10) FROM visits")
        cost = AnswerCost.of(plan)
        q = plan.quantities[0]
        assert cost.gaussian_multipliers == (pytest.approx(q.noise.scale / 10),)
        assert q.noise.scale == pytest.approx(gaussian_sigma(0.5, 1e-6, 10.0))
        eps, dlt = rdp_total([cost] * count)
        b_eps, b_dlt = basic_total([cost] * count)
        assert eps <= float(b_eps) + 1e-12 and dlt == pytest.approx(float(b_dlt))
        if count == 30:
            assert eps < 0.5 * float(b_eps), "many Gaussian answers compose much better under RDP"


def test_laplace_answers_compose_basically_under_rdp() -> None:
    _, plan, _ = build("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.5) browser, ANON_COUNT(*) FROM visits "
                       "GROUP BY browser", noise=NoiseKind.LAPLACE)
    cost = AnswerCost.of(plan)
    assert cost.gaussian_multipliers == ()
    assert rdp_total([cost] * 4) == (pytest.approx(2.0), pytest.approx(4e-6))


def test_rdp_analyst_end_to_end(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    bob = demo_config.analysts["bob"].model_copy(update={"accountant": Accountant.RDP,
                                                          "epsilon_budget": 3.0, "delta_budget": 1e-4})
    cfg = demo_config.model_copy(update={"analysts": {**demo_config.analysts, "bob": bob}})
    with running_proxy(loop_thread, cfg, backend) as px:
        with psycopg.connect(px.dsn("admin"), autocommit=True) as admin:
            admin.execute("SELECT dp_reset_budget('bob')")
        with psycopg.connect(px.dsn("bob"), autocommit=True) as conn:
            q = ("SELECT WITH ANONYMIZATION OPTIONS(noise='gaussian', epsilon=0.5, delta=1e-6) "
                 "ANON_SUM(duration, 0, 10) FROM visits")
            for _ in range(10):  # nominally 5.0 > the budget of 3: RDP composition fits
                conn.execute(q).fetchall()
            assert 0.5 < spent(conn).epsilon < 3.0


def test_refresh_period_renews_the_budget(loop_thread: LoopThread, demo_config: Config,
                                          backend: Backend) -> None:
    import asyncio

    import asyncpg

    carol = demo_config.analysts["alice"].model_copy(update={"refresh_days": 30, "epsilon_budget": 1.0})
    cfg = demo_config.model_copy(update={"analysts": {**demo_config.analysts, "carol": carol}})
    async def age(days: int) -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute("UPDATE dpproxy.analysts SET created_at = now() - make_interval(days => $1) "
                               "WHERE analyst = 'carol'", days)
        finally:
            await conn.close()

    with running_proxy(loop_thread, cfg, backend) as px:
        with psycopg.connect(px.dsn("carol", password="alice"), autocommit=True) as conn:
            conn.execute("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.6) ANON_COUNT(*) FROM visits").fetchall()
            asyncio.run(age(10))
            assert spent(conn).epsilon == 0.6, "not due yet"
            with pytest.raises(psycopg.Error) as exc:
                conn.execute("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.6) ANON_COUNT(*) FROM visits")
            assert exc.value.sqlstate == "53400"
            asyncio.run(age(31))
            conn.execute("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.6) ANON_COUNT(*) FROM visits").fetchall()
            assert spent(conn).epsilon == 0.6, "renewed, then charged once"
        with psycopg.connect(px.dsn("admin"), autocommit=True) as admin:
            kinds = [r[0] for r in admin.execute("SELECT outcome FROM dp_ledger('carol') WHERE kind = 'reset'")]
            assert kinds == ["budget renewed: refresh period of 30 days"]


def test_an_exhausted_budget_hints_at_what_fits() -> None:
    """Issue 29: with something left, the hint says how much; with nothing left, lowering ε
    cannot help and the hint says who can reset it."""
    from decimal import Decimal

    from dp_core.budget import Budget, check_affordable
    from dp_core.errors import BudgetExhausted

    some = Budget("alice", Decimal(1), Decimal("0.75"), Decimal("1e-5"), Decimal(0))
    with pytest.raises(BudgetExhausted) as info:
        check_affordable(some, Decimal("0.5"), Decimal(0))
    assert info.value.hint is not None and info.value.hint.startswith("0.25 is left")
    spent = Budget("alice", Decimal(1), Decimal(1), Decimal("1e-5"), Decimal(0))
    with pytest.raises(BudgetExhausted) as info:
        check_affordable(spent, Decimal("0.1"), Decimal(0))
    assert info.value.hint is not None and "nothing is left" in info.value.hint
    assert "dp_reset_budget('alice')" in info.value.hint and "dp.epsilon" not in info.value.hint


def test_an_exhausted_total_budget_says_which_and_who_resets_it() -> None:
    """Issue 31: a total budget's refusal names it, says all analysts share it, and hints
    at its own reset."""
    from decimal import Decimal

    from dp_core.budget import Budget, check_affordable
    from dp_core.errors import BudgetExhausted

    total = Budget("total:public.visits", Decimal(2), Decimal(2), Decimal("1e-5"), Decimal(0))
    assert total.scope == "public.visits"
    assert Budget("alice", Decimal(1), Decimal(0), Decimal(0), Decimal(0)).scope is None
    with pytest.raises(BudgetExhausted) as info:
        check_affordable(total, Decimal("0.1"), Decimal(0))
    assert info.value.sqlstate == "53400"
    assert info.value.message.startswith("total privacy budget of public.visits (shared by all "
                                         "analysts) exhausted: epsilon spent 2 of 2")
    assert info.value.hint is not None \
        and "dp_reset_total_budget('public.visits')" in info.value.hint
