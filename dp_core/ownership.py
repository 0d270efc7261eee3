"""Ownership (paper Table 2): FROM items, joins on the uid, and inner queries over protected tables."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from pglast import ast
from pglast.enums import JoinType

from dp_core.catalogue import SYSTEM_SCHEMAS
from dp_core.errors import (
    FeatureNotSupported,
    SyntaxError_,
    UndefinedTable,
)
from dp_core.fanout import (
    Tie,
    anchor,
    column_of,
    renamed,
    table_columns,
    ties,
    using_ties,
)
from dp_core.join_fence import Scope, fence
from dp_core.public_reads import (
    no_aggregates_inside,
    public_relation,
    public_subquery,
    reads_protected,
)
from dp_core.query import PublicSource, Relation, TablePolicy, TableRef
from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import (
    NUMERIC_ROW_CLAMP,
    OWNED_CLAUSES,
    const_number,
    from_names,
    func_name,
    node_sql,
    only_clauses,
    refuse,
    walk_nodes,
    within_magnitude,
)
from dp_core.totality import Totalizer
from dp_core.uid_links import UidLinks

JOIN_ROWS_PER_USER = 100
"""Where two protected FROM items are joined row by row, the rows of each user each of them
reads (`FromAnalysis.capped_joins`): the join then makes at most 100² rows per user."""


def _capped(node: Any, table: TableRef) -> ast.RangeSubselect:
    """`node`, a protected FROM item, as a subquery of the same name that reads at most
    JOIN_ROWS_PER_USER rows of each user, chosen from the user's own rows alone: those of a
    table with the lowest hash of their place in it (ctid: cheap, and the same in each
    statement of one snapshot), those of an inner query at random (each row its own draw).
    An inner query's rows have no place, and their values are not read for the choice: its
    whole row would be made of every column it selects (300 columns of one 4 MB value make a
    row past Postgres's 1 GB, an error only that user's rows cause). Its columns are the
    item's and dp_rn (the row's rank within its user's): a condition on the uid still
    reaches the table's index."""
    alias, uid = _quote(table.alias), _quote(table.uid_column)
    rank = "random()" if table.derived else f"hashtextextended({alias}.ctid::text, 0)"
    sub = parse_sql(
        f"SELECT * FROM (SELECT {alias}.*, row_number() OVER (PARTITION BY {alias}.{uid} "
        f"ORDER BY {rank}) AS dp_rn FROM dp_capped) AS dp_c "
        f"WHERE dp_c.dp_rn <= {JOIN_ROWS_PER_USER}")[0].stmt
    sub.fromClause[0].subquery.fromClause = (node,)
    return ast.RangeSubselect(subquery=sub, alias=ast.Alias(aliasname=table.alias))


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _no_column_aliases(rv: ast.RangeVar) -> None:
    """`FROM visits AS v (browser, uid)` renames columns by position: v.uid would be the
    browser, and the privacy unit with it. Refused for every relation with user rows."""
    if rv.alias is not None and rv.alias.colnames:
        raise refuse("column aliases on a table with user rows (they would rename its uid)",
                      node_sql(rv))


def _session_table(name: str, configured: str, schemas: Mapping[str, str | None] | None) -> None:
    """An unqualified protected name must mean the protected table in the session's
    search_path: 42P01 where the path finds no table of the name (as Postgres), refused where
    it finds another one first (a table of the session or of another schema, say): the name
    is protected (the classifier refuses it elsewhere), and the query must not read one table
    for another."""
    found = None if schemas is None else schemas.get(name)
    if schemas is None or found == configured:
        return
    qualified = f"{configured}.{name}"
    if found is None:
        raise UndefinedTable(f'relation "{name}" does not exist',
                             hint=f"the protected table is {qualified}: write its schema, or "
                                  f"add {configured} to search_path")
    raise FeatureNotSupported(
        f"{name} means {found}.{name} in this session's search_path, not the protected table "
        f"{qualified}", hint=f"write the schema: {qualified}")


class FromAnalysis:
    """Walks FROM: finds protected tables, checks joins between them equate their uids."""

    def __init__(self, policy: Mapping[str, TablePolicy], totalize: Totalizer,
                 ctes: Mapping[str, str | None] | None = None) -> None:
        self.policy = policy
        self.totalize = totalize
        self.ctes = dict(ctes or {})
        """Common table expressions in scope: name → uid column (None: no protected rows)."""
        self.tables: list[TableRef] = []
        self.links = UidLinks(self.tables)
        self.names: set[str] = set()
        """The names of the scope's FROM items (aliases, or table names)."""
        self.nullable: set[str] = set()
        """Aliases of protected FROM items that an outer join can null (their uid is then
        NULL in rows they have no part in)."""
        self.nodes: dict[str, Any] = {}
        """Each protected FROM item's node, by alias (for `capped_joins`)."""
        self.public: dict[str, PublicSource] = {}
        """Each public FROM item's source, by alias (`dp_core.fanout`)."""
        self.ties: list[Tie] = []
        """Equalities that tie a public item's column to other items (`fanout.ties`)."""
        self.fence_refs: tuple[Any, ...] = ()
        self.fence_converted = False
        """(`fence`: a column of each FROM item, and whether an inner join became outer.)"""
        self.columns: dict[str, PublicSource] = {}
        """Protected tables, and subqueries of one table: the columns they read as they are
        (a tie's partner, `fanout.column_of`)."""

    def item(self, node: Any) -> Any:
        if isinstance(node, ast.RangeVar):
            return self._range_var(node)
        if isinstance(node, ast.JoinExpr):
            if node.isNatural:
                raise refuse("NATURAL JOIN (name the join columns)", node_sql(node))
            if node.alias is not None:  # (it hides the names inside: a.uid could be another a's)
                raise refuse("an alias on a join (name its tables instead)", node_sql(node))
            if node.jointype not in (JoinType.JOIN_INNER, JoinType.JOIN_LEFT, JoinType.JOIN_RIGHT,
                                     JoinType.JOIN_FULL):
                raise refuse("this kind of join", node_sql(node))
            before = len(self.tables)
            node.larg = self.item(node.larg)
            mid = len(self.tables)
            node.rarg = self.item(node.rarg)
            left = {t.alias for t in self.tables[before:mid]}
            right = {t.alias for t in self.tables[mid:]}
            if node.jointype in (JoinType.JOIN_LEFT, JoinType.JOIN_FULL):
                self.nullable |= right
            if node.jointype in (JoinType.JOIN_RIGHT, JoinType.JOIN_FULL):
                self.nullable |= left
            self.links.join(node, left, right)
            # (an outer join's two sides' items, and those of its nullable side: none for FULL)
            sides = (from_names(node.larg), from_names(node.rarg))
            nullable = {JoinType.JOIN_LEFT: sides[1], JoinType.JOIN_RIGHT: sides[0]}
            outer = None if node.jointype == JoinType.JOIN_INNER \
                else (*sides, nullable.get(node.jointype, set()))
            self.ties += using_ties(node, list(self.public), self._partner_of, outer)
            self.totalize.using(node)
            if node.quals is not None:
                self.ties += ties(node.quals, list(self.public), self._partner_of, outer)
                node.quals = self.totalize(node.quals, "JOIN condition")
            return node
        if isinstance(node, ast.RangeSubselect):
            if node.lateral:
                raise refuse("LATERAL subqueries", node_sql(node))
            if node.alias is None:
                raise refuse("a subquery in FROM needs an alias", node_sql(node))
            sub_uid = owned_subquery(node.subquery, self.policy,
                                      self.totalize.inner(node.subquery), self.ctes)
            alias = str(node.alias.aliasname)
            self._named(alias)
            if sub_uid is None:
                self.public[alias] = renamed(
                    self.totalize.findings.public_sources[id(node.subquery)], node.alias)
            else:
                if node.alias.colnames:
                    raise refuse("column aliases on a subquery that reads protected tables", alias)
                columns = table_columns(node.subquery)
                if columns is not None:
                    self.columns[alias] = columns
                bases, per_user = self.totalize.findings.shapes[id(node.subquery)]
                self.tables.append(TableRef(alias, alias, sub_uid, derived=True, bases=bases,
                                            per_user=per_user))
                self.nodes[alias] = node
            return node
        if isinstance(node, (ast.RangeFunction, ast.RangeTableFunc)):
            raise refuse("functions in FROM", node_sql(node))
        if isinstance(node, ast.RangeTableSample):
            raise refuse("TABLESAMPLE (a DP query reads every row it selects)", node_sql(node))
        raise refuse(f"FROM item {type(node).__name__}", node_sql(node))

    def _partner_of(self, node: Any) -> tuple[Relation, str] | None:
        return column_of(node, {**self.columns, **self.public})

    def _named(self, alias: str) -> None:
        """Every FROM item of a scope has its own name (Postgres checks it too, but not
        across a join's alias): the analysis reads `alias.uid` as that item's."""
        if alias in self.names:
            raise refuse("the same alias twice", alias)
        self.names.add(alias)
        self.totalize.findings.row_names.add(alias)

    def _range_var(self, rv: ast.RangeVar) -> ast.RangeVar:
        name = str(rv.relname)
        schema = str(rv.schemaname) if rv.schemaname else None
        alias = str(rv.alias.aliasname) if rv.alias else name
        self._named(alias)
        if (schema in SYSTEM_SCHEMAS) or name.startswith("pg_"):
            raise refuse("system catalogs", name)
        if schema is None and name in self.ctes:
            cte_uid = self.ctes[name]
            if cte_uid is not None:
                _no_column_aliases(rv)
                bases, per_user = self.totalize.findings.shapes[name]
                self.tables.append(TableRef(name, alias, cte_uid, derived=True, bases=bases,
                                            per_user=per_user))
                if name in self.totalize.findings.cte_columns:  # (a table's columns)
                    self.columns[alias] = self.totalize.findings.cte_columns[name]
                self.nodes[alias] = rv
            else:
                self.public[alias] = renamed(self.totalize.findings.public_sources[name],
                                              rv.alias)
            return rv
        pol = self.policy.get(name)
        if pol is not None and schema in (None, pol.schema):
            if schema is None:
                _session_table(name, pol.schema, self.totalize.findings.schemas)
            _no_column_aliases(rv)
            self.tables.append(TableRef(name, alias, pol.uid_column,
                                        bases=frozenset({f"{pol.schema}.{name}"})))
            self.columns[alias] = PublicSource((pol.schema, name))
            self.nodes[alias] = rv
            rv.schemaname = pol.schema  # (the pushdown names the configured table, whatever
            # the pushdown role's search_path finds first)
        else:
            public_relation(rv, self.ctes, self.totalize)
            self.public[alias] = renamed(PublicSource(
                (str(rv.schemaname) if rv.schemaname else None, name)), rv.alias)
        return rv

    def owned(self) -> list[TableRef]:
        """The protected FROM items whose uid no outer join can null, in FROM order."""
        return [t for t in self.tables if t.alias not in self.nullable]

    def owner(self) -> ast.Node:
        """Each row's owner (DESIGN §3.4): the uid of the first protected FROM item that no
        outer join nulls; where every one can be (a FULL JOIN between protected tables, a
        public table LEFT JOINed to one), the first of their uids that is not NULL. A row
        whose owner is NULL belongs to no user (the pushdown drops it)."""
        refs = [ast.ColumnRef(fields=(ast.String(sval=t.alias), ast.String(sval=t.uid_column)))
                for t in (self.owned() or self.tables)]
        return refs[0] if len(refs) == 1 or self.owned() else ast.CoalesceExpr(args=tuple(refs))

    def check_multiplying(self) -> None:
        """Joined row by row, protected tables multiply each user's rows: two tables give the
        product of the user's rows in each (the work a query does then grows with one user's
        rows squared), a table with itself the square. Allowed: two different tables, and any
        number of inner queries with one row per user (grouped by the uid alone)."""
        rows = [t for t in self.tables if not t.per_user]
        seen: set[str] = set()
        for t in rows:
            if seen & t.bases:
                raise refuse("a protected table joined row by row with itself (aggregate one "
                              "side per user first: (SELECT uid, ... GROUP BY uid))", t.alias)
            seen |= t.bases
        if len(rows) > 2:
            raise refuse("joins of more than two protected tables row by row (aggregate the "
                          "others per user first: (SELECT uid, ... GROUP BY uid))",
                          ", ".join(t.alias for t in rows))

    def capped_joins(self, items: tuple[Any, ...]) -> tuple[Any, ...]:
        """`items` (this scope's FROM) where two protected items are joined row by row: each
        then reads at most JOIN_ROWS_PER_USER rows of each user (`_capped` says which),
        so that the join makes at most JOIN_ROWS_PER_USER² rows of one user, whatever that
        user's rows (DESIGN §3.11: no construct lets one user's rows multiply the work)."""
        rows = [t for t in self.tables if not t.per_user]
        if len(rows) < 2:
            return items
        capped = {id(self.nodes[t.alias]): _capped(self.nodes[t.alias], t) for t in rows}
        self.totalize.findings.joins_capped = True

        def swap(node: Any) -> Any:
            if id(node) in capped:
                return capped[id(node)]
            if isinstance(node, ast.JoinExpr):
                node.larg, node.rarg = swap(node.larg), swap(node.rarg)
            return node

        return tuple(swap(item) for item in items)

    def fence(self, items: tuple[Any, ...], where: Any) -> tuple[tuple[Any, ...], Any]:
        """`items` and `where` rewritten so that no join's input is filtered by protected rows
        (`dp_core.join_fence`); `self.fence_refs` then holds the fence's columns (none where
        the scope does not join)."""
        scope = Scope({t.alias: t.uid_column for t in self.tables},
                      frozenset(t.alias for t in self.tables if t.derived),
                      frozenset(n for n, uid in self.ctes.items() if uid is None))
        out = fence(items, where, scope)
        self.fence_refs, self.fence_converted = scope.refs, scope.converted
        return out

    def check_connected(self, where: Any) -> None:
        """All protected tables must be joined on uid equality into one privacy unit
        (`UidLinks`: what ties them for every row kept)."""
        if where is not None:
            self.ties += ties(where, list(self.public), self._partner_of)
        self.totalize.findings.fanout += anchor(self.public, {t.alias for t in self.tables},
                                                self.ties)
        if len(self.tables) <= 1:
            return
        if where is not None:
            self.links.where(where)
        if not self.links.connected():
            names = ", ".join(t.alias for t in self.tables)
            raise refuse("joins between protected tables must equate their uid columns, "
                          "e.g. USING (uid) or ON a.uid = b.uid", names)


_PER_USER_AGGREGATES = frozenset({"count", "sum", "avg", "min", "max"})


def owned_subquery(sel: Any, policy: Mapping[str, TablePolicy], totalize: Totalizer,
                    ctes: Mapping[str, str | None]) -> str | None:
    """Check an inner query (subquery in FROM or WITH) against the ownership rules.

    Returns the name of its uid output column, or None when it reads no protected
    rows. Projection and selection are free; aggregation must group by the uid
    (per-user rows); DISTINCT, LIMIT/OFFSET, window functions and set operations
    are refused. The uid is appended to the select list when it is missing and
    that is unambiguous. Expressions are made total in place.
    """
    if not isinstance(sel, ast.SelectStmt):
        raise refuse("this kind of subquery", node_sql(sel))
    if sel.op and sel.larg is not None:
        if reads_protected(sel, policy, ctes):
            raise refuse("set operations (UNION, INTERSECT, EXCEPT) over protected tables", node_sql(sel))
        raise refuse("set operations (UNION, INTERSECT, EXCEPT) in a DP query", node_sql(sel))
    if not reads_protected(sel, policy, ctes):
        public_subquery(sel, totalize, ctes, "a subquery over unprotected tables")
        return None
    if sel.withClause is not None:
        raise refuse("WITH inside a subquery", node_sql(sel))
    if sel.distinctClause:
        raise refuse("DISTINCT in a subquery over protected tables", node_sql(sel))
    if sel.limitCount is not None or sel.limitOffset is not None:
        raise refuse("LIMIT or OFFSET in a subquery over protected tables", node_sql(sel))
    if sel.windowClause:
        raise refuse("named windows (WINDOW w AS ...) in a subquery", node_sql(sel))
    if sel.havingClause is not None:
        raise refuse("HAVING in a subquery over protected tables", node_sql(sel))
    if sel.valuesLists or not sel.fromClause:
        raise refuse("this kind of subquery", node_sql(sel))
    if sel.sortClause:
        raise refuse("ORDER BY in a subquery over protected tables (without LIMIT it means "
                      "nothing)", node_sql(sel))
    only_clauses(sel, OWNED_CLAUSES, "a subquery over protected tables")
    fa = FromAnalysis(policy, totalize, ctes)
    sel.fromClause = tuple(fa.item(item) for item in sel.fromClause)
    fa.check_connected(sel.whereClause)
    fa.check_multiplying()
    sel.fromClause = fa.capped_joins(sel.fromClause)
    if sel.whereClause is not None:
        sel.whereClause = totalize(sel.whereClause, "WHERE")
    sel.fromClause, sel.whereClause = fa.fence(sel.fromClause, sel.whereClause)
    if fa.fence_refs:
        # kept apart (OFFSET 0): merged into the query around it, or given its conditions,
        # Postgres would filter one of its items where it is read (`dp_core.join_fence`)
        sel.limitOffset = ast.A_Const(val=ast.Integer(ival=0))
    # a uid that an outer join can null is not a user: only the owned tables' uids bound a
    # contribution (per-user groups and windows); an unqualified one only where no nullable
    # table has a uid of that name
    owned = fa.owned()
    if not fa.tables:
        raise refuse("protected tables read elsewhere than in a subquery's FROM", node_sql(sel))
    if not owned:
        raise refuse("outer joins that can null every protected table of a subquery (its "
                      "rows would have no owner)", node_sql(sel))
    uid_refs = {(t.alias, t.uid_column) for t in owned}
    uid_names = {t.uid_column for t in owned} - \
        {t.uid_column for t in fa.tables if t.alias in fa.nullable}

    def is_uid(node: Any) -> bool:
        if not isinstance(node, ast.ColumnRef):
            return False
        parts = tuple(str(f.sval) for f in node.fields if isinstance(f, ast.String))
        return (len(parts) == 2 and parts in uid_refs) or (len(parts) == 1 and parts[0] in uid_names)

    grouped = bool(sel.groupClause)
    if grouped:
        keys = group_expressions(sel)
        if not any(is_uid(k) for k in keys):
            raise refuse("aggregation in a subquery must group by the uid (per-user rows)",
                          node_sql(sel))
        sel.groupClause = tuple(totalize(g, "GROUP BY") if not is_uid(g) else g
                                for g in sel.groupClause)
    targets = []
    uid_out: str | None = None
    starred = False
    for target in sel.targetList or ():
        val = target.val
        if isinstance(val, ast.ColumnRef) and isinstance(val.fields[-1], ast.A_Star):
            if fa.nullable:
                raise refuse("* in a subquery with an outer join of protected tables (name "
                              "the columns)", node_sql(sel))
            targets.append(target)
            starred = True
            qualifier = getattr(val.fields[-2], "sval", "") if len(val.fields) > 1 else None
            item = next((t for t in owned if t.alias == qualifier), None)
            if uid_out is None and (qualifier is None or item is not None):
                # (t.* of a public item gives no uid, whatever its columns' names)
                uid_out = (item or fa.tables[0]).uid_column
            continue
        if is_uid(val) and uid_out is None:
            uid_out = str(target.name) if target.name else str(val.fields[-1].sval)
            targets.append(target)
            continue
        if isinstance(val, ast.FuncCall) and val.over is not None:
            target.val = _per_user_window(val, is_uid, totalize)
        else:
            for node in walk_nodes(val):
                if isinstance(node, ast.FuncCall) and node.over is not None:
                    raise refuse("window functions inside expressions", node_sql(val))
            target.val = _per_user_expression(val, grouped, totalize)
        targets.append(target)
    if uid_out is None:  # propagate the uid: unambiguous, the first owned table's
        first = owned[0]
        uid_out = "dp_uid_auto" if starred or any(t.name == first.uid_column for t in targets) \
            else first.uid_column
        targets.append(ast.ResTarget(name=uid_out, val=ast.ColumnRef(fields=(
            ast.String(sval=first.alias), ast.String(sval=first.uid_column)))))
    sel.targetList = tuple(targets)
    bases = frozenset().union(*(t.bases for t in fa.tables))
    per_user = grouped and len(group_expressions(sel)) == 1
    totalize.findings.shapes[id(sel)] = (bases, per_user)
    return uid_out


def _builtin(fc: ast.FuncCall) -> bool:
    return len(fc.funcname) == 1 or str(fc.funcname[0].sval) == "pg_catalog"


_DEFAULT_FRAME = 1058
"""pglast's WindowDef.frameOptions without a frame clause (RANGE UNBOUNDED PRECEDING to
CURRENT ROW, the frame Postgres computes incrementally)."""
_WINDOW_FUNCTIONS = frozenset({"row_number", "rank", "dense_rank", "count", "sum", "avg", "min", "max"})


def _per_user_window(fc: Any, is_uid: Any, totalize: Totalizer) -> Any:
    """A window function over one user's rows: partitioned by the uid, total."""
    over = fc.over
    if over.refname or not any(is_uid(p) for p in (over.partitionClause or ())):
        raise refuse("window functions must be partitioned by the uid", node_sql(fc))
    name = func_name(fc)
    if name not in _WINDOW_FUNCTIONS or not _builtin(fc):
        raise refuse(f"window function {name}() (allowed: {', '.join(sorted(_WINDOW_FUNCTIONS))})",
                      node_sql(fc))
    if fc.agg_filter is not None or fc.agg_distinct:
        raise refuse("FILTER or DISTINCT in a window function", node_sql(fc))
    if over.frameOptions != _DEFAULT_FRAME:
        # (a frame whose start moves recomputes max() over it on every row: quadratic work
        # in one user's rows)
        raise refuse("window frames (ROWS or RANGE BETWEEN ...)", node_sql(fc))
    args = tuple(totalize(a, "window function argument") for a in (fc.args or ()))
    _compared(name, args, totalize)
    if name in ("sum", "avg"):  # (as a per-user aggregate's: `_per_user_aggregate`)
        args = tuple(within_magnitude(totalize.number(a, f"{name}() of a number", node_sql(fc)),
                                      NUMERIC_ROW_CLAMP) for a in args)
    fc.args = args or None
    over.partitionClause = tuple(p if is_uid(p) else totalize(p, "PARTITION BY")
                                 for p in over.partitionClause)
    if over.orderClause:
        for sort in over.orderClause:
            if sort.useOp:
                raise refuse("ORDER BY ... USING in a window", node_sql(fc))
            sort.node = totalize(sort.node, "window ORDER BY")
    if over.startOffset is not None or over.endOffset is not None:
        raise refuse("window frames with offsets", node_sql(fc))
    return fc


def _compared(name: str, args: tuple[Any, ...], totalize: Totalizer) -> None:
    """min() and max() compare their argument's values: noted as a comparison (`TypeMix`),
    which the server refuses for arrays and composites whose parts Postgres cannot order (it
    looks that up when a user's second value reaches it: `max(ja)` of a json[])."""
    if name in ("min", "max"):
        for a in args:
            totalize.mix("compare", [a, copy.deepcopy(a)], f"{name}()")


def _per_user_expression(val: Any, grouped: bool, totalize: Totalizer) -> Any:
    """A select-list item of an inner query: total, with per-user aggregates made total too."""
    if isinstance(val, ast.FuncCall) and func_name(val) in _PER_USER_AGGREGATES:
        if not grouped:
            raise refuse("aggregates in a subquery need GROUP BY uid", node_sql(val))
        if val.over is not None or val.agg_filter is not None or val.agg_order \
                or not _builtin(val):
            raise refuse("FILTER, ORDER BY or OVER in a per-user aggregate, or one that is not "
                          "built in", node_sql(val))
        name = func_name(val)
        args = tuple(totalize(a, "aggregate argument") for a in (val.args or ()))
        _compared(name, args, totalize)
        if name in ("sum", "avg"):
            # exact, in numeric, each row within ±NUMERIC_ROW_CLAMP: no overflow for any
            # user's rows (two near numeric's largest overflowed it)
            args = tuple(within_magnitude(totalize.number(a, f"{name}() of a number",
                                                          node_sql(val)), NUMERIC_ROW_CLAMP)
                         for a in args)
        val.args = args or None
        return val
    for node in walk_nodes(val):
        if isinstance(node, ast.FuncCall) and func_name(node) in _PER_USER_AGGREGATES:
            raise refuse("expressions over per-user aggregates (select the aggregate itself)",
                          node_sql(val))
    no_aggregates_inside(val)
    return totalize(val, "subquery select list")


def group_expressions(stmt: ast.SelectStmt) -> list[Any]:
    out = []
    for g in stmt.groupClause or ():
        if isinstance(g, (ast.GroupingSet,)):
            raise refuse("GROUPING SETS, ROLLUP and CUBE")
        n = const_number(g)
        if n is not None:
            if not math.isfinite(n):
                raise SyntaxError_(f"GROUP BY position {n} is not in select list")
            idx = int(n) - 1
            if not 0 <= idx < len(stmt.targetList) or n != int(n):
                raise SyntaxError_(f"GROUP BY position {n} is not in select list")
            out.append(stmt.targetList[idx].val)
        else:
            out.append(g)
    return out
