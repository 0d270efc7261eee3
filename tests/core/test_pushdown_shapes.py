"""Every pushdown the rewriter produces keeps its per-user rows on Citus's workers (issue 32):
the shape rule of tests/support/shapes.py over the golden cases and the fuzzer's queries, in
each form the proxy runs them (whole, split by uid ranges, prefiltered); and the rule itself
catches each shape that Citus gathers on the coordinator."""

from __future__ import annotations

import random
import re

import pytest

from dp_core.errors import DPError
from dp_core.rewrite import Pushdown, pushdown, ranged_pushdown
from tests.fuzz.test_fuzz_sql import _query
from tests.support.engine import EXTRA_CASES, GOLDEN_CASES, build, golden_sql
from tests.support.shapes import problems


def _forms(sql: str) -> list[tuple[str, Pushdown]]:
    """The statement's pushdowns as the proxy may run them: whole, for a range of users, and
    prefiltered for a range (where it groups)."""
    query, plan, _ = build(sql)
    out = [("whole", pushdown(query, plan, order_seed=1234))]
    ranged = ranged_pushdown(query, plan, None, 1234)
    out.append(("ranged", ranged.of(("5", "9"))))
    if query.keys:
        pre = ("int8", *("text" for _ in query.keys))
        out.append(("prefiltered", ranged_pushdown(query, plan, None, 1234, pre).of((None, "5"))))
    return out


def _check(sql: str) -> None:
    for form, pd in _forms(sql):
        for name, statement in pd.statements().items():
            found = problems(statement)
            assert not found, f"{sql}\n{form} {name}: {found}\n{statement}"


@pytest.mark.parametrize("sql", [golden_sql(c).strip() for c in GOLDEN_CASES] + EXTRA_CASES,
                         ids=[c.stem for c in GOLDEN_CASES] + [f"extra{i}" for i in range(len(EXTRA_CASES))])
def test_golden_and_extra_pushdowns_keep_per_user_rows_on_the_workers(sql: str) -> None:
    _check(sql)


def test_the_fuzzers_queries_keep_per_user_rows_on_the_workers() -> None:
    rng = random.Random(20261126)
    built = 0
    for _ in range(600):
        sql, protected = _query(rng)
        # (without OPTIONS, which `build` does not validate as the proxy does: they change
        # the numbers in a pushdown, not its shape)
        sql = re.sub(r"OPTIONS\([^)]*\) ", "", sql.removeprefix("EXPLAIN "))
        if not protected:
            continue
        try:
            forms = _forms(sql)
        except (DPError, ValueError):
            continue  # refused (ValueError: an option's value `build` cannot read): nothing runs
        built += 1
        for form, pd in forms:
            for name, statement in pd.statements().items():
                found = problems(statement)
                assert not found, f"{sql}\n{form} {name}: {found}\n{statement}"
    assert built > 150, built


# each shape Citus gathers on the coordinator (as pushdowns had them before issue 32)
BAD = [
    ("WITH dp_per_user AS (SELECT uid AS dp_uid, sum(x) AS s, count(x) AS n FROM t GROUP BY 1), "
     "dp_bounded AS (SELECT *, row_number() OVER (PARTITION BY dp_uid) AS dp_rn FROM dp_per_user) "
     "SELECT sum(v) FROM (SELECT *, s / n AS v FROM dp_bounded WHERE dp_rn <= 1 OFFSET 0) AS k",
     "an OFFSET"),
    ("SELECT count(*) FROM (SELECT uid FROM t LIMIT 10) AS l", "a LIMIT outside a scalar subquery"),
    ("SELECT k, count(*) FROM (SELECT k, row_number() OVER (PARTITION BY k) AS r FROM t) AS w "
     "GROUP BY k", "a window not partitioned by the uid"),
    ("WITH dp_per_user AS (SELECT uid AS dp_uid, k AS dp_k0 FROM t GROUP BY 1, 2) "
     "SELECT dp_k0, 0 FROM dp_per_user UNION ALL SELECT dp_k0, 1 FROM dp_per_user",
     "a CTE of per-user rows read 2 times"),
    ("WITH dp_bounded AS (SELECT *, row_number() OVER (PARTITION BY dp_uid) AS dp_rn FROM p) "
     "SELECT 0, count(*) FROM dp_bounded UNION ALL SELECT 1, count(*) FROM dp_bounded",
     "a CTE of per-user rows read 2 times"),
    ("WITH dp_bounded AS (SELECT uid AS dp_uid, k AS dp_k0, array_agg(x) AS a FROM t GROUP BY 1, 2) "
     "SELECT dp_k0, (SELECT count(DISTINCT v) FROM unnest(array_agg(a)) AS v) FROM dp_bounded "
     "GROUP BY dp_k0", "an aggregate inside a subquery of an aggregating stage"),
]


@pytest.mark.parametrize("sql,expected", BAD, ids=[b[1] for b in BAD])
def test_the_rule_catches_each_shape_citus_gathers(sql: str, expected: str) -> None:
    assert any(p.startswith(expected) for p in problems(sql)), problems(sql)


def test_the_rule_allows_what_citus_pushes_down() -> None:
    # an aggregated CTE read thrice, a per-user CTE read once, a scalar subquery's LIMIT
    ok = ("WITH dp_per_user AS (SELECT uid AS dp_uid, k AS dp_k0, (SELECT array_agg(v) FROM "
          "(SELECT v FROM unnest(array_agg(x)) AS v LIMIT 3) AS d) AS a FROM t GROUP BY 1, 2), "
          "dp_t AS (SELECT dp_k0, count(*) AS n FROM dp_per_user GROUP BY dp_k0) "
          "SELECT sum(n) FROM dp_t UNION ALL SELECT max(n) FROM dp_t UNION ALL SELECT 1 FROM dp_t")
    assert problems(ok) == []
    # an OFFSET 0 over public rows alone (a reference table's: gathered and sent to each shard)
    public = ("SELECT count(*) FROM public.visits AS v JOIN (SELECT code FROM countries "
              "WHERE code <> 'x' OFFSET 0) AS c ON c.code = v.country GROUP BY v.uid")
    assert problems(public) == []
    sentinel = ("SELECT count(*) FROM (SELECT dp_s.* FROM (VALUES (0)) AS dp_one (dp_x) LEFT JOIN "
                "(SELECT uid, max(country) AS c FROM public.visits GROUP BY uid) AS dp_s ON TRUE "
                "OFFSET 0) AS s GROUP BY s.uid")
    assert problems(sentinel) == ["an OFFSET"]
