"""The operator endpoint: Prometheus metrics and the health check, on their own port."""

from __future__ import annotations

import urllib.error
import urllib.request

import psycopg
import pytest

from config import Config
from tests.support.backend import Backend
from tests.support.proxy import LoopThread, Proxy, running_proxy

Q = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.1) browser, ANON_COUNT(*) FROM visits GROUP BY browser"


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not in metrics")


def test_metrics_count_answers_refusals_epsilon_and_sessions(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    config = demo_config.model_copy(update={"metrics": demo_config.metrics.model_copy(
        update={"port": 0})})
    with running_proxy(loop_thread, config, backend) as px:
        assert px.server.ops is not None
        port = px.server.ops.port
        with psycopg.connect(px.dsn("admin"), autocommit=True) as adm:
            adm.execute("SELECT dp_reset_budget('alice')")
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            conn.execute(Q).fetchall()
            conn.execute("EXPLAIN " + Q).fetchall()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT * FROM visits")
            with pytest.raises(psycopg.errors.FeatureNotSupported):
                conn.execute("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits WHERE random() > 0.5")
            conn.execute("SELECT name FROM countries").fetchall()
            conn.execute("SELECT 1; SET dp.epsilon = 0.5").fetchall()  # split: one of each
            with pytest.raises(psycopg.errors.UndefinedTable):
                conn.execute("SELECT * FROM no_such_table")
            cur = conn.cursor()
            cur.execute("SELECT code FROM countries WHERE code = %s", ("FR",), prepare=True)
            status, text = _get(port, "/metrics")
            assert status == 200
            assert _value(text, "dpproxy_sessions") == 1
        def statements(kind: str, outcome: str) -> float:
            return _value(text, f'dpproxy_statements_total{{kind="{kind}",outcome="{outcome}"}}')

        assert statements("dp_query", "ok") == 1
        assert statements("dp_explain", "ok") == 1
        assert statements("dp_query", "error") == 1
        assert statements("refused", "error") == 1
        assert statements("local", "ok") == 2  # dp_reset_budget() and SET dp.epsilon
        # countries, the split SELECT 1, and the extended-protocol batch
        assert statements("pass_through", "ok") == 3
        assert statements("pass_through", "error") == 1
        assert _value(text, 'dpproxy_errors_total{sqlstate="42501"}') == 1
        assert _value(text, 'dpproxy_errors_total{sqlstate="0A000"}') == 1
        assert _value(text, 'dpproxy_epsilon_spent_total{analyst="alice"}') == pytest.approx(0.1)
        assert _value(text, "dpproxy_dp_answer_seconds_count") == 1
        assert _value(text, "dpproxy_pushdown_seconds_count") == 1
        # nothing about queries or data
        assert "visits" not in text and "browser" not in text
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/other")[0] == 404


def test_no_endpoint_unless_configured(proxy: Proxy) -> None:
    assert proxy.server.ops is None
