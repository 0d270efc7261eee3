"""Text in a DP query's expressions: value sizes bounded, substring searches under "C"."""

from __future__ import annotations

import copy

from pglast import ast
from pglast.enums import A_Expr_Kind, MinMaxOp

MAX_TEXT_CHARS = 1_000_000
"""String functions that can make a value larger than what they read (`concat`, `||`,
`replace`) or take a workspace several times its size (`upper`, `lower`, `initcap`, `ILIKE`:
four bytes per byte outside the C locale) read at most this many characters of each value
(`bounded_text`): a user's value of 110 MB, `concat`enated ten times, passed Postgres's 1 GB
limit on a value, an error (54000) after the charge that only that user's row made (red
team, session 31). At four bytes a character and the cost model's 32 passes, no value they
make nears 1 GB. (`lpad` and `rpad` make exactly their literal length.)"""
GROWING_FUNCTIONS = frozenset({"replace"})
"""Of LITERAL_ARGUMENT_FUNCTIONS, those whose value can be larger than their first argument."""
RECASED_FUNCTIONS = frozenset({"upper", "lower", "initcap"})


TEXT_TYPES = frozenset({"text", "varchar", "bpchar", "name"})
SEARCHING_FUNCTIONS = frozenset({"strpos", "position", "replace", "split_part"})
"""Substring searches: under a nondeterministic collation Postgres refuses them (and LIKE) on
each row that reaches them, an error only the rows make (`WHERE CASE WHEN uid = 42 THEN
x LIKE 'a%' END`); their literal is given the "C" collation, which decides the search's
(explicit), and under which every deterministic collation's results are the same."""


def in_c(node: ast.Node) -> ast.Node:
    """A literal text under the "C" collation."""
    return ast.CollateClause(arg=node, collname=(ast.String(sval="pg_catalog"),
                                                 ast.String(sval="C")))


def like_of_lowered(value: ast.Node, pattern: ast.Node, negated: bool) -> ast.A_Expr:
    """`value ILIKE pattern` (`value` a text already bounded) as Postgres computes it in a
    multibyte database, `lower(value) LIKE lower(pattern)`, the pattern lowered under the
    value's collation (a CASE of both never taking the value: its collation, which the
    pattern's, a literal's default, yields to), and the LIKE under "C" (see
    SEARCHING_FUNCTIONS): Postgres refuses ILIKE under a nondeterministic collation on each
    row that reaches it, an error only the rows make; lower() it computes under any."""
    def lower(arg: ast.Node) -> ast.FuncCall:
        return ast.FuncCall(funcname=(ast.String(sval="pg_catalog"), ast.String(sval="lower")),
                            args=(arg,))
    collated = ast.CaseExpr(args=(ast.CaseWhen(expr=ast.A_Const(val=ast.Boolean(boolval=False)),
                                               result=copy.deepcopy(value)),),
                            defresult=pattern)
    return ast.A_Expr(kind=A_Expr_Kind.AEXPR_LIKE, name=(ast.String(sval="!~~" if negated
                                                                    else "~~"),),
                      lexpr=lower(value), rexpr=in_c(lower(collated)))


def as_text(node: ast.Node) -> ast.TypeCast:
    """`CAST(node AS pg_catalog.text)`."""
    return ast.TypeCast(arg=node, typeName=ast.TypeName(names=(ast.String(sval="pg_catalog"),
                                                               ast.String(sval="text"))))


def bounded_text(node: ast.Node) -> ast.Node:
    """`node` (a text) cut to its first MAX_TEXT_CHARS characters (a literal as it is). As
    text: of another type, Postgres would refuse substr() before the proxy's own check of the
    type (`totality.Totalizer._text`) had its say."""
    if isinstance(node, ast.A_Const):
        return node
    text = as_text(node)
    return ast.FuncCall(funcname=(ast.String(sval="pg_catalog"), ast.String(sval="substr")),
                        args=(text, ast.A_Const(val=ast.Integer(ival=1)),
                              ast.A_Const(val=ast.Integer(ival=MAX_TEXT_CHARS))))


ONE_ARGUMENT_FUNCTIONS = {
    "length": "length(bytes, encoding) fails on an unknown encoding and on bytes invalid in it",
}
"""Allowed functions whose other overloads can fail on a row's value: one argument only."""


def capped_bit_length(value: ast.Node) -> ast.Node:
    """bit_length(value) of a text: Postgres computes octet_length(x) * 8 in int4, which
    overflows from 256 MiB (a user's text of 256 MiB, 3 MB on disk, made the query fail after
    the charge; red team, session 32). Here the octets are taken at most to 2^28 - 1, so the
    bits stay within int4 (a value of 256 MiB or more gives 2,147,483,640)."""
    octets = ast.FuncCall(funcname=(ast.String(sval="pg_catalog"), ast.String(sval="octet_length")),
                          args=(as_text(value),))
    capped = ast.MinMaxExpr(op=MinMaxOp.IS_LEAST,
                            args=(octets, ast.A_Const(val=ast.Integer(ival=2**28 - 1))))
    return ast.A_Expr(kind=A_Expr_Kind.AEXPR_OP, name=(ast.String(sval="*"),), lexpr=capped,
                      rexpr=ast.A_Const(val=ast.Integer(ival=8)))
