"""Find and strip the DP clause `SELECT WITH ANONYMIZATION [OPTIONS(...)]`, which pglast cannot parse.

The clause is found with pglast's scanner, so text inside strings, quoted
identifiers and comments is never matched. It is replaced by spaces of the same
UTF-8 length, so every byte offset the parser reports afterwards still points
into the original text. (The scanner counts characters; the parse tree counts
bytes.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pglast import parser

from dp_core.errors import SyntaxError_
from dp_core.sql_parse import scan

DP_KEYWORDS = frozenset({"anonymization", "differential_privacy"})
OPTION_NAMES = frozenset({"epsilon", "delta", "max_groups_contributed", "noise",
                          "partition_selection", "privacy_unit_column",
                          "max_rows_contributed"})
"""BigQuery's privacy_unit_column must name the configured uid column (the analysis checks
it); max_rows_contributed is T of row-level aggregates (`dp_core.tuning`)."""

OptionValue = float | int | str


@dataclass(frozen=True)
class DPClause:
    """One `WITH ANONYMIZATION` clause: where its SELECT starts, and its options."""

    select_offset: int
    """UTF-8 byte offset of the SELECT keyword the clause belongs to: in the text it was found
    in (`strip_dp_clauses`), in its statement's own text once classified (`Statement`)."""
    options: tuple[tuple[str, OptionValue], ...] = ()

    def option(self, name: str) -> OptionValue | None:
        for k, v in self.options:
            if k == name:
                return v
        return None


def might_have_dp_clause(sql: str) -> bool:
    """Cheap pre-filter: False means the text certainly has no DP clause nor ANON_COUNT(*, U)."""
    low = sql.lower()
    return "anonymization" in low or "differential_privacy" in low or "anon_count" in low


def strip_dp_clauses(sql: str) -> tuple[str, tuple[DPClause, ...]]:
    """Return `sql` with every DP clause blanked out, and the clauses found.

    Raises SyntaxError_ (42601) for a malformed OPTIONS list.
    """
    if not might_have_dp_clause(sql):
        return sql, ()
    try:
        tokens = list(scan(sql))
    except parser.ParseError as e:
        raise SyntaxError_(str(e)) from None
    raw = sql  # token offsets index characters
    pieces: list[str] = []
    done = 0
    clauses = []
    counted = counted_to = 0
    in_dp_statement = False
    """Since a DP clause, up to the end of its statement: BigQuery's COUNT(*, bounds) is read
    there as ANON_COUNT(*, U) is everywhere."""
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if (
            t.name == "SELECT"
            and i + 2 < len(tokens)
            and tokens[i + 1].name == "WITH"
            and tokens[i + 2].name == "IDENT"
            and _text(raw, tokens[i + 2]).lower() in DP_KEYWORDS
        ):
            start = tokens[i + 1].start
            j = i + 3
            options: tuple[tuple[str, OptionValue], ...] = ()
            if j < len(tokens) and tokens[j].name == "OPTIONS":
                options, j = _parse_options(raw, tokens, j + 1)
            end = tokens[j - 1].end + 1
            pieces.append(sql[done:start])
            pieces.append(" " * len(sql[start:end].encode("utf-8")))
            done = end
            # (the SELECT's byte offset, counted on from the last clause's: linear in the text)
            counted += len(sql[counted_to : t.start].encode("utf-8"))
            counted_to = t.start
            clauses.append(DPClause(counted, options))
            in_dp_statement = True
            i = j
        elif t.name == "ASCII_59":
            in_dp_statement = False
            i += 1
        elif (
            t.name == "IDENT"
            and (_text(raw, t).lower() == "anon_count"
                 or (in_dp_statement and _text(raw, t).lower() == "count"))
            and i + 3 < len(tokens)
            and tokens[i + 1].name == "ASCII_40"
            and tokens[i + 2].name == "ASCII_42"
            and tokens[i + 3].name == "ASCII_44"
        ):
            # ANON_COUNT(*, U) (and in a DP query BigQuery's COUNT(*, contribution_bounds_per_group
            # => (L, U))) is not Postgres grammar; counting 1 counts the same rows
            star = tokens[i + 2].start
            pieces.append(sql[done:star])
            pieces.append("1")
            done = star + 1
            i += 4
        else:
            i += 1
    pieces.append(sql[done:])
    return "".join(pieces), tuple(clauses)


def _text(raw: str, tok: parser.Token) -> str:
    return raw[tok.start : tok.end + 1]


def _parse_options(
    raw: str, tokens: list[parser.Token], j: int
) -> tuple[tuple[tuple[str, OptionValue], ...], int]:
    """Parse `( name = value [, ...] )` starting at the token after OPTIONS."""

    def expect(name: str, what: str) -> None:
        if j >= len(tokens) or tokens[j].name != name:
            got = _text(raw, tokens[j]) if j < len(tokens) else "end of input"
            raise SyntaxError_(f"syntax error in OPTIONS: expected {what}, found {got!r}")

    expect("ASCII_40", "'('")
    j += 1
    opts: dict[str, OptionValue] = {}
    while True:
        if j < len(tokens) and tokens[j].name == "ASCII_41" and not opts:
            j += 1
            break
        if j >= len(tokens) or tokens[j].kind == "RESERVED_KEYWORD":
            expect("IDENT", "an option name")
        name = _text(raw, tokens[j]).lower()
        if name not in OPTION_NAMES:
            raise SyntaxError_(
                f"unknown option {name!r} in OPTIONS",
                hint=f"allowed options: {', '.join(sorted(OPTION_NAMES))}",
            )
        if name in opts:
            raise SyntaxError_(f"option {name!r} given twice in OPTIONS")
        j += 1
        expect("ASCII_61", "'='")
        j += 1
        value, j = _parse_value(raw, tokens, j)
        opts[name] = value
        if j < len(tokens) and tokens[j].name == "ASCII_44":
            j += 1
            continue
        expect("ASCII_41", "',' or ')'")
        j += 1
        break
    return tuple(opts.items()), j


def _parse_value(raw: str, tokens: list[parser.Token], j: int) -> tuple[OptionValue, int]:
    sign = 1
    if j < len(tokens) and tokens[j].name in ("ASCII_45", "ASCII_43"):
        sign = -1 if tokens[j].name == "ASCII_45" else 1
        j += 1
    if j >= len(tokens):
        raise SyntaxError_("syntax error in OPTIONS: expected a value, found end of input")
    tok = tokens[j]
    text = _text(raw, tok)
    if tok.name in ("ICONST", "FCONST"):
        try:
            value: float | int = sign * (int(text) if tok.name == "ICONST" else float(text))
        except ValueError:  # 0x10, 0o17, 0b1: Postgres 16's integer forms, not Python's
            raise SyntaxError_(f"syntax error in OPTIONS: {text!r} is not a decimal number",
                               hint="write option values as decimal numbers, such as 0.5 "
                                    "or 1e-6") from None
        if math.isnan(value):  # pragma: no cover - the scanner never yields NaN literals
            raise SyntaxError_("NaN is not a valid option value")
        return value, j + 1
    if sign == 1 and tok.name == "SCONST":
        return text[1:-1].replace("''", "'"), j + 1
    if sign == 1 and tok.kind != "RESERVED_KEYWORD" and text.replace("_", "").isalnum():
        return text.lower(), j + 1
    raise SyntaxError_(f"syntax error in OPTIONS: {text!r} is not a number or a name")
