"""Totality: every expression over user rows made total (or refused), its work per row counted."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, LimitOption, SetOperation, SubLinkType

from dp_core.catalogue import (
    ARITHMETIC,
    CHECKED_CAST_TARGETS,
    DATE_UNITS,
    DATETIME_UNITS,
    LATER_FUNCTIONS,
    LITERAL_ARGUMENT_FUNCTIONS,
    LITERAL_CAST_TARGETS,
    MAX_DIGITS,
    NUMBER_TYPES,
    NUMERIC_ARG_FUNCTIONS,
    ROUNDING_UP,
    TOTAL_FUNCTIONS,
    TOTAL_OPERATORS,
    datetime_call,
    integer_literal,
    is_dp_aggregate,
    is_number_valued,
)
from dp_core.cost import Cost, Linear, RowWorkBudget, row_cost
from dp_core.errors import (
    SyntaxError_,
)
from dp_core.query import ArithmeticCheck, CastCheck, PublicItem, PublicSource, Relation, TypeMix
from dp_core.sqlnodes import (
    INTEGER_LIMITS,
    NUMERIC_ROW_CLAMP,
    as_integer,
    as_numeric,
    clamp_magnitude,
    const_number,
    const_string,
    func_name,
    node_sql,
    nullif_zero,
    refuse,
    walk_nodes,
    within_magnitude,
)
from dp_core.text_bounds import (
    GROWING_FUNCTIONS,
    ONE_ARGUMENT_FUNCTIONS,
    RECASED_FUNCTIONS,
    SEARCHING_FUNCTIONS,
    TEXT_TYPES,
    bounded_text,
    capped_bit_length,
    in_c,
    like_of_lowered,
)


@dataclass
class Findings:
    """What the analysis of one query collects in all its scopes, for checks needing Postgres."""

    casts: list[CastCheck] = field(default_factory=list)
    """Casts whose totality depends on their argument's type (`argument_probe_sql`)."""
    arithmetic: list[ArithmeticCheck] = field(default_factory=list)
    """Arithmetic operators of the analyst's text, whose types the proxy asks Postgres."""
    output_sizes: dict[Any, Linear] = field(default_factory=dict)
    """The largest value of each inner query's select list (by id of its node, and each WITH
    query's also by name), a bound in the protected row's bytes (`Totalizer.column_size`)."""
    mixes: list[TypeMix] = field(default_factory=list)
    """Values Postgres brings to one type, whose types the proxy asks Postgres (`TypeMix`)."""
    relations: list[Relation] = field(default_factory=list)
    """The unprotected tables the query reads by name, which the server checks the analysts
    may read (`AnalyzedQuery.relations`)."""
    shapes: dict[Any, tuple[frozenset[str], bool]] = field(default_factory=dict)
    """Each inner query over protected tables (by id of its node, and each WITH query also by
    name): the protected tables whose rows it carries, and whether it has one row per user."""
    row_names: set[str] = field(default_factory=set)
    """The names of FROM items in every scope: a bare column reference of one of them is a
    whole row (whose comparisons fail on some values), refused."""
    in_lists: list[ast.SelectStmt] = field(default_factory=list)
    """Those of IN (not EXISTS, which runs once): each protected row may be compared with
    every row of one (`dp_core.fanout`)."""
    sublinks: list[ast.SelectStmt] = field(default_factory=list)
    """Subqueries in IN and EXISTS, which the server prepares alone: they must not read the
    DP query's row (a correlated subquery runs once per row, over a whole public table)."""
    costs: list[tuple[Cost, str, Any]] = field(default_factory=list)
    """Each expression a row meets (its bound from `dp_core.cost`, where it is, the node)."""
    work: Linear = field(default_factory=Linear)
    """The sum of their work."""
    budget: RowWorkBudget = field(default_factory=RowWorkBudget)
    public_sources: dict[Any, PublicSource] = field(default_factory=dict)
    """What each public subquery (by id of its node) and public WITH query (by name) reads
    (`dp_core.fanout`)."""
    cte_columns: dict[str, PublicSource] = field(default_factory=dict)
    """Protected WITH queries of one table: the columns they select as they are."""
    fanout: list[PublicItem] = field(default_factory=list)
    """The public FROM items of every scope with protected rows, tied as they are
    (`fanout.anchor`): their product bounds the public rows one protected row meets."""
    joins_capped: bool = False
    """Some scope joins two protected items row by row (`FromAnalysis.capped_joins`)."""
    schemas: Mapping[str, str | None] | None = None
    """Not a finding but what every scope reads: the schema each unqualified relation name
    means in the asking session's search_path (None: no such relation there); None: names
    as written, a protected table's in its configured schema."""
    """The most work per row the query's expressions may do together."""


class Totalizer:
    """Checks an expression over user rows and returns a total version of it."""

    def __init__(self, protected_names: frozenset[str], findings: Findings | None = None,
                 scope: ast.SelectStmt | None = None,
                 integer_types: Mapping[int, str] | None = None) -> None:
        self.protected_names = protected_names
        self.findings = Findings() if findings is None else findings  # (the scopes share it)
        self.casts = self.findings.casts
        self.arithmetic = self.findings.arithmetic
        self.relations = self.findings.relations
        self.integer_types: Mapping[int, str] = integer_types or {}
        """The integer type of the arithmetic operators that have one, by location."""
        self._in_arithmetic = 0
        """How many arithmetic operators the expression being totalised is inside."""
        self.scope = scope
        """The inner query whose FROM the expressions read (None: the DP query's own)."""
        self.from_items: tuple[Any, ...] = ()
        """The DP query's own FROM items, where this totaliser's scope is the DP query's."""
        self.semi_joins: Callable[[ast.SubLink], ast.SubLink] | None = None
        """Checks an IN or EXISTS subquery of the DP query's WHERE (`semi_join`); None: every
        subquery is refused."""

    def column_size(self) -> Linear:
        """The largest value a column of this scope's FROM can hold (a bound in the protected
        row's bytes): a table's, one pass over the row; a subquery's or WITH query's, the
        largest of its select list's values (`Findings.output_sizes`). The DP query's own
        FROM is `from_items` (set when the analysis has it)."""
        items = self.scope.fromClause if self.scope is not None else self.from_items
        return _widest_item(items or (), self.findings.output_sizes)

    def inner(self, scope: ast.SelectStmt) -> Totalizer:
        """The totaliser of an inner query's expressions (its casts are checked in its FROM)."""
        return Totalizer(self.protected_names, self.findings, scope, self.integer_types)

    def with_semi_joins(self, check: Callable[[ast.SubLink], ast.SubLink]) -> Totalizer:
        """This totaliser, with IN and EXISTS subqueries accepted where `check` accepts them."""
        other = Totalizer(self.protected_names, self.findings, self.scope, self.integer_types)
        other.from_items = self.from_items
        other.semi_joins = check
        return other

    def __call__(self, node: Any, context: str) -> Any:
        """A total copy of `node` (the original is left as the client wrote it); its work per
        row is noted (`Findings.costs`)."""
        # (the expression's text is printed only for a refusal: pglast's printer leaves the
        # nodes it printed too deep for deepcopy)
        cost = row_cost(node, self.column_size())
        found = self.findings
        if self.scope is not None and context not in _NOT_OUTPUTS:
            # (what this inner query's output columns can hold: its select list's values)
            key = id(self.scope)
            found.output_sizes[key] = found.output_sizes.get(key, Linear()).widest(cost.size)
        found.costs.append((cost, context, node))
        found.work = found.work + cost.work
        # far over the budget, refused before the total form is written (which copies some
        # arguments: nested, their copies multiply); else after its own rules had their say
        budget = found.budget
        _check_work(found, RowWorkBudget(budget.per_byte * 1000, budget.fixed * 1000), budget)
        total = self._total(copy.deepcopy(node), context)
        _check_work(found, budget)
        return total

    def _total(self, node: Any, ctx: str) -> Any:
        if node is None or isinstance(node, (ast.A_Const, ast.ColumnRef, ast.ParamRef)):
            if isinstance(node, ast.ColumnRef) and isinstance(node.fields[-1], ast.A_Star):
                raise refuse("* outside COUNT(*)", ctx)
            if isinstance(node, ast.ColumnRef) and len(node.fields) == 1 \
                    and str(node.fields[0].sval) in self.findings.row_names:
                raise refuse("whole-row references (name the columns)", node_sql(node))
            return node
        if isinstance(node, ast.BoolExpr):
            node.args = tuple(self._total(a, ctx) for a in node.args)
            return node
        if isinstance(node, (ast.NullTest, ast.BooleanTest)):
            node.arg = self._total(node.arg, ctx)
            return node
        if isinstance(node, ast.A_Expr):
            return self._a_expr(node, ctx)
        if isinstance(node, ast.CaseExpr):
            node.arg = self._total(node.arg, ctx)
            node.args = tuple(self._total(w, ctx) for w in node.args)
            node.defresult = self._total(node.defresult, ctx)
            self.mix("choose", [*(w.result for w in node.args), node.defresult], "CASE")
            if node.arg is not None:
                self.mix("compare", [node.arg, *(w.expr for w in node.args)], "CASE x WHEN", pairs=True)
            return node
        if isinstance(node, ast.CaseWhen):
            node.expr = self._total(node.expr, ctx)
            node.result = self._total(node.result, ctx)
            return node
        if isinstance(node, (ast.CoalesceExpr, ast.MinMaxExpr)):
            node.args = tuple(self._total(a, ctx) for a in node.args)
            self.mix("choose", list(node.args), "COALESCE" if isinstance(node, ast.CoalesceExpr)
                      else "GREATEST or LEAST")
            return node
        if isinstance(node, ast.TypeCast):
            return self._cast(node, ctx)
        if isinstance(node, ast.FuncCall):
            return self._function(node, ctx)
        if isinstance(node, ast.SubLink):
            if self.semi_joins is None:
                raise refuse("subqueries inside a DP query (but IN or EXISTS over "
                              "unprotected tables in WHERE)", ctx)
            link = self.semi_joins(node)
            link.testexpr = self._total(link.testexpr, ctx)
            if link.testexpr is not None and isinstance(link.subselect, ast.SelectStmt):
                # (the subquery's column, as a scalar subquery: prepared, never run; its
                # values are converted when it runs, which only a row reaching it makes happen)
                column = ast.SubLink(subLinkType=SubLinkType.EXPR_SUBLINK,
                                     subselect=copy.deepcopy(link.subselect))
                self.mix("compare", [link.testexpr, column], "IN, ANY or ALL (SELECT ...)",
                          constant=(_constant(link.testexpr), False))
            return link
        if isinstance(node, ast.SQLValueFunction):
            raise refuse("only immutable functions", node_sql(node))
        raise refuse(f"expression of type {type(node).__name__}", node_sql(node))

    def _a_expr(self, node: ast.A_Expr, ctx: str) -> Any:
        kind = node.kind
        op = str(node.name[-1].sval) if node.name else ""
        if node.name and len(node.name) > 1 and str(node.name[0].sval) != "pg_catalog":
            raise refuse("only built-in operators", node_sql(node))
        if kind == A_Expr_Kind.AEXPR_OP:
            if op in TOTAL_OPERATORS:
                node.lexpr, node.rexpr = self._total(node.lexpr, ctx), self._total(node.rexpr, ctx)
                self.mix("compare", [node.lexpr, node.rexpr], op)
                return node
            if op in ARITHMETIC:
                # exact numeric arithmetic cannot overflow on column values; x/0 is NULL
                location = node.location if isinstance(node.location, int) else -1
                if location >= 0:
                    self.arithmetic.append(ArithmeticCheck(copy.deepcopy(node), location,
                                                           self.scope))
                outermost = not self._in_arithmetic
                self._in_arithmetic += 1
                try:
                    left = None if node.lexpr is None else self._total(node.lexpr, ctx)
                    right = self._total(node.rexpr, ctx)
                finally:
                    self._in_arithmetic -= 1
                node.lexpr = None if left is None else clamp_magnitude(left)
                node.rexpr = nullif_zero(clamp_magnitude(right)) if op in ("/", "%") \
                    else clamp_magnitude(right)
                integer = self.integer_types.get(location)
                if integer is None:
                    return clamp_magnitude(node) if outermost else node
                # Postgres's integer semantics: a quotient truncated toward zero; the type
                # (and its range) only where the arithmetic ends, inner values being exact
                value = ast.FuncCall(funcname=(ast.String(sval="trunc"),), args=(node,)) \
                    if op == "/" else node
                return as_integer(value, integer) if outermost else value
            if op == "||":
                return self._concatenation(node, ctx)
            raise refuse(f"operator {op} (it can fail on some values)", node_sql(node))
        if kind in (A_Expr_Kind.AEXPR_IN, A_Expr_Kind.AEXPR_DISTINCT, A_Expr_Kind.AEXPR_NOT_DISTINCT,
                    A_Expr_Kind.AEXPR_BETWEEN, A_Expr_Kind.AEXPR_NOT_BETWEEN,
                    A_Expr_Kind.AEXPR_NULLIF):
            node.lexpr = self._total(node.lexpr, ctx)
            if isinstance(node.rexpr, (tuple, list)):
                node.rexpr = tuple(self._total(r, ctx) for r in node.rexpr)
            else:
                node.rexpr = self._total(node.rexpr, ctx)
            values = [node.lexpr, *(node.rexpr if isinstance(node.rexpr, tuple) else
                                    (node.rexpr,))]
            what = _MIXED_BY.get(kind, "IN")
            self.mix("compare", values, what)
            listed = [v for v in values[1:] if not isinstance(v, ast.ColumnRef)]
            if kind == A_Expr_Kind.AEXPR_IN and len(listed) > 1:
                # (Postgres makes them an array of one type, chosen with the tested value's,
                # which it compares with each: `x = ANY (ARRAY[...])`)
                self.mix("choose", [values[0], *listed], what,
                          constant=(None, *(_constant(v) for v in listed)))
            return node
        if kind in (A_Expr_Kind.AEXPR_LIKE, A_Expr_Kind.AEXPR_ILIKE):
            pattern = const_string(node.rexpr)
            if pattern is None:
                raise refuse("LIKE patterns must be constant strings", node_sql(node))
            trailing = len(pattern) - len(pattern.rstrip("\\"))
            if trailing % 2:
                raise SyntaxError_("LIKE pattern must not end with escape character")
            node.lexpr = self._total(node.lexpr, ctx)
            if kind == A_Expr_Kind.AEXPR_LIKE:
                node.rexpr = in_c(node.rexpr)
            if kind == A_Expr_Kind.AEXPR_ILIKE:  # (Postgres lower()s the value: its workspace)
                return like_of_lowered(self._text(node.lexpr, "ILIKE of a text", node_sql(node)),
                                       node.rexpr, str(node.name[-1].sval) == "!~~*")
            return node
        raise refuse("this operator kind (regular expressions, SIMILAR TO, ...)", node_sql(node))

    def _cast(self, node: ast.TypeCast, ctx: str) -> Any:
        target = str(node.typeName.names[-1].sval).lower()
        names = node.typeName.names
        builtin = (len(names) == 1 or str(names[0].sval) == "pg_catalog") \
            and not node.typeName.arrayBounds and not node.typeName.setof
        if isinstance(node.arg, ast.ParamRef) and builtin and target in LITERAL_CAST_TARGETS:
            # (a parameter not bound yet, describing a statement: `uid = $1::int8` as asyncpg
            # writes it; its value is bound as a typed literal, and its cast checked, when the
            # statement is executed)
            return node
        if isinstance(node.arg, ast.A_Const):
            # a literal converted when the pushdown is planned (a string by the type's input,
            # a number by an immutable cast): fails, if at all, before any row. Not a domain,
            # whose check runs on each row, nor a type whose conversion is not immutable
            literal_targets = LITERAL_CAST_TARGETS if isinstance(node.arg.val, ast.String) \
                else CHECKED_CAST_TARGETS | {"text", "varchar"}
            if not builtin or target not in literal_targets:
                raise refuse(f"casts of literals to {target}", node_sql(node))
            return node
        if builtin and target in ("text", "varchar"):
            node.arg = self._total(node.arg, ctx)
            self.casts.append(CastCheck(copy.deepcopy(node.arg), target, node_sql(node),
                                        self.scope, output=True))
            return node
        if builtin and target in INTEGER_LIMITS and is_number_valued(node.arg) \
                and not node.typeName.typmods and not node.typeName.arrayBounds:
            return self._guarded_integer_cast(node, target, ctx)
        if builtin and target in CHECKED_CAST_TARGETS \
                and not node.typeName.typmods and not node.typeName.arrayBounds:
            text = node_sql(node)
            node.arg = self._total(node.arg, ctx)
            self.casts.append(CastCheck(copy.deepcopy(node.arg), target, text, self.scope))
            return node
        raise refuse(f"casts of column values to {target} (they can fail on some values)",
                      node_sql(node))

    def mix(self, kind: str, operands: list[Any], text: str,
             constant: tuple[bool | None, ...] | None = None, pairs: bool = False) -> None:
        """Note values Postgres brings to one type (`TypeMix`): each literal shape once (an IN
        list of a thousand values is a few types; each operand is a column of the probe), no
        parameter (bound, the query is checked again). `pairs`: the first operand with each
        other one, read and copied once (CASE x WHEN: x per WHEN was quadratic)."""
        values: list[Any] = []
        flags: list[bool | None] = []
        shapes: set[tuple[str, ...] | None] = set()
        for j, v in enumerate(operands):
            if v is None or any(isinstance(n, ast.ParamRef) for n in walk_nodes(v)):
                if pairs and j == 0:
                    return  # (x not known: nothing to pair)
                continue
            shape = _literal_shape(v)
            if shape is not None and shape in shapes:
                continue
            shapes.add(shape)
            values.append(copy.deepcopy(v))
            flags.append(_constant(v) if constant is None else constant[j])
        for at in [(0, k) for k in range(1, len(values))] if pairs else [range(len(values))]:
            if len(at) > 1:
                mixed = tuple(values[k] for k in at), tuple(flags[k] for k in at)
                self.findings.mixes.append(TypeMix(*mixed, kind, text, self.scope))

    def using(self, join: ast.JoinExpr) -> None:
        """Note each USING column of `join`: Postgres compares its two sides' columns, and
        gives the join that column brought to one type (`TypeMix`); each read in its side."""
        sides = tuple(ast.SelectStmt(fromClause=(side,), op=SetOperation.SETOP_NONE,
                                     limitOption=LimitOption.LIMIT_OPTION_DEFAULT)
                      for side in (join.larg, join.rarg))
        for col in join.usingClause or ():
            ref = ast.ColumnRef(fields=(ast.String(sval=str(col.sval)),))
            self.findings.mixes.append(TypeMix((ref, copy.deepcopy(ref)), (False, False),
                                               "choose", f"USING ({col.sval})", scopes=sides))

    def number(self, value: ast.Node, rule: str, text: str) -> ast.Node:
        """`value` (totalised) as numeric, checked when the query is planned to be a number:
        a cast of text to numeric would parse each row's value, and fail on some."""
        checked = isinstance(value, ast.TypeCast) and \
            str(value.typeName.names[-1].sval).lower() in NUMBER_TYPES  # (checked as a cast)
        if const_number(value) is None and not checked:
            self.casts.append(CastCheck(copy.deepcopy(value), "numeric", text, self.scope,
                                        rule=rule, sources=NUMBER_TYPES))
        return as_numeric(value)

    def _text(self, node: ast.Node, rule: str, text: str) -> ast.Node:
        """`node` (totalised), which must be a text (checked when the query is planned, as
        `rule`), cut by `bounded_text`."""
        if not isinstance(node, ast.A_Const):
            self.casts.append(CastCheck(copy.deepcopy(node), "text", text, self.scope,
                                        rule=rule, sources=TEXT_TYPES))
        return bounded_text(node)

    def _concatenation(self, node: ast.A_Expr, ctx: str) -> ast.A_Expr:
        """`a || b` of text cannot fail (as concat() cannot), but `||` of arrays can: each
        operand that is not a literal or another `||` must be text, which Postgres reports
        when the query is planned (a CastCheck to text, accepted from text, varchar, bpchar)."""
        text = node_sql(node)
        for side in ("lexpr", "rexpr"):
            operand = getattr(node, side)
            total = self._total(operand, ctx)
            setattr(node, side, total)
            if operand is None or isinstance(operand, ast.A_Const) or (
                    isinstance(operand, ast.A_Expr) and operand.kind == A_Expr_Kind.AEXPR_OP
                    and operand.name and str(operand.name[-1].sval) == "||"):
                continue
            setattr(node, side, self._text(total, "operands of || must be text", text))
        self.mix("concatenate", [node.lexpr, node.rexpr], "||")  # (their collations merge)
        return node

    def _width_bucket(self, fc: ast.FuncCall, args: list[Any], ctx: str) -> ast.Node:
        """`width_bucket(x, low, high, n)` (a histogram's bins): it fails on NaN bounds or
        operand, infinite or equal bounds and n <= 0, so the bounds and n must be literals
        that cannot make it fail, and a NaN x gives NULL (`x::numeric = 'NaN'`: every number
        type casts to numeric, ±Infinity included, and Postgres's NaN equals NaN)."""
        low, high = (const_number(a) for a in args[1:3]) if len(args) == 4 else (None, None)
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) \
                or low == high or not integer_literal(args[3], 1, 2**31 - 2):
            raise refuse("width_bucket() but as width_bucket(x, low, high, n) with finite, "
                          "different literal bounds and a literal n >= 1", node_sql(fc))
        value = self._total(args[0], ctx)
        fc.args = (value, *args[1:])
        nan = ast.A_Expr(kind=A_Expr_Kind.AEXPR_OP, name=(ast.String(sval="="),),
                         lexpr=as_numeric(copy.deepcopy(value)),
                         rexpr=as_numeric(ast.A_Const(val=ast.String(sval="NaN"))))
        return ast.CaseExpr(args=(ast.CaseWhen(expr=nan, result=ast.A_Const(isnull=True)),),
                            defresult=fc)

    def _guarded_integer_cast(self, node: ast.TypeCast, target: str, ctx: str) -> ast.Node:
        """`(duration / 60)::int`: a number cast to an integer type, made total. The argument
        is arithmetic or a numeric function (`is_number_valued`), numeric once totalised, and
        its cast rounds as round(numeric) does and fails out of range, on NaN and ±Infinity:
        so the rounded value is cast where it is in range, else NULL (`as_integer`; NaN
        sorts above every number)."""
        rounded = ast.FuncCall(funcname=(ast.String(sval="round"),),
                               args=(self._total(node.arg, ctx),))
        return as_integer(rounded, target)

    def _function(self, fc: ast.FuncCall, ctx: str) -> Any:
        name = func_name(fc)
        if fc.over is not None:
            raise refuse("window functions", node_sql(fc))
        if is_dp_aggregate(name) or name in LATER_FUNCTIONS:
            raise refuse("aggregates inside expressions or in WHERE", node_sql(fc))
        if len(fc.funcname) > 1 and str(fc.funcname[0].sval) != "pg_catalog":
            raise refuse("only built-in functions", node_sql(fc))
        if name not in TOTAL_FUNCTIONS and name not in LITERAL_ARGUMENT_FUNCTIONS \
                and name != "width_bucket":
            raise refuse(f"function {name}() (only immutable built-ins that cannot fail are "
                          f"allowed: {', '.join(sorted(TOTAL_FUNCTIONS))}, and "
                          f"{', '.join(sorted(LITERAL_ARGUMENT_FUNCTIONS))} with literal "
                          "arguments after the first)", node_sql(fc))
        if fc.agg_star or fc.agg_distinct or fc.agg_order or fc.agg_filter or fc.func_variadic:
            raise refuse("aggregate syntax on a plain function", node_sql(fc))
        args = list(fc.args or ())
        if name in ONE_ARGUMENT_FUNCTIONS and len(args) != 1:
            raise refuse(f"{name}() but as {name}(x): {ONE_ARGUMENT_FUNCTIONS[name]}",
                         node_sql(fc))
        if name == "width_bucket":
            return self._width_bucket(fc, args, ctx)
        if name in LITERAL_ARGUMENT_FUNCTIONS:
            check, shape = LITERAL_ARGUMENT_FUNCTIONS[name]
            if not check(args[1:]):
                raise refuse(f"{name}() but as {name}{shape}: literal arguments after the "
                              "value, which cannot make it fail", node_sql(fc))
            args[:1] = [self._total(a, ctx) for a in args[:1]]
            if name in SEARCHING_FUNCTIONS:
                args[1] = in_c(args[1])
            if name in GROWING_FUNCTIONS:
                args[:1] = [self._text(a, f"{name}() of a text", node_sql(fc)) for a in args[:1]]
        elif name in ("date_trunc", "date_part", "extract"):
            unit = const_string(args[0]) if args else None
            if unit is None or unit.lower() not in DATE_UNITS:
                raise refuse(f"{name}() needs a constant, valid unit", node_sql(fc))
            if len(args) != 2:
                raise refuse(f"{name}() but as {name}('unit', x)", node_sql(fc))
            args[1:] = [self._total(a, ctx) for a in args[1:]]
            unit = unit.lower()
            types = frozenset(t for (f, t), units in DATETIME_UNITS.items()
                              if f == name and unit in units)
            shown = ", ".join(sorted(types)) or "no type"
            self.casts.append(CastCheck(
                copy.deepcopy(args[1]), "", node_sql(fc), self.scope, sources=types,
                rule=f"{name}() with the unit {unit} takes {shown} (it fails on some values "
                     "of other types)"))
            fc.args = tuple(args)
            return datetime_call(fc, args[1])
        elif name in NUMERIC_ARG_FUNCTIONS:
            if name in ("round", "trunc") and len(args) == 2 and not integer_literal(
                    args[1], -MAX_DIGITS, MAX_DIGITS):
                raise refuse(f"{name}() needs a constant number of digits from {-MAX_DIGITS} "
                              f"to {MAX_DIGITS}", node_sql(fc))
            args[0] = self.number(self._total(args[0], ctx), f"{name}() of a number", node_sql(fc))
            if name in ROUNDING_UP:
                # (ceil(x) of a numeric x of 131072 nines and a half overflows numeric: one
                # user's value made the query fail, after the charge; red team, session 32)
                args[0] = within_magnitude(args[0], NUMERIC_ROW_CLAMP)
        else:
            args = [self._total(a, ctx) for a in args]
            if name == "bit_length" and len(args) == 1 and not isinstance(args[0], ast.A_Const):
                self.casts.append(CastCheck(copy.deepcopy(args[0]), "text", node_sql(fc),
                                            self.scope, rule="bit_length() of a text",
                                            sources=TEXT_TYPES))
                return capped_bit_length(args[0])
            if name in RECASED_FUNCTIONS and len(args) == 1:
                # (lower() and upper() of a range, its bounds, are refused with the rest)
                args = [self._text(args[0], f"{name}() of a text", node_sql(fc))]
            elif name == "concat":
                # (concat(x) is x's text, whatever its type: then cut; printed once, not n times)
                text = node_sql(fc)
                self.casts.extend(CastCheck(copy.deepcopy(a), "text", text, self.scope, output=True)
                                  for a in args if not isinstance(a, ast.A_Const))
                args = [a if isinstance(a, ast.A_Const) else bounded_text(ast.FuncCall(
                    funcname=(ast.String(sval="pg_catalog"), ast.String(sval="concat")),
                    args=(a,))) for a in args]
                self.mix("concatenate", list(args), "concat()")
        fc.args = tuple(args)
        return fc


_MIXED_BY = {A_Expr_Kind.AEXPR_DISTINCT: "IS DISTINCT FROM",
             A_Expr_Kind.AEXPR_NOT_DISTINCT: "IS NOT DISTINCT FROM",
             A_Expr_Kind.AEXPR_BETWEEN: "BETWEEN", A_Expr_Kind.AEXPR_NOT_BETWEEN: "BETWEEN",
             A_Expr_Kind.AEXPR_NULLIF: "NULLIF"}


_NOT_OUTPUTS = frozenset({"WHERE", "JOIN condition", "GROUP BY", "PARTITION BY",
                          "window ORDER BY"})
"""Contexts of an inner query whose values are not among its output columns."""


def _widest_item(items: Any, sizes: Mapping[Any, Linear]) -> Linear:
    """The largest column of FROM items: a subquery's or WITH query's (by `sizes`), else a
    table's (one pass over the row)."""
    out = Linear()
    for item in items:
        if isinstance(item, ast.JoinExpr):
            out = out.widest(_widest_item((item.larg, item.rarg), sizes))
        elif isinstance(item, ast.RangeSubselect):
            out = out.widest(sizes.get(id(item.subquery), _ROW_SIZE))
        elif isinstance(item, ast.RangeVar) and item.schemaname is None \
                and str(item.relname) in sizes:
            out = out.widest(sizes[str(item.relname)])
        else:
            out = out.widest(_ROW_SIZE)
    return out


_ROW_SIZE = Linear(1.0, 0.0)
"""A table's column: at most the row's bytes."""

_FOLDED_FUNCTIONS = frozenset({"round", "trunc", "floor", "ceil", "ceiling", "abs", "sign",
                               "numeric_larger", "numeric_smaller"})
"""Functions immutable for every type they take (numbers): of constants, Postgres computes
them when it plans the statement (arithmetic's total form calls round())."""


def _literal_shape(node: Any) -> tuple[str, ...] | None:
    """What decides a literal's type (its kind; an integer's or a decimal's; a cast's target),
    or None for anything else."""
    if isinstance(node, ast.TypeCast) and isinstance(node.arg, ast.A_Const):
        return ("cast", node_sql(node.typeName))
    if not isinstance(node, ast.A_Const):
        return None
    if node.isnull or node.val is None:
        return ("null",)
    if isinstance(node.val, ast.Float):  # (digits alone: bigint or numeric by magnitude)
        text = str(node.val.fval)
        whole = text.lstrip("-").isdigit() and -2**63 <= int(text) < 2**63
        return ("float", "int8" if whole else "numeric")
    return (type(node.val).__name__,)


def _constant(node: Any) -> bool:
    """Literals and bound parameters, cast or not, and arithmetic of them: what Postgres
    folds into one value when it plans the pushdown (its operators and functions on numbers
    are immutable). Not another function's call (extract() of a timestamptz is only stable:
    evaluated on each row that reaches it), a column or a subquery."""
    return not any(isinstance(n, (ast.ColumnRef, ast.SubLink, ast.SQLValueFunction))
                   or (isinstance(n, ast.FuncCall) and func_name(n) not in _FOLDED_FUNCTIONS)
                   for n in walk_nodes(node))


def _check_work(found: Findings, budget: RowWorkBudget,
                named: RowWorkBudget | None = None) -> None:
    """Refuse a query whose expressions may do more work on one row than `budget` (DESIGN
    §3.11: the time a query takes must not be a lever on one user's rows), naming the
    costliest expression."""
    total = found.work
    unbounded = not (math.isfinite(total.fixed) and math.isfinite(total.per_byte))
    if total.fits(budget.linear) or (named is not None and unbounded):
        return  # (an unbounded cost is a non-literal argument: the rules refuse it by name)
    _, where, node = max(found.costs, key=lambda c: (c[0].work.per_byte, c[0].work.fixed))
    budget = named or budget  # (the budget the message names)
    raise refuse(
        f"expressions whose work on one row may exceed {budget.per_byte:g} passes over its "
        f"values plus {budget.fixed:g} bytes (here {total.per_byte:g} passes plus "
        f"{total.fixed:g} bytes; the costliest is {where}: {node_sql(node)})")
