"""Relative dates in a DP query (`now() - interval '30 days'`), fixed once when it is planned.

BI tools filter on the time relative to now: `WHERE started_at > now() - interval '30 days'`,
`current_date - 7`, `date_trunc('month', now())`. Inside a DP query such an expression would
run in the pushdown, where `now()` is not immutable (and the operators on dates are not in
the catalogue of total expressions). Each constant expression that reads the clock is
evaluated once instead, when the query is planned, by Postgres in the session's TimeZone
(`clock_sql`, run by the server), and replaced by a literal of its value and type
(`fix_clock`): the pushdown reads a constant, deterministic and total, and whether it fails
depends on the text alone (an interval that does not parse fails at planning, before any
charge). Only built-in constants, casts, operators and a few date functions are folded;
`clock_timestamp()` and the session's identity (`current_user`) are not, and stay refused.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, SQLValueFunctionOp
from pglast.stream import RawStream
from pglast.visitors import Skip, Visitor

from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import walk_nodes

CLOCK_FUNCTIONS = frozenset({"now", "transaction_timestamp", "statement_timestamp"})
"""Functions of the time the statement runs (Postgres's `now()` family): the planning time."""
CLOCK_VALUES = frozenset({
    SQLValueFunctionOp.SVFOP_CURRENT_DATE, SQLValueFunctionOp.SVFOP_CURRENT_TIME,
    SQLValueFunctionOp.SVFOP_CURRENT_TIME_N, SQLValueFunctionOp.SVFOP_CURRENT_TIMESTAMP,
    SQLValueFunctionOp.SVFOP_CURRENT_TIMESTAMP_N, SQLValueFunctionOp.SVFOP_LOCALTIME,
    SQLValueFunctionOp.SVFOP_LOCALTIME_N, SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP,
    SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP_N})
"""`current_date`, `current_timestamp`, `localtimestamp`, ... (not `current_user` and the
other values of the session's identity)."""
DATE_FUNCTIONS = frozenset({
    "date_trunc", "date_part", "extract", "date_bin", "make_interval", "make_date",
    "make_timestamp", "make_timestamptz", "justify_days", "justify_hours", "justify_interval",
    "timezone", "isfinite"})
"""Built-in functions a relative date may be computed with (their constant arguments
evaluated with it, when the query is planned)."""
OPERATORS = frozenset({"+", "-", "*", "/"})
CAST_TARGETS = frozenset({
    "date", "time", "timetz", "timestamp", "timestamptz", "interval", "int2", "int4", "int8",
    "numeric", "float4", "float8", "text", "varchar", "bpchar", "bool"})
"""The types a relative date may be cast to on its way (dates, times, numbers, text)."""

ClockValue = tuple[str | None, str, str]
"""A folded expression's value as Postgres prints it (None: NULL), and its type (schema, name)."""


def _builtin(names: Any) -> bool:
    return bool(names) and (len(names) == 1 or (len(names) == 2
                                                 and str(names[0].sval) == "pg_catalog"))


def _name(node: Any) -> str:
    """A function's or operator's own name (without its schema), lowercased."""
    names = node.funcname if isinstance(node, ast.FuncCall) else node.name
    return str(names[-1].sval).lower() if names else ""


def _constant(node: Any) -> bool:
    """`node` is a constant that Postgres may compute once: literals, built-in casts, the
    four arithmetic operators, clock values and the date functions."""
    if isinstance(node, ast.A_Const):
        return True
    if isinstance(node, ast.TypeCast):
        t: Any = node.typeName
        return (_builtin(t.names) and str(t.names[-1].sval).lower() in CAST_TARGETS
                and not t.setof and not t.pct_type and not t.arrayBounds
                and _constant(node.arg))
    if isinstance(node, ast.NamedArgExpr):  # make_interval(days => 30)
        return _constant(node.arg)
    if isinstance(node, ast.SQLValueFunction):
        return node.op in CLOCK_VALUES
    if isinstance(node, ast.FuncCall):
        return (_builtin(node.funcname) and _name(node) in CLOCK_FUNCTIONS | DATE_FUNCTIONS
                and not (node.agg_order or node.agg_filter or node.over or node.agg_star
                         or node.agg_distinct or node.func_variadic or node.agg_within_group)
                and all(_constant(a) for a in node.args or ()))
    if isinstance(node, ast.A_Expr):
        return (node.kind == A_Expr_Kind.AEXPR_OP and _builtin(node.name)
                and _name(node) in OPERATORS
                and (node.lexpr is None or _constant(node.lexpr)) and _constant(node.rexpr))
    return False


CLOCK_WORDS = ("now", "today", "tomorrow", "yesterday")
"""Date and time input that reads the clock: `'now'::timestamptz`, `date 'today'`,
`'tomorrow 09:00'::timestamp` (Postgres reads them, in any case, when the literal is cast)."""
_TIME_TYPES = frozenset({"date", "time", "timetz", "timestamp", "timestamptz"})


def _clock_literal(node: Any) -> str | None:
    """Of a cast of a string to a date or time type that reads the clock, the string
    (stripped, lowercased); else None."""
    if not (isinstance(node, ast.TypeCast) and isinstance(node.arg, ast.A_Const)
            and isinstance(node.arg.val, ast.String)):
        return None
    t: Any = node.typeName
    if not t.names or str(t.names[-1].sval).lower() not in _TIME_TYPES:
        return None
    text = str(node.arg.val.sval).strip().lower()
    return text if any(w in text for w in CLOCK_WORDS) else None


def _reads_clock(node: Any) -> bool:
    return any((isinstance(n, ast.SQLValueFunction) and n.op in CLOCK_VALUES)
               or (isinstance(n, ast.FuncCall) and _name(n) in CLOCK_FUNCTIONS)
               or _clock_literal(n) is not None
               for n in walk_nodes(node))


class _Clock(Visitor):
    """Finds (and with `literals`, replaces) the largest constant expressions that read the
    clock, in the visitor's order (breadth first: the same for the same text)."""

    def __init__(self, literals: Sequence[ast.Node] | None = None) -> None:
        super().__init__()
        self.found: list[Any] = []
        self.literals = literals

    def visit(self, ancestors: Any, node: Any) -> Any:
        if not (isinstance(node, (ast.SQLValueFunction, ast.FuncCall, ast.A_Expr, ast.TypeCast))
                and _constant(node) and _reads_clock(node)):
            return None
        self.found.append(node)
        if self.literals is None:
            return Skip
        return copy.deepcopy(self.literals[len(self.found) - 1])


def clock_expressions(stmt: ast.Node) -> list[Any]:
    """The constant expressions of `stmt` that read the clock, outermost ones only."""
    finder = _Clock()
    finder(stmt)
    return finder.found


def _qualified(node: Any) -> Any:
    """A copy of `node` whose functions, operators and types are named in pg_catalog (it is
    evaluated on a connection whose search_path is not the session's)."""
    out = copy.deepcopy(node)
    for n in walk_nodes(out):
        if isinstance(n, ast.FuncCall):
            _in_catalog(n, "funcname")
        elif isinstance(n, ast.A_Expr):
            _in_catalog(n, "name")
        elif isinstance(n, ast.TypeCast):
            _in_catalog(n.typeName, "names")
    return out


def _in_catalog(holder: Any, field: str) -> None:
    """`holder.field`, a name without a schema, named in pg_catalog."""
    names = getattr(holder, field)
    if names is not None and len(names) == 1:
        setattr(holder, field, (ast.String(sval="pg_catalog"), *names))


_LOCAL_ORIGIN = "CAST('2000-01-01' AS pg_catalog.timestamp)"


def _quantum_forms(seconds: int) -> dict[Any, str]:
    """Each clock value as read at the start of its quantum of `seconds` of the session's
    local time (quanta of a day start at local midnight): by the function's name or the
    SQL value's kind, the expression that replaces it, of its type."""
    local = (f"pg_catalog.date_bin(pg_catalog.make_interval(secs => {int(seconds)}), "
             f"CAST(pg_catalog.now() AS pg_catalog.timestamp), {_LOCAL_ORIGIN})")
    # the instant: now less the local time since the quantum's start (never later than now,
    # also where the local start is ambiguous or missing, at a daylight saving change)
    zoned = (f"(pg_catalog.now() OPERATOR(pg_catalog.-) (CAST(pg_catalog.now() AS "
             f"pg_catalog.timestamp) OPERATOR(pg_catalog.-) {local}))")
    op = SQLValueFunctionOp
    return {**{name: zoned for name in CLOCK_FUNCTIONS},
            op.SVFOP_CURRENT_TIMESTAMP: zoned, op.SVFOP_CURRENT_TIMESTAMP_N: zoned,
            op.SVFOP_LOCALTIMESTAMP: local, op.SVFOP_LOCALTIMESTAMP_N: local,
            op.SVFOP_CURRENT_DATE: f"CAST({local} AS pg_catalog.date)",
            op.SVFOP_CURRENT_TIME: f"CAST({zoned} AS pg_catalog.timetz)",
            op.SVFOP_CURRENT_TIME_N: f"CAST({zoned} AS pg_catalog.timetz)",
            op.SVFOP_LOCALTIME: f"CAST({local} AS pg_catalog.time)",
            op.SVFOP_LOCALTIME_N: f"CAST({local} AS pg_catalog.time)"}


def _expression(sql: str) -> Any:
    stmt: Any = parse_sql(f"SELECT {sql}")[0].stmt
    return stmt.targetList[0].val


class _Quantised(Visitor):
    """Replaces each clock value by its form read at the start of its quantum."""

    def __init__(self, seconds: int) -> None:
        super().__init__()
        self.forms = {kind: _expression(sql) for kind, sql in _quantum_forms(seconds).items()}

    def visit(self, ancestors: Any, node: Any) -> Any:
        if _clock_literal(node) == "now":  # ('today' and its kin: read exactly, by the day)
            cast = copy.deepcopy(node)
            cast.arg = ast.TypeCast(arg=copy.deepcopy(self.forms[SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP]),
                                    typeName=ast.TypeName(names=(ast.String(sval="pg_catalog"),
                                                                 ast.String(sval="text"))))
            return cast
        if isinstance(node, ast.SQLValueFunction) and node.op in self.forms:
            return copy.deepcopy(self.forms[node.op])
        if isinstance(node, ast.FuncCall) and _name(node) in CLOCK_FUNCTIONS:
            return copy.deepcopy(self.forms[_name(node)])
        return None


def clock_sql(exprs: Sequence[Any], granularity: int = 0) -> str:
    """One statement that gives each expression's value as text (v{i}) and its type's oid
    (t{i}): run once, in a transaction whose TimeZone is the session's and whose output
    styles are Postgres's defaults (ISO dates, `postgres` intervals), so that the text reads
    back as the same value under any settings. With `granularity` (seconds; 0: none), the
    clock is read at the start of its quantum of the session's local time, so that a
    question asked again within one quantum is the same question (`now` is its time)."""
    items = []
    if granularity:
        exprs = [copy.deepcopy(e) for e in exprs]
        holder: Any = ast.SelectStmt(targetList=tuple(ast.ResTarget(val=e) for e in exprs))
        _Quantised(granularity)(holder)
        exprs = [t.val for t in holder.targetList]
        now = _quantum_forms(granularity)["now"]
        items.append(f"CAST(({now}) AS pg_catalog.text) AS now")
    for i, e in enumerate(exprs):
        text = str(RawStream()(_qualified(e)))
        items.append(f"CAST(({text}) AS pg_catalog.text) AS v{i}, "
                     f"CAST(pg_catalog.pg_typeof({text}) AS pg_catalog.oid) AS t{i}")
    return "SELECT " + ", ".join(items)


def _literal(value: ClockValue) -> ast.Node:
    """A folded expression's value, as a literal of its type."""
    text, type_schema, type_name = value
    arg = ast.A_Const(isnull=True) if text is None else ast.A_Const(val=ast.String(sval=text))
    return ast.TypeCast(arg=arg, typeName=ast.TypeName(
        names=(ast.String(sval=type_schema), ast.String(sval=type_name))))


def fix_clock(stmt: ast.Node, values: Sequence[ClockValue]) -> None:
    """Replace, in place, the expressions `clock_expressions` finds in `stmt` (a parse of the
    same text) by literals of `values`, one for each, in the same order."""
    if values:
        _Clock([_literal(v) for v in values])(stmt)
