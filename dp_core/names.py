"""Names in HAVING and ORDER BY, read as Postgres reads them (and the proxy's one extension).

Postgres reads a name in HAVING as an input column (a column of the FROM items), which outside
an aggregate must be a GROUP BY key (42803). In ORDER BY a bare name (`ORDER BY x`) is an output
column first (42702 where two of that name differ), else an input column; a name inside an
expression (`ORDER BY x + 1`) is an input column only. Which names are input columns, and which
are grouped, is the database's to say: for each reference Postgres answers when the proxy
prepares `probes.column_probe_sql` (never run), and the analysis runs again with the answers
(`InputColumns`). An expression equal to a GROUP BY expression as written is that key, the
columns inside it unasked (`HAVING upper(browser) <> 'X'` of `GROUP BY upper(browser)`). The one
extension: in HAVING, an output alias where no input column has the name, inside any
expression (`HAVING n * 2 > 10`): a filter on released values, post-processing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence, Set
from typing import Any

from pglast import ast

from dp_core.catalogue import LATER_FUNCTIONS, OTHER_AGGREGATES, is_dp_aggregate
from dp_core.errors import AmbiguousColumn, DPError, FeatureNotSupported, InvalidColumnReference
from dp_core.sqlnodes import func_name, node_sql, refuse, same_node

ColumnName = tuple[str, ...]
"""A column reference as written: ("country",) or ("v", "country")."""

InputColumns = Mapping[ColumnName, DPError | None]
"""What Postgres makes of each column reference read outside aggregates in the DP query's FROM,
grouped as the proxy groups it (`column_probe_sql`): None for a GROUP BY key, else its error
(42803: an input column that is not grouped; 42703: no input column has the name; 42702, 42P01:
the query's error)."""

ABSENT = "42703"
"""Postgres's SQLSTATE for a name no input column has (undefined_column)."""
UNGROUPED = "42803"
"""Postgres's SQLSTATE for an input column that is not grouped (grouping_error)."""


def column_name(node: Any) -> ColumnName | None:
    """The fields of a column reference; None for anything else (and for `t.*`)."""
    if not isinstance(node, ast.ColumnRef) or not node.fields \
            or not all(isinstance(f, ast.String) for f in node.fields):
        return None
    return tuple(str(f.sval) for f in node.fields)


class Names:
    """HAVING and ORDER BY with every name replaced by what Postgres reads it as: a grouped input
    column by its GROUP BY expression, an output column by its select-list expression (HAVING,
    the extension) or its position (a bare ORDER BY name). The result query (dp_core.result)
    then maps expressions onto released columns and reads no name itself."""

    def __init__(self, targets: Sequence[tuple[str, Any]], groups: Sequence[Any],
                 columns: InputColumns | None, aliased_groups: Set[str] = frozenset()) -> None:
        self.targets = list(targets)
        """The select list: (output name, expression as written), in order."""
        self.groups = list(groups)
        """The GROUP BY expressions, as the query is grouped (`AnalyzedQuery.grouped_by`)."""
        self.aliased_groups = aliased_groups
        """Names GROUP BY reads as an output column of another expression (`GROUP BY x` of
        `upper(x) AS x`), where Postgres reads the input column x."""
        self.columns = columns
        self.missing: list[ColumnName] = []
        """References Postgres has not answered for (`AnalyzedQuery.name_checks`)."""
        self.reads: list[Any] = []
        """The GROUP BY expressions the names read (each released, hidden if not selected)."""

    def having(self, node: Any) -> Any:
        """HAVING as Postgres reads it: names are input columns; where no input column has
        the name, an output alias (the extension), in any expression."""
        return None if node is None else self._rewrite(copy.deepcopy(node), alias=True)

    def order_by(self, sorts: Sequence[ast.SortBy], distinct: bool = False
                 ) -> tuple[ast.SortBy, ...]:
        """ORDER BY as Postgres reads it: a bare name is an output column first (written as its
        position), else an input column; names inside expressions are input columns. Of a
        SELECT DISTINCT, each must be a select-list expression."""
        out = []
        for sort in sorts:
            sort = copy.deepcopy(sort)
            asked = len(self.missing)
            position = self._output_position(sort.node)
            sort.node = position if position is not None \
                else self._rewrite(sort.node, alias=False)
            if distinct and len(self.missing) == asked and not isinstance(sort.node, ast.A_Const) \
                    and not any(same_node(sort.node, val) for _, val in self.targets):
                raise InvalidColumnReference(
                    "for SELECT DISTINCT, ORDER BY expressions must appear in select list")
            out.append(sort)
        return tuple(out)

    def _output_position(self, node: Any) -> ast.A_Const | None:
        """The position of the output column a bare ORDER BY name names (Postgres takes the
        first of equal ones and refuses the name where they differ), or None."""
        name = column_name(node)
        if name is None or len(name) != 1:
            return None
        found = [(i, val) for i, (n, val) in enumerate(self.targets) if n == name[0]]
        if not found:
            return None
        if any(not same_node(found[0][1], val) for _, val in found[1:]):
            raise AmbiguousColumn(f'ORDER BY "{name[0]}" is ambiguous')
        return ast.A_Const(val=ast.Integer(ival=found[0][0] + 1))

    def _rewrite(self, node: Any, alias: bool) -> Any:
        """`node` (a copy, changed in place) with its names replaced. An expression equal to a
        GROUP BY expression is that key, whatever columns it reads (`HAVING upper(browser) <>
        'X'` of `GROUP BY upper(browser)`), as Postgres matches them before it looks inside."""
        if isinstance(node, ast.ColumnRef):
            return self._column(node, alias)
        if isinstance(node, ast.Node):
            for g in self.groups:
                if column_name(g) is None and same_node(node, g):
                    self.reads.append(g)
                    return copy.deepcopy(g)
        if isinstance(node, ast.FuncCall) and node.over is None:
            name = func_name(node)
            if is_dp_aggregate(name):
                return node  # its arguments are rows' values, which the pushdown reads
            if name in OTHER_AGGREGATES or name in LATER_FUNCTIONS or node.agg_star \
                    or node.agg_distinct or node.agg_order or node.agg_filter is not None \
                    or node.agg_within_group:
                # (Postgres would aggregate rows with it; there is no noisy form of it)
                raise refuse(f"aggregates without a DP form in HAVING or ORDER BY: {name}()",
                             node_sql(node))
        if isinstance(node, ast.SubLink):
            return node  # (the result query refuses it)
        if isinstance(node, ast.Node):
            for attr in node:
                setattr(node, attr, self._rewrite(getattr(node, attr), alias))
            return node
        if isinstance(node, (tuple, list)):
            return type(node)(self._rewrite(item, alias) for item in node)
        return node

    def _column(self, node: ast.ColumnRef, alias: bool) -> Any:
        name = column_name(node)
        if name is None:
            return node  # (t.*: the result query refuses it)
        if self.columns is None or name not in self.columns:
            self.missing.append(name)
            return node
        error = self.columns[name]
        if error is None:
            return self._key(name)
        if error.sqlstate == UNGROUPED and name[-1] in self.aliased_groups:
            raise FeatureNotSupported(
                f"not allowed in a DP query (GROUP BY {name[-1]} read as the output column "
                f"{name[-1]}, with HAVING or ORDER BY reading the input column {name[-1]})",
                hint=f"Postgres groups by the input column {name[-1]}: group by the expression "
                     "(or its position) and give its output column another name")
        if alias and error.sqlstate == ABSENT and len(name) == 1:
            return self._alias(name[0], error)
        raise error

    def _key(self, name: ColumnName) -> Any:
        """The GROUP BY expression a grouped input column is, as written there: `country` and
        `v.country` name one column where Postgres finds it grouped."""
        exact = [g for g in self.groups if column_name(g) == name]
        near = [g for g in self.groups if (written := column_name(g)) is not None
                and written[-1] == name[-1] and 1 in (len(written), len(name))]
        found = exact or near
        if not found or any(not same_node(found[0], g) for g in found[1:]):
            # (grouped through another key: a primary key's table, or a USING column grouped
            # from both sides)
            raise refuse("a column that HAVING or ORDER BY reads must be a GROUP BY key as "
                          "written", ".".join(name))
        self.reads.append(found[0])
        return copy.deepcopy(found[0])

    def _alias(self, name: str, absent: DPError) -> Any:
        """The select-list expression of the output column `name`, where no input column has
        that name (the extension); Postgres's error where no output column has it either."""
        found = [val for n, val in self.targets if n == name]
        if not found:
            raise absent
        if any(not same_node(found[0], val) for val in found[1:]):
            raise AmbiguousColumn(f'column reference "{name}" is ambiguous')
        return copy.deepcopy(found[0])
