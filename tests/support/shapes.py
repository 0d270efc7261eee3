"""The shape rule for pushdowns that Citus runs whole on its workers (issue 32), without a cluster.

Citus pushes a query down to the shards, one task per shard, where every stage that reads
per-user rows keeps them apart by the distribution column (the uid), and gathers only what
the stages above return: per-group partial aggregates. A pushdown keeps its per-user rows
(the per-user stage, the window that picks each user's groups, the user's own subqueries)
on the workers when:

1. no SELECT of users' rows has an OFFSET, and only a scalar subquery of one row's values
   has a LIMIT (an OFFSET 0 fence, or a LIMIT, makes Citus gather the rows below it to apply
   it; a subquery of public rows alone, no uid anywhere in it, may have one: those rows are
   a reference table's, gathered and sent to each shard);
2. every window is partitioned by the uid;
3. a CTE of per-user rows (one not aggregated by something other than the uid) is read at
   most once (Citus gathers a CTE read twice, every row of it, on the coordinator);
4. a stage that aggregates per-user rows by something other than the uid computes its
   aggregates at its top level, none inside a subquery of its select list (Citus cannot
   split those into per-shard partials, so it gathers the rows below).

`problems(sql, uid_names)` lists the breaches of one statement (uid_names: the uid columns'
names; `dp_uid` always counts). tests/operations/test_citus.py checks the same pushdowns'
plans on a real cluster.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from pglast import ast, parse_sql

AGGREGATES = frozenset({"count", "sum", "avg", "min", "max", "array_agg", "string_agg",
                        "var_pop", "var_samp", "variance", "stddev", "stddev_pop",
                        "stddev_samp", "bool_and", "bool_or", "every", "percentile_cont",
                        "percentile_disc", "json_agg", "jsonb_agg", "bit_and", "bit_or"})


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, (list, tuple)):
        yield from node
    elif isinstance(node, ast.Node):
        for slot in node:
            value = getattr(node, slot)
            if isinstance(value, (ast.Node, list, tuple)):
                yield value


def _walk(node: Any, stop_at_sublinks: bool = False) -> Iterator[Any]:
    yield node
    for child in _children(node):
        if stop_at_sublinks and isinstance(child, ast.SubLink):
            continue
        yield from _walk(child, stop_at_sublinks)


def _name(node: Any) -> str | None:
    if isinstance(node, ast.ColumnRef) and node.fields:
        last = node.fields[-1]
        return last.sval if isinstance(last, ast.String) else None
    return None


def _reads_users(node: Any, ctes: dict[str, Any], uids: frozenset[str], depth: int = 0) -> bool:
    """Whether a SELECT reads a uid: names one, or reads a CTE that does."""
    for n in _walk(node):
        if isinstance(n, ast.ColumnRef) and _name(n) in uids:
            return True
        if isinstance(n, ast.RangeVar) and n.schemaname is None and str(n.relname) in ctes \
                and depth < 8 and _reads_users(ctes[str(n.relname)], ctes, uids, depth + 1):
            return True
    return False


def _group_names(select: ast.SelectStmt) -> list[str | None]:
    """The names of a SELECT's GROUP BY items (positions resolved to their target's name or
    column)."""
    names: list[str | None] = []
    for item in select.groupClause or ():
        if isinstance(item, ast.A_Const) and isinstance(item.val, ast.Integer):
            target = select.targetList[item.val.ival - 1]
            names.append(target.name or _name(target.val))
        else:
            names.append(_name(item))
    return names


def _function(node: Any) -> str | None:
    if isinstance(node, ast.FuncCall):
        return node.funcname[-1].sval
    return None


def _aggregates(select: ast.SelectStmt) -> bool:
    """Whether a SELECT aggregates (at its own level: not in its subqueries)."""
    if select.groupClause:
        return True
    for target in select.targetList or ():
        for n in _walk(target, stop_at_sublinks=True):
            if _function(n) in AGGREGATES and not (isinstance(n, ast.FuncCall) and n.over):
                return True
    return False


def _per_user(select: ast.SelectStmt, uids: frozenset[str]) -> bool:
    """Whether a SELECT's rows are per user: it does not aggregate, or groups by the uid."""
    if select.op and select.op.name != "SETOP_NONE":
        return any(_per_user(s, uids) for s in (select.larg, select.rarg) if s is not None)
    return not _aggregates(select) or any(n in uids for n in _group_names(select))


def problems(sql: str, uid_names: frozenset[str] | set[str] = frozenset({"uid"})) -> list[str]:
    """The breaches of the rules above in one pushdown statement."""
    uids = frozenset(uid_names) | {"dp_uid"}
    (raw,) = parse_sql(sql)
    root = raw.stmt
    out: list[str] = []
    selects = [n for n in _walk(root) if isinstance(n, ast.SelectStmt)]
    in_sublinks = {id(s) for link in _walk(root) if isinstance(link, ast.SubLink)
                   for s in _walk(link.subselect) if isinstance(s, ast.SelectStmt)}
    ctes = {str(c.ctename): c.ctequery for sel in selects
            for c in (sel.withClause.ctes if sel.withClause else ())}
    for s in selects:
        if s.limitOffset is not None and _reads_users(s, ctes, uids):
            out.append("an OFFSET")
        if s.limitCount is not None and id(s) not in in_sublinks:
            out.append("a LIMIT outside a scalar subquery")
    for n in _walk(root):
        if isinstance(n, ast.FuncCall) and n.over is not None:
            parts = {_name(p) for p in n.over.partitionClause or ()}
            if not parts & uids:
                out.append(f"a window not partitioned by the uid: {_function(n)}()")
    reads = Counter(n.relname for n in _walk(root)
                    if isinstance(n, ast.RangeVar) and n.schemaname is None)
    for s in selects:
        for cte in (s.withClause.ctes if s.withClause else ()):
            query = cte.ctequery
            if isinstance(query, ast.SelectStmt) and _per_user(query, uids) and \
                    reads[cte.ctename] > 1:
                out.append(f"a CTE of per-user rows read {reads[cte.ctename]} times: {cte.ctename}")
    for s in selects:
        if not _aggregates(s) or _per_user(s, uids):
            continue
        for target in s.targetList or ():
            for link in _walk(target, stop_at_sublinks=False):
                if isinstance(link, ast.SubLink) and any(
                        _function(n) in AGGREGATES for n in _walk(link.subselect)):
                    out.append("an aggregate inside a subquery of an aggregating stage")
    return out


# ------------------------------------------------------------------ the same on a cluster's plan

_AGGREGATE_NODES = ("HashAggregate", "GroupAggregate", "Aggregate", "MixedAggregate")
_SORTS = ("Sort", "Incremental Sort")
_SCANS = ("Seq Scan on", "Index Scan", "Index Only Scan", "Bitmap Heap Scan",
          "Parallel Seq Scan on")


def _node(line: str) -> str:
    return line.strip().removeprefix("->").strip()


def _tasks(lines: list[str]) -> Iterator[list[str]]:
    """The lines of each task's plan shown in a Citus EXPLAIN (the lines indented under
    a `->  Task` line)."""
    for i, line in enumerate(lines):
        if _node(line) == "Task":
            indent = len(line) - len(line.lstrip())
            body = []
            for below in lines[i + 1:]:
                if len(below) - len(below.lstrip()) <= indent:
                    break
                body.append(below)
            yield body


def plan_problems(explain: str, uid_names: frozenset[str] | set[str] = frozenset({"uid"})) -> list[str]:
    """What a Citus EXPLAIN shows of per-user rows leaving the workers: a task that reads
    shards (a scan) and returns rows that are not aggregated by something other than the uid
    (its plan's top node, below any sort, is not an aggregate, or one grouped by the uid), or
    a window run on the coordinator (outside every task, or in a task over intermediate
    results)."""
    uids = frozenset(uid_names) | {"dp_uid"}
    lines = explain.splitlines()
    out = []
    inside: set[int] = set()
    for body in _tasks(lines):
        inside.update(id(line) for line in body)
        nodes = [_node(line) for line in body]
        if not any(n.startswith(_SCANS) for n in nodes):
            # on the coordinator, over intermediate results
            if any("WindowAgg" in n for n in nodes):
                out.append("a window on the coordinator")
            continue
        plan = [n for n in nodes if n[:1].isupper() and not n.startswith((
            "Node:", "Tuple data", "Planning", "Execution", "Sort Key", "Sort Method",
            "Presorted Key", "Full-sort", "Pre-sorted"))]
        top = next((n for n in plan if not n.startswith(_SORTS)), "")
        if not top.startswith(_AGGREGATE_NODES):
            out.append(f"a task returns unaggregated rows: {top}")
            continue
        after = plan[plan.index(top) + 1:]
        key = after[0] if after and after[0].startswith("Group Key:") else ""
        columns = {c.strip().split(".")[-1].strip("()") for c in
                   key.removeprefix("Group Key:").split(",")}
        if columns & uids:
            out.append(f"a task returns per-user rows: {top}, {key}")
    for line in lines:
        if id(line) not in inside and "WindowAgg" in line:
            out.append("a window on the coordinator")
    return out
