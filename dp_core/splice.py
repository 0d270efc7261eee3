"""Placeholders in our SQL templates, and splicing the user's AST nodes in where they stand.

A template names its placeholders with the prefix `PH`: columns (`dp_ph_uid`, `dp_ph_k0`,
...) and FROM items (`FROM dp_ph_from`); `Splice` puts the user's (validated) nodes in their
place, so that no user text is ever concatenated into SQL.
"""

from __future__ import annotations

import copy
from typing import Any

from pglast import ast

from dp_core.errors import InternalError

PH = "dp_ph_"


class Splice:
    """Replaces placeholders in the template with the user's AST nodes.

    A direct walk over the nodes' slots (pglast's generic Visitor, which tracks every node's
    ancestors, took half of a pushdown's build time); what it puts in is not walked again, so
    the user's own names are never taken for placeholders."""

    def __init__(self, nodes: dict[str, Any], from_clause: tuple[Any, ...],
                 inner_froms: dict[str, tuple[Any, ...]] | None = None) -> None:
        self.nodes = nodes
        self.froms = {f"{PH}from": from_clause, **(inner_froms or {})}
        """FROM placeholders (`FROM dp_ph_from`, ...) and the FROM clause each stands for."""

    def __call__(self, node: Any) -> Any:
        return self._walk(node)

    def _walk(self, node: Any) -> Any:
        """`node` with its placeholders replaced: the replacement when it is one itself."""
        if isinstance(node, ast.ColumnRef):
            fields = node.fields
            name = getattr(fields[-1], "sval", "") if fields else ""
            if len(fields) == 1 and name.startswith(PH):
                if name not in self.nodes:
                    raise InternalError()
                return copy.deepcopy(self.nodes[name])
            return node
        done = None
        if isinstance(node, ast.SelectStmt):
            fc = node.fromClause
            if fc and len(fc) == 1 and isinstance(fc[0], ast.RangeVar) and \
                    fc[0].relname in self.froms:
                node.fromClause = copy.deepcopy(self.froms[fc[0].relname])
                done = "fromClause"
        for slot in node.__slots__:
            if slot == done:
                continue
            value = getattr(node, slot)
            if isinstance(value, ast.Node):
                new = self._walk(value)
                if new is not value:
                    setattr(node, slot, new)
            elif isinstance(value, tuple) and value:
                new = self._walk_items(value)
                if new is not value:
                    setattr(node, slot, new)
        return node

    def _walk_items(self, items: tuple[Any, ...]) -> tuple[Any, ...]:
        """`items` with their placeholders replaced (the same tuple when none is there)."""
        out = [self._walk(v) if isinstance(v, ast.Node) else
               self._walk_items(v) if isinstance(v, tuple) else v for v in items]
        return tuple(out) if any(a is not b for a, b in zip(out, items, strict=True)) else items
