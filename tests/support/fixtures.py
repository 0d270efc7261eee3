"""The fixtures every test can use: one real Postgres for the whole run, a fresh proxy per test.

tests/conftest.py registers this module as a plugin. A test that requests `backend` (itself,
or through `proxy`, `px`, ...) needs the test Postgres: it is marked `live`, the others `pure`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from config import DEMO_CONFIG, Config, load_config
from dp_core.classify import Classifier, ProtectionPolicy
from server.embedded import EmbeddedPostgres

from .backend import ON_CITUS, Backend, prepared_backend, prepared_citus_backend
from .proxy import LoopThread, Proxy, budgets_reset, reset_budget, running_proxy

NO_REUSE = {"DPPROXY_DEFAULTS__ANSWER_REUSE": "off"}
"""The suite's proxies give every DP question a fresh answer (most tests ask one question
several times and look at each answer or charge); tests/proxy/test_reuse.py turns reuse on."""


@pytest.fixture(scope="session")
def demo_config() -> Config:
    return load_config(DEMO_CONFIG, environ=NO_REUSE)


@pytest.fixture(scope="session")
def backend(demo_config: Config) -> Iterator[Backend]:
    """The test Postgres, with the suite's database: the server `DPPROXY_TEST_DSN` names (a
    superuser DSN), else an embedded cluster started for the run."""
    if ON_CITUS:
        citus = os.environ.get("DPPROXY_TEST_CITUS_DSN")
        if not citus:
            raise RuntimeError("DPPROXY_TEST_ON_CITUS needs DPPROXY_TEST_CITUS_DSN")
        yield prepared_citus_backend(citus, demo_config)
        return
    external = os.environ.get("DPPROXY_TEST_DSN")
    pg: EmbeddedPostgres | None = None
    if external:
        server_dsn = external
    else:
        pg = EmbeddedPostgres().start()
        server_dsn = pg.dsn()
    try:
        yield prepared_backend(server_dsn, demo_config, embedded=pg)
    finally:
        if pg is not None:
            pg.stop()


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def proxy(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> Iterator[Proxy]:
    """A fresh proxy with the demo config."""
    with running_proxy(loop_thread, demo_config, backend) as px:
        yield px


@pytest.fixture
def px(proxy: Proxy) -> Proxy:
    """A fresh proxy, with alice's budget full."""
    reset_budget(proxy)
    return proxy


@pytest.fixture
def fresh_budgets(proxy: Proxy) -> Iterator[None]:
    """alice's and bob's budgets full at the start of the test, and again after it."""
    with budgets_reset(proxy):
        yield


@pytest.fixture(scope="module")
def classifier() -> Classifier:
    """A classifier protecting visits and purchases (schema public) and events (schema app)."""
    return Classifier(ProtectionPolicy({"visits": "public", "purchases": "public", "events": "app"}))
