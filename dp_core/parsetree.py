"""Reading pglast's JSON parse tree: walks, names, constants and parameters."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def range_vars(node: Any) -> Iterator[Mapping[str, Any]]:
    """Every relation reference below `node`.

    In pglast's JSON a field typed RangeVar appears without its type wrapper
    (`"relation": {"relname": ...}`), so any object with a `relname` counts.
    """
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            if "relname" in cur:
                yield cur
            stack.extend(v for v in cur.values() if isinstance(v, (dict, list)))
        elif isinstance(cur, list):
            stack.extend(cur)


def walk(node: Any, wanted: str, skip: frozenset[str] = frozenset()) -> Iterator[Mapping[str, Any]]:
    """Every node of type `wanted` below `node` in a JSON parse tree, not entering `skip` types."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            for k, v in cur.items():
                if k in skip:
                    continue
                if k == wanted and isinstance(v, dict):
                    yield v
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(cur, list):
            stack.extend(cur)


def const_value(node: Any) -> str | float | int | None:
    """A constant of a JSON parse tree (string, integer or float); None for anything else."""
    const = node.get("A_Const") if isinstance(node, dict) else None
    if const is None:
        return None
    if "ival" in const:
        return int(const["ival"].get("ival", 0))  # protobuf omits zero
    if "fval" in const:
        return float(const["fval"].get("fval", "0"))
    if "sval" in const:
        return str(const["sval"].get("sval", ""))
    return None


def literal(node: Any) -> str | int | None:
    """A string or integer constant, also cast (`'x'::text`); None for anything else."""
    if isinstance(node, dict) and "TypeCast" in node:
        node = node["TypeCast"].get("arg")
    value = const_value(node)
    return None if isinstance(value, float) else value


def highest_parameter(tree: Any) -> int:
    """The highest $n in a statement's JSON parse tree (0 when there is none)."""
    highest, stack = 0, [tree]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            ref = cur.get("ParamRef")
            if isinstance(ref, dict):
                highest = max(highest, int(ref.get("number", 0)))
            stack.extend(v for v in cur.values() if isinstance(v, (dict, list)))
        elif isinstance(cur, list):
            stack.extend(cur)
    return highest


def func_name(fc: Mapping[str, Any]) -> str:
    parts = [p.get("String", {}).get("sval", "") for p in fc.get("funcname", [])]
    return parts[-1].lower() if parts else ""


def const_int(node: Any) -> int | None:
    const = node.get("A_Const") if isinstance(node, dict) else None
    if const is None or "ival" not in const:
        return None
    return int(const["ival"].get("ival", 0))  # protobuf omits zero
