"""How many public rows one protected row can meet in a DP query's joins: a bound from the text and catalog.

DESIGN §3.11: no construct may let one user's rows multiply the backend's work. A join with a
public table gives each protected row every public row it matches: `visits CROSS JOIN
countries a CROSS JOIN countries b` gives each of a user's rows 200² rows to work through,
and the query's time then tells that user's rows (a timing side channel) where the cross
join of a few public tables outlasts the statement timeout (an error). Each public FROM item
of a scope that reads protected rows (`PublicItem`) is bounded by what the query's text and
the catalog say, never by protected data:

- tied by an equality (`c.code = v.country`, in WHERE or an inner join's ON, or in an outer
  join's ON to an item of its other side) to items already bounded, on a column with a
  unique index (a PRIMARY KEY or UNIQUE column, from the catalog), against a column or an
  expression cast to a type its equality compares exactly, or to a literal (also in a
  public subquery's own WHERE): 1 row;
- a VALUES list tied on one of its columns: the most rows sharing one literal value there;
- else its rows (a table's, counted up to the limit: public data the analysts may read).

The bounds multiply (each given the items before it); a query whose product exceeds
`PUBLIC_ROWS_PER_ROW` is refused (54000) before anything runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind

from dp_core.errors import ProgramLimitExceeded
from dp_core.query import PublicItem, PublicSource, Relation, TieKey
from dp_core.sqlnodes import conjuncts, from_name, from_names, node_sql, walk_nodes

PUBLIC_ROWS_PER_ROW = 100
"""The most public rows one protected row may meet in a DP query's joins (as
`ownership.JOIN_ROWS_PER_USER` bounds a user's rows in a join of protected tables)."""
SUBLINK_READ_ROWS = 10_000
"""The rows an IN or EXISTS subquery may read (its table's, its WHERE aside). Postgres runs
one once, and only where a row of the query reaches it: whether it runs at all can depend on
one user's rows, so what it reads must be small (10,000 rows: about a millisecond, within
the release quantum; `dp_core.join_fence`)."""
IN_COMPARISONS_PER_ROW = 10
"""An IN subquery's row costs a protected row one comparison (where Postgres scans them
rather than hash them), a joined row its trip through the join and the per-user aggregation:
about ten comparisons."""


def values_source(lists: Sequence[Sequence[Any]], names: Sequence[str]) -> PublicSource:
    """A VALUES list with its columns `names`: its rows, and per column of integer literals
    alone, or of string literals alone, the most rows that share one value (strings compared
    case-folded, trailing spaces dropped: as no collation or padded type could tell apart
    fewer); a column with any other expression is not counted."""
    repeats: dict[str, int] = {}
    for j, name in enumerate(names):
        values = [row[j].val if j < len(row) and isinstance(row[j], ast.A_Const) else None
                  for row in lists]
        if all(isinstance(v, ast.Integer) for v in values):
            seen = Counter(str(v.ival) for v in values if isinstance(v, ast.Integer))
        elif all(isinstance(v, ast.String) for v in values):
            seen = Counter(str(v.sval).casefold().rstrip() for v in values
                           if isinstance(v, ast.String))
        else:
            continue
        repeats[name] = max(seen.values(), default=0)
    return PublicSource(rows=len(lists), repeats=repeats, order=tuple(names))


Partners = Callable[[Any], "tuple[Relation, str] | None"]
"""The table column an expression is as it is (alias.col of a table item), or None."""


Tie = tuple[str, TieKey, frozenset[str], "frozenset[str] | None"]
"""(the public item, its column and what it equals, the items the other side reads, and
where it holds only if every protected item of the scope is among them: those items)."""


def ties(cond: Any, public: Sequence[str], partner: Partners,
         outer: tuple[set[str], set[str], set[str]] | None = None) -> list[Tie]:
    """The equalities among `cond`'s conjuncts between a public item's column (`alias.col`,
    `alias` in `public`) and an expression of other items' qualified columns (or of none).
    `outer`: an outer join's two sides' items and its nullable side's (none for FULL): its
    ON bounds the rows of an item on its nullable side that meet each row of the rest, but
    an item on a preserved side keeps all its rows, and meets only a protected row of the
    other side once (`outer_tie`)."""
    out = []
    for col, other in _equal_sides(cond):
        name = _qualified(col)
        reads = _reads(other)
        if name is None or name[0] not in public or reads is None or name[0] in reads:
            continue
        literal = isinstance(other, ast.A_Const) and isinstance(other.val, (ast.String,
                                                                             ast.Integer))
        cast = node_sql(other.typeName) if isinstance(other, ast.TypeCast) else None
        key = TieKey(name[1], partner(other), literal,
                     literal or _qualified(other) is not None, cast)
        tie = (name[0], key, reads, None) if outer is None \
            else outer_tie(name[0], key, reads, *outer)
        if tie is not None:
            out.append(tie)
    return out


def _equal_sides(cond: Any) -> Iterator[tuple[Any, Any]]:
    """Each side of each `=` among `cond`'s conjuncts, with the other side."""
    for conj in conjuncts(cond):
        if isinstance(conj, ast.A_Expr) and conj.kind == A_Expr_Kind.AEXPR_OP \
                and conj.name and conj.name[-1].sval == "=":
            yield conj.lexpr, conj.rexpr
            yield conj.rexpr, conj.lexpr


def using_ties(join: ast.JoinExpr, public: Sequence[str], partner: Partners,
               outer: tuple[set[str], set[str], set[str]] | None = None) -> list[Tie]:
    """A join's USING columns where a public item is alone on one side: its column equals
    the other side's (that item's, where the other side is one item too)."""
    sides = (from_names(join.larg), from_names(join.rarg))
    out: list[Tie] = []
    for col in (str(c.sval) for c in join.usingClause or ()):
        for one, other, theirs in ((join.larg, sides[1], join.rarg),
                                   (join.rarg, sides[0], join.larg)):
            alias, them = from_name(one), from_name(theirs)
            if alias is None or alias not in public:
                continue
            key = TieKey(col, None if them is None else partner(ast.ColumnRef(
                fields=(ast.String(sval=them), ast.String(sval=col)))))
            tie = (alias, key, frozenset(other), None) if outer is None \
                else outer_tie(alias, key, frozenset(other), *outer)
            out += [] if tie is None else [tie]
    return out


def outer_tie(alias: str, key: TieKey, reads: frozenset[str], left: set[str], right: set[str],
              nullable: set[str]) -> Tie | None:
    """A tie in an outer join's ON (or USING): of an item on its nullable side, to items of
    the join; of an item on a preserved side, to items of the other side, holding only where
    every protected item is there (`countries c LEFT JOIN visits v ON c.code = v.country`);
    else none."""
    if alias in nullable:
        return (alias, key, reads, None) if reads <= left | right else None
    other = right if alias in left else left
    return (alias, key, reads, frozenset(other)) if reads <= other else None


def anchor(public: Mapping[str, PublicSource], bounded: set[str],
           found: Sequence[Tie]) -> list[PublicItem]:
    """Each public item with the columns that tie it to items bounded before it: from the
    protected items (`bounded`), each item tied to bounded ones is bounded next, with every
    tie it has to them then (its rows meet them all); where none is tied, the first item left
    is bounded by its rows, and others may then be tied to it."""
    found = [t for t in found if t[3] is None or bounded <= t[3]]
    done = set(bounded)
    items: list[PublicItem] = []
    keys: dict[str, tuple[TieKey, ...]] = {}
    while len(done - bounded) < len(public):
        ready: dict[str, list[TieKey]] = {}
        for alias, key, reads, _ in found:
            if alias not in done and reads <= done:
                ready.setdefault(alias, []).append(key)
        if not ready:
            done.add(next(a for a in public if a not in done))  # (bounded by its rows)
            continue
        for alias, found_keys in ready.items():
            keys[alias] = tuple(dict.fromkeys(found_keys))
        done |= ready.keys()
    for alias, source in public.items():
        items.append(PublicItem(source, keys.get(alias, ())))
    return items


Unique = Callable[[Relation, str, TieKey], bool]
"""Whether a table's column (as the catalog says) has one row per value under the equality
a tie compares it with."""
Composite = Callable[[Relation, Sequence[tuple[str, TieKey]]], bool]
"""Whether a table's columns tied as listed include all the columns of a unique index of
several (as the catalog says), each under the equality its tie compares it with."""


def _none(relation: Relation, tied: Sequence[tuple[str, TieKey]]) -> bool:
    return False


def row_bound(items: Sequence[PublicItem], unique: Unique,
              rows: Callable[[Relation], int], in_lists: Sequence[int] = (),
              composite: Composite = _none) -> float:
    """The most public rows one protected row meets, in joined rows: the product of each
    item's bound (1 on a unique column it is tied by; a VALUES list's repeats of the value it
    is tied on; else its rows), `unique` and `rows` saying what the catalog and the public
    tables hold; times the IN subqueries' comparisons, IN_COMPARISONS_PER_ROW to a joined row
    (`in_lists`: their rows, each of which Postgres may compare a row with where it does not
    hash them); `composite`: tied on all the columns of a unique index of several, 1 too."""
    total = max(1.0, sum(in_lists) / IN_COMPARISONS_PER_ROW)
    for item in items:
        total *= _item_bound(item, unique, rows, composite)
        if total > PUBLIC_ROWS_PER_ROW:
            break
    return total


def check_row_bound(items: Sequence[PublicItem], unique: Unique,
                    rows: Callable[[Relation], int], in_lists: Sequence[int] = (),
                    composite: Composite = _none) -> None:
    """54000 where the query's joins (and IN subqueries) may give one protected row more
    than PUBLIC_ROWS_PER_ROW public rows."""
    bound = row_bound(items, unique, rows, in_lists, composite)
    if bound > PUBLIC_ROWS_PER_ROW:
        raise ProgramLimitExceeded(
            f"this DP query's joins with public tables can give one protected row more than "
            f"{PUBLIC_ROWS_PER_ROW} public rows (its time would grow with one user's rows "
            f"times theirs)", hint="join each public table on a column with a unique index "
            "(PRIMARY KEY or UNIQUE) by equality, join smaller ones, and keep IN (SELECT ...) "
            f"to at most {PUBLIC_ROWS_PER_ROW * IN_COMPARISONS_PER_ROW} rows in all (or list "
            "the values)")


def counted(items: Sequence[PublicItem], unique: Unique, composite: Composite = _none
            ) -> set[Relation]:
    """The tables whose rows bound some item (those not tied on a unique column, or on all
    the columns of a unique index): the only ones whose rows need counting."""
    return {item.source.relation for item in items if item.source.relation is not None
            and not _on_unique(item, unique, composite)}


def _on_unique(item: PublicItem, unique: Unique, composite: Composite) -> bool:
    """Whether a table item is tied on a column with one row per value, or on all the columns
    of a unique index."""
    source = item.source
    assert source.relation is not None
    tied = [(column, key) for key in item.keys
            if (column := source.column(key.column)) is not None]
    tied += [(key.column, key) for key in source.own]
    return any(unique(source.relation, column, key) for column, key in tied) or \
        (len(tied) > 1 and composite(source.relation, tied))


def _item_bound(item: PublicItem, unique: Unique,
                rows: Callable[[Relation], int], composite: Composite) -> int:
    source = item.source
    if source.relation is None:
        tied = [source.repeats[k.column] for k in item.keys
                if k.column in source.repeats and k.bare]  # (a bare column: a join clause)
        return min([source.rows, *tied])
    return 1 if _on_unique(item, unique, composite) else rows(source.relation)


def column_of(node: Any, sources: Mapping[str, PublicSource]) -> tuple[Relation, str] | None:
    """The table column `node` is as it is (alias.col of an item in `sources` that reads it
    as it is), or None (`TieKey.partner`)."""
    name = _qualified(node)
    source = None if name is None else sources.get(name[0])
    column = None if name is None or source is None else source.column(name[1])
    return None if source is None or source.relation is None or column is None \
        else (source.relation, column)


def _qualified(node: Any) -> tuple[str, str] | None:
    if not isinstance(node, ast.ColumnRef):
        return None
    fields = tuple(node.fields or ())
    if len(fields) != 2 or not all(isinstance(f, ast.String) for f in fields):
        return None
    return str(fields[0].sval), str(fields[1].sval)


def _reads(node: Any) -> frozenset[str] | None:
    """The aliases an expression's columns are qualified by; None where it reads a column
    unqualified (whose item Postgres decides) or has a subquery."""
    out = set()
    for n in walk_nodes(node):
        if isinstance(n, ast.SubLink):
            return None
        if isinstance(n, ast.ColumnRef):
            name = _qualified(n)
            if name is None:
                return None
            out.add(name[0])
    return frozenset(out)


def renamed(source: PublicSource, alias: Any) -> PublicSource:
    """`source` as a FROM item whose alias may rename its columns by position (where their
    order is known: a VALUES list's, a subquery's select list; a table's columns, whose order
    is not known here, are then none taken for a unique one)."""
    names = [str(c.sval) for c in (alias.colnames or ())] if alias is not None else []
    if not names:
        return source
    if not source.order:
        return replace(source, columns={} if source.relation is not None else None,
                       repeats={})
    new = {old: names[j] if j < len(names) else old for j, old in enumerate(source.order)}
    twice = {n for n in new.values() if list(new.values()).count(n) > 1}  # (ambiguous)
    columns = None if source.columns is None else {
        new[c]: t for c, t in source.columns.items() if c in new and new[c] not in twice}
    return replace(source, columns=columns,
                   repeats={new[c]: n for c, n in source.repeats.items()
                            if c in new and new[c] not in twice},
                   order=tuple(new.values()))


def selected_source(sub: ast.SelectStmt, known: Mapping[Any, PublicSource]) -> PublicSource:
    """What a public subquery of one table (or none) reads, with the output columns that are
    that table's columns as they are, or a VALUES list's (`known`: the public WITH queries'
    sources, by name)."""
    (item,) = sub.fromClause or (None,)
    if item is None:
        return PublicSource()
    name = str(item.relname)
    base = known[name] if item.schemaname is None and name in known \
        else PublicSource((str(item.schemaname) if item.schemaname else None, name))
    base = renamed(base, item.alias)
    literal = (*base.own, *_literal_ties(sub.whereClause, base,
                                     str(item.alias.aliasname) if item.alias else name))
    targets = sub.targetList or ()
    columns: dict[str, str] = {}
    repeats: dict[str, int] = {}
    order: list[str] = []
    for target in targets:
        last = (target.val.fields or (None,))[-1] if isinstance(target.val, ast.ColumnRef) \
            else None
        if isinstance(last, ast.A_Star):
            if len(targets) == 1:
                return replace(base, own=literal)
            return PublicSource(base.relation, {}, base.rows, own=literal)
        own = str(last.sval) if isinstance(last, ast.String) else None
        out = str(target.name) if target.name else own or "?column?"
        order.append(out)
        if own is None:
            continue
        column = base.column(own)
        if column is not None:
            columns[out] = column
        if own in base.repeats:
            repeats[out] = base.repeats[own]
    return PublicSource(base.relation, columns, base.rows, repeats, tuple(order), literal)


def _literal_ties(where: Any, source: PublicSource, alias: str) -> list[TieKey]:
    """The table columns `where`'s conjuncts equate to a plain string or integer literal (a
    column unqualified or qualified by `alias`, as the table has it: `source.column`)."""
    out = []
    for col, other in _equal_sides(where):
        fields = tuple(col.fields or ()) if isinstance(col, ast.ColumnRef) else ()
        names = [str(f.sval) for f in fields if isinstance(f, ast.String)]
        if not fields or len(names) != len(fields) or len(names) > 2 \
                or (len(names) == 2 and names[0] != alias):
            continue
        if not (isinstance(other, ast.A_Const)
                and isinstance(other.val, (ast.String, ast.Integer))):
            continue
        column = source.column(names[-1])
        if column is not None:
            out.append(TieKey(column, literal=True))
    return out


def table_columns(sel: ast.SelectStmt) -> PublicSource | None:
    """The columns a protected inner query of one table (by name, in its configured schema)
    selects as they are, where it reads one: a join key's partner (`TieKey.partner`)."""
    items = tuple(sel.fromClause or ())
    if len(items) != 1 or not isinstance(items[0], ast.RangeVar) or not items[0].schemaname:
        return None
    return selected_source(sel, {})

