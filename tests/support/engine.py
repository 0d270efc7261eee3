"""The pure DP core's pipeline for one statement (`build`), and the golden pushdown cases."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dp_core.analysis import analyze, parse_select
from dp_core.classify import Classifier, ProtectionPolicy
from dp_core.mechanism_choices import SelectionKind
from dp_core.mechanisms import NoiseKind
from dp_core.plan import make_plan
from dp_core.query import Bounds, TablePolicy
from dp_core.rewrite import pushdown

from .paths import GOLDEN

POLICY = {
    "visits": TablePolicy("public", "uid", {"duration": Bounds(0, 3600)}),
    "purchases": TablePolicy("public", "uid", {"amount": Bounds(0, 500)}),
}
CLASSIFIER = Classifier(ProtectionPolicy({"visits": "public", "purchases": "public"}))


def build(sql: str, epsilon: float = 1.0, delta: float = 1e-6, max_groups: int = 1,
          noise: NoiseKind = NoiseKind.LAPLACE, schema: str = "public",
          policy: dict[str, TablePolicy] | None = None):  # type: ignore[no-untyped-def]
    """(query, plan, pushdown SQL) of one statement, under `policy` (POLICY: its tables in
    `schema`), with the statement's OPTIONS over these defaults (the pushdown's group order
    seeded, so it is reproducible)."""
    classifier = CLASSIFIER
    policy = policy or POLICY
    if schema != "public":
        policy = {name: replace(p, schema=schema) for name, p in POLICY.items()}
        classifier = Classifier(ProtectionPolicy({name: schema for name in POLICY}))
    (st,) = classifier.classify(sql)
    options = dict(st.dp_clause.options) if st.dp_clause else {}
    unit = options.get("privacy_unit_column")
    query = analyze(parse_select(st.stripped_sql), policy, plain_form=st.dp_clause is None,
                    privacy_unit=None if unit is None else str(unit),
                    dp_at=None if st.dp_clause is None else st.dp_clause.select_offset)
    plan = make_plan(query, float(options.get("epsilon", epsilon)), float(options.get("delta", delta)),
                     int(options.get("max_groups_contributed", max_groups)),
                     NoiseKind(options.get("noise", noise)),
                     selection=SelectionKind(options.get("partition_selection", "laplace")))
    pd = pushdown(query, plan, order_seed=1234)
    return query, plan, ";\n".join(pd.statements().values())


EXTRA_CASES = [
    # forms the golden cases do not cover: the tuning statement (COUNT(DISTINCT x) beside
    # row-level aggregates), plain AVG/VAR, several quantiles, bounds found from the data
    "SELECT browser, COUNT(*), SUM(duration), COUNT(DISTINCT country) FROM visits GROUP BY browser",
    "SELECT COUNT(*), SUM(duration), COUNT(DISTINCT country) FROM visits",
    "SELECT country, AVG(duration), VAR_POP(duration) FROM visits GROUP BY country",
    "SELECT browser, percentile_cont(0.5) WITHIN GROUP (ORDER BY duration), "
    "percentile_cont(0.9) WITHIN GROUP (ORDER BY duration) FROM visits GROUP BY browser",
    "SELECT WITH ANONYMIZATION browser, ANON_SUM(duration), ANON_AVG(duration) FROM visits "
    "GROUP BY browser",
    "SELECT WITH ANONYMIZATION browser, ANON_COUNT(DISTINCT country), ANON_AVG(duration, 0, 100), "
    "ANON_VAR(duration, 0, 100) FROM visits GROUP BY browser",
    "SELECT WITH ANONYMIZATION ANON_COUNT(DISTINCT country, 3), ANON_COUNT(DISTINCT browser) "
    "FROM visits",
]
"""Queries whose pushdowns the shape rule checks beside the golden cases'."""

GOLDEN_CASES = sorted(p for p in GOLDEN.glob("*.sql") if not p.name.endswith(".expected.sql"))
"""The golden inputs: tests/golden/rewrite/NAME.sql, whose pushdown is NAME.expected.sql."""


def golden_sql(case: Path | str) -> str:
    """A golden input's query (a path, or a case's name), without its comment lines."""
    path = GOLDEN / f"{case}.sql" if isinstance(case, str) else case
    return "\n".join(ln for ln in path.read_text().splitlines() if not ln.startswith("--"))
