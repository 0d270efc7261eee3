"""The neighbour fuzzer: whether a DP query fails must not depend on one user's data.

Generated DP queries aimed at one user (CASE on its uid, divisions by its values, huge
literals, outer joins, per-user windows, ordered or distinct subqueries, public subqueries)
run through the proxy on the demo data without and with that user, whose rows hold extreme
values (the ends of integer and numeric ranges, zero, NULL, a long text, a country no lookup
has; dates and times at the ends of their types' ranges and infinite). The outcome of each query, answered or the SQLSTATE of its refusal or failure, must be
the same on both databases (issue 26: each class of leak there made the outcome differ). The
answers themselves are noisy; the stochastic tester checks their distributions.
Seeded (DPPROXY_TEST_FUZZ_SEED replays a failure; DPPROXY_TEST_FUZZ_ROUNDS runs longer).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.types.string import TextLoader

from config import Config
from config.models import TableConfig
from tests.support.backend import Backend, init_backend
from tests.support.proxy import LoopThread, Proxy, running_proxy, spent

SEED = int(os.environ.get("DPPROXY_TEST_FUZZ_SEED", random.randrange(1 << 30)))
ROUNDS = int(os.environ.get("DPPROXY_TEST_FUZZ_ROUNDS", "60"))
TARGET = 987_654_321
"""The uid of the user who is in one database and not in the other."""

_TARGET_ROWS = [
    "INSERT INTO visits (uid, browser, country, duration) VALUES "
    f"({TARGET}, 'Chrome', 'US', 2147483647), ({TARGET}, 'Chrome', 'US', -2147483648), "
    f"({TARGET}, 'Zz', 'ZZ', 0), ({TARGET}, 'Firefox', 'DE', NULL), ({TARGET}, 'Safari', 'FR', 663), "
    f"({TARGET}, repeat('x', 5000), 'US', 42)",
    "INSERT INTO purchases (uid, category, amount) VALUES "
    f"({TARGET}, 'books', 99999999.99), ({TARGET}, 'books', -99999999.99), ({TARGET}, 'zz', 0)",
]
_REMOVE = [f"DELETE FROM {t} WHERE uid = {TARGET}" for t in ("visits", "purchases", "events")]

EVENTS_SQL = [
    "DROP TABLE IF EXISTS events",
    "CREATE TABLE events (uid bigint NOT NULL, kind text NOT NULL, ts timestamptz, "
    "at timestamp, d date, t time, tz timetz, iv interval)",
    "INSERT INTO events SELECT uid, browser, ts, ts AT TIME ZONE 'UTC', ts::date, ts::time, "
    "ts::timetz, duration * interval '1 second' FROM (SELECT uid, browser, duration, "
    "timestamptz '2024-01-01 00:00+00' + (uid % 997) * interval '7 hours' AS ts "
    "FROM visits WHERE uid % 3 = 0) s",
]
"""A protected table of dates and times (the demo has none), filled from a third of the
demo's users: timestamps over most of a year, their dates, times of day, durations."""
_TARGET_EVENTS = [
    "INSERT INTO events (uid, kind, ts, at, d, t, tz, iv) VALUES "
    f"({TARGET}, 'a', 'infinity', 'infinity', 'infinity', '24:00', '24:00-15:59', "
    "'178000000 years'), "
    f"({TARGET}, 'a', '-infinity', '-infinity', '-infinity', '00:00', '00:00+15:59', "
    "'-178000000 years'), "
    f"({TARGET}, 'b', '294276-12-31 23:59:59+00', '294276-12-31 23:59:59', '5874897-12-31', "
    "'23:59:59.999999', '10:00+02', '1 month 3 days 10:00:01.5'), "
    f"({TARGET}, 'b', '4714-11-24 00:00:00+00 BC', '4714-11-24 00:00:00 BC', '4713-01-01 BC', "
    "NULL, NULL, NULL)",
]

_SOURCES = [
    ("visits v", ["v.browser", "v.country"], ["v.duration"], "v.uid"),
    ("visits v JOIN purchases p ON p.uid = v.uid", ["v.browser", "p.category"],
     ["v.duration", "p.amount"], "v.uid"),
    ("visits v LEFT JOIN purchases p ON p.uid = v.uid", ["v.browser", "p.category"],
     ["v.duration", "p.amount"], "v.uid"),
    ("purchases p RIGHT JOIN visits v ON p.uid = v.uid", ["v.country"], ["v.duration", "p.amount"],
     "v.uid"),
    ("visits v FULL JOIN purchases p ON p.uid = v.uid", ["p.category"], ["v.duration", "p.amount"],
     "v.uid"),
    ("countries c LEFT JOIN visits v ON v.country = c.code", ["c.region"], ["v.duration"], "v.uid"),
    ("visits v JOIN countries c ON c.code = v.country", ["c.region", "v.browser"], ["v.duration"],
     "v.uid"),
    ("(SELECT uid, browser, duration, sum(duration) OVER (PARTITION BY uid) AS t FROM visits) v",
     ["v.browser"], ["v.duration", "v.t"], "v.uid"),
    ("(SELECT uid, country, sum(duration) AS duration FROM visits GROUP BY uid, country) v",
     ["v.country"], ["v.duration"], "v.uid"),
    ("(SELECT v.uid, v.browser, p.amount AS duration FROM visits v LEFT JOIN purchases p "
     "ON v.uid = p.uid) v", ["v.browser"], ["v.duration"], "v.uid"),
    ("(SELECT uid, browser, duration FROM visits ORDER BY duration / (uid - {t})) v", ["v.browser"],
     ["v.duration"], "v.uid"),
    ("(SELECT DISTINCT ON (uid) uid, browser, duration FROM visits ORDER BY uid, duration) v",
     ["v.browser"], ["v.duration"], "v.uid"),
    ("visits v JOIN (SELECT code, 1 / (length(code) - 2) AS x FROM countries) c ON c.code = v.country",
     ["c.code"], ["v.duration", "c.x"], "v.uid"),
    ("w", ["w.browser"], ["w.duration"], "w.uid"),
    ("events e", ["e.kind", "e.d", "date_trunc('month', e.ts)", "date_trunc('day', e.at)",
                  "extract(year FROM e.d)", "e.ts::date", "date_trunc('week', e.ts)",
                  "date_part('hour', e.t)", "extract(isodow FROM e.ts)"],
     ["extract(epoch FROM e.iv)", "extract(epoch FROM e.ts)", "date_part('year', e.at)",
      "extract(minute FROM e.tz)", "extract(day FROM e.d)", "e.d - date '2024-01-01'",
      "extract(epoch FROM e.t)"], "e.uid"),
    ("events e JOIN visits v ON v.uid = e.uid", ["e.kind", "v.browser", "e.d"],
     ["v.duration", "extract(month FROM e.ts)"], "e.uid"),
]
_WITH = ("WITH w AS (SELECT uid, browser, duration FROM visits WHERE duration / (uid - {t}) "
         "IS NOT NULL OR uid = {t}) ")


def _value(rng: random.Random, nums: list[str], uid: str) -> str:
    """A number that one user's rows (uid {t}) may push to an edge."""
    x = rng.choice(nums)
    return rng.choice([
        x, f"{x} * 2", f"{x} / ({x} - 663)", f"{x} % ({x} - 42)", f"({x} * {x} * {x})",
        f"CASE WHEN {uid} = {{t}} THEN 1e300 ELSE 0 END * 1e38 * 1e38",
        f"CASE WHEN {uid} = {{t}} THEN 1e37 / 7 ELSE 1 END * {x} / 3 / {x}",
        f"CASE WHEN {uid} = {{t}} AND {x} > 600 THEN 1e100000 ELSE 0 END * 1e100000",
        f"({x} * 1e38 * 1e38)::int", f"({x} * 2147483647)::int2", f"{x}::int2",
        f"CASE {uid} WHEN {{t}} THEN 'NaN'::float8 ELSE {x} END",
        f"CASE {uid} WHEN {{t}} THEN '-Infinity'::float8 ELSE {x} END / 1",
        f"width_bucket(CASE {uid} WHEN {{t}} THEN 'NaN'::float8 ELSE {x} END, 0, 3600, 4)",
        f"abs({x})", f"round({x} / 7.0, 2)", f"({x} + 1)::bigint", f"{x} - 2147483647 - 1",
        # values brought to one type: numeric converted to real or double precision
        f"GREATEST({x} * 1e100, 1::float4)", f"COALESCE(CASE WHEN {uid} = {{t}} THEN {x} * 1e30 "
        "END, 1::real)", f"CASE WHEN {uid} = {{t}} THEN {x} * 1e-200 * 1e-200 ELSE 1::float8 END",
        f"NULLIF({x} * 1e-320, 1::float8)", f"LEAST({x}::float8, 1.5)",
    ])


_DATETIME = [
    "date_trunc('decade', e.ts)", "date_trunc('month', e.at + e.iv)", "e.d + 1",
    "e.d + interval '1 day'", "e.ts - interval '300000 years'", "e.at::timestamptz",
    "e.d::timestamp", "extract(hour FROM e.d)", "age(e.ts)", "e.ts + e.iv",
    "to_char(e.ts, 'YYYY-MM')", "e.ts AT TIME ZONE 'Pacific/Kiritimati'",
    "date_trunc('year', e.ts AT TIME ZONE 'Pacific/Pago_Pago')", "justify_interval(e.iv)",
    "e.iv * 1000", "make_date(extract(year FROM e.d)::int, 1, 1)", "e.t + e.iv",
    "CASE WHEN e.uid = {t} THEN 'infinity'::date ELSE e.d END - date '2024-01-01'",
    "extract(epoch FROM e.ts)::int", "date_part('millennium', e.d::timestamp)",
    "extract(julian FROM e.at)", "e.ts::date - e.d", "COALESCE(e.d, e.at)",
    "GREATEST(e.at, e.ts)", "CASE WHEN e.uid = {t} THEN e.d ELSE e.ts END", "e.d < e.at",
    "e.d IN (e.at, e.ts)", "LEAST(e.d, date '2024-01-01')",
]
"""Date/time expressions that fail on some values (out of range, infinite, past a unit's
end) or never: what of them a DP query may use must not depend on the target's dates."""


def _condition(rng: random.Random, keys: list[str], nums: list[str], uid: str) -> str:
    k = rng.choice(keys)
    return rng.choice([
        f"{_value(rng, nums, uid)} > 0", f"1 / ({uid} - {{t}}) > 0", f"{uid} = {{t}}",
        f"length(lpad({k}::text, 10000, 'C')) > 0", f"substring({k}::text, 2, 3) = 'x'",
        f"{k}::text LIKE 'Z%'", f"{k} IS NULL",
        f"{k} IN (SELECT code FROM countries WHERE 1 / (length(code) - 2) > 0)",
        f"{k} IN (SELECT code FROM countries ORDER BY 1 / (length(code) - 2))",
        f"EXISTS (SELECT 1 FROM countries WHERE code = {k}::text AND 1 / ({uid} - {{t}}) > 0)",
        *([f"{rng.choice(_DATETIME)} IS NOT NULL", f"{rng.choice(_DATETIME)}::text > '2'"]
          if uid == "e.uid" else []),
    ])


def _query(rng: random.Random) -> str:
    source, keys, nums, uid = rng.choice(_SOURCES)
    key = rng.choice([*keys, ""])
    if uid == "e.uid" and rng.random() < 0.3:
        key = rng.choice(_DATETIME)
    aggs = rng.sample([
        "ANON_COUNT(*)", f"ANON_SUM({_value(rng, nums, uid)}, 0, 100)",
        f"ANON_AVG({_value(rng, nums, uid)}, -10, 10)", f"ANON_COUNT(DISTINCT {uid})",
        f"ANON_VAR({_value(rng, nums, uid)}, 0, 1e100)",
        f"ANON_MEDIAN({_value(rng, nums, uid)}, 0, 3600)",
        f"ANON_COUNT(*) FILTER (WHERE {_value(rng, nums, uid)} > 1)",
        f"COUNT(DISTINCT {rng.choice(keys)})", f"SUM({_value(rng, nums, uid)})",
    ], rng.choice([1, 2]))
    sql = "SELECT WITH ANONYMIZATION " + ", ".join([*([key] if key else []), *aggs])
    sql += f" FROM {source}"
    if rng.random() < 0.6:
        sql += " WHERE " + _condition(rng, keys, nums, uid)
    if key:
        sql += f" GROUP BY {key}"
    if source == "w":
        sql = _WITH + sql
    return sql.replace("{t}", str(TARGET))


@pytest.fixture(scope="module")
def events_config(demo_config: Config, backend: Backend) -> Iterator[Config]:
    """The demo config with `events` protected too, its table made and set up as
    init-backend would; dropped afterwards."""
    config = demo_config.model_copy(update={"tables": {
        **demo_config.tables, "events": TableConfig(uid_column="uid")}})
    with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
        for stmt in EVENTS_SQL:
            su.execute(stmt)
    init_backend(backend, config)
    try:
        yield config
    finally:
        with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
            su.execute("DROP TABLE events")
        init_backend(backend, demo_config)


@pytest.fixture(params=["plain", "split"])
def plain_or_split_proxy(request: pytest.FixtureRequest, loop_thread: LoopThread,
                         events_config: Config, backend: Backend) -> Iterator[Proxy]:
    """The demo proxy, with `events`; "split": every pushdown that can be is split by uid
    ranges."""
    config = events_config
    if request.param == "split":
        b = config.backend.model_copy(update={"pushdown_split": 3, "pushdown_split_min_rows": 0})
        config = config.model_copy(update={"backend": b})
    with running_proxy(loop_thread, config, backend) as px:
        yield px


def _outcomes(proxy: Proxy, queries: list[str]) -> list[str]:
    """Per query: "answered", or the error's SQLSTATE; an answer's rows in the order they
    came, by their first column's texts (`_same_order`)."""
    out = []
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin, \
            psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        admin.execute("SELECT dp_reset_budget('alice')")
        conn.execute("SET dp.epsilon = 0.01")
        for sql in queries:
            try:
                rows = conn.execute(sql).fetchall()
                out.append("answered" + "".join(f"\x00{r[0]}" for r in rows if r))
            except psycopg.Error as e:
                # (APPROX_BOUNDS finding too few users says so, its cost charged: a DP outcome,
                # random as an answer is, which may differ between two runs of one database)
                charged = e.sqlstate == "22023" and "cost is charged" in str(e)
                out.append("answered" if charged else str(e.sqlstate))
            assert conn.execute("SELECT 1").fetchone() == (1,), sql  # the session lives on
            if spent(conn).epsilon > 8:
                admin.execute("SELECT dp_reset_budget('alice')")
    return out


def test_one_users_data_never_changes_whether_a_query_fails(plain_or_split_proxy: Proxy,
                                                            backend: Backend) -> None:
    rng = random.Random(SEED)
    queries = [_query(rng) for _ in range(ROUNDS)]
    without = _outcomes(plain_or_split_proxy, queries)
    with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
        try:
            for stmt in [*_TARGET_ROWS, *_TARGET_EVENTS]:
                su.execute(stmt)
            with_user = _outcomes(plain_or_split_proxy, queries)
        finally:
            for stmt in _REMOVE:
                su.execute(stmt)
    differ = [(q, a, b) for q, a, b in zip(queries, without, with_user, strict=True)
              if not _same_outcome(a, b)]
    assert not differ, f"seed {SEED}: outcomes differ with user {TARGET}:\n" + "\n".join(
        f"{a} / {b}: {q}" for q, a, b in differ)
    # the generator reaches both sides, or it tests little
    assert any(o.startswith("answered") for o in without) and \
        any(not o.startswith("answered") for o in without), without


def _same_outcome(a: str, b: str) -> bool:
    """Both answered, with the rows both released (by their first column: keys, or noisy
    values that rarely meet) in one order; or both failed with one SQLSTATE. The order of the
    rows is the released keys' alone: the pushdown's hash order could follow one user."""
    if not (a.startswith("answered") and b.startswith("answered")):
        return a == b
    rows_a, rows_b = a.split("\x00")[1:], b.split("\x00")[1:]
    if len(set(rows_a)) < len(rows_a) or len(set(rows_b)) < len(rows_b):
        return True  # (repeated texts: no one order to compare)
    common = set(rows_a) & set(rows_b)
    return [r for r in rows_a if r in common] == [r for r in rows_b if r in common]


def test_keys_at_the_ends_of_date_and_time_types_are_released_as_postgres_prints_them(
        loop_thread: LoopThread, events_config: Config, backend: Backend) -> None:
    """Grouped by a date, timestamp or time column where many users hold values no driver's
    types can hold (year 5874897, 294276 AD, 4714 BC, infinity, 24:00): every query answers
    (the pushdown returned such keys typed, and decoding them after the charge closed the
    session: issue 26), the session lives on, and the released extreme keys read back as
    Postgres prints them. An interval key (178 million years) is refused before any charge:
    its equal values print differently ('1 day', '24:00:00'), and a group would show one of
    its rows' spellings."""
    crowd = range(TARGET + 1, TARGET + 301)
    inserts = [stmt.replace(str(TARGET), "{u}") for stmt in _TARGET_EVENTS]
    columns = ["d", "at", "ts", "t", "tz"]
    with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
        try:
            for u in crowd:
                for stmt in inserts:
                    su.execute(stmt.replace("{u}", str(u)))
            truth = {c: {r[0] for r in su.execute(
                f"SELECT DISTINCT {c}::text FROM events WHERE uid >= {crowd[0]} "
                f"AND {c} IS NOT NULL")} for c in columns}
            with running_proxy(loop_thread, events_config, backend) as px, \
                    psycopg.connect(px.dsn("admin"), autocommit=True) as admin, \
                    psycopg.connect(px.dsn(), autocommit=True) as conn:
                admin.execute("SELECT dp_reset_budget('alice')")
                for name in ("date", "timestamp", "timestamptz", "time", "timetz", "interval"):
                    conn.adapters.register_loader(name, TextLoader)  # (as Postgres prints)
                with pytest.raises(psycopg.errors.FeatureNotSupported, match="type interval"):
                    conn.execute("SELECT WITH ANONYMIZATION iv, ANON_COUNT(*) FROM events "
                                 "GROUP BY iv")
                for c in columns:
                    rows = conn.execute(
                        "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.5, delta=1e-6, "
                        f"max_groups_contributed=4) {c}, ANON_COUNT(*) FROM events "
                        f"GROUP BY {c}").fetchall()
                    released = {r[0] for r in rows}
                    # the crowd's values are each held by 300 users: all released
                    assert truth[c] <= released, (c, truth[c] - released)
                    assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            su.execute(f"DELETE FROM events WHERE uid >= {crowd[0]}")
