"""pglast's parse_sql and scan, in time linear in the text whatever characters it has.

pglast turns each node's or token's byte offset into a character index by scanning a list
of every multibyte byte after it: a text of a million emoji and a few hundred nodes took
30 s, in the event loop of the worker every session on it shares. A text that is not ASCII
is parsed to libpg_query's JSON instead (in C) and its tree built from that, and scanned
with each multibyte character written as as many x's as it has bytes; offsets are mapped
with one binary search each. Nodes, values, tokens and locations are pglast's (tested
against it).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from pglast import ast, enums, parser
from pglast import parse_sql as _pglast_parse_sql
from pglast.parser import parse_sql_json

from dp_core.errors import StatementTooComplex

SLOW_SCAN_WORK = 10_000_000
"""The most tokens × multibyte bytes of a text scanned by pglast itself (`scan`)."""
_EMPTY_TEXTS = {"String": "sval", "Float": "fval", "BitString": "bsval"}
_AS_X = bytes.maketrans(bytes(range(0x80, 0x100)), b"x" * 0x80)


def parse_sql(sql: str) -> tuple[ast.RawStmt, ...]:
    """The statements of `sql`, as `pglast.parse_sql` gives them (its ParseError too)."""
    if sql.isascii():  # (no multibyte character: pglast's own offsets cost nothing)
        return _pglast_parse_sql(sql)
    try:
        tree = json.loads(parse_sql_json(sql))
        build = _Builder(sql)
        return tuple(build.raw_stmt(s) for s in tree.get("stmts", ()))
    except RecursionError:  # (pglast builds its tree in C: a Python walk of it is limited)
        raise StatementTooComplex("a statement nested too deeply to read",
                                  hint="write long sums or concatenations with fewer "
                                       "levels, e.g. concat(a, b, c)") from None


def scan(sql: str) -> list[parser.Token]:
    """The lexical tokens of `sql`, as `pglast.parser.scan` gives them.

    Postgres's lexer reads a byte of a multibyte character as it reads a letter, so x's in
    its place make the same tokens, except that a word with a multibyte character is never
    a keyword (no keyword has "xx" in it) and that dollar-quote tags are compared whole: a
    dollar-quoted string whose closing tag is not its opening one in `sql` (two tags of
    multibyte characters alike in x's) is scanned by pglast, if that is cheap enough (54001
    otherwise)."""
    if sql.isascii():
        return parser.scan(sql)
    offsets = _Offsets(sql)
    ascii_sql = sql.encode("utf-8").translate(_AS_X).decode("ascii")
    multibyte = len(ascii_sql) - len(sql)
    try:
        found = parser.scan(ascii_sql)
    except parser.ParseError as e:
        if "$" in sql:  # (maybe a string ended too early: its true end is pglast's to find)
            return _slow_scan(sql, len(sql) * multibyte)
        raise offsets.error(sql, e) from None
    tokens = [parser.Token(offsets.inside(t.start), offsets.inside(t.end), t.name, t.kind)
              for t in found]
    if all(_same_tags(sql[t.start:t.end + 1]) for t in tokens if sql[t.start] == "$"):
        return tokens
    return _slow_scan(sql, len(tokens) * multibyte)


def _slow_scan(sql: str, work: int) -> list[parser.Token]:
    """pglast's own scan of `sql`, where its `work` (tokens × multibyte bytes) is small."""
    if work > SLOW_SCAN_WORK:
        raise StatementTooComplex(
            "a DP clause in a text whose dollar-quote tags of non-ASCII characters would "
            "take too long to compare", hint="write the tags of dollar quotes in ASCII")
    return parser.scan(sql)


def _same_tags(token: str) -> bool:
    """A token starting with $ (a parameter, or a dollar-quoted string): for the string, its
    closing tag is its opening one."""
    tag, sep, _ = token[1:].partition("$")
    return not sep or (token.endswith(f"${tag}$") and len(token) >= 2 * len(tag) + 4)


class _Offsets:
    """Byte offsets in a text's UTF-8 as pglast's character indexes."""

    def __init__(self, sql: str) -> None:
        points = np.frombuffer(sql.encode("utf-32-le"), dtype=np.uint32)
        sizes = 1 + (points > 0x7F) + (points > 0x7FF) + (points > 0xFFFF)
        self.starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        """The byte offset of each character, and the text's length in bytes last."""

    def index(self, offset: int) -> int | None:
        """The character holding byte `offset` (None beyond the text, as pglast)."""
        if not 0 <= offset < int(self.starts[-1]):
            return None
        return int(np.searchsorted(self.starts, offset, side="right")) - 1

    def inside(self, offset: int) -> int:
        """The character holding byte `offset`, a byte of the text."""
        index = self.index(offset)
        assert index is not None
        return index

    def error(self, sql: str, e: parser.ParseError) -> parser.ParseError:
        """`e`, raised on the text with x's, as pglast would raise it on `sql`: its index a
        character's, the text it quotes from `sql`."""
        message, at = e.args[0], e.args[1] if len(e.args) > 1 else None
        if at is None:
            return e
        head, sep, quoted = message.partition(' at or near "')
        if sep and quoted.endswith('"'):
            text = sql.encode("utf-8")[at:at + len(quoted) - 1].decode("utf-8", "replace")
            message = f'{head}{sep}{text}"'
        return parser.ParseError(message, self.index(at))


class _Builder(_Offsets):
    """Nodes from libpg_query's JSON, with its byte offsets as pglast's character indexes."""

    def raw_stmt(self, raw: dict[str, Any]) -> ast.RawStmt:
        start = raw.get("stmt_location", 0)
        first = self.index(start)
        end = self.index(start + raw.get("stmt_len", 0))
        length = None if first is None or end is None else end - first
        return ast.RawStmt(stmt=self.node(raw["stmt"]), stmt_location=first, stmt_len=length)

    def node(self, wrapped: dict[str, Any]) -> Any:
        """A node written as {"Type": {fields}} (a List as a tuple of its items; {} is a
        list's NULL item)."""
        if not wrapped:
            return None
        ((kind, fields),) = wrapped.items()
        if kind == "List":
            return tuple(self.node(item) for item in fields.get("items", ()))
        return self.typed(kind, fields)

    def typed(self, kind: str, fields: dict[str, Any]) -> Any:
        if kind == "A_Const":
            return self._const(fields)
        if kind in _EMPTY_TEXTS:  # (the JSON leaves an empty text out; pglast gives '')
            return getattr(ast, kind)(fields.get(_EMPTY_TEXTS[kind], ""))
        cls = getattr(ast, kind)
        # (pglast writes a field named as a Python keyword with a trailing _: def_)
        values = {name: self._value(info.c_type, fields.get(name.rstrip("_")))
                  for name, info in cls.__slots__.items()}
        return cls(**values)

    def _value(self, ctype: str, value: Any) -> Any:
        if ctype == "ParseLoc":
            return self.index(value if value is not None else 0)
        if ctype == "List*":
            return None if value is None else tuple(self.node(item) for item in value)
        if ctype == "Node*":
            return None if value is None else self.node(value)
        if ctype == "char*":
            return value
        if ctype.endswith("*"):  # a field of one node type is written without its wrapper
            if value is None:
                return None
            cls = getattr(ast, ctype[:-1], None)
            concrete = cls is not None and isinstance(cls.__slots__, dict)
            return self.typed(ctype[:-1], value) if concrete else self.node(value)
        if ctype == "bool":
            return bool(value)
        if ctype == "char":
            return value if value is not None else "\x00"
        enum = getattr(enums, ctype, None)
        if enum is not None:
            return enum[value] if value is not None else enum(0)
        return value if value is not None else 0

    def _const(self, fields: dict[str, Any]) -> ast.A_Const:
        if fields.get("isnull"):  # (pglast keeps no location of a constant)
            return ast.A_Const(isnull=True, val=None)
        for key, cls, default in (("ival", ast.Integer, 0), ("fval", ast.Float, ""),
                                  ("boolval", ast.Boolean, False), ("bsval", ast.BitString, ""),
                                  ("sval", ast.String, "")):
            if key in fields:
                val = cls(fields[key].get(key, default))
                return ast.A_Const(isnull=False, val=val)
        raise ValueError(f"a constant of no known kind: {sorted(fields)}")
