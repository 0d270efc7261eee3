"""How deep a DP query may nest and how many items it may list: its analysis's time grows with them."""

from __future__ import annotations

from typing import Any

from pglast import ast

from dp_core.errors import StatementTooComplex

MAX_NESTING = 64
"""How deep a DP query's syntax tree may be: the analysis walks and copies it recursively."""

MAX_ITEMS = {
    "select items": 1000,
    "GROUP BY expressions": 64,
    "FROM items": 100,
    "WITH queries": 100,
    "arguments of one function": 100,
    "values of one COALESCE, GREATEST or LEAST": 1000,
    "WHEN clauses of one CASE": 1000,
    "rows of one VALUES list": 1000,
    "values of one IN list": 10_000,
}
"""The most items of each kind in one place of a DP query. The analysis compares some of
them pairwise (GROUP BY's with the select list's, FROM items as it orders their joins, each
WHEN's value with CASE's), so that 2,000 GROUP BY keys took 6 s and 16,000 comma-listed FROM
items 51 s, and copies and prints VALUES rows and IN values in each probe (60,000 VALUES rows:
seconds in the event loop; red team, session 33). Postgres itself takes at most 100
arguments of a function; the pushdown of more than about 90 GROUP BY keys nests past what
it is printed with."""


def check_limits(root: ast.SelectStmt) -> None:
    """Refuse (54001) a query that nests deeper than MAX_NESTING or lists more items than
    MAX_ITEMS allows, walking its tree once (without recursion)."""
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        cur, depth = stack.pop()
        if isinstance(cur, ast.Node):
            depth += 1
            if depth > MAX_NESTING:
                raise StatementTooComplex(
                    f"a DP query nests expressions more than {MAX_NESTING} levels deep",
                    hint="write long sums or concatenations with fewer levels, e.g. "
                         "concat(a, b, c)")
            for kind, items in _items(cur):
                if items is not None and len(items) > MAX_ITEMS[kind]:
                    raise StatementTooComplex(
                        f"a DP query with more than {MAX_ITEMS[kind]} {kind}",
                        hint="split it into several queries")
            stack.extend((getattr(cur, name), depth) for name in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend((item, depth) for item in cur)


def _items(node: ast.Node) -> list[tuple[str, Any]]:
    if isinstance(node, ast.SelectStmt):
        return [("select items", node.targetList), ("GROUP BY expressions", node.groupClause),
                ("FROM items", node.fromClause), ("rows of one VALUES list", node.valuesLists),
                ("WITH queries", node.withClause.ctes if node.withClause else None)]
    if isinstance(node, ast.A_Expr) and isinstance(node.rexpr, tuple):
        return [("values of one IN list", node.rexpr)]
    if isinstance(node, ast.FuncCall):
        return [("arguments of one function", node.args)]
    if isinstance(node, (ast.CoalesceExpr, ast.MinMaxExpr)):
        return [("values of one COALESCE, GREATEST or LEAST", node.args)]
    if isinstance(node, ast.CaseExpr):
        return [("WHEN clauses of one CASE", node.args)]
    return []
