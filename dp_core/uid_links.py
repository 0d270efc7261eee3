"""Which protected FROM items a scope's joins tie to one user: uid equalities and USING on the uid.

A row of a DP query belongs to one user only where every protected FROM item in it has the
same uid (or none: an outer join's NULL side). `UidLinks` collects what says so, and only
what says so for every row the scope keeps:

- `a.uid = b.uid` among the conjuncts of WHERE, or of an inner join's ON;
- in an outer join's ON, only between an item of one side and an item of the other: the ON
  filters none of the preserved side's rows (`a JOIN b ON true LEFT JOIN c ON a.uid = b.uid`
  keeps every pair of a and b);
- `JOIN ... USING (c)` where each side's column c is a protected item's uid, not a column of
  another meaning with its name (`(SELECT uid AS u, 5 AS uid FROM visits) s JOIN purchases
  USING (uid)` gives every user of s the rows of user 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, JoinType

from dp_core.query import TableRef
from dp_core.sqlnodes import conjuncts, from_name


class UidLinks:
    """The links between protected FROM items (by alias) that equate their uids."""

    def __init__(self, tables: Sequence[TableRef]) -> None:
        self.tables = tables
        """The scope's protected FROM items (the list the FROM walk appends to)."""
        self.pairs: list[tuple[str, str]] = []
        """Links that hold in every row the scope keeps (WHERE, inner joins)."""
        self.outer: list[tuple[JoinType, set[str], set[str], list[tuple[str, str]]]] = []
        """Each outer join's links across its sides, with its kind and sides' items, from the
        innermost join out."""

    def join(self, join: ast.JoinExpr, left: set[str], right: set[str]) -> None:
        """A join's links (USING, ON), `left` and `right` its sides' protected items: an inner
        join's hold for every row it keeps; an outer join's only between an item of each side,
        and only where it matched (`connected`)."""
        found = self._using(join) + ([] if join.quals is None
                                     else self._equalities(join.quals))
        if join.jointype == JoinType.JOIN_INNER:
            self.pairs += found
            return
        across = [(a, b) if a in left else (b, a) for a, b in found
                  if (a in left and b in right) or (b in left and a in right)]
        kind: Any = join.jointype
        self.outer.append((kind, left, right, across))

    def where(self, cond: Any) -> None:
        """WHERE's links: they hold for every row kept."""
        self.pairs += self._equalities(cond)

    def connected(self) -> bool:
        """Whether the links tie every protected item to every other. An outer join's ON
        holds only where its sides matched: it attaches its nullable side's items to the one
        user its preserved side's linked items already are (for a FULL JOIN, each side's to
        the other's), never merging two of the preserved side (`a JOIN b ON true LEFT JOIN s
        ON s.uid = a.uid AND s.uid = b.uid` keeps every pair of a and b where s is NULL)."""
        parent = {t.alias: t.alias for t in self.tables}

        def find(a: str) -> str:
            while parent[a] != a:
                a = parent[a]
            return a

        for a, b in self.pairs:
            parent[find(a)] = find(b)
        for kind, _, _, across in self.outer:
            if not across:
                continue
            lefts = {find(a) for a, _ in across}
            rights = {find(b) for _, b in across}
            if (kind in (JoinType.JOIN_LEFT, JoinType.JOIN_FULL) and len(lefts) > 1) \
                    or (kind in (JoinType.JOIN_RIGHT, JoinType.JOIN_FULL) and len(rights) > 1):
                continue  # (its ON ties no user: the preserved side is more than one)
            first = find(across[0][0])
            for a, b in across:
                parent[find(a)] = first
                parent[find(b)] = first
        return len({find(t.alias) for t in self.tables}) <= 1

    def _equalities(self, cond: Any) -> list[tuple[str, str]]:
        """The uid equalities among `cond`'s conjuncts."""
        out = []
        for conj in conjuncts(cond):
            if (isinstance(conj, ast.A_Expr) and conj.kind == A_Expr_Kind.AEXPR_OP
                    and conj.name and conj.name[-1].sval == "="):
                a, b = self._uid_alias(conj.lexpr), self._uid_alias(conj.rexpr)
                if a and b and a != b:
                    out.append((a, b))
        return out

    def _using(self, join: ast.JoinExpr) -> list[tuple[str, str]]:
        """A join's USING columns: each links the items whose uid it is on both sides."""
        out = []
        for col in sorted({str(c.sval) for c in join.usingClause or ()}):
            left, right = self._uid_named(join.larg, col), self._uid_named(join.rarg, col)
            out += [(a, b) for a in sorted(left) for b in sorted(right)]
        return out

    def _uid_named(self, node: Any, col: str) -> set[str]:
        """The protected items whose uid is `node`'s column named `col`, where it is one (a
        FROM item; a join's column of that name is one side's, Postgres refusing a name both
        sides have, or with USING both sides', equal where neither is NULL)."""
        if isinstance(node, ast.JoinExpr):
            return self._uid_named(node.larg, col) | self._uid_named(node.rarg, col)
        alias = from_name(node)
        return {t.alias for t in self.tables if t.alias == alias and t.uid_column == col}

    def _uid_alias(self, node: Any) -> str | None:
        """The alias whose uid column `node` names (alias.uid), if any."""
        fields = tuple(node.fields or ()) if isinstance(node, ast.ColumnRef) else ()
        if len(fields) != 2 or not all(isinstance(f, ast.String) for f in fields):
            return None
        alias, col = str(fields[0].sval), str(fields[1].sval)
        for t in self.tables:
            if t.alias == alias and t.uid_column == col:
                return alias
        return None
