"""Route each statement of a query string: pass-through, DP query, proxy-local, or refused.

Fails closed: anything that names a protected table and is not a DP form, a
schema probe (`LIMIT 0`) or a local command is refused. Classification uses
pglast's JSON parse tree (a C-speed parse; no Python AST is built) and is
cached by statement text.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from pglast import parser

from dp_core.errors import DPError, InsufficientPrivilege, SyntaxError_
from dp_core.parsetree import const_int, func_name, range_vars, walk
from dp_core.reach import REACH_WORDS, reach_refusal
from dp_core.setting_changes import SettingAtBind, SettingChanges
from dp_core.sql_parse import scan
from dp_core.syntax import DPClause, strip_dp_clauses

LOCAL_FUNCTIONS = frozenset({"dp_budget", "dp_total_budgets", "dp_ledger", "dp_reset_budget",
                             "dp_reset_total_budget", "dp_tune_bounds", "dp_tuned_bounds",
                             "dp_drop_tuned_bounds"})
DP_SETTING_PREFIX = "dp."
AGGREGATE_NAMES = frozenset(
    {"count", "sum", "avg", "min", "max", "stddev", "stddev_samp", "stddev_pop", "variance",
     "var_samp", "var_pop", "percentile_cont", "percentile_disc"}
)

def protected_refusal(tables: tuple[str, ...], reason: str | None = None,
                      instead: str | None = None) -> InsufficientPrivilege:
    """What a statement that reads protected `tables` outside the DP path is told: which
    tables are protected (or the `reason`), and what to do instead: `instead`, or DP queries
    over the first of them (tables the statement named, so configured ones)."""
    which = f"table {tables[0]} is" if len(tables) == 1 else f"tables {', '.join(tables)} are"
    message = reason or (f"{which} protected: only differentially private aggregates may read "
                         f"{'it' if len(tables) == 1 else 'them'}")
    example = (f"e.g. SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM {tables[0]}, or a plain "
               f"SELECT k, count(*), sum(x), avg(x) FROM {tables[0]} GROUP BY k") \
        if tables else None
    return InsufficientPrivilege(message, hint=instead or example)


class StatementKind(Enum):
    PASS_THROUGH = "pass-through"
    """Forwarded to the backend under the restricted role."""
    DP_QUERY = "dp-query"
    DP_EXPLAIN = "dp-explain"
    LOCAL_SET = "local-set"
    LOCAL_SHOW = "local-show"
    LOCAL_FUNCTION = "local-function"
    REFUSED = "refused"
    EMPTY = "empty"


class Effect(Enum):
    """What a forwarded statement also does to the session state the proxy keeps itself (its
    dp.* settings, the prepared statements it answers), once the backend has run it."""

    RESET_ALL = "reset-all"
    """RESET ALL: dp.* settings back to their defaults too."""
    DISCARD_ALL = "discard-all"
    """DISCARD ALL (what poolers send between clients): that, and every prepared statement and
    portal the proxy holds."""
    DEALLOCATE = "deallocate"
    """DEALLOCATE name (`Statement.setting`), or ALL (None): the proxy's ones too."""
    SAVEPOINT = "savepoint"
    """SAVEPOINT name: where a ROLLBACK TO takes dp.* settings back to."""
    RELEASE = "release"
    ROLLBACK_TO = "rollback-to"
    ROLLBACK_AND_CHAIN = "rollback-and-chain"
    """Ends the block as ROLLBACK does, and opens another."""
    COMMIT_AND_CHAIN = "commit-and-chain"
    """Ends the block as COMMIT does (a failed one rolls back), and opens another."""


TRANSACTION_EFFECTS = frozenset({Effect.SAVEPOINT, Effect.RELEASE, Effect.ROLLBACK_TO,
                                 Effect.ROLLBACK_AND_CHAIN, Effect.COMMIT_AND_CHAIN})
"""Effects that matter only while dp.* settings have changed in the open transaction block."""


@dataclass(frozen=True)
class Statement:
    """One classified statement."""

    kind: StatementKind
    sql: str
    """The statement's text as the client wrote it (DP clause included)."""
    stripped_sql: str = ""
    """The text with the DP clause blanked out: what pglast can parse."""
    dp_clause: DPClause | None = None
    protected: tuple[str, ...] = ()
    """Protected tables the statement names."""
    tree: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The statement's node in pglast's JSON parse tree."""
    setting: str | None = None
    """For LOCAL_SET / LOCAL_SHOW: the `dp.*` name; for LOCAL_FUNCTION: the function; for an
    `effect`, the prepared statement's or savepoint's name."""
    refusal: DPError | None = field(default=None, compare=False)
    effect: Effect | None = None
    """For PASS_THROUGH: what it does to the proxy's own session state."""
    at_bind: tuple[SettingAtBind, ...] = ()
    """Setting changes whose name or value a parameter gives: checked at Bind."""

    @property
    def node_type(self) -> str:
        return next(iter(self.tree), "")

    @property
    def wraps_result(self) -> bool:
        """A DP query or local function inside DECLARE ... CURSOR or COPY ... TO STDOUT: the
        proxy's result query is declared or copied the same way (and returns no rows itself)."""
        return self.kind in (StatementKind.DP_QUERY, StatementKind.LOCAL_FUNCTION) \
            and self.node_type in _WRAPPERS

    @property
    def cursor(self) -> Cursor | None:
        """For a DP query declared as a cursor (`DECLARE c CURSOR FOR SELECT WITH
        ANONYMIZATION ...`): the cursor's name and options."""
        body = self.tree.get("DeclareCursorStmt")
        if body is None:
            return None
        return Cursor(body.get("portalname", ""), body.get("options", 0))


@dataclass(frozen=True)
class Cursor:
    """A DECLARE CURSOR's name and option bits (Postgres's CURSOR_OPT_*)."""

    name: str
    options: int

    BINARY = 0x01
    SCROLL = 0x02
    NO_SCROLL = 0x04
    INSENSITIVE = 0x08
    ASENSITIVE = 0x10
    HOLD = 0x20

    @property
    def hold(self) -> bool:
        return bool(self.options & self.HOLD)

    def declare(self, query: str, quote: Callable[[str], str]) -> str:
        """DECLARE this cursor (its options as written) for `query`; `quote` quotes the name."""
        words = [f"DECLARE {quote(self.name)}"]
        for bit, word in ((self.BINARY, "BINARY"), (self.INSENSITIVE, "INSENSITIVE"),
                          (self.ASENSITIVE, "ASENSITIVE"), (self.SCROLL, "SCROLL"),
                          (self.NO_SCROLL, "NO SCROLL")):
            if self.options & bit:
                words.append(word)
        words.append("CURSOR WITH HOLD FOR" if self.hold else "CURSOR FOR")
        return " ".join(words) + " " + query


class ProtectionPolicy:
    """Which relations are protected: qualified (schema, name) and bare names."""

    def __init__(self, tables: Mapping[str, str]) -> None:
        """`tables` maps each protected table name to its schema."""
        self.qualified = frozenset((schema, name) for name, schema in tables.items())
        self.names = frozenset(tables)

    def matches(self, schema: str | None, name: str) -> bool:
        # An unqualified name is protected whatever search_path says: a temp
        # table or CTE of the same name is refused too (fail closed).
        if schema is None or schema == "pg_temp":
            return name in self.names
        return (schema, name) in self.qualified


_WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
"""What `\\b` counts as a word character in a bytes pattern (ASCII letters, digits, _)."""
_PLAIN_MEMO_SIZE = 1024
_PLAIN_MEMO_MAX_LENGTH = 4096
"""Texts whose fast-path verdict `Classifier.is_plain_pass_through_bytes` remembers: how
many, up to what length."""
_DIGITS = b"0123456789"


def _trie_pattern(words: list[bytes]) -> bytes:
    """A regular expression matching any of `words`, factored by common prefixes so that the
    matcher decides on each byte once instead of trying every word in turn; where one word
    extends another the longer one matches (a greedy optional tail)."""
    trie: dict[bytes, Any] = {}
    for word in words:
        node = trie
        for byte in word:
            node = node.setdefault(bytes((byte,)), {})
        node[b""] = {}

    def build(node: dict[bytes, Any]) -> bytes:
        branches = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items()) if ch]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        return b"(?:" + body + b")?" if b"" in node else body

    return build(trie)


class Classifier:
    """Classifies query strings against a fixed policy, with an LRU cache by text."""

    def __init__(self, policy: ProtectionPolicy, cache_size: int = 4096,
                 settings: SettingChanges | None = None) -> None:
        """`settings`: the rules of setting changes, with which client encodings the proxy
        reads SQL in as Postgres does; by default only UTF8."""
        self.policy = policy
        self.settings = settings or SettingChanges()
        self._cache: OrderedDict[str, tuple[Statement, ...]] = OrderedDict()
        self._cache_size = cache_size
        # Words whose presence sends a statement to the full classifier. SQL can
        # only name a table by writing its name (any case, maybe quoted) or by a
        # U&"..." escape; DP forms and local commands need their keywords, and so do the
        # statements that change how Postgres reads SQL or the proxy's own session state, and
        # what the backend role cannot keep apart between analysts.
        words = sorted(policy.names | {"u&", "dp.", '"dp"', "dp_", "anonymization",
                                       "differential_privacy", *_SESSION_WORDS,
                                       *REACH_WORDS})
        # and DO / CALL, refused whatever they name, as words (not inside "double", "local")
        opaque = r"\bdo\b|\bcall\b"
        self._needs_parse = re.compile("|".join([*(re.escape(w) for w in words), opaque]),
                                       re.IGNORECASE)
        # The bytes form, on the hot path of every forwarded Query and Parse, searches
        # lowercased text case-sensitively (re.IGNORECASE costs 5× more), with the words
        # in one trie-shaped pattern (a plain alternation costs 1.4× more), and leaves the
        # word boundaries of DO and CALL to Python (a \b in the pattern doubles the cost
        # of every search). At a position the longest word matches, so a word that extends
        # DO or CALL wins over them; DO or CALL extending a word counts as that word.
        plain_words = [w.encode().lower() for w in words]
        self._needs_parse_bytes = re.compile(_trie_pattern([*plain_words, b"do", b"call"]))
        self._opaque_words = frozenset(
            o for o in (b"do", b"call") if not any(o.startswith(w) for w in plain_words))
        # The verdicts are remembered by folded text: ASCII letters lowercased (as the search
        # wants them) and, when no word has a digit, every digit written as 0, so that the
        # same statement with other numbers (pgbench's, a BI tool's ids) is one entry. The
        # verdict cannot change: a word without digits neither meets a digit in the text nor
        # finds one in the folded text, and digits stay word characters for DO and CALL.
        fold = bytearray(bytes(range(256)).lower())
        if not any(d in w for w in plain_words for d in _DIGITS):
            for d in _DIGITS:
                fold[d] = ord("0")
        self._fold = bytes(fold)
        self._plain_memo: dict[bytes, bool] = {}

    def is_plain_pass_through(self, sql: str) -> bool:
        """True when `sql` certainly names no protected table and no DP feature.

        Such text is forwarded without parsing: the fast path for statements
        whose literals change every time (so the cache cannot help). The
        restricted role stays the second wall, as for SQL built at run time.
        """
        return self._needs_parse.search(sql) is None

    def is_plain_pass_through_bytes(self, sql: bytes) -> bool:
        """`is_plain_pass_through` on UTF-8 text (protected names are ASCII identifiers), for
        the hot path of every forwarded Query and Parse: the verdict is remembered by folded
        text (clients send the same few statements again and again, with other literals).

        The fold lowercases ASCII only, as re.IGNORECASE does on bytes.
        """
        text = sql.translate(self._fold)
        hit = self._plain_memo.get(text)
        if hit is None:
            hit = self._search_plain(text)
            if len(text) <= _PLAIN_MEMO_MAX_LENGTH:
                if len(self._plain_memo) >= _PLAIN_MEMO_SIZE:
                    self._plain_memo.clear()
                self._plain_memo[text] = hit
        return hit

    def _search_plain(self, text: bytes) -> bool:
        """No word that needs the parser in `text` (folded)."""
        search, opaque, n = self._needs_parse_bytes.search, self._opaque_words, len(text)
        m = search(text)
        while m is not None:
            start, end = m.span()
            if m.group() not in opaque:
                return False
            if (start == 0 or text[start - 1] not in _WORD_BYTES) and \
                    (end == n or text[end] not in _WORD_BYTES):
                return False  # DO or CALL as a word
            m = search(text, start + 1)  # inside a word ("double", "recall"): look on
        return True

    def classify(self, sql: str) -> tuple[Statement, ...]:
        """All statements of `sql`, in order. Raises SyntaxError_ (42601) when it does not parse."""
        hit = self._cache.get(sql)
        if hit is not None:
            self._cache.move_to_end(sql)
            return hit
        result = self._classify(sql)
        self._cache[sql] = result
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result

    def _classify(self, sql: str) -> tuple[Statement, ...]:
        stripped, clauses = strip_dp_clauses(sql)
        try:
            tree = json.loads(parser.parse_sql_json(stripped))
        except parser.ParseError as e:
            raise SyntaxError_(_parse_error_message(e)) from None
        raw = sql.encode("utf-8")
        raw_stripped = stripped.encode("utf-8")
        stmts = tree.get("stmts", [])
        if not stmts:
            return (Statement(StatementKind.EMPTY, sql, stripped),)
        offsets = [c.select_offset for c in clauses]
        out = []
        for item in stmts:
            start = item.get("stmt_location", 0)
            length = item.get("stmt_len", len(raw) - start)
            piece = raw_stripped[start : start + length].decode("utf-8")
            text_stripped = piece.strip()
            # (each clause's offset in the statement's own text, as its parse tree counts)
            lead = start + len(piece[: len(piece) - len(piece.lstrip())].encode("utf-8"))
            # (the clauses are in text order: those of this statement found by bisection)
            first = bisect_left(offsets, start)
            own = [replace(c, select_offset=c.select_offset - lead)
                   for c in clauses[first:bisect_left(offsets, start + length)]]
            text = raw[start : start + length].decode("utf-8").strip()
            node = item.get("stmt", {})
            out.append(self._one(node, text, text_stripped, own))
        return tuple(out)

    def _one(
        self, node: Mapping[str, Any], sql: str, stripped: str, clauses: list[DPClause]
    ) -> Statement:
        if not node:
            return Statement(StatementKind.EMPTY, sql, stripped)
        ntype, body = next(iter(node.items()))
        protected = tuple(sorted(self._protected_in(body)))

        at_bind: tuple[SettingAtBind, ...] = ()

        def make(kind: StatementKind, **kw: Any) -> Statement:
            return Statement(kind, sql, stripped, protected=protected, tree=node,
                             at_bind=at_bind, **kw)

        isolation = reach_refusal(node)
        if isolation is not None:
            return make(StatementKind.REFUSED, refusal=isolation)
        if (clauses or protected or _local_function(body)) \
                and _copies_to_server(ntype, body, stripped):
            return self._refuse(make, protected, "a DP answer can only be copied TO STDOUT: "
                                "it is released to the client, never written on the server",
                                "COPY (...) TO STDOUT, or psql's \\copy (...) TO 'file'")
        if clauses:
            if len(clauses) > 1:
                return self._refuse(make, protected, "only one WITH ANONYMIZATION clause per "
                                    "query: each DP query is one answer, charged once",
                                    "write the DP query as one SELECT with one clause")
            if ntype == "ExplainStmt":
                if _explain_analyze(body):
                    return self._refuse(make, protected, "EXPLAIN ANALYZE of a DP query would "
                                        "reveal the true row counts",
                                        "EXPLAIN without ANALYZE shows the plan and the "
                                        "privacy cost, and charges nothing")
                return make(StatementKind.DP_EXPLAIN, dp_clause=clauses[0])
            if ntype != "SelectStmt" and ntype not in _WRAPPERS:
                # PREPARE, CREATE TABLE AS, INSERT ... SELECT: a DP answer is only sent to
                # the client (DESIGN §1.4: cursors aside, anything else is refused with 42501)
                return self._refuse(make, protected, "a DP query can only be run, declared as a "
                                    "cursor or copied TO STDOUT, not used in "
                                    f"{_statement_name(ntype)}: its answer is released to "
                                    "the client once, when it is charged",
                                    "to prepare it, use the extended protocol (Parse), as "
                                    "drivers do; to keep its answer, copy it TO STDOUT")
            return make(StatementKind.DP_QUERY, dp_clause=clauses[0])
        lexing, at_bind = self.settings.refusal(ntype, body)
        if lexing is not None:
            st: Statement = make(StatementKind.REFUSED, refusal=lexing)
            return st
        if ntype in ("VariableSetStmt", "VariableShowStmt"):
            name = body.get("name", "")
            if name.startswith(DP_SETTING_PREFIX):
                kind = StatementKind.LOCAL_SET if ntype == "VariableSetStmt" else StatementKind.LOCAL_SHOW
                return make(kind, setting=name)
        local = _local_function(body)
        if local is not None:
            return make(StatementKind.LOCAL_FUNCTION, setting=local)
        if not protected:
            return make(StatementKind.PASS_THROUGH, **_effect(ntype, body))
        if ntype == "SelectStmt":
            if _is_schema_probe(body):
                return make(StatementKind.PASS_THROUGH)
            if _is_aggregate_select(body):
                return make(StatementKind.DP_QUERY)
        if ntype == "LockStmt":
            if body.get("mode") == _ACCESS_SHARE:
                # what pg_dump takes: it reads no row, and Postgres grants it to a role with
                # SELECT (the analyst's own, under row-level security); any SELECT of the
                # table takes the same lock
                return make(StatementKind.PASS_THROUGH)
            return self._refuse(make, protected, "LOCK TABLE of a protected table in a mode "
                                "stronger than ACCESS SHARE: it would hold off the DP queries "
                                "that read it", "LOCK TABLE ... IN ACCESS SHARE MODE (what "
                                "pg_dump takes) is allowed")
        if ntype in _WRAPPERS:
            # a cursor over the plain DP form (psql's FETCH_COUNT, ODBC's declare/fetch mode),
            # or a copy of it to the client (psql's \copy)
            inner_body = body.get("query", {}).get("SelectStmt")
            if inner_body is not None and _is_aggregate_select(inner_body):
                return make(StatementKind.DP_QUERY)
        if ntype == "ExplainStmt" and not _explain_analyze(body):
            inner = body.get("query", {})
            inner_body = inner.get("SelectStmt")
            if inner_body is not None and _is_aggregate_select(inner_body):
                return make(StatementKind.DP_EXPLAIN)
        return self._refuse(make, protected, None)

    @staticmethod
    def _refuse(make: Any, protected: tuple[str, ...], reason: str | None,
                instead: str | None = None) -> Statement:
        err = protected_refusal(protected, reason, instead)
        st: Statement = make(StatementKind.REFUSED, refusal=err)
        return st

    def _protected_in(self, node: Any) -> Iterator[str]:
        for rv in range_vars(node):
            name = rv.get("relname", "")
            if self.policy.matches(rv.get("schemaname"), name):
                yield name


def _statement_name(ntype: str) -> str:
    """`PrepareStmt` → PREPARE, `CreateTableAsStmt` → CREATE TABLE AS, ... for messages."""
    return _STATEMENT_NAMES.get(ntype, ntype.removesuffix("Stmt"))


_STATEMENT_NAMES = {"PrepareStmt": "PREPARE", "CreateTableAsStmt": "CREATE TABLE AS",
                    "InsertStmt": "INSERT", "ViewStmt": "CREATE VIEW", "UpdateStmt": "UPDATE",
                    "DeleteStmt": "DELETE", "ExecuteStmt": "EXECUTE",
                    "CreateFunctionStmt": "CREATE FUNCTION", "RuleStmt": "CREATE RULE"}


_WRAPPERS = ("DeclareCursorStmt", "CopyStmt")
"""Statements that may wrap a DP query or local function: its released rows, declared as a
cursor or copied to the client."""


def _copies_to_server(ntype: str, body: Mapping[str, Any], sql: str) -> bool:
    """A COPY of a query to a file or program: never a DP answer's (the restricted role could
    not write it anyway, but only after the answer was charged). The JSON tree leaves an
    empty file name out, as it does STDOUT: `TO ''` is told apart by its tokens."""
    if ntype != "CopyStmt" or "query" not in body:
        return False
    if body.get("filename") is not None or body.get("is_program"):
        return True
    depth, after_to = 0, False
    for t in scan(sql):  # (the word after the TO outside the query's parentheses)
        if after_to:
            return t.name not in ("STDOUT", "STDIN")  # (TO STDIN is read as TO STDOUT)
        depth += (t.name == "ASCII_40") - (t.name == "ASCII_41")
        after_to = depth == 0 and t.name == "TO"
    return True


_SESSION_WORDS = ("standard_conforming_strings", "client_encoding", "names", "set_config",
                  "pg_settings", "reset", "discard", "deallocate", "savepoint", "release",
                  "rollback", "chain")
"""Words of the statements `SettingChanges.refusal` refuses and `_effect` marks."""
def _effect(ntype: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The `effect` (and `setting`) of a forwarded statement, as keywords for Statement."""
    if ntype == "VariableSetStmt" and body.get("kind") == "VAR_RESET_ALL":
        return {"effect": Effect.RESET_ALL}
    if ntype == "DiscardStmt" and body.get("target") == "DISCARD_ALL":
        return {"effect": Effect.DISCARD_ALL}
    if ntype == "DeallocateStmt":
        return {"effect": Effect.DEALLOCATE, "setting": None if body.get("isall") else
                body.get("name")}
    if ntype == "TransactionStmt":
        kind = body.get("kind")
        if kind in _SAVEPOINT_KINDS:
            return {"effect": _SAVEPOINT_KINDS[kind], "setting": body.get("savepoint_name")}
        if kind == "TRANS_STMT_ROLLBACK" and body.get("chain"):
            return {"effect": Effect.ROLLBACK_AND_CHAIN}
        if kind == "TRANS_STMT_COMMIT" and body.get("chain"):
            return {"effect": Effect.COMMIT_AND_CHAIN}
    return {}


_SAVEPOINT_KINDS = {"TRANS_STMT_SAVEPOINT": Effect.SAVEPOINT, "TRANS_STMT_RELEASE": Effect.RELEASE,
                    "TRANS_STMT_ROLLBACK_TO": Effect.ROLLBACK_TO}


def _local_function(body: Any) -> str | None:
    for fc in walk(body, "FuncCall"):
        name = func_name(fc)
        if name in LOCAL_FUNCTIONS:
            return name
    return None


def _is_schema_probe(select: Mapping[str, Any]) -> bool:
    """`SELECT ... LIMIT 0`: what BI tools send to learn a table's columns; it reads no row."""
    return (
        select.get("limitOption") == "LIMIT_OPTION_COUNT"
        and const_int(select.get("limitCount")) == 0
        and "larg" not in select
        and "withClause" not in select
    )


_ACCESS_SHARE = 1
"""LockStmt's mode for ACCESS SHARE (Postgres's AccessShareLock)."""


def _is_aggregate_select(select: Mapping[str, Any]) -> bool:
    """A top-level SELECT with GROUP BY or an aggregate in its select list, or a SELECT from
    one subquery that is one, or from one WITH query that is one (a query over a DP answer):
    a DP candidate."""
    if select.get("groupClause") or select.get("distinctClause") == [{}]:
        return True  # (SELECT DISTINCT k: the keys that DP partition selection releases)
    items = select.get("fromClause", [])
    if len(items) == 1 and "RangeSubselect" in items[0]:
        sub = items[0]["RangeSubselect"].get("subquery", {}).get("SelectStmt")
        if sub is not None and _is_aggregate_select(sub):
            return True
    if len(items) == 1 and "RangeVar" in items[0] and "schemaname" not in items[0]["RangeVar"]:
        name = items[0]["RangeVar"].get("relname")
        for cte in select.get("withClause", {}).get("ctes", []):
            body = cte.get("CommonTableExpr", {})
            sub = body.get("ctequery", {}).get("SelectStmt")
            if body.get("ctename") == name and sub is not None and _is_aggregate_select(sub):
                return True
    for target in select.get("targetList", []):
        for fc in walk(target, "FuncCall", skip=_SUBQUERIES):
            if func_name(fc) in AGGREGATE_NAMES or func_name(fc).startswith("anon_"):
                return True
    return False


_SUBQUERIES = frozenset({"SubLink", "SelectStmt"})


def _explain_analyze(body: Mapping[str, Any]) -> bool:
    for opt in body.get("options", []):
        elem = opt.get("DefElem", {})
        if elem.get("defname") == "analyze":
            arg = elem.get("arg")
            if arg is None:
                return True
            val = json.dumps(arg).lower()
            return not any(f in val for f in ('"false"', '"off"', '"0"', "false"))
    return False


def _parse_error_message(e: parser.ParseError) -> str:
    msg = str(e.args[0]) if e.args else str(e)
    return msg[:1].lower() + msg[1:] if msg else "syntax error"
