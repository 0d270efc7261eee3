"""Analysis of a DP query: parse it, apply the rules, and assemble its `AnalyzedQuery`.

Input: the statement text with its DP clause blanked out, the policy, and the
session's DP settings. Output: an `AnalyzedQuery` (dp_core.query) holding pglast AST
pieces that the rewriter assembles into the pushdown. The rules live in their own modules:
which FROM items and inner queries may read protected rows (dp_core.ownership), every
expression over user rows made total so that whether the query fails never depends on one
user's data, paper §5.2 (dp_core.totality, over the catalogue of dp_core.catalogue),
which calls are DP aggregates with which bounds (dp_core.aggregates), and what the names in
HAVING and ORDER BY read, as Postgres reads them (dp_core.names). Everything outside the rules
is refused with 0A000 naming the rule. A query around a DP query (a WITH query or subquery
that is one, aggregated, filtered, sorted: what BI tools send) is split off first
(`post_processed`): post-processing of the released rows, which the result query runs.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType, NullTestType
from pglast.parser import ParseError
from pglast.visitors import Visitor

from dp_core.aggregates import (
    aggregate_call,
    configured_domain,
    dp_aggregates_in,
    interval_call,
    is_uid,
    make_aggregate,
    no_nested_intervals,
)
from dp_core.cost import Linear, RowWorkBudget
from dp_core.errors import (
    SyntaxError_,
)
from dp_core.fanout import table_columns
from dp_core.limits import check_limits
from dp_core.names import InputColumns, Names, column_name
from dp_core.ownership import FromAnalysis, group_expressions, owned_subquery
from dp_core.public_reads import semi_join
from dp_core.query import (
    Aggregate,
    AnalyzedQuery,
    Key,
    OutputColumn,
    SelectItem,
    TablePolicy,
)
from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import (
    OWNED_CLAUSES,
    func_name,
    is_ref_to,
    node_sql,
    only_clauses,
    refuse,
    same_node,
    walk_nodes,
)
from dp_core.totality import Findings, Totalizer


class _ParamBinder(Visitor):
    def __init__(self, values: Mapping[int, ast.Node]) -> None:
        super().__init__()
        self.values = values

    def visit_ParamRef(self, ancestors: Any, node: ast.ParamRef) -> Any:
        value = self.values.get(node.number)
        if value is None:
            raise SyntaxError_(f"there is no parameter ${node.number}")
        return value


class _SchemaQualifiedColumns(Visitor):
    """`schema.table.column` → `table.column` where FROM has `schema.table` without an alias
    (the form Metabase writes): the same column, since a FROM list cannot hold two items of
    one name; the rules then see the table's uid and configured bounds."""

    def __init__(self, tables: frozenset[tuple[str, str]]) -> None:
        super().__init__()
        self.tables = tables

    def visit_ColumnRef(self, ancestors: Any, node: ast.ColumnRef) -> Any:
        fields = node.fields
        if len(fields) == 3 and isinstance(fields[0], ast.String) \
                and isinstance(fields[1], ast.String) \
                and (str(fields[0].sval), str(fields[1].sval)) in self.tables:
            return ast.ColumnRef(fields=fields[1:], location=node.location)
        return None


def _unaliased_tables(stmt: ast.Node) -> frozenset[tuple[str, str]]:
    return frozenset((str(n.schemaname), str(n.relname)) for n in walk_nodes(stmt)
                     if isinstance(n, ast.RangeVar) and n.schemaname and n.alias is None
                     and not n.catalogname)


def parse_select(stripped_sql: str, params: Mapping[int, ast.Node] | None = None) -> ast.SelectStmt:
    """Parse one SELECT (the DP clause already blanked), bind `$n` parameters as constants and
    write `schema.table.column` references as `table.column`."""
    try:
        stmts = parse_sql(stripped_sql)
    except ParseError as e:
        raise SyntaxError_(str(e)) from None
    if len(stmts) != 1:
        raise SyntaxError_("a DP query is exactly one statement")
    stmt = stmts[0].stmt
    if isinstance(stmt, (ast.ExplainStmt, ast.DeclareCursorStmt, ast.CopyStmt)) \
            and stmt.query is not None:
        stmt = stmt.query  # (a cursor is declared over the released answer, or it is copied)
    if not isinstance(stmt, ast.SelectStmt):
        raise refuse("only SELECT", type(stmt).__name__)
    check_limits(stmt)
    if params:
        _ParamBinder(params)(stmt)
    tables = _unaliased_tables(stmt)
    if tables:
        _SchemaQualifiedColumns(tables)(stmt)
    return stmt


def analyze(stmt: ast.SelectStmt, policy: Mapping[str, TablePolicy], plain_form: bool,
            privacy_unit: str | None = None,
            integer_types: Mapping[int, str] | None = None,
            row_work: RowWorkBudget | None = None,
            columns: InputColumns | None = None,
            schemas: Mapping[str, str | None] | None = None,
            dp_at: int | None = None) -> AnalyzedQuery:
    """Check `stmt` against the DP rules and split it into keys, aggregates and the rest.

    `privacy_unit`: BigQuery's OPTIONS(privacy_unit_column=...), which must name the uid
    column (the privacy unit is the configuration's, not the query's). `integer_types`: the
    integer type of arithmetic operators (by location), as Postgres reported them for a first
    analysis's `ArithmeticCheck`s. `columns`: Postgres's reading of a first analysis's
    `name_checks` (dp_core.names). `schemas`: the schema of each unqualified relation name in
    the asking session's search_path (`Findings.schemas`). `dp_at`: where the paper form's
    SELECT WITH ANONYMIZATION starts in the text (bytes): the query it belongs to is the DP
    query, never a query around one."""
    answered = post_processed(stmt, policy, _clause_owner(stmt, plain_form, dp_at))
    if answered is not None:
        dp, outer = answered
        return replace(analyze(dp, policy, plain_form, privacy_unit, integer_types,
                               row_work, columns, schemas, dp_at), outer=outer)
    if stmt.op is not None and stmt.op != 0 and stmt.larg is not None:
        raise refuse("set operations (UNION, INTERSECT, EXCEPT)")
    ctes: dict[str, str | None] = {}
    findings = Findings(budget=row_work or RowWorkBudget(), schemas=schemas)
    cte_nodes: tuple[Any, ...] = ()
    if stmt.withClause is not None:
        if stmt.withClause.recursive:
            raise refuse("recursive WITH")
        for cte in stmt.withClause.ctes:
            name = str(cte.ctename)
            if name.startswith("dp_"):
                raise refuse("names starting with dp_ are reserved", name)
            if cte.aliascolnames:
                raise refuse("column aliases on a WITH query", name)
            if not isinstance(cte.ctequery, ast.SelectStmt):
                raise refuse("data-modifying WITH", name)
            ctes[name] = owned_subquery(cte.ctequery, policy,
                                         Totalizer(frozenset(policy), findings, cte.ctequery,
                                                   integer_types), ctes)
            # (what its columns can hold, for the queries that read it by name)
            findings.output_sizes[name] = findings.output_sizes.get(id(cte.ctequery),
                                                                    Linear(1.0, 0.0))
            if ctes[name] is not None:
                findings.shapes[name] = findings.shapes[id(cte.ctequery)]
                by_table = table_columns(cte.ctequery)
                if by_table is not None:  # (its columns, for joins on them: `dp_core.fanout`)
                    findings.cte_columns[name] = by_table
            else:
                findings.public_sources[name] = findings.public_sources[id(cte.ctequery)]
        cte_nodes = tuple(stmt.withClause.ctes)
    distinct = stmt.distinctClause == (None,) and not stmt.groupClause and not any(
        dp_aggregates_in(t) for t in stmt.targetList or ())
    if distinct:
        # SELECT DISTINCT k (a BI tool's filter values): GROUP BY k, its keys released by
        # partition selection alone
        stmt = copy.copy(stmt)
        stmt.distinctClause = None
        stmt.groupClause = tuple(ast.A_Const(val=ast.Integer(ival=i + 1))
                                 for i in range(len(stmt.targetList or ())))
    if stmt.distinctClause:
        raise refuse("SELECT DISTINCT (distinct over users' rows)")
    if stmt.windowClause:
        raise refuse("window functions")
    if stmt.intoClause is not None or stmt.lockingClause:
        raise refuse("SELECT INTO or FOR UPDATE")
    if not stmt.fromClause:
        raise refuse("a DP query must read a protected table")
    only_clauses(stmt, (*OWNED_CLAUSES, "havingClause", "sortClause", "limitCount",
                         "limitOffset", "withClause"), "a DP query")
    totalize = Totalizer(frozenset(policy), findings, None, integer_types)
    totalize.from_items = tuple(stmt.fromClause)
    fa = FromAnalysis(policy, totalize, ctes)
    from_clause = tuple(fa.item(item) for item in stmt.fromClause)
    if not fa.tables:
        raise refuse("a DP query must read a protected table")
    if privacy_unit is not None and all(privacy_unit.lower() != t.uid_column.lower()
                                        for t in fa.tables):
        units = ", ".join(sorted({t.uid_column for t in fa.tables}))
        raise refuse(f"privacy_unit_column {privacy_unit} (the privacy unit is the configured uid "
                      f"column: {units})")
    fa.check_connected(stmt.whereClause)
    fa.check_multiplying()
    from_clause = fa.capped_joins(from_clause)
    uid = fa.owner()
    # rows whose owner is NULL (a NULL uid in the data, or the side an outer join adds) belong
    # to no user: dropped before anything is counted
    owned: ast.Node = ast.NullTest(arg=copy.deepcopy(uid), nulltesttype=NullTestType.IS_NOT_NULL)
    where = owned
    if stmt.whereClause is not None:
        semi = totalize.with_semi_joins(lambda link: semi_join(link, policy, ctes, totalize))
        where = ast.BoolExpr(boolop=BoolExprType.AND_EXPR,
                             args=(semi(stmt.whereClause, "WHERE"), owned))
    from_clause, where = fa.fence(from_clause, where)

    group_exprs = group_expressions(stmt)
    group_checks, inputs = _group_names(stmt, columns)
    """GROUP BY names Postgres must say the meaning of, and those that are input columns: a
    bare GROUP BY name is an input column where one has it, an output column's alias else."""

    def alias_of(g: Any, name: str) -> bool:
        return is_ref_to(g, name) and name not in inputs

    keys: list[Key] = []
    aggregates: list[Aggregate] = []
    outputs: list[OutputColumn] = []
    select: list[SelectItem] = []
    key_reads: list[list[Any]] = []
    """The GROUP BY keys each select-list expression of keys (or constant) reads."""
    targets: list[tuple[str, Any]] = []
    """The select list: (output name, expression as written)."""
    def release_hidden(calls: list[Any]) -> None:
        """Post-processing: each DP aggregate of an expression over them (in the select list,
        HAVING or ORDER BY) that no output answers yet is released hidden; the result query
        evaluates the expression over the released values."""
        for fc in calls:
            if not any(same_node(fc, o.source) for o in outputs):
                hidden = f"dp_hidden{len(outputs)}"
                aggregates.append(make_aggregate(fc, hidden, fa, policy, totalize))
                outputs.append(OutputColumn(hidden, aggregate=len(aggregates) - 1, source=fc))

    named = [(str(t.name), t.val) for t in stmt.targetList or ()
             if isinstance(t, ast.ResTarget) and t.name and t.val is not None]
    uses = Counter(name for name, _ in named)
    aliases = {name: val for name, val in named if aggregate_call(val, plain_form) is not None
               and uses[name] == 1}
    """Output names of DP aggregates, which DP_INTERVAL_LOW / HIGH may name (a name two
    select-list items have names neither)."""
    intervals: list[tuple[int, str, str, Any, Any]] = []
    """Interval columns: (select-list position, name, "low" or "high", the aggregate, the
    item)."""
    no_nested_intervals(stmt)
    for target in stmt.targetList or ():
        if not isinstance(target, ast.ResTarget) or target.val is None:
            raise refuse("this select-list item")
        val = target.val
        if isinstance(val, ast.ColumnRef) and isinstance(val.fields[-1], ast.A_Star):
            raise refuse("SELECT * (list the group keys and DP aggregates)")
        name = str(target.name) if target.name else _default_name(val)
        targets.append((name, val))
        bound = interval_call(val, aliases, plain_form)
        if bound is not None:  # released once the aggregates are known (below)
            intervals.append((len(select), name, *bound, val))
            select.append(SelectItem(name))
            continue
        agg = aggregate_call(val, plain_form)
        if agg is not None:
            aggregates.append(make_aggregate(agg, name, fa, policy, totalize))
            outputs.append(OutputColumn(name, aggregate=len(aggregates) - 1, source=val))
            select.append(SelectItem(name, column=len(outputs) - 1))
            continue
        inner = dp_aggregates_in(val)
        if inner:
            release_hidden(inner)
            parts = _key_parts(val, group_exprs, plain_form)
            if parts:  # (None: the result query refuses what it cannot read, before the charge)
                key_reads.append(parts)
            select.append(SelectItem(name, expr=val))
            continue
        if any(isinstance(n, ast.FuncCall) and n.over is not None for n in walk_nodes(val)):
            raise refuse("window functions but over DP aggregates (sum(count(*)) OVER ())",
                          node_sql(val))
        if not any(same_node(val, g) or alias_of(g, name) for g in group_exprs):
            parts = _key_parts(val, group_exprs, plain_form)
            if parts is None:
                raise refuse("every selected column must be a GROUP BY key or a DP aggregate "
                             "(or an expression of them)", node_sql(val))
            # a constant, or an expression of GROUP BY keys (upper(browser)): post-processing,
            # evaluated by the result query over the released keys
            key_reads.append(parts)
            select.append(SelectItem(name, expr=val))
            continue
        keys.append(Key(totalize(val, "GROUP BY key"), name,
                        domain=configured_domain(val, fa, policy)))
        outputs.append(OutputColumn(name, key=len(keys) - 1, source=val))
        select.append(SelectItem(name, column=len(outputs) - 1))
    for position, name, side, fc, item in intervals:
        release_hidden([fc])  # (its aggregate, where no output answers it yet)
        i = next(o.aggregate for o in outputs
                 if o.aggregate is not None and o.bound is None and same_node(fc, o.source))
        outputs.append(OutputColumn(name, aggregate=i, bound=side, source=item))
        select[position] = SelectItem(name, column=len(outputs) - 1)
    grouped_by, aliased = _grouped_by(group_exprs, outputs, inputs)
    names = Names(targets, grouped_by, columns, aliased)
    having = names.having(stmt.havingClause)
    order_by = names.order_by(stmt.sortClause or (), distinct)
    for expr in (having, *(s.node for s in order_by)):
        if expr is not None:  # (they filter and sort on noisy values too)
            release_hidden(dp_aggregates_in(expr))
    if names.reads:  # (grouped columns they read, released hidden if not selected)
        key_reads.append(names.reads)
    for parts in key_reads:
        for g in parts:  # each key the expression reads, released hidden if not selected
            if not any(o.key is not None and same_node(o.source, g) for o in outputs):
                keys.append(Key(totalize(g, "GROUP BY key"), f"dp_hidden{len(outputs)}",
                                domain=configured_domain(g, fa, policy)))
                outputs.append(OutputColumn(f"dp_hidden{len(outputs)}", key=len(keys) - 1,
                                            source=g))
    selected = [(o.source, o.name) for o in outputs if o.key is not None]
    for g in group_exprs:
        # (against the selected expressions as written: the keys are totalised, `x % 2`
        # became `x % NULLIF(2, 0)`, and would not match `GROUP BY x % 2` or `GROUP BY 1`)
        if not any(same_node(g, source) or alias_of(g, name) for source, name in selected):
            # a GROUP BY key that is not selected still partitions the result
            keys.append(Key(totalize(g, "GROUP BY key"), f"__key{len(keys)}",
                            domain=configured_domain(g, fa, policy)))
    if not aggregates and not keys:  # (keys alone: the groups partition selection releases)
        raise refuse("a DP query needs at least one DP aggregate, e.g. ANON_COUNT(*)")
    for k in keys:
        if is_uid(k.expr, fa):
            raise refuse("grouping by the uid: every group would hold one user, and partition "
                          "selection releases none (group by something coarser)", node_sql(k.expr))
    for clause, what in ((stmt.limitCount, "LIMIT"), (stmt.limitOffset, "OFFSET")):
        _constant_count(clause, what)
    return AnalyzedQuery(
        from_clause=from_clause, where=where, fence_refs=fa.fence_refs,
        ranges_after_joins=fa.fence_converted, uid=uid,
        tables=tuple(fa.tables), keys=tuple(keys),
        aggregates=tuple(aggregates), outputs=tuple(outputs), having=having,
        order_by=order_by, limit=stmt.limitCount, offset=stmt.limitOffset,
        plain_form=plain_form, ctes=cte_nodes, select=tuple(select),
        casts=tuple(findings.casts), arithmetic=tuple(findings.arithmetic),
        mixes=tuple(findings.mixes),
        relations=tuple(dict.fromkeys(findings.relations)),
        sublinks=tuple(findings.sublinks), joins_capped=findings.joins_capped,
        public_items=tuple(findings.fanout), in_lists=tuple(findings.in_lists),
        grouped_by=tuple(grouped_by),
        # (GROUP BY's names first: HAVING's and ORDER BY's are read against its grouping)
        name_checks=tuple(dict.fromkeys(group_checks or names.missing)),
    )


GROUP_NAME = ""
"""The first part of a GROUP BY name's check (`AnalyzedQuery.name_checks`): no column
reference has an empty part, so it is told apart from HAVING's and ORDER BY's names."""


def _group_names(stmt: ast.SelectStmt, columns: InputColumns | None
                 ) -> tuple[list[tuple[str, ...]], set[str]]:
    """The bare GROUP BY names that are also another select-list expression's alias (`GROUP
    BY ts` of `date_trunc('month', ts) AS ts`), whose meaning Postgres must say: not answered
    yet; and those an input column has, which Postgres groups by (where none has it, the
    alias's expression)."""
    aliases = {str(t.name): t.val for t in stmt.targetList or ()
               if isinstance(t, ast.ResTarget) and t.name}
    checks: list[tuple[str, ...]] = []
    inputs: set[str] = set()
    for g in stmt.groupClause or ():
        name = column_name(g)
        if name is None or len(name) != 1 or name[0] not in aliases:
            continue
        aliased = column_name(aliases[name[0]])
        if aliased is not None and aliased[-1] == name[0]:
            continue  # (`rows.country AS country`: the column either reading names)
        check = (GROUP_NAME, name[0])
        if columns is None or check not in columns:
            checks.append(check)
        elif columns[check] is None:
            inputs.add(name[0])
    return checks, inputs


def _grouped_by(group_exprs: list[Any], outputs: list[OutputColumn],
                inputs: AbstractSet[str] = frozenset()) -> tuple[list[Any], set[str]]:
    """The GROUP BY expressions as the query is grouped by them, as written: a selected key's
    select-list expression where GROUP BY names it (by its name, position or expression),
    else the GROUP BY expression itself; and the names GROUP BY reads as another expression's
    output column (`GROUP BY x` of `upper(x) AS x`)."""
    found: list[Any] = []
    aliased: set[str] = set()
    for g in group_exprs:
        named = [o.source for o in outputs if o.key is not None
                 and (same_node(o.source, g) or (is_ref_to(g, o.name) and o.name not in inputs))]
        for expr in named or [g]:
            if not same_node(expr, g):
                aliased.add(str(g.fields[0].sval))
            if not any(same_node(expr, f) for f in found):
                found.append(expr)
    return found, aliased


def _clause_owner(stmt: ast.SelectStmt, plain_form: bool,
                  dp_at: int | None) -> Callable[[ast.SelectStmt], bool]:
    """Whether a SELECT of `stmt` is the one with the WITH ANONYMIZATION clause: the one whose
    select list starts first after the clause's SELECT (at `dp_at`); where that is not known,
    one that calls ANON_* functions itself."""
    if plain_form:
        return lambda sel: False
    if dp_at is None:
        return lambda sel: any(func_name(fc).startswith("anon_") for part in (
            sel.targetList, sel.havingClause, sel.sortClause) for fc in dp_aggregates_in(part))
    # (by its first select-list item: a copy of the SELECT has the same)
    firsts = [(t.location, t) for n in walk_nodes(stmt) if isinstance(n, ast.SelectStmt)
              and n.targetList for t in n.targetList[:1]
              if isinstance(t.location, int) and t.location > dp_at]
    owner = min(firsts, key=lambda f: f[0])[1] if firsts else None
    return lambda sel: bool(sel.targetList) and sel.targetList[0] is owner


def post_processed(stmt: ast.SelectStmt, policy: Mapping[str, TablePolicy],
                   is_dp: Callable[[ast.SelectStmt], bool] = lambda sel: False,
                   ) -> tuple[ast.SelectStmt, ast.SelectStmt] | None:
    """The DP query that `stmt` only post-processes, and `stmt` around its answer; or None.

    That is a SELECT whose one FROM item is a DP query (a subquery, or a WITH query it reads
    by name: `_with_as_subquery`), or another such SELECT (Superset counts the rows of its
    chart's query over a virtual dataset: a query around a query around the DP query). It
    reads nothing but the released rows, so it may do anything to them: filter, project,
    aggregate, group, sort, limit. It may read nothing else: no other FROM item, WITH query or
    subquery, no function in FROM (those stay refused as reads of protected rows).

    The query around is returned with a placeholder (a FROM subquery of None) where the DP
    query was: the result query of its released rows goes there (`dp_core.result`). `is_dp`:
    a SELECT that is the DP query itself (it has the paper form's clause)."""
    if is_dp(stmt):
        return None
    stmt = _with_as_subquery(stmt) or stmt
    if (stmt.op not in (None, 0) or stmt.valuesLists or not stmt.fromClause
            or len(stmt.fromClause) != 1):
        return None
    item = stmt.fromClause[0]
    if not isinstance(item, ast.RangeSubselect) or not isinstance(item.subquery, ast.SelectStmt):
        return None
    nested = post_processed(item.subquery, policy, is_dp)
    if nested is None and not _answers(item.subquery, policy):
        return None  # a projection of rows or per-user rows: the outer query is the DP query
    if item.lateral or stmt.withClause is not None or stmt.intoClause is not None \
            or stmt.lockingClause:
        raise refuse("LATERAL, WITH, INTO or FOR UPDATE around a DP query", node_sql(stmt))
    for part in (stmt.targetList, stmt.whereClause, stmt.groupClause, stmt.havingClause,
                 stmt.sortClause, stmt.limitCount, stmt.limitOffset, stmt.distinctClause,
                 stmt.windowClause):
        for node in walk_nodes(part) if part is not None else ():
            if isinstance(node, (ast.SubLink, ast.RangeVar, ast.RangeFunction)):
                raise refuse("a query over a DP answer reads only its rows (no subqueries)",
                              node_sql(node))
    dp, inner = (item.subquery, None) if nested is None else nested
    outer = copy.copy(stmt)
    outer.fromClause = (ast.RangeSubselect(subquery=inner, alias=item.alias),)
    return dp, outer


def _answers(sel: ast.SelectStmt, policy: Mapping[str, TablePolicy]) -> bool:
    """`sel` (a FROM subquery) is a DP query: it aggregates, groups or is DISTINCT, and not by
    a uid column (a subquery grouped by the uid has per-user rows, which the query around
    aggregates with DP)."""
    if sel.op not in (None, 0):
        return False
    distinct = sel.distinctClause == (None,)
    if not (sel.groupClause or distinct or any(dp_aggregates_in(t) for t in sel.targetList or ())):
        return False
    uids = {t.uid_column for t in policy.values()}
    keys = group_expressions(sel) if sel.groupClause else \
        [t.val for t in sel.targetList or ()] if distinct else []
    return not any(isinstance(k, ast.ColumnRef) and isinstance(k.fields[-1], ast.String)
                   and str(k.fields[-1].sval) in uids for k in keys)


def _with_as_subquery(stmt: ast.SelectStmt) -> ast.SelectStmt | None:
    """`WITH t AS (DP query) SELECT ... FROM t ...` (a BI tool's or psql user's way of naming
    a DP answer) as `SELECT ... FROM (DP query) AS t ...`, or None where `stmt` is not of that
    form. The WITH queries before t, which t may read, go with it (into its own WITH list);
    the others are left out, as Postgres leaves out a WITH query nothing reads (the query
    around reads t only, or is refused)."""
    with_clause = stmt.withClause
    if with_clause is None or with_clause.recursive or not stmt.fromClause \
            or len(stmt.fromClause) != 1 or not isinstance(stmt.fromClause[0], ast.RangeVar):
        return None
    rv = stmt.fromClause[0]
    if rv.schemaname or rv.catalogname:
        return None
    ctes = list(with_clause.ctes)
    at = next((i for i, c in enumerate(ctes) if str(c.ctename) == str(rv.relname)), None)
    if at is None or not isinstance(ctes[at].ctequery, ast.SelectStmt) \
            or not all(isinstance(c.ctequery, ast.SelectStmt) for c in ctes):
        return None
    cte = ctes[at]
    dp = copy.copy(cte.ctequery)
    before = ctes[:at]
    if dp.withClause is not None:
        before += list(dp.withClause.ctes)
    dp.withClause = ast.WithClause(ctes=tuple(before)) if before else None
    # (a column alias list renames the columns by position: the WITH query's, then the
    # FROM item's)
    colnames = list(cte.aliascolnames or ())
    renamed = list(rv.alias.colnames or ()) if rv.alias is not None else []
    colnames = renamed + colnames[len(renamed):]
    alias = ast.Alias(aliasname=str(rv.alias.aliasname) if rv.alias is not None else
                      str(cte.ctename), colnames=tuple(colnames) or None)
    out = copy.copy(stmt)
    out.withClause = None
    out.fromClause = (ast.RangeSubselect(subquery=dp, alias=alias),)
    return out


def _key_parts(val: Any, group_exprs: list[Any], plain_form: bool) -> list[Any] | None:
    """The GROUP BY expressions a select-list expression is made of besides its DP aggregates
    (none for a constant), or None when it reads a column (or a subquery) other than
    through them."""
    found: list[Any] = []
    stack = [val]
    while stack:
        cur = stack.pop()
        match = next((g for g in group_exprs if same_node(cur, g)), None)
        if isinstance(cur, ast.FuncCall) and aggregate_call(cur, plain_form) is cur:
            continue  # a DP aggregate: released itself
        if match is not None:
            if not any(same_node(match, f) for f in found):
                found.append(match)
        elif isinstance(cur, (ast.ColumnRef, ast.SubLink)):
            return None
        elif isinstance(cur, ast.Node):
            stack.extend(getattr(cur, n) for n in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend(cur)
    return found


def _default_name(val: Any) -> str:
    """The column name Postgres would give an unaliased select-list item."""
    if isinstance(val, ast.ColumnRef) and isinstance(val.fields[-1], ast.String):
        return str(val.fields[-1].sval)
    if isinstance(val, ast.FuncCall):
        return func_name(val)
    if isinstance(val, ast.TypeCast):
        inner = _default_name(val.arg)
        return inner if inner != "?column?" else str(val.typeName.names[-1].sval)
    return "?column?"


def _constant_count(node: Any, what: str) -> None:
    """LIMIT and OFFSET of a DP query apply to its released rows (post-processing): numbers,
    parameters, casts and arithmetic of them, and NULL or ALL; nothing that reads a column,
    a table (a subquery) or calls a function."""
    if node is None:
        return
    for n in walk_nodes(node):
        if isinstance(n, (ast.A_Const, ast.ParamRef, ast.TypeName, ast.String, ast.Integer,
                          ast.Float, ast.Boolean, ast.BitString)):
            continue
        if isinstance(n, ast.TypeCast) or (isinstance(n, ast.A_Expr)
                                           and n.kind == A_Expr_Kind.AEXPR_OP):
            continue
        raise refuse(f"{what} of anything but numbers and parameters", node_sql(node))

