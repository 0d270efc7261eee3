"""Joins whose work no user's rows can cut short: a scope's filters run after its joins.

Postgres skips work a join cannot need: a hash join whose outer side has no row never builds
its hash (nor reads the inner side), one whose inner side is empty never reads the outer
side, a nested loop reads its inner side once per outer row, a merge join stops where a side
ends. A filter on one FROM item is evaluated where that item is read, so where a DP query's
filter keeps no row of an item (`WHERE p.uid = 42 AND p.category = 'x'`), the other items
of the join are never read: the time then says whether user 42 has such a row, by as much
as reading the largest table the query names (measured: 0.05 s against 0.10 s on the demo,
one query, deterministic). `fence` rewrites each scope that joins (two FROM items or more,
or an IN / EXISTS subquery) so that no input of a join is filtered by protected rows:

- **Filters after the joins.** Every condition of WHERE, and of an inner join's ON, other
  than a join key (`a.x = b.y`, columns of items on either side: what Postgres hashes or
  merges on) or a constant (an uncorrelated EXISTS too: run once, before anything), is
  evaluated only where every FROM item of the scope is joined:
  `CASE WHEN num_nulls(<a column of each item>) >= 0 THEN <conditions> END`, which reads
  every item (so Postgres cannot evaluate it before they are all joined), is true exactly
  where the conditions are, and is not strict (so no outer join is reduced around it). IN and
  EXISTS subqueries come first in it, so that the first joined row evaluates them. Conditions
  on public rows alone too: `c.code = 'VU'` with the key `c.code = v.country` would become
  `v.country = 'VU'` where visits is read.
- **Outer-join chains.** Where a group of items joined by inner joins has three or more
  members (the items, and an outer join's nullable side, count one each), or holds a
  subquery over protected rows, the join of two of them could be empty (through a key to a
  public item of a few chosen rows, `JOIN (VALUES (42)) t(u) ON t.u = p.uid`, or a subquery's
  own WHERE) and so skip the rest: each inner join there becomes an outer join on its keys
  that keeps the side holding the group's core (a protected table, else a public item;
  between subqueries alone, a FULL JOIN), the scope's conditions asking that the other side
  matched (a key column of it is not NULL). The pushdown runs with `PLANNER_SETTINGS`, so
  that Postgres joins in this order (it would nest one outer join inside another).
- **Nullable sides.** Conditions inside an outer join's nullable side (its inner joins', and
  the outer join's own ON on that side) are fenced into that ON over the side's items alone:
  an empty nullable side never cuts the preserved side's work. Its joins keep the one item
  the outer join's keys touch (keys on its other items join the fence): a key strict on an
  item they could null would make Postgres turn that join inner again.
- **Sentinel rows.** A subquery or WITH query over protected rows that a join keeps (a
  nullable side's core, a FULL JOIN's side, an outer join's preserved side without a key)
  gets one row of NULLs when it has none (a row no uid equals, whose owner is NULL: no answer
  counts it), so a join with it always reads the other side.
- **Cross joins.** A join without a key reads one side once per row of the other: a
  protected subquery there gets sentinel rows; a public item no key reads keeps its own
  conditions inside it, read once (`_own_conditions`).
- **Public subqueries kept apart** (OFFSET 0): merged into the scope, their constants would
  reach the protected item through the join key, as above. So is a protected subquery that
  itself joins (`ownership.owned_subquery`): merged into the query around it, or given its
  conditions, Postgres would filter one of its tables where it is read.

What is left: join keys filter (an equality of two items' columns keeps the pairs that are
equal), where no literal names a user; a merge join stops at the last key of a side (which
the largest uid of a table decides); a table with no rows at all; an IN or EXISTS subquery
runs once where a row reaches it (what it reads is bounded: `fanout.SUBLINK_READ_ROWS`).
docs/privacy.md (Timing).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType, JoinType, NullTestType

from dp_core.join_items import filtered, sentinel
from dp_core.join_keys import column, is_key, lenient, outside, reads, unnamed_key
from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import conjuncts, from_name, from_names, node_sql, refuse


@dataclass
class Scope:
    """One scope's FROM items: the protected ones' uid columns by alias, and which of them are
    subqueries or WITH queries (they get sentinel rows). Every other FROM item is public."""

    uids: Mapping[str, str]
    derived: frozenset[str] = frozenset()
    public_ctes: frozenset[str] = frozenset()
    """The names of WITH queries over public rows (`_kept_apart`)."""
    refs: tuple[Any, ...] = field(default=())
    """The fence's columns (one per FROM item), once `fence` has found the scope joins."""
    converted: bool = False
    """Some inner join became an outer one: a strict condition on the uid added later (a
    split's uid range) would turn it back, and goes in the fence too."""
    whole: set[str] = field(default_factory=set)
    """Subqueries given sentinel rows: never empty, they keep a join's rows as a table does."""


PLANNER_SETTINGS = {"join_collapse_limit": "1", "from_collapse_limit": "1",
                    "enable_mergejoin": "off"}
"""Settings of the pushdown's transaction: Postgres joins the FROM items in the order the
rewrite writes them (it would otherwise move a join inside another one where the conditions
allow: `(p LEFT JOIN v ON ...) LEFT JOIN s ON s.uid = v.uid` as `p LEFT JOIN (v LEFT JOIN s
...)`, where an empty filtered `v` would skip `s`), and not by merging sorted inputs (a merge
join stops reading one input where the other ends, or at its NULL keys: how far it reads a
table would follow the last uid of a filtered one)."""


def fence(items: tuple[Any, ...], where: Any | None, scope: Scope) -> tuple[tuple[Any, ...], Any | None]:
    """`items` (a scope's FROM, analysed) and `where` (its WHERE, total) rewritten so that no
    join's input is filtered by protected rows (the module's docstring); unchanged where the
    scope does not join. Sets `scope.refs` for later conditions (`fenced`)."""
    names = [n for item in items for n in _leaf_names(item)]
    has_sublink = where is not None and any(isinstance(n, ast.SubLink) for n in outside(where))
    if len(names) < 2 and not has_sublink:
        return items, where
    scope.refs = tuple(_ref(n, scope) for n in names)
    conds: list[Any] = []
    rest = [c for c in (conjuncts(where) if where is not None else ())
            if not _into_join(c, items)]
    members = [n for i in items for n in _members(i)]
    convert = sum(_units(i) for i in items) >= 3 or any(n in scope.derived for n in members)
    scope.converted = convert
    done = [_kept_apart(i, scope) for i in items]
    if len(done) > 1 and convert:
        done = [_chain(done, rest, scope)]
    done = [_region(i, conds, convert, scope) for i in done]
    if len(done) == 1 and convert and from_name(done[0]) in scope.derived:
        done = [_whole(done[0], scope)]
    kept = []
    for c in rest:
        read = reads(c)
        if read == frozenset():
            kept.append(c)  # a constant (a one-time filter, evaluated before anything)
        elif not convert and len(done) > 1 and (is_key(c, *_sides(done, c)) or unnamed_key(c)):
            kept.append(c)  # a join key of items listed with commas
        else:
            conds.append(c)
    done, conds = _own_conditions(done, conds, kept, scope)
    if conds:
        unique = [c for i, c in enumerate(conds) if not any(c == d for d in conds[:i])]
        kept.append(fenced(unique, scope.refs))
    return tuple(done), _and(kept)


def _own_conditions(items: list[Any], conds: list[Any], kept: list[Any],
                    scope: Scope) -> tuple[list[Any], list[Any]]:
    """A public item of the scope's group that no join key reads (a cross join) keeps the
    conditions on its own rows inside it (`(SELECT * FROM t AS d WHERE d.id = 5 OFFSET 0) AS
    d`): its constants reach no protected item, and after the join it would be read whole
    once per protected row."""
    keyed: set[str] = set()
    for c in [*kept, *(q for i in items for q in _join_quals(i))]:
        keyed |= reads(c) or set()
    members = {n for i in items for n in _members(i)}
    alone = {n for n in members if n not in scope.uids and n not in keyed}
    own: dict[str, list[Any]] = {}
    rest = []
    for c in conds:
        read = reads(c)
        if read is not None and len(read) == 1 and next(iter(read)) in alone and not any(
                isinstance(n, ast.SubLink) for n in outside(c)):
            own.setdefault(next(iter(read)), []).append(c)
        else:
            rest.append(c)
    return [filtered(i, own) for i in items], rest


def _join_quals(node: Any) -> list[Any]:
    """The conditions of a FROM item's joins, but the fences (which read every item)."""
    if not isinstance(node, ast.JoinExpr):
        return []
    quals = [c for c in conjuncts(node.quals) if not isinstance(c, ast.CaseExpr)] \
        if node.quals is not None else []
    return [*quals, *_join_quals(node.larg), *_join_quals(node.rarg)]


def fenced(conds: list[Any], refs: tuple[Any, ...]) -> Any:
    """`conds` as one condition evaluated where every one of `refs`' items is joined:
    `CASE WHEN num_nulls(refs) >= 0 THEN conds END` (true exactly where all of `conds` are;
    IN and EXISTS subqueries first)."""
    ordered = sorted(conds, key=lambda c: not any(isinstance(n, ast.SubLink) for n in outside(c)))
    test = ast.A_Expr(kind=A_Expr_Kind.AEXPR_OP, name=(ast.String(sval=">="),),
                      lexpr=ast.FuncCall(funcname=(ast.String(sval="pg_catalog"),
                                                   ast.String(sval="num_nulls")),
                                         args=tuple(copy.deepcopy(refs))),
                      rexpr=ast.A_Const(val=ast.Integer(ival=0)))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=test, result=_and(ordered)),))


def _into_join(cond: Any, items: tuple[Any, ...]) -> bool:
    """A key of WHERE between two items of one join (inner, and not inside an outer join's
    nullable side) goes into that join's ON, where it stays a key; True where it went."""
    read = reads(cond)
    if read is None or len(read) != 2 or not is_key(cond, set(read), set(read)):
        return False
    x, y = sorted(read)
    for item in items:
        node = item
        while isinstance(node, ast.JoinExpr):
            left, right = from_names(node.larg), from_names(node.rarg)
            if node.jointype == JoinType.JOIN_INNER and not node.usingClause and (
                    (x in left and y in right) or (x in right and y in left)):
                node.quals = _and([*conjuncts(node.quals), cond]) if node.quals is not None \
                    else cond
                return True
            node = next((s for s in _group_sides(node) if {x, y} <= from_names(s)), None)
    return False


def _and(conds: list[Any]) -> Any | None:
    if not conds:
        return None
    return conds[0] if len(conds) == 1 else ast.BoolExpr(boolop=BoolExprType.AND_EXPR,
                                                         args=tuple(conds))


def _ref(name: str, scope: Scope) -> Any:
    """A column of the FROM item `name` for the fence: a protected item's uid, a public
    item's whole row."""
    last = ast.String(sval=scope.uids[name]) if name in scope.uids else ast.A_Star()
    return ast.ColumnRef(fields=(ast.String(sval=name), last))


def _leaf_names(node: Any) -> list[str]:
    if isinstance(node, ast.JoinExpr):
        return _leaf_names(node.larg) + _leaf_names(node.rarg)
    name = from_name(node)
    return [] if name is None else [name]


def _units(node: Any) -> int:
    """The members of the inner-join group `node` belongs to: items, and one per outer
    join's nullable side (or FULL join)."""
    if not isinstance(node, ast.JoinExpr):
        return 1
    if node.jointype == JoinType.JOIN_INNER:
        return _units(node.larg) + _units(node.rarg)
    if node.jointype == JoinType.JOIN_LEFT:
        return _units(node.larg) + 1
    if node.jointype == JoinType.JOIN_RIGHT:
        return 1 + _units(node.rarg)
    return 1


def _members(node: Any) -> list[str]:
    """The items of `node`'s group: joined by inner joins, or on an outer join's preserved
    side (an empty one of them can leave the group's join empty)."""
    if not isinstance(node, ast.JoinExpr):
        name = from_name(node)
        return [] if name is None else [name]
    return [n for side in _group_sides(node) for n in _members(side)]


def _group_sides(join: ast.JoinExpr) -> tuple[Any, ...]:
    """The sides of a join in its group: both of an inner join, an outer join's preserved
    one, none of a FULL join's."""
    kind: Any = join.jointype
    return {JoinType.JOIN_INNER: (join.larg, join.rarg), JoinType.JOIN_LEFT: (join.larg,),
            JoinType.JOIN_RIGHT: (join.rarg,)}.get(kind, ())


def _core(names: list[str], scope: Scope) -> str | None:
    """The item a group's joins keep every row of: a protected table (all its rows, whatever
    the query asks of them), else a public item (public rows), else a subquery (which gets
    sentinel rows)."""
    def rank(name: str) -> int:
        if name in scope.whole:
            return 0
        return 2 if name in scope.derived else 0 if name in scope.uids else 1
    return min(names, key=rank, default=None)


def _region(node: Any, conds: list[Any], convert: bool, scope: Scope,
            prefer: str | None = None) -> Any:
    """`node` with its joins rewritten; conditions to evaluate after the group's joins go to
    `conds`. `convert`: each inner join with keys becomes an outer join that keeps the side
    holding the group's core (`_core`, or `prefer` where it is one of the group's items)."""
    if not isinstance(node, ast.JoinExpr):
        return node
    if node.jointype == JoinType.JOIN_INNER:
        left, right = from_names(node.larg), from_names(node.rarg)
        quals = list(conjuncts(node.quals)) if node.quals is not None else []
        keys = [c for c in quals if is_key(c, left, right) or (not convert and unnamed_key(c))]
        conds += [c for c in quals if not any(c is k for k in keys)]
        node.quals = _and(keys)
        if not convert or not (keys or node.usingClause):  # (or a cross join: both as they are)
            node.larg = _region(node.larg, conds, convert, scope, prefer)
            node.rarg = _region(node.rarg, conds, convert, scope, prefer)
            if not keys and not node.usingClause:
                # a cross join reads one side once per row of the other: none where that is
                # empty, so a subquery there gets sentinel rows
                node.larg, node.rarg = _whole(node.larg, scope), _whole(node.rarg, scope)
            return node
        members = _members(node)
        core = prefer if prefer in members else _core(members, scope)
        if core in scope.derived and core not in scope.whole:
            # (subqueries alone, outside any nullable side: a FULL JOIN reads both sides)
            if node.usingClause and (isinstance(node.larg, ast.JoinExpr)
                                     or isinstance(node.rarg, ast.JoinExpr)):
                _using_leaves(node)
            node.larg = _region(node.larg, conds, True, scope)
            node.rarg = _region(node.rarg, conds, True, scope)
            node.jointype = JoinType.JOIN_FULL
            conds += [_matched(node.larg, keys, node.usingClause, scope),
                      _matched(node.rarg, keys, node.usingClause, scope)]
            node.quals = _and(lenient(keys, left | right))
            return node
        keep_left = core in left
        kept, other = (node.larg, node.rarg) if keep_left else (node.rarg, node.larg)
        if node.usingClause and isinstance(other, ast.JoinExpr):
            _using_leaves(node)
        kept = _region(kept, conds, True, scope, core)
        other, keys = _nullable_side(other, keys, conds, scope)
        conds.append(_matched(other, keys, node.usingClause, scope))
        keys = lenient(keys, from_names(other))
        node.quals = _and(keys)
        node.larg, node.rarg = (kept, other) if keep_left else (other, kept)
        node.jointype = JoinType.JOIN_LEFT if keep_left else JoinType.JOIN_RIGHT
        return node
    if node.jointype == JoinType.JOIN_FULL:
        # (it reads both sides whatever they hold, unless a strict condition above turns it
        # into an outer join that keeps one: a subquery there gets sentinel rows)
        for side in (node.larg, node.rarg):
            if isinstance(side, ast.JoinExpr):
                raise refuse("a FULL JOIN of a join (join its items to the FULL JOIN one by one)",
                              node_sql(node))
        node.larg, node.rarg = (_whole(side, scope) for side in (node.larg, node.rarg))
        return node
    left_kept = node.jointype == JoinType.JOIN_LEFT
    kept, nullable = (node.larg, node.rarg) if left_kept else (node.rarg, node.larg)
    if node.usingClause and isinstance(nullable, ast.JoinExpr):
        _using_leaves(node)
    kept = _region(kept, conds, convert, scope, prefer)
    names = _leaf_names(nullable)
    if len(names) < 2 and node.quals is not None:
        # keys not strict; the other conditions as join filters (over both sides' items), not
        # filters of the nullable item where it is read: a nested loop would rescan a
        # filtered item per row of the other side, more often where the target's row is in it
        quals = list(conjuncts(node.quals))
        keys = [c for c in quals if is_key(c, from_names(kept), set(names))]
        own = [c for c in quals if not any(c is k for k in keys)
               and ((read := reads(c)) is None or read <= set(names))]
        rest = [c for c in quals if not any(c is k for k in keys) and not any(c is o for o in own)]
        refs = tuple(_ref(n, scope) for n in [*_leaf_names(kept), *names])
        node.quals = _and([*lenient(keys, set(names)), *rest,
                           *([fenced(own, refs)] if own else [])])
    if len(names) >= 2:
        # its ON's conditions but its keys to one item, and those of the nullable side's own
        # joins, after those joins (over the nullable side's items only)
        inner: list[Any] = []
        quals = list(conjuncts(node.quals)) if node.quals is not None else []
        keys = [c for c in quals if is_key(c, from_names(kept), set(names))]
        inner += [c for c in quals if not any(c is k for k in keys)]
        nullable, keys = _nullable_side(nullable, keys, inner, scope)
        keys = lenient(keys, set(names))
        if inner:
            keys.append(fenced(inner, tuple(_ref(n, scope) for n in names)))
        node.quals = _and(keys)
    node.larg, node.rarg = (kept, nullable) if left_kept else (nullable, kept)
    if from_name(kept) in scope.derived:
        _kept_whole(node, kept, conds, scope)
    return node


def _nullable_side(side: Any, keys: list[Any], conds: list[Any],
                   scope: Scope) -> tuple[Any, list[Any]]:
    """The nullable side of an outer join (or of an inner one made outer), rewritten, and the
    join's keys left to it. Its own joins keep the item the keys touch (a key on another item
    would be strict on a side they may null: Postgres would make that join inner again, and
    an empty input of it would skip the rest), with sentinel rows where that is a subquery;
    keys on its other items go to `conds` with the rest."""
    names = _leaf_names(side)
    if len(names) < 2:
        return side, keys
    touched = [n for n in names if any(n in (reads(k) or ()) for k in keys)]
    core = touched[0] if touched else _core(_members(side), scope)
    kept = [k for k in keys if core in (reads(k) or ())]
    conds += [k for k in keys if not any(k is c for c in kept)]
    side = _whole_core(side, core, scope)
    return _region(side, conds, True, scope, core), kept


def _using_leaves(join: ast.JoinExpr) -> None:
    """USING equates the merged column strictly (a side's outer joins would turn inner):
    refused where a side it may null is itself a join."""
    raise refuse("USING where a side the join may null is itself a join, in a join of "
                  "several FROM items (write the join columns with ON)", node_sql(join))


def _whole(node: Any, scope: Scope) -> Any:
    """`node` with sentinel rows where it is a subquery over protected rows."""
    name = from_name(node)
    if name is None or name not in scope.derived or isinstance(node, ast.JoinExpr):
        return node
    scope.whole.add(name)
    return sentinel(node)


def _whole_core(node: Any, core: str | None, scope: Scope) -> Any:
    """`node` (a nullable side) with sentinel rows on its core where that is a subquery: its
    joins keep the core's rows, so it must have some."""
    if core is None or core not in scope.derived:
        return node
    if not isinstance(node, ast.JoinExpr):
        return _whole(node, scope) if from_name(node) == core else node
    node.larg = _whole_core(node.larg, core, scope)
    node.rarg = _whole_core(node.rarg, core, scope)
    return node


def _kept_apart(node: Any, scope: Scope) -> Any:
    """A public subquery or WITH query not merged into the scope (OFFSET 0): merged, a
    condition of its own on a join key (`WHERE code = 'VU'`) would become one on the
    protected item joined to it (`v.country = 'VU'`), filtering it where it is read."""
    if isinstance(node, ast.JoinExpr):
        node.larg, node.rarg = _kept_apart(node.larg, scope), _kept_apart(node.rarg, scope)
        return node
    name = from_name(node)
    if name is None or name in scope.uids:
        return node
    if isinstance(node, ast.RangeVar) and node.schemaname is None and \
            str(node.relname) in scope.public_ctes:
        sub: Any = parse_sql("SELECT * FROM dp_cte OFFSET 0")[0].stmt
        rv = copy.copy(node)
        rv.alias = None
        sub.fromClause = (rv,)
        return ast.RangeSubselect(lateral=False, subquery=sub,
                                  alias=node.alias or ast.Alias(aliasname=name))
    if isinstance(node, ast.RangeSubselect) and isinstance(node.subquery, ast.SelectStmt) \
            and node.subquery.limitCount is None and node.subquery.limitOffset is None:
        node.subquery.limitOffset = ast.A_Const(val=ast.Integer(ival=0))
    return node


def _kept_whole(join: ast.JoinExpr, kept: Any, conds: list[Any], scope: Scope) -> None:
    """An outer join whose preserved side is a subquery over protected rows: were it empty,
    Postgres would not read the other side. A FULL JOIN reads both, the conditions asking
    that the subquery's side is there; where the ON has no key to hash on (a FULL JOIN needs
    one), the subquery gets sentinel rows instead."""
    keys = [c for c in conjuncts(join.quals) if is_key(c, from_names(join.larg),
                                                         from_names(join.rarg))] \
        if join.quals is not None else []
    if keys or join.usingClause:
        join.jointype = JoinType.JOIN_FULL
        name = str(from_name(kept))  # (its rows of a NULL uid count nowhere: no uid equals it)
        conds.append(ast.NullTest(arg=ast.ColumnRef(fields=(ast.String(sval=name),
                                                             ast.String(sval=scope.uids[name]))),
                                  nulltesttype=NullTestType.IS_NOT_NULL))
    elif join.larg is kept:
        join.larg = sentinel(kept)
    else:
        join.rarg = sentinel(kept)


def _chain(items: list[Any], rest: list[Any], scope: Scope) -> Any:
    """FROM items listed with commas, in a group that converts, as one chain of inner joins on
    the keys of `rest` (WHERE's conditions; those used are taken out), from the item holding
    the group's core (`_region` then makes them outer); an item no key ties to those before
    it is cross joined."""
    core = _core([n for i in items for n in _members(i)], scope)
    first = next(i for i in items if core in _members(i))
    chain, names = first, from_names(first)
    todo = [i for i in items if i is not first]
    while todo:
        for item in todo:
            keys = [c for c in rest if is_key(c, names, from_names(item))]
            if keys:
                break
        else:
            item, keys = todo[0], []
        todo.remove(item)
        for k in keys:
            rest.remove(k)
        chain = ast.JoinExpr(jointype=JoinType.JOIN_INNER, larg=chain, rarg=item,
                             quals=_and(keys), isNatural=False)
        names = names | from_names(item)
    return chain


def _matched(side: Any, keys: list[Any], using: Any, scope: Scope) -> Any:
    """That an outer join made of an inner one found a row of its side `side`: a key column
    of that side is not NULL (an equality matched it, so it is not). With USING, the side's
    column of that name: its item's where `side` is one, else the one protected item of
    `side` whose uid the column is."""
    names = from_names(side)
    col: Any = None
    k: Any
    for k in keys:
        for part in (k.lexpr, k.rexpr):
            ref = column(part)
            if ref is not None and str(ref.fields[0].sval) in names:
                col = ref
                break
        if col is not None:
            break
    if col is None:
        columns = [str(c.sval) for c in using or ()]
        name = from_name(side)
        if name is None and columns:
            owners = [n for n in from_names(side) if scope.uids.get(n) == columns[0]]
            name = owners[0] if len(owners) == 1 else None
        if not columns or name is None:
            raise refuse("USING to a parenthesized join in a join of three or more FROM items "
                          "(write the join columns with ON)", node_sql(side))
        col = ast.ColumnRef(fields=(ast.String(sval=name), ast.String(sval=columns[0])))
    return ast.NullTest(arg=copy.deepcopy(col), nulltesttype=NullTestType.IS_NOT_NULL)


def _sides(items: list[Any], cond: Any) -> tuple[set[str], set[str]]:
    """For a key of two comma-listed items: the names of the two items it reads (else two
    empty sets)."""
    read = reads(cond) or frozenset()
    hit = [from_names(i) for i in items if from_names(i) & read]
    return (hit[0], hit[1]) if len(hit) == 2 else (set(), set())


