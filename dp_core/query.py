"""The query model: what the analysis finds in a DP query, and what the rewriter and planner read."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType

from dp_core.errors import (
    InternalError,
)
from dp_core.sqlnodes import walk_nodes
from dp_core.text_bounds import as_text

Relation = tuple[str | None, str]
"""An unprotected table a DP query reads: (schema as written, or None; name)."""


class AggKind(Enum):
    COUNT = "count"
    """Rows per user and group, clamped to [0, U] (U = 1 unless given): a bounded sum."""
    COUNT_USERS = "count_users"
    """COUNT(DISTINCT uid): the number of users in the group."""
    COUNT_DISTINCT = "count_distinct"
    """COUNT(DISTINCT x) of anything but the uid: the distinct values in the group, each user
    adding at most k of its own (k = U, 1 unless given)."""
    SUM = "sum"
    AVG = "avg"
    VAR = "var"
    STDDEV = "stddev"
    QUANTILE = "quantile"
    """ANON_NTILE and its forms: a DP quantile of the users' own quantiles (dp_core.quantiles)."""


@dataclass(frozen=True)
class Bounds:
    lower: float
    upper: float


@dataclass(frozen=True)
class TableRef:
    """A protected table in the query's FROM: its alias and uid column."""

    name: str
    alias: str
    uid_column: str
    derived: bool = False
    """A subquery or WITH query over protected tables (no configured column bounds)."""
    bases: frozenset[str] = frozenset()
    """The protected tables whose rows it carries."""
    per_user: bool = False
    """At most one row per user (a subquery grouped by the uid alone)."""


CLIPPED_KINDS = frozenset({AggKind.SUM, AggKind.AVG, AggKind.VAR, AggKind.STDDEV})
"""The row-level aggregates a clip is chosen for (`AnalyzedQuery.clips_means`)."""


@dataclass(frozen=True)
class Aggregate:
    kind: AggKind
    arg: ast.Node | None
    """The (totalised) argument; None for COUNT(*) and COUNT(DISTINCT uid)."""
    bounds: Bounds | None
    """Contribution bounds: of each user's value in a group (per-user aggregates; [0, U] for
    counts), or of each row's value (row-level ones; [0, 1] for counts); None when
    APPROX_BOUNDS finds them."""
    output_name: str
    quantile: float | None = None
    """The quantile (0…1) of a QUANTILE aggregate."""
    row_level: bool = False
    """Postgres's meaning (plain COUNT, SUM, AVG, VAR, STDDEV without written bounds): an
    aggregate of rows, each row's value within `bounds`, each user's rows weighted down to
    at most max_rows_contributed in all its groups. False: the paper's per-user meaning
    (ANON_*, written per-group bounds), one clamped value per user and group."""
    row_bounds: Bounds | None = None
    """A row-level SUM's or mean's own bounds where a clip was chosen for the query within
    them (`dp_core.tuning`): each row is then within `row_bounds` and each user's mean in a
    group within `bounds` (the clip: its rows' sum at most rows × the clip), which bound the
    noise as rows within `bounds` would; None: each row within `bounds`."""

    @property
    def known_bounds(self) -> Bounds:
        if self.bounds is None:
            raise InternalError("bounds used before APPROX_BOUNDS found them (this is a bug)")
        return self.bounds


@dataclass(frozen=True)
class CastCheck:
    """A cast of column values that is total only for some source types, which the analysis
    cannot see: the server learns the source type from Postgres (`argument_probe_sql`) and
    `check_casts` refuses the query unless the cast is in TOTAL_CASTS."""

    arg: ast.Node
    """The (totalised) expression being cast."""
    target: str
    text: str
    """The cast as the analyst wrote it, for the refusal message."""
    scope: ast.SelectStmt | None = None
    """The inner query (subquery in FROM, or WITH query) whose FROM `arg` reads; None: the
    DP query's own FROM. Its FROM is final once the analysis is done."""
    rule: str | None = None
    """The refusal's rule when it is not a cast (an operand of `||` that is not text)."""
    sources: frozenset[str] | None = None
    """The source types accepted, where the check is not of a cast to `target` (a date/time
    function's unit, which fails on every value of the other types)."""
    output: bool = False
    """A value's text (a cast to text or varchar, concat()): total, but for types whose text
    can pass Postgres's 1 GB limit on a value (`server.dp_query.type_shapes`), which the
    server refuses instead."""


@dataclass(frozen=True)
class TypeMix:
    """Values Postgres brings to one type before it compares or chooses among them (a
    comparison, IN, BETWEEN, NULLIF: "compare"; CASE's results, COALESCE, GREATEST, LEAST:
    "choose"), converting some implicitly: numeric to real or double precision fails beyond
    their range (1e39, 1e-45), a date to a timestamp past 294276 AD. The server learns each
    operand's type from Postgres (`argument_probe_sql`) and `check_mixes` refuses the query
    where a value of the rows (not a constant, converted once when the pushdown is planned)
    may be converted so."""

    operands: tuple[ast.Node, ...]
    """The (totalised) values, in order."""
    constant: tuple[bool | None, ...]
    """Per operand: a constant (literals, bound parameters and arithmetic of them: folded
    when the pushdown is planned), or None where Postgres never converts it (an IN's tested
    value, whose type only takes part in choosing its list's)."""
    kind: str
    """"compare", "choose", or "concatenate" (`||`, concat(): texts, whose collations only
    merge)."""
    text: str
    """What brings them to one type (CASE, COALESCE, =, IN, ...), for the refusal message."""
    scope: ast.SelectStmt | None = None
    """As `CastCheck.scope`."""
    scopes: tuple[ast.SelectStmt, ...] | None = None
    """Where each operand is read in a FROM of its own (a USING column of each side of a
    join, its side alone as the FROM), instead of `scope`."""


@dataclass(frozen=True)
class ArithmeticCheck:
    """An arithmetic operator as the analyst wrote it, whose type Postgres reports when the
    proxy prepares `argument_probe_sql` (t{i}): where it is an integer type, the analysis runs
    again with it (`analyze(..., integer_types=...)`) so that the total form keeps Postgres's
    integer semantics (`duration / 60` truncates) and type."""

    arg: ast.Node
    """The operator's expression, untouched (prepared, never run)."""
    location: int
    """Its offset in the statement: the key of `integer_types`."""
    scope: ast.SelectStmt | None = None


@dataclass(frozen=True)
class Key:
    expr: ast.Node
    output_name: str
    hashed: bool = False
    """Matched between the pushdown's statements (a group's row and its quantile trees) by a
    hash of its value (`dp_h{i}`) instead of its text (`dp_t{i}`): for types whose equal
    values can print differently (numeric 1.0 = 1.00, float -0 = 0, ...)."""
    domain: KeyDomain | None = None
    """The public keys of the column it reads, where it is one configured with them."""
    canonical: str | None = None
    """Its type where the pushdown groups it by one value of its equals (`canonical_key`);
    `expr` stays as written (HAVING and ORDER BY name it so)."""


@dataclass(frozen=True)
class OutputColumn:
    """One released column: a key or an aggregate (hidden when only an expression uses it)."""

    name: str
    key: int | None = None
    aggregate: int | None = None
    source: Any = field(default=None, compare=False)
    """The select-list expression it answers (to map HAVING / ORDER BY / expressions onto)."""
    bound: str | None = None
    """"low" or "high": the column is that end of `aggregate`'s 95% noise interval
    (DP_INTERVAL_LOW / DP_INTERVAL_HIGH), not its value."""


@dataclass(frozen=True)
class SelectItem:
    """One column the client sees: a released column, or an expression over released columns."""

    name: str
    column: int | None = None
    expr: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class TablePolicy:
    schema: str
    uid_column: str
    columns: Mapping[str, Bounds] = field(default_factory=dict)
    """Configured contribution bounds of numeric columns."""
    domains: Mapping[str, KeyDomain] = field(default_factory=dict)
    """Configured public key domains of columns."""


@dataclass(frozen=True)
class KeyDomain:
    """A column's public keys: listed (as Postgres prints them), or a public table's column."""

    keys: tuple[str, ...] | None = None
    source: tuple[str, str, str] | None = None
    """(schema, table, column) holding the keys."""


@dataclass(frozen=True)
class PublicSource:
    """What a public FROM item reads: a table, or a public subquery or WITH query (of one
    table, or a VALUES list)."""

    relation: Relation | None = None
    """The table it reads (None: a VALUES list, or a SELECT without FROM)."""
    columns: Mapping[str, str] | None = None
    """A subquery's output columns that are the table's columns as they are (name → the
    table's); None: the item is the table itself (every column its own)."""
    rows: int = 1
    """A VALUES list's rows (1: a SELECT without FROM)."""
    repeats: Mapping[str, int] = field(default_factory=dict)
    """A VALUES list's columns: the most rows with one literal value (a column with any other
    expression is not listed)."""
    order: tuple[str, ...] = ()
    """The output columns' names in order, where known (a column alias renames by position;
    empty: a table's, not known here)."""
    own: tuple[TieKey, ...] = ()
    """A subquery's or WITH query's own WHERE ties: its table's columns (by the table's
    names) each equal to a plain literal there (`WHERE id = 5`: on a unique column, one row)."""

    def column(self, name: str) -> str | None:
        """The table's column that the item's column `name` is, where it is one."""
        if self.relation is None:
            return None
        return name if self.columns is None else self.columns.get(name)


@dataclass(frozen=True)
class TieKey:
    """A public item's column that an equality ties to items bounded before it, and what it
    is equated with where the bound may rely on it (a unique column counts one row per value
    only under its own type's equality: a table column of the same type, or a plain
    literal, which takes the column's type)."""

    column: str
    partner: tuple[Relation, str] | None = None
    """The table column (relation, column) it equals, where the other side is one."""
    literal: bool = False
    """It equals a plain string or integer literal."""
    bare: bool = True
    """It equals a column as it is, or a literal: Postgres joins on it (an expression of
    an outer join's nullable item may only filter the rows joined before it)."""
    cast: str | None = None
    """It equals an expression cast to this type, as written (`d.day = CAST(v.ts AS date)`):
    the comparison is that type's equality, whatever the expression reads."""


@dataclass(frozen=True)
class PublicItem:
    """A public FROM item of a scope with protected rows, with the columns that tie it to the
    items bounded before it (`anchor`; none: it is bounded by its rows)."""

    source: PublicSource
    keys: tuple[TieKey, ...] = ()


@dataclass(frozen=True)
class AnalyzedQuery:
    """A validated DP query, in pieces for the rewriter."""

    from_clause: tuple[ast.Node, ...]
    where: ast.Node | None
    uid: ast.Node
    tables: tuple[TableRef, ...]
    keys: tuple[Key, ...]
    aggregates: tuple[Aggregate, ...]
    outputs: tuple[OutputColumn, ...]
    having: ast.Node | None
    """HAVING, its names replaced by what they read (dp_core.names): DP aggregates, GROUP BY
    expressions and select-list expressions, which the result query maps onto released columns."""
    order_by: tuple[ast.Node, ...]
    """ORDER BY, likewise; a bare name of an output column is its position."""
    limit: ast.Node | None
    offset: ast.Node | None
    plain_form: bool
    """True for `SELECT k, COUNT(*) ...` without WITH ANONYMIZATION."""
    fence_refs: tuple[Any, ...] = ()
    """A column of each FROM item where the query's scope joins (`dp_core.join_fence`): the
    pushdown's own conditions on its rows are evaluated after the joins, as WHERE's are."""
    ranges_after_joins: bool = False
    """Some inner join of the query became an outer one (`join_fence`): a split's uid range,
    strict, would turn it back, so it is tested after the joins too."""
    ctes: tuple[Any, ...] = ()
    """The query's (validated) WITH list, kept ahead of the pushdown's own."""
    select: tuple[SelectItem, ...] = ()
    """What the client sees, in select-list order."""
    casts: tuple[CastCheck, ...] = ()
    """Casts whose totality depends on their source type (see `check_casts`)."""
    arithmetic: tuple[ArithmeticCheck, ...] = ()
    """Arithmetic operators whose type decides their integer semantics (`ArithmeticCheck`)."""
    mixes: tuple[TypeMix, ...] = ()
    """Values brought to one type, which must not convert a row's value where that can fail
    (see `check_mixes`)."""
    sublinks: tuple[ast.SelectStmt, ...] = ()
    """Its IN and EXISTS subqueries (total), which must plan alone (`Findings.sublinks`)."""
    relations: tuple[Relation, ...] = ()
    """The unprotected tables it reads by name (schema as written, or None; name): the
    server refuses the query unless each is one the analysts may read."""
    joins_capped: bool = False
    """Two protected FROM items are joined row by row somewhere: each reads at most
    JOIN_ROWS_PER_USER rows of a user."""
    in_lists: tuple[ast.SelectStmt, ...] = ()
    """Its IN subqueries (of `sublinks`): the server counts their rows (`fanout`)."""
    public_items: tuple[PublicItem, ...] = ()
    """The public FROM items of its scopes with protected rows, as their joins tie them: the
    server bounds the public rows one protected row meets (`dp_core.fanout`)."""
    outer: ast.SelectStmt | None = None
    """A query over this one's answer (`SELECT ... FROM (DP query) AS t WHERE ...`, as Power BI
    writes; `WITH t AS (DP query) SELECT ... FROM t`; aggregates over it, as Superset's
    charts over a virtual dataset): post-processing, run over the released rows. The DP
    query's place in it is a FROM subquery left empty (None), maybe under further queries
    around (`analysis.post_processed`), where the result query goes."""
    grouped_by: tuple[Any, ...] = ()
    """The GROUP BY expressions as written (positions and aliases replaced by their select-list
    expressions): what Postgres checks a HAVING or ORDER BY name against (`column_probe_sql`)."""
    name_checks: tuple[tuple[str, ...], ...] = ()
    """Column references of HAVING and ORDER BY whose meaning depends on the FROM items'
    columns, which the analysis cannot see: the server asks Postgres (`column_probe_sql`) and
    analyses again with the answers (`analyze(..., columns=...)`). HAVING and ORDER BY are
    unresolved while any is left: such a query is never answered."""

    def with_bounds(self, found: Mapping[int, Bounds]) -> AnalyzedQuery:
        """The query with bounds filled in for the given aggregates: found by APPROX_BOUNDS,
        or a clip chosen within a row-level SUM's or mean's bounds (`Aggregate.row_bounds`
        keeps them: its rows stay within them, its users' means go within the clip)."""
        aggregates = tuple(
            a if i not in found else replace(a, bounds=found[i]) if a.bounds is None
            or found[i] == a.bounds or not self.clips_means(i)
            else replace(a, bounds=found[i], row_bounds=a.row_bounds or a.bounds)
            for i, a in enumerate(self.aggregates))
        return replace(self, aggregates=aggregates)

    def clips_means(self, i: int) -> bool:
        """Whether a clip chosen for aggregate i bounds each user's mean in a group (and, for
        VAR and STDDEV, its mean squared distance to the clip's midpoint), its rows staying
        within its own bounds (`Aggregate.row_bounds`): a row-level SUM's, AVG's, VAR's or
        STDDEV's."""
        a = self.aggregates[i]
        return a.row_level and a.kind in CLIPPED_KINDS

    def with_hashed_keys(self, hashed: Iterable[int]) -> AnalyzedQuery:
        """The query with the given keys matched by hash (`Key.hashed`)."""
        which = set(hashed)
        return replace(self, keys=tuple(replace(k, hashed=i in which)
                                        for i, k in enumerate(self.keys)))

    def with_canonical_keys(self, types: Mapping[int, str]) -> AnalyzedQuery:
        """The query with each key of `types` (its type: `CANONICAL_KEY_TYPES` or
        `COLLATED_KEY_TYPES`) grouped by one value of its equal ones (`Key.canonical`), but
        in a query of public groups (whose keys are matched to their domains' texts). A key
        a domain lists, in a query partition selection releases (`SELECT DISTINCT k`, or
        grouped by another key too), is canonical like any other."""
        return replace(self, keys=tuple(
            replace(k, canonical=types[i]) if i in types and not self.public_groups else k
            for i, k in enumerate(self.keys)))

    def grouped_expr(self, i: int) -> ast.Node:
        """Key i as the pushdown groups it (`Key.canonical`)."""
        k = self.keys[i]
        return k.expr if k.canonical is None else canonical_key(k.expr, k.canonical)

    @property
    def public_groups(self) -> bool:
        """Grouped only by columns with public key domains, with DP aggregates: every
        combination of their keys is released (absent ones with noise around zero), no
        partition selection. (Keys alone, `SELECT DISTINCT k`, keep partition selection.)"""
        return bool(self.keys) and bool(self.aggregates) \
            and all(k.domain is not None for k in self.keys)

    @property
    def has_quantiles(self) -> bool:
        return any(a.kind is AggKind.QUANTILE for a in self.aggregates)

    @property
    def keys_read_uid(self) -> bool:
        """Whether a group key reads a protected table's uid column (by name)."""
        names = {t.uid_column for t in self.tables}
        return any(isinstance(n, ast.ColumnRef) and getattr(n.fields[-1], "sval", "") in names
                   for k in self.keys for n in walk_nodes(k.expr))


CANONICAL_KEY_TYPES = frozenset({"numeric", "float4", "float8"})
"""Key types whose equal values print differently, and which `canonical_key` writes as one."""
COLLATED_KEY_TYPES = frozenset({"text", "varchar", "bpchar", "name",
                                "text[]", "varchar[]", "name[]"})
"""Key types whose equality follows a collation, which may be nondeterministic ('a' = 'A'
under a case-insensitive ICU collation): `canonical_key` groups them under "C"."""
KEY_CHARS = 1000
"""A text key is grouped and released by its first KEY_CHARS characters, an array key where
it has at most KEY_CHARS elements and KEY_CHARS * 4 bytes of their text (else as NULL): each
(user, group) row hashes, sorts, copies and sends its key several times, so one user's key of
200 million characters (2.3 MB on disk) took 11 quanta more (red team, session 32), and a
join of two protected tables grouped by a key of each makes up to 100 x 100 such rows."""


def canonical_key(expr: ast.Node, type_name: str) -> ast.Node:
    """A group key of `type_name` as the one value of its equals that the group releases: a
    group's key is printed from one of its rows, so 1.0 and 1.00 (numeric), -0 and 0 (floats)
    would tell which rows it has (the user whose spelling differs). numeric: trim_scale()
    (1.00 is 1); floats: 0 for -0. Every value stays in its group (they are equal). Texts
    (`COLLATED_KEY_TYPES`) are grouped under the "C" collation: under a nondeterministic one
    'a' = 'A' would be one group printed from one of its rows; under every deterministic
    collation equal texts are the same bytes, so the groups are the same (bpchar's equal
    values may differ in trailing blanks, which their text, the released one, drops).
    Texts are cut to KEY_CHARS characters, arrays kept within KEY_CHARS elements (else NULL):
    each (user, group) row handles its key several times (`KEY_CHARS`)."""
    if type_name.endswith("[]"):
        expr = _bounded_array(expr)
    elif type_name in COLLATED_KEY_TYPES:
        cut: ast.Node = _func("substr", as_text(copy.deepcopy(expr)), _int(1), _int(KEY_CHARS))
        # (bpchar unqualified: pglast prints pg_catalog.bpchar as char, which is char(1))
        cut = cut if type_name == "text" else ast.TypeCast(arg=cut, typeName=ast.TypeName(
            names=(ast.String(sval="bpchar"),) if type_name == "bpchar" else
            (ast.String(sval="pg_catalog"), ast.String(sval=type_name))))
        if isinstance(expr, ast.ColumnRef):
            # a column as it is where it has at most KEY_CHARS bytes (its length read from
            # its header): the same groups, without a copy of each row's key (substr() made
            # the per-user aggregation 8% slower); an expression is not computed twice
            short = _op("<=", _func("octet_length", copy.deepcopy(expr)), _int(KEY_CHARS))
            cut = ast.CaseExpr(args=(ast.CaseWhen(expr=short, result=expr),), defresult=cut)
        expr = cut
    if type_name in COLLATED_KEY_TYPES:
        return ast.CollateClause(arg=expr, collname=(ast.String(sval="pg_catalog"),
                                                     ast.String(sval="C")))
    if type_name.endswith("[]"):
        return expr
    if type_name == "numeric":
        trimmed = _func("trim_scale", expr)
        if not isinstance(expr, ast.ColumnRef):
            return trimmed
        # a column's value where it has at most about 2 KEY_CHARS digits (its stored size
        # read from its header first), else NULL: a user's keys of 131,072 digits (772 bytes
        # on disk) made `GROUP BY n` 30-47 quanta slower (red team, session 33)
        # (NaN and ±Infinity, of no scale, kept: NaN sorts above Infinity)
        infinity = ast.TypeCast(arg=ast.A_Const(val=ast.String(sval="Infinity")),
                                typeName=ast.TypeName(names=(ast.String(sval="pg_catalog"),
                                                             ast.String(sval="numeric"))))
        finite_or_not = ast.BoolExpr(boolop=BoolExprType.OR_EXPR, args=(
            _op("<", _func("abs", copy.deepcopy(expr)),
                ast.A_Const(val=ast.Float(fval=f"1e{KEY_CHARS}"))),
            _op(">=", _func("abs", copy.deepcopy(expr)), infinity)))
        small = ast.BoolExpr(boolop=BoolExprType.AND_EXPR, args=(
            _op("<=", _func("pg_column_size", copy.deepcopy(expr)), _int(KEY_CHARS)),
            _op("<=", ast.CoalesceExpr(args=(_func("scale", copy.deepcopy(expr)), _int(0))),
                _int(KEY_CHARS)), finite_or_not))
        return ast.CaseExpr(args=(ast.CaseWhen(expr=small, result=trimmed),))
    zero = ast.TypeCast(arg=ast.A_Const(val=ast.Integer(ival=0)),
                        typeName=ast.TypeName(names=(ast.String(sval="pg_catalog"),
                                                     ast.String(sval=type_name))))
    is_zero = _op("=", copy.deepcopy(expr), copy.deepcopy(zero))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=is_zero, result=zero),), defresult=expr)


def _bounded_array(expr: ast.Node) -> ast.Node:
    """`expr` (an array) where it has at most KEY_CHARS elements and KEY_CHARS * 4 bytes of
    their text, else NULL (`KEY_CHARS`). Its stored size is asked first (read from its
    header, never decompressed): at most 16 bytes an element more than that, so it keeps
    every array the rest keeps, and a larger one is not read at all."""
    small = ast.BoolExpr(boolop=BoolExprType.AND_EXPR, args=(
        _op("<=", _func("pg_column_size", copy.deepcopy(expr)), _int(KEY_CHARS * 20 + 64)),
        _op("<=", _func("cardinality", copy.deepcopy(expr)), _int(KEY_CHARS)),
        _op("<=", _func("octet_length", _func("array_to_string", copy.deepcopy(expr),
                                              ast.A_Const(val=ast.String(sval="")))),
            _int(KEY_CHARS * 4))))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=small, result=expr),))


def _op(op: str, left: ast.Node, right: ast.Node) -> ast.A_Expr:
    return ast.A_Expr(kind=A_Expr_Kind.AEXPR_OP, name=(ast.String(sval=op),), lexpr=left,
                      rexpr=right)


def _func(name: str, *args: ast.Node) -> ast.FuncCall:
    return ast.FuncCall(funcname=(ast.String(sval="pg_catalog"), ast.String(sval=name)),
                        args=args)


def _int(value: int) -> ast.A_Const:
    return ast.A_Const(val=ast.Integer(ival=value))

