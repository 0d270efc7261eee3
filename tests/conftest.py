"""The suite's root: the shared fixtures (tests/support), `--long`, and the pure/live markers.

The fixtures and what they are built from live in tests/support/ (`fixtures` holds the
fixtures themselves: one real Postgres for the whole run, a fresh proxy per test). Each test
is marked `live` when it needs the test Postgres (its fixtures include `backend`, or it says
`@pytest.mark.live`, for one that starts its own), else `pure`: `pytest -m pure` runs those
alone, without starting Postgres.
"""

from __future__ import annotations

import os

import pytest

pytest.register_assert_rewrite("tests.support")  # its helpers assert: keep pytest's messages

pytest_plugins = ["tests.support.fixtures"]

# proxies the tests start as processes read it too (tests.support.fixtures.NO_REUSE)
os.environ.setdefault("DPPROXY_DEFAULTS__ANSWER_REUSE", "off")

LIVE_FIXTURE = "backend"
"""The fixture that starts (or connects to) the test Postgres, in tests/support/fixtures.py."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="the stochastic DP tester's deeper mode (more databases, samples, depth)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long"):
        os.environ["DPPROXY_TEST_STOCHASTIC_LONG"] = "1"  # read by test_stochastic at import


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test `live` (it needs the test Postgres) or `pure` (no database, no proxy),
    from its fixture closure: a test is live when LIVE_FIXTURE is in it, or when it is marked
    live itself (one that starts a Postgres of its own)."""
    for item in items:
        if item.get_closest_marker("live") is not None:
            continue
        live = LIVE_FIXTURE in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.live if live else pytest.mark.pure)
