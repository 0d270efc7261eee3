"""dp_core.limits: how deep a DP query nests and how many items it lists, checked before the analysis."""

from __future__ import annotations

import pytest

from dp_core.analysis import parse_select
from dp_core.errors import StatementTooComplex
from dp_core.limits import MAX_ITEMS


def _forms(n: int) -> dict[str, str]:
    """A DP query listing n items of each kind (red team, session 33: the analysis compared
    some of them pairwise, 2,000 GROUP BY keys took 6 s, 16,000 FROM items 51 s)."""
    return {
        "select items": "SELECT " + ", ".join(f"count(*) AS c{i}" for i in range(n)) +
                        " FROM visits",
        "GROUP BY expressions": "SELECT count(*) FROM visits GROUP BY " +
                                ", ".join(["browser"] * n),
        "FROM items": "SELECT count(*) FROM visits" +
                      "".join(f", (SELECT 1 AS a) AS c{i}" for i in range(n - 1)),
        "WITH queries": "WITH " + ", ".join(f"w{i} AS (SELECT 1)" for i in range(n)) +
                        " SELECT count(*) FROM visits",
        "arguments of one function": "SELECT count(*) FROM visits WHERE concat(" +
                                     ", ".join(["browser"] * n) + ") > 'a'",
        "values of one COALESCE, GREATEST or LEAST": "SELECT count(*) FROM visits WHERE "
                                                     "greatest(" + ", ".join(["browser"] * n) +
                                                     ") > 'a'",
        "rows of one VALUES list": "SELECT count(*) FROM visits WHERE browser IN (VALUES " +
                                   ", ".join(f"('b{i}')" for i in range(n)) + ")",
        "values of one IN list": "SELECT count(*) FROM visits WHERE browser IN (" +
                                 ", ".join(f"'b{i}'" for i in range(n)) + ")",
        "WHEN clauses of one CASE": "SELECT count(*) FROM visits WHERE CASE browser " +
                                    " ".join(f"WHEN 'b{i}' THEN {i}" for i in range(n)) +
                                    " END > 0",
    }


@pytest.mark.parametrize("kind", sorted(MAX_ITEMS))
def test_items_past_the_limit_get_54001_before_the_analysis(kind: str) -> None:
    limit = MAX_ITEMS[kind]
    parse_select(_forms(limit)[kind])  # (at the limit: read)
    with pytest.raises(StatementTooComplex) as exc:
        parse_select(_forms(limit + 1)[kind])
    assert exc.value.sqlstate == "54001" and kind in str(exc.value)


def test_limits_hold_in_subqueries_too() -> None:
    inner = "SELECT uid, " + ", ".join(["browser"] * 65) + " FROM visits GROUP BY uid, " + \
            ", ".join(["browser"] * 64)
    with pytest.raises(StatementTooComplex, match="GROUP BY expressions"):
        parse_select(f"SELECT count(*) FROM ({inner}) AS s")


def test_a_query_at_the_limit_of_keys_is_rewritten() -> None:
    """(Review, session 33: at 100 keys the pushdown's printing recursed too deep.)"""
    from tests.support.engine import build

    keys = ", ".join(f"k{i}" for i in range(MAX_ITEMS["GROUP BY expressions"]))
    items = ", ".join(f"browser AS k{i}" for i in range(MAX_ITEMS["GROUP BY expressions"]))
    build(f"SELECT count(*) FROM (SELECT uid, {items} FROM visits) s GROUP BY {keys}")
