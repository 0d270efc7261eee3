"""Public groups: columns whose keys the configuration lists (or reads from a public table)
release every key when a query groups by them alone, absent ones with noise around zero,
with no partition selection and nothing spent on it (issue 30)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import psycopg
import pytest
from psycopg.types.json import Jsonb
from pydantic import ValidationError

from config import Config
from config.models import ColumnBounds
from dp_core.analysis import analyze, parse_select
from dp_core.binned import Binned
from dp_core.mechanisms import NoiseKind
from dp_core.plan import make_plan
from dp_core.query import Bounds, KeyDomain, TablePolicy
from dp_core.release import absent_groups, release
from dp_core.rewrite import pushdown
from dp_core.tuning import ROW_EDGES
from tests.support.backend import Backend
from tests.support.proxy import LoopThread, Proxy, reset_budget, running_proxy, spent

BROWSERS = ["Netscape", "Chrome", "Firefox"]
"""One browser the demo data does not have, listed first, and two it has (Safari, Edge... are
not listed)."""


@pytest.fixture(scope="module")
def public_config(demo_config: Config) -> Config:
    visits = demo_config.tables["visits"]
    columns = {**visits.columns, "browser": ColumnBounds(public_keys=list(BROWSERS)),
               "country": ColumnBounds(public_keys_from="public.countries.code")}
    return demo_config.model_copy(update={"tables": {
        **demo_config.tables, "visits": visits.model_copy(update={"columns": columns})}})


@pytest.fixture
def public_proxy(loop_thread: LoopThread, public_config: Config,
                 backend: Backend) -> Iterator[Proxy]:
    with running_proxy(loop_thread, public_config, backend) as px:
        reset_budget(px)
        yield px


def _truth(backend: Backend, sql: str) -> dict[str, int]:
    with psycopg.connect(backend.admin_dsn) as conn:
        return {str(k): int(v) for k, v in conn.execute(sql).fetchall()}


def test_every_listed_key_is_released_and_no_other(public_proxy: Proxy, backend: Backend) -> None:
    truth = _truth(backend, "SELECT browser, count(*) FROM visits GROUP BY browser")
    assert "Netscape" not in truth and {"Chrome", "Firefox", "Safari"} <= truth.keys()
    with psycopg.connect(public_proxy.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 1")
        before = spent(conn)
        listed = conn.execute("SELECT browser, count(*) FROM visits GROUP BY browser"
                              ).fetchall()
        after = spent(conn)
        # in the listed order, whichever groups have rows (their order must not tell)
        assert [r[0] for r in listed] == BROWSERS
        rows = dict(listed)
        assert abs(rows["Netscape"]) < 2000  # noise around zero (T·Laplace at ε 0.9)
        assert rows["Chrome"] > 0.7 * truth["Chrome"]
        # laplace noise and no partition selection: no δ spent
        assert after.delta == before.delta and after.epsilon > before.epsilon
        # with COUNT(DISTINCT x) (whose statistics run as a statement of their own first)
        distinct = conn.execute("SELECT browser, count(*), count(DISTINCT country) FROM visits "
                                "GROUP BY browser").fetchall()
        assert [r[0] for r in distinct] == BROWSERS
        per_user = dict(conn.execute(
            "SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) FROM visits GROUP BY browser"
        ).fetchall())
        assert set(per_user) == set(BROWSERS)
        explain = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN SELECT browser, count(*) FROM visits GROUP BY browser").fetchall())
        assert "Public groups: every key the configuration lists for browser" in explain
        assert "Partition selection" not in explain


def test_keys_read_from_a_public_table_and_their_combinations(public_proxy: Proxy,
                                                              backend: Backend) -> None:
    codes = set(_truth(backend, "SELECT code, 0 FROM countries"))
    with psycopg.connect(public_proxy.dsn(), autocommit=True) as conn:
        rows = conn.execute("SELECT country, sum(duration) FROM visits GROUP BY country").fetchall()
        assert {r[0] for r in rows} == codes  # countries without visits too
        both = conn.execute("SELECT WITH ANONYMIZATION browser, country, ANON_COUNT(*) "
                            "FROM visits GROUP BY browser, country").fetchall()
        assert {(r[0], r[1]) for r in both} == {(b, c) for b in BROWSERS for c in codes}
        # quantiles alone: every listed group too (an empty one's answer is the empty tree's)
        medians = conn.execute("SELECT browser, percentile_cont(0.5) WITHIN GROUP (ORDER BY "
                               "duration) FROM visits GROUP BY browser").fetchall()
        assert [r[0] for r in medians] == BROWSERS
        # a key that is an expression of the column is not public: partition selection
        explain = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN SELECT lower(browser), count(*) FROM visits GROUP BY 1").fetchall())
        assert "Partition selection" in explain and "Public groups" not in explain
        # the table's keys go into the pushdown as a list, read when the query is planned (an
        # IN subquery would run only where a row reaches it: a time one user's rows decide)
        explain = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN SELECT country, count(*) FROM visits GROUP BY country").fetchall())
        assert "= ANY(CAST(ARRAY[" in explain and "IN (SELECT" not in explain


def test_public_keys_of_values_that_print_several_ways_are_refused(
        loop_thread: LoopThread, public_config: Config, backend: Backend) -> None:
    """numeric 1.0 = 1.00: a group's text would be whichever of its values' texts Postgres
    kept, and one user could move a group's whole value to another listed key. Refused
    (0A000) before anything is spent."""
    purchases = public_config.tables["purchases"]
    columns = {**purchases.columns, "amount": ColumnBounds(public_keys=["1.0", "1.00"])}
    config = public_config.model_copy(update={"tables": {
        **public_config.tables, "purchases": purchases.model_copy(update={"columns": columns})}})
    with running_proxy(loop_thread, config, backend) as px, \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        reset_budget(px)
        before = spent(conn)
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="print differently"):
            conn.execute("SELECT amount, count(*) FROM purchases GROUP BY amount")
        assert spent(conn) == before


def test_public_keys_configuration_is_checked(demo_config: Config) -> None:
    with pytest.raises(ValidationError, match="lower and upper come together"):
        ColumnBounds(lower=0)
    with pytest.raises(ValidationError, match="exclude each other"):
        ColumnBounds(public_keys=["a"], public_keys_from="t.c")
    with pytest.raises(ValidationError, match="give bounds"):
        ColumnBounds()
    visits = demo_config.tables["visits"]
    closed = {**visits.columns, "browser": ColumnBounds(public_keys_from="public.visits.browser")}
    with pytest.raises(ValidationError, match="is not a public table"):
        Config.model_validate({**demo_config.model_dump(by_alias=True), "tables": {
            **{n: t.model_dump(by_alias=True) for n, t in demo_config.tables.items()},
            "visits": {**visits.model_dump(by_alias=True),
                       "columns": {c: b.model_dump(exclude_none=True)
                                   for c, b in closed.items()}}}})


def test_absent_groups_get_the_noise_of_any_group() -> None:
    """Statistical: 4,000 absent public groups of a row-level COUNT(*) with T fixed at 2 and
    of a per-user ANON_SUM: their released values are Laplace noise around 0 of the plan's
    scale (the sum's mean within 5 standard errors of 0, its mean absolute value within 10%
    of the scale; the count's share of zeros, rounded noise below 0.5, within 5 standard
    errors of 1 − e^(−0.5/b)/2)."""
    keys = [f"k{i}" for i in range(4000)]
    policy = {"visits": TablePolicy("public", "uid", {"duration": Bounds(0, 10)},
                                    {"browser": KeyDomain(tuple(keys))})}
    for sql, max_rows in (("SELECT browser, count(*) FROM visits GROUP BY browser", 2),
                          ("SELECT browser, ANON_SUM(duration) FROM visits GROUP BY browser",
                           None)):
        query = analyze(parse_select(sql), policy, plain_form=max_rows is not None)
        assert query.public_groups
        plan = make_plan(query, 1.0, 1e-6, 1, NoiseKind.LAPLACE, max_rows=max_rows)
        assert plan.threshold is None and plan.tau is None and plan.cost.delta == 0
        (q,) = plan.quantities
        assert q.spec is not None
        assert "= ANY" in (pushdown(query, plan, order_seed=1).main or "")
        rows = absent_groups(query, plan, [(k,) for k in keys], {("k0",)},
                             None if max_rows is None else Binned.empty(1))
        for r in rows:
            r.pop("dp_binned", None)
        assert len(rows) == len(keys) - 1
        out = np.array([float(r[1]) for r in release(query, plan, rows).rows])
        assert len(out) == len(rows)
        scale = q.spec.scale
        if max_rows is None:
            assert abs(out.mean()) < 5 * scale * np.sqrt(2 / len(out)), out.mean()
            assert abs(np.abs(out).mean() / scale - 1) < 0.1
        else:  # counts are released rounded, never below 0: 0 where the noise is below 0.5
            zero = 1 - 0.5 * np.exp(-0.5 / scale)
            assert abs(np.mean(out == 0) - zero) < 5 * np.sqrt(zero * (1 - zero) / len(out))


def test_a_tuned_tables_public_groups_take_t_when_planned(public_proxy: Proxy,
                                                          backend: Backend) -> None:
    """Public groups are all released, none selected: with the table's tuned bounds, T is
    chosen when the query is planned (EXPLAIN shows it), not after partition selection as for
    selected groups, its noise weighed over the public groups (3), as per-query tuning weighs
    it, not over the tuning's `groups` (the admin's, 1). The stored statistics are set to 100
    users of 1,000 rows each: rows beyond T + groups × T / ε (the count's mean |noise| per
    unit of T). At ε 1/60: over 1 group, least at T = 1024 (61,440; at T = 1, 99,960);
    over 3 groups, at T = 1 (100,080; at T = 1024, 184,320)."""
    reset_budget(public_proxy, "admin")
    with psycopg.connect(public_proxy.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT * FROM dp_tune_bounds('visits', 0.2)").fetchall()
        try:
            with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
                (stored,) = su.execute("SELECT tuning FROM dpproxy.tuned_bounds "
                                       "WHERE table_name = 'public.visits'").fetchone() or ()
                assert stored["groups"] == 1
                stored.update(rows_total=100_000.0,
                              lost=[100.0 * max(0, 1000 - c) for c in ROW_EDGES],
                              users_over=[1.0 if c < 1000 else 0.0 for c in ROW_EDGES])
                su.execute("UPDATE dpproxy.tuned_bounds SET tuning = %s "
                           "WHERE table_name = 'public.visits'", [Jsonb(stored)])
            admin.execute("SET dp.epsilon = 0.016666666666666666")

            def t_of(sql: str) -> str:
                plan = "\n".join(r[0] for r in admin.execute("EXPLAIN " + sql).fetchall())
                assert "admin tuned" in plan and "T chosen per query" not in plan, plan
                assert "chosen after partition selection" not in plan, plan
                (t,) = re.findall(r"max_rows_contributed T (\d+)", plan)
                return t

            public = "SELECT browser, COUNT(*) FROM visits GROUP BY browser"
            assert "Public groups" in "\n".join(
                r[0] for r in admin.execute("EXPLAIN " + public).fetchall())
            assert t_of(public) == "1"  # weighed over the 3 public groups
            assert t_of("SELECT COUNT(*) FROM visits") == "1024"  # over 1: no GROUP BY
            rows = admin.execute(public).fetchall()
            assert [r[0] for r in rows] == BROWSERS
        finally:
            admin.execute("SELECT dp_drop_tuned_bounds('visits')")
            reset_budget(public_proxy, "admin")
