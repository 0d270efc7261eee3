"""dp_budget(), dp_total_budgets(), dp_ledger() and the resets: the proxy's own functions, answered
from the ledger in place of their calls (admins only, but an analyst's own dp_budget() and the
total budgets every analyst's answers charge)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pglast import ast
from pglast.visitors import Visitor

from dp_core.classify import LOCAL_FUNCTIONS
from dp_core.errors import FeatureNotSupported, InternalError, InvalidParameterValue
from dp_core.explain import fmt
from dp_core.result import result_sql
from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import const_number, const_string, walk_nodes
from dp_core.table_tuning import TableTuning
from server.ledger import BUDGET_COLUMNS, LEDGER_COLUMNS, Ledger, require_admin

if TYPE_CHECKING:
    from server.dp_query.table_tuning import TableTuner

PG = "pg_catalog"


class LocalFunctions(Visitor):
    """Replaces dp_budget() / dp_ledger(a) in FROM with VALUES, and calls in expressions with text."""

    def __init__(self, ledger: Ledger, user: str, is_admin: bool, dry_run: bool,
                 total_scopes: Sequence[str] = (), tuner: TableTuner | None = None) -> None:
        super().__init__()
        self.ledger = ledger
        self.tuner = tuner
        """Runs dp_tune_bounds() (`server.dp_query.table_tuning`)."""
        self.total_scopes = list(total_scopes)
        """The configured total budgets, which dp_total_budgets() shows."""
        self.user = user
        self.is_admin = is_admin
        self.dry_run = dry_run
        self.results: dict[int, Any] = {}

    async def resolve(self, stmt: Any) -> None:
        """Run the functions (admin checks first) and keep their results for the rewrite."""
        calls = [n for n in walk_nodes(stmt) if isinstance(n, ast.FuncCall)
                 and str(n.funcname[-1].sval).lower() in LOCAL_FUNCTIONS]
        for fc in calls:
            name = str(fc.funcname[-1].sval).lower()
            args = list(fc.args or ())
            target = "database" if name == "dp_reset_total_budget" else self.user
            if name in TUNING_FUNCTIONS:
                self.results[id(fc)] = await self._tuning(name, args)
                continue
            if name == "dp_total_budgets":
                if args:
                    raise FeatureNotSupported("dp_total_budgets() takes no argument")
                self.results[id(fc)] = [b.row() for b in await self.ledger.totals(
                    self.total_scopes)] if self.total_scopes else []
                continue
            if (name != "dp_budget" and name != "dp_reset_total_budget") or args:
                arg = args[0] if len(args) == 1 else None
                if isinstance(arg, ast.TypeCast):  # a typed parameter, bound
                    arg = arg.arg
                if self.dry_run and isinstance(arg, ast.ParamRef):
                    arg = ast.A_Const(val=ast.String(sval=self.user))  # (for the columns)
                if const_string(arg) is None:
                    what = "total budget's scope" if name == "dp_reset_total_budget" \
                        else "analyst name"
                    raise FeatureNotSupported(f"{name}() takes one {what}: a string "
                                              "literal or a parameter")
                target = str(const_string(arg))
            if name == "dp_budget":
                if target != self.user:
                    require_admin(self.is_admin, "dp_budget(analyst)")
                self.results[id(fc)] = [(await self.ledger.budget(target)).row()]
            elif name == "dp_ledger":
                require_admin(self.is_admin, name)
                self.results[id(fc)] = await self.ledger.entries(target)
            else:
                require_admin(self.is_admin, name)
                if self.dry_run:
                    self.results[id(fc)] = [("",)]
                elif name == "dp_reset_total_budget":
                    b = await self.ledger.reset_total(target, self.user)
                    self.results[id(fc)] = [(f"total budget of {target} reset: epsilon "
                                             f"{fmt(float(b.epsilon_total))}, delta "
                                             f"{fmt(float(b.delta_total))} available",)]
                else:
                    b = await self.ledger.reset(target, self.user)
                    self.results[id(fc)] = [(f"budget of {b.analyst} reset: epsilon "
                                             f"{fmt(float(b.epsilon_total))}, delta "
                                             f"{fmt(float(b.delta_total))} available",)]

    async def _tuning(self, name: str, args: list[Any]) -> list[tuple[Any, ...]]:
        """dp_tune_bounds(table [, epsilon [, groups]]) and dp_drop_tuned_bounds(table),
        admins only; dp_tuned_bounds(), anyone's."""
        if self.dry_run and any(isinstance(a, ast.ParamRef) for a in args):
            return [] if name != "dp_drop_tuned_bounds" else [("",)]  # (for the columns)
        values = [_literal(a) for a in args]
        if name == "dp_tuned_bounds":
            if values:
                raise FeatureNotSupported("dp_tuned_bounds() takes no argument")
            require_admin(self.is_admin, name)
            return [_tuning_row(t) for _, t in sorted((await self.ledger.tunings()).items())]
        require_admin(self.is_admin, name)
        most = 3 if name == "dp_tune_bounds" else 1
        if not 1 <= len(values) <= most or not isinstance(values[0], str) \
                or any(v is None for v in values):
            raise FeatureNotSupported(
                "dp_tune_bounds() takes a protected table's name, then maybe epsilon and "
                "groups (numbers)" if most == 3 else f"{name}() takes a protected table's name")
        numbers = [_number(v, what) for v, what in zip(values[1:], ("epsilon", "groups"),
                                                       strict=False)]
        if self.tuner is None:
            raise InternalError()
        _, table = self.tuner.table(str(values[0]))
        if self.dry_run:
            return [] if most == 3 else [("",)]
        if name == "dp_drop_tuned_bounds":
            gone = await self.ledger.drop_tuning(table, self.user)
            return [(f"tuned bounds of {table} dropped" if gone
                     else f"{table} had no tuned bounds",)]
        groups = numbers[1] if len(numbers) > 1 else None
        if groups is not None and groups != int(groups):
            raise InvalidParameterValue("dp_tune_bounds: groups must be a whole number")
        tuning = await self.tuner.tune(self.user, table, numbers[0] if numbers else None,
                                       None if groups is None else int(groups))
        return [_tuning_row(tuning)]

    def visit_RangeFunction(self, ancestors: Any, node: Any) -> Any:
        fc = node.functions[0][0] if node.functions else None
        if not isinstance(fc, ast.FuncCall) or id(fc) not in self.results:
            return None
        name = str(fc.funcname[-1].sval).lower()
        budgets = name in ("dp_budget", "dp_total_budgets")
        cols, types = ((BUDGET_COLUMNS, ["text"] + ["numeric"] * 6) if budgets else
                       (TUNING_COLUMNS, TUNING_TYPES) if name in ("dp_tune_bounds",
                                                                  "dp_tuned_bounds") else
                       (LEDGER_COLUMNS, ["int8", "timestamptz", "text", "numeric", "numeric", "text",
                                         "text", "text", "text", "text"]) if name == "dp_ledger" else
                       ([name], ["text"]))
        rows = self.results[id(fc)]
        alias = str(node.alias.aliasname) if node.alias else name
        inner_sql = result_sql(cols, [(PG, t) for t in types], [tuple(_plain(v) for v in r) for r in rows])
        sub = parse_sql(inner_sql)[0].stmt
        return ast.RangeSubselect(subquery=sub, alias=ast.Alias(aliasname=alias))

    def visit_FuncCall(self, ancestors: Any, node: Any) -> Any:
        if id(node) not in self.results:
            return None
        rows = self.results[id(node)]
        if not rows:
            return ast.A_Const(isnull=True)
        text = rows[0][0] if len(rows[0]) == 1 else "(" + ",".join(str(_plain(v)) for v in rows[0]) + ")"
        return ast.A_Const(val=ast.String(sval=str(text)))


TUNING_FUNCTIONS = frozenset({"dp_tune_bounds", "dp_tuned_bounds", "dp_drop_tuned_bounds"})
TUNING_COLUMNS = ["table_name", "max_rows_contributed", "mean_rows_contributed",
                  "sum_rows_contributed", "clips", "rows_cut", "users_cut", "groups", "epsilon",
                  "ledger_id", "tuned_at"]
TUNING_TYPES = ["text", "int4", "int4", "int4", "text", "float8", "float8", "int4", "numeric",
                "int8", "text"]


def _tuning_row(t: TableTuning) -> tuple[Any, ...]:
    clips = ", ".join(f"{c} [{fmt(b.lower)}, {fmt(b.upper)}] (about "
                      f"{fmt(100 * t.clipped.get(c, 0.0))}% of its value beyond)"
                      for c, b in sorted(t.clips.items()))
    return (t.table, t.max_rows, t.mean_rows, t.sum_rows, clips, t.rows_cut, t.users_cut,
            t.groups, str(t.epsilon.numerator / t.epsilon.denominator), t.ledger_id,
            t.tuned_at)


def _literal(node: Any) -> str | float | None:
    """An argument's value: a string or number literal (a bound parameter is one), or None."""
    if isinstance(node, ast.TypeCast):
        node = node.arg
    text = const_string(node)
    return text if text is not None else const_number(node)


def _number(value: str | float | None, what: str) -> float:
    """A numeric argument (a parameter bound as text, too); 22023 otherwise."""
    try:
        x = float(value) if value is not None else math.nan
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise InvalidParameterValue(f"dp_tune_bounds: {what} must be a finite number")
    return x


def _plain(v: Any) -> str | int | float | None:
    if v is None or isinstance(v, (int, float, str)):
        return v
    if isinstance(v, Decimal):
        return str(v)
    return str(v)

