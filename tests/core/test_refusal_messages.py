"""Every refusal the classifier can produce says what the statement did, why, and what to do
instead, naming only tables the configuration holds (issue 34). Pure classifier tests."""

from __future__ import annotations

import re

import pytest

from dp_core import reach
from dp_core.classify import Classifier, ProtectionPolicy, StatementKind
from dp_core.errors import DPError
from dp_core.setting_changes import SettingChanges
from tests.core.test_isolation_refusals import REFUSED

CONFIGURED = {"rides": "ops", "riders": "ops"}
"""A configuration without the demo's tables: a hint naming visits would be a made-up one."""
DEMO_NAMES = ("visits", "purchases", "countries", "events", "users", "rides_demo")

OWN_REFUSALS = [
    # protected tables read outside the DP path, in every statement form
    "SELECT * FROM rides",
    "SELECT rider_id, fare FROM ops.rides WHERE fare > 10",
    "SELECT r.* FROM rides r JOIN riders d ON d.id = r.rider_id",
    "COPY rides TO STDOUT",
    "TABLE riders",
    "DELETE FROM rides",
    "CREATE TEMP TABLE t AS SELECT * FROM rides",
    "CREATE TEMP VIEW v AS SELECT fare FROM rides",
    "PREPARE p AS SELECT * FROM rides",
    # DP queries used where an answer cannot go
    "COPY (SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides) TO '/tmp/x'",
    "COPY (SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides) TO PROGRAM 'cat'",
    "EXPLAIN ANALYZE SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides",
    "PREPARE p AS SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides",
    "CREATE TEMP TABLE t AS SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides",
    "INSERT INTO t SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM riders",
    "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM (SELECT WITH ANONYMIZATION ANON_COUNT(*) "
    "FROM rides) s",
    # settings that change how SQL is read
    "SET standard_conforming_strings = off",
    "SET client_encoding TO 'SJIS'",
    "SET NAMES 'EUC_TW'",
    "SELECT set_config('client_encoding', 'MULE_INTERNAL', false)",
    "SELECT set_config('client_' || 'encoding', 'UTF8', false)",
    "SELECT set_config('client_encoding', lower('X'), false)",
    "PREPARE p(text) AS SELECT set_config('client_encoding', $1, false)",
    "UPDATE pg_settings SET setting = 'off' WHERE name = 'standard_conforming_strings'",
]
"""The classifier's own refusals (the isolation rules' are `REFUSED`)."""

REACH_GENERATED = [
    *(f"SELECT * FROM {name}" for name in reach._ISOLATION_RELATIONS),
    "SELECT * FROM pg_stat_subscription",
    *(f"SELECT {name}(1)" for name in reach._ISOLATION_FUNCTIONS),
    "SELECT pg_stat_get_xact_blocks_hit(1)",
    "SELECT lo_open(1, 2)",
]
"""One statement per relation and function the isolation rules refuse, from their tables."""


def _classifiers() -> list[Classifier]:
    from server.encodings import encoding_help, encoding_named

    policy = ProtectionPolicy(CONFIGURED)
    return [Classifier(policy),
            Classifier(policy, settings=SettingChanges(
                lambda v: encoding_named(v) is not None, encoding_help))]


def _refusals(sql: str) -> list[DPError]:
    out = []
    for classifier in _classifiers():
        for st in classifier.classify(sql):
            if st.kind is StatementKind.REFUSED:
                assert st.refusal is not None
                out.append(st.refusal)
    return out


_FROM = re.compile(r"\b(?:FROM|JOIN|TABLE|INTO|UPDATE)\s+([A-Za-z_][\w.]*)")
"""Where SQL in a message names a table (the examples write keywords in capitals)."""


@pytest.mark.parametrize("sql", [*OWN_REFUSALS, *REFUSED, *REACH_GENERATED])
def test_every_refusal_says_what_why_and_what_instead_with_configured_tables(sql: str) -> None:
    refusals = _refusals(sql)
    assert refusals, f"not refused: {sql}"
    for err in refusals:
        assert err.sqlstate in ("42501", "0A000"), err
        message, hint = err.message, err.hint or ""
        # what the statement did, and why (after a colon, in the detail, or what it "would" do)
        assert ": " in message or err.detail or " would " in message, message
        # what to do instead, beyond the message
        assert hint and hint not in message, (sql, message, hint)
        text = " ".join((message, hint, err.detail or ""))
        for word in DEMO_NAMES:
            if word not in sql:
                assert word not in text, (sql, text)
        for name in _FROM.findall(text):
            table = name.rsplit(".", 1)[-1].lower()
            assert table in CONFIGURED or table in sql.lower(), (sql, name, text)


def test_the_walk_reaches_every_reason_the_isolation_rules_give() -> None:
    hints = {err.hint for sql in [*REFUSED, *REACH_GENERATED] for err in _refusals(sql)}
    assert set(reach._INSTEAD.values()) <= hints


def test_the_encoding_hint_names_only_encodings_it_takes() -> None:
    """The hint for an encoding the proxy cannot read lists what it reads, and each of those
    it takes (the old hint said "the EUC encodings work too" when refusing EUC_TW)."""
    from server.encodings import READABLE, encoding_named

    (err,) = {str(e.hint): e for e in _refusals("SET client_encoding TO 'EUC_TW'")
              if "EUC" in (e.hint or "")}.values()
    assert err.hint is not None and "EUC_TW" not in err.hint
    named = re.findall(r"[A-Z][A-Z0-9_]+", READABLE)
    ranges = re.findall(r"([A-Z_]+?)(\d+) to \1(\d+)", READABLE)
    for family, low, high in ranges:
        named += [f"{family}{n}" for n in range(int(low), int(high) + 1)]
    for name in named:
        if not name.endswith("_"):
            assert encoding_named(name) is not None, name
