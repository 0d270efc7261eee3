"""Public data inside a DP query: unprotected tables by name, their subqueries in FROM, WITH, IN, EXISTS."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pglast import ast
from pglast.enums import SubLinkType

from dp_core.catalogue import SYSTEM_SCHEMAS, is_dp_aggregate
from dp_core.errors import FeatureNotSupported, UndefinedTable
from dp_core.fanout import selected_source, values_source
from dp_core.query import TablePolicy
from dp_core.sqlnodes import PUBLIC_CLAUSES, func_name, node_sql, only_clauses, refuse, walk_nodes
from dp_core.totality import Totalizer


def public_relation(rv: ast.RangeVar, ctes: Mapping[str, str | None],
                     totalize: Totalizer) -> None:
    """An unprotected table (or a WITH query) read by name in a DP query: never a system
    catalog; recorded for the server, which refuses it unless the analysts may read it."""
    name = str(rv.relname)
    schema = str(rv.schemaname) if rv.schemaname else None
    if schema in SYSTEM_SCHEMAS or name.startswith("pg_") or rv.catalogname:
        raise refuse("system catalogs", name)
    if schema is None and name in ctes:
        return
    schemas = totalize.findings.schemas
    if schema is None and schemas is not None:
        # the table the session's search_path finds: the pushdown names it
        schema = schemas.get(name)
        if schema is None:
            raise UndefinedTable(f'relation "{name}" does not exist')
        if schema in SYSTEM_SCHEMAS:
            raise refuse("system catalogs", f"{schema}.{name}")
        rv.schemaname = schema
    totalize.relations.append((schema, name))


def semi_join(link: ast.SubLink, policy: Mapping[str, TablePolicy],
               ctes: Mapping[str, str | None], totalize: Totalizer) -> ast.SubLink:
    """`x IN (SELECT ...)` or `EXISTS (SELECT ...)` in a DP query's WHERE, checked and made
    total in place: over unprotected tables only, a plain SELECT [WHERE] of their rows
    (public data), total.

    Subqueries in WHERE that read protected tables, correlated or not, are refused (DESIGN
    §3.1, the paper's Table 2), even the semi-join on the uid (`uid IN (SELECT uid FROM
    purchases ...)`), which would be safe: a join on the uid in FROM says the same."""
    sub = link.subselect
    exists = link.subLinkType == SubLinkType.EXISTS_SUBLINK
    if not exists and (link.subLinkType != SubLinkType.ANY_SUBLINK or
                       (link.operName and str(link.operName[-1].sval) != "=")):
        raise refuse("subqueries inside a DP query (but IN or EXISTS over unprotected tables "
                      "in WHERE)", node_sql(link))
    if not isinstance(sub, ast.SelectStmt):
        raise refuse("this kind of subquery", node_sql(link))
    if reads_protected(sub, policy, ctes):
        raise refuse("correlated or WHERE subqueries that read protected tables (join the "
                      "table on the uid in FROM instead)", node_sql(link))
    public_subquery(sub, totalize.inner(sub), ctes,
                     "a subquery in IN or EXISTS over unprotected tables")
    totalize.findings.sublinks.append(sub)
    if not exists:
        totalize.findings.in_lists.append(sub)
    return link


def public_subquery(sub: ast.SelectStmt, totalize: Totalizer,
                     ctes: Mapping[str, str | None], scope: str) -> None:
    """A subquery of unprotected tables inside a DP query (in FROM, WITH, IN or EXISTS): a
    plain SELECT of their rows, filtered, made total (it may read the DP query's row too), or
    a VALUES list; its tables are recorded for the server's check (`public_relation`)."""
    if sub.valuesLists:
        only_clauses(sub, ("valuesLists",), scope)
        totalize.findings.public_sources[id(sub)] = values_source(
            sub.valuesLists, [f"column{j + 1}" for j in range(len(sub.valuesLists[0]))])
        sub.valuesLists = tuple(tuple(totalize(v, "VALUES list") for v in row)
                                for row in sub.valuesLists)
        return
    try:
        only_clauses(sub, PUBLIC_CLAUSES, scope)
    except FeatureNotSupported:
        raise refuse(f"{scope} but as SELECT ... FROM ... [WHERE]", node_sql(sub)) from None
    if len(sub.fromClause or ()) > 1:
        raise refuse(f"{scope} reads one table (no joins: work per row of the DP query)",
                      node_sql(sub))
    for item in sub.fromClause or ():
        if not isinstance(item, ast.RangeVar):
            raise refuse(f"{scope} reads tables by name only (no joins, functions or "
                          "subqueries)", node_sql(item))
        public_relation(item, ctes, totalize)
        totalize.findings.row_names.add(str(item.alias.aliasname) if item.alias
                                        else str(item.relname))
    totalize.findings.public_sources[id(sub)] = selected_source(sub, totalize.findings.public_sources)
    for target in sub.targetList or ():
        if isinstance(target.val, ast.ColumnRef) \
                and isinstance((target.val.fields or (None,))[-1], ast.A_Star):
            continue
        no_aggregates_inside(target.val)
        target.val = totalize(target.val, "subquery select list")
    if sub.whereClause is not None:
        sub.whereClause = totalize(sub.whereClause, "WHERE")


def reads_protected(sel: Any, policy: Mapping[str, TablePolicy], ctes: Mapping[str, str | None]) -> bool:
    for node in walk_nodes(sel):
        if isinstance(node, ast.RangeVar):
            name = str(node.relname)
            schema = str(node.schemaname) if node.schemaname else None
            pol = policy.get(name)
            if pol is not None and schema in (None, pol.schema):
                return True
            if schema is None and ctes.get(name) is not None:
                return True
    return False


def no_aggregates_inside(val: Any) -> None:
    for node in walk_nodes(val):
        if isinstance(node, ast.FuncCall) and is_dp_aggregate(func_name(node)):
            raise refuse("expressions over DP aggregates are not supported yet "
                          "(select the aggregate itself)", node_sql(val))
