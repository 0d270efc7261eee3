"""Client encodings: the ones in which the proxy reads SQL as Postgres does, and their codecs.

Postgres converts every string a client sends from the session's
client_encoding, and every string it sends back into it. The proxy must do
the same where it reads or writes text itself: the SQL it classifies and
rewrites, the bind parameters of DP queries, its own messages and the SQL of
its result queries.

It must also read SQL *exactly* as Postgres does, or a statement it judged
harmless could mean something else to Postgres. In every encoding Postgres can
store (UTF8, the LATIN and WIN families, KOI8, the EUC family...) a byte below
0x80 is always that ASCII character, never part of a multibyte one, so quotes,
backslashes, keywords and the (ASCII) names of protected tables are the same
bytes whatever the encoding: statements split and classify alike in all of
them. The client-only encodings (SJIS, BIG5, GBK, UHC, GB18030, JOHAB) put
ASCII bytes such as a backslash or letters inside multibyte characters, so the
same bytes lex differently under them; the proxy refuses them, as it refuses
standard_conforming_strings off. MULE_INTERNAL and EUC_TW have no Python codec.
"""

from __future__ import annotations

from server.errors import CharacterNotInRepertoire, UntranslatableCharacter

_LATIN = {"LATIN1": "latin-1", "LATIN2": "iso8859-2", "LATIN3": "iso8859-3",
          "LATIN4": "iso8859-4", "LATIN5": "iso8859-9", "LATIN6": "iso8859-10",
          "LATIN7": "iso8859-13", "LATIN8": "iso8859-14", "LATIN9": "iso8859-15",
          "LATIN10": "iso8859-16"}

CODECS: dict[str, str] = {
    "UTF8": "utf-8",
    # no conversion: the text is the database's, which Postgres still checks is valid UTF-8
    # in a UTF8 database (a SQL_ASCII database takes any bytes; the proxy reads them as UTF-8)
    "SQL_ASCII": "utf-8",
    **_LATIN,
    **{f"ISO_8859_{n}": f"iso8859-{n}" for n in (5, 6, 7, 8)},
    "KOI8R": "koi8-r", "KOI8U": "koi8-u",
    "WIN866": "cp866", "WIN874": "cp874",
    **{f"WIN{n}": f"cp{n}" for n in range(1250, 1259)},
    "EUC_JP": "euc_jp", "EUC_JIS_2004": "euc_jis_2004", "EUC_KR": "euc_kr", "EUC_CN": "gb2312",
}
"""Postgres encoding name (as ParameterStatus reports client_encoding) → Python codec."""

READABLE = ("UTF8, SQL_ASCII, LATIN1 to LATIN10, ISO_8859_5 to ISO_8859_8, WIN866, WIN874, "
            "WIN1250 to WIN1258, KOI8R, KOI8U, EUC_JP, EUC_JIS_2004, EUC_KR and EUC_CN")
"""The encodings of CODECS, as a hint names them."""

CLIENT_ONLY = frozenset({"SJIS", "SHIFT_JIS_2004", "BIG5", "GBK", "UHC", "GB18030", "JOHAB"})
_CLIENT_ONLY_NAMES = frozenset({
    "sjis", "shiftjis", "mskanji", "win932", "windows932", "shiftjis2004", "big5", "win950",
    "windows950", "gbk", "win936", "windows936", "cp936", "uhc", "win949", "windows949",
    "gb18030", "johab"})
"""The client-only encodings' names and Postgres's aliases for them, cleaned (see `_clean`)."""

ALIASES = {
    "unicode": "UTF8", "koi8": "KOI8R", "win": "WIN1251", "alt": "WIN866",
    "abc": "WIN1258", "tcvn": "WIN1258", "tcvn5712": "WIN1258", "vscii": "WIN1258",
    **{f"iso8859{n}": latin for n, latin in (("1", "LATIN1"), ("2", "LATIN2"), ("3", "LATIN3"),
                                             ("4", "LATIN4"), ("9", "LATIN5"), ("10", "LATIN6"),
                                             ("13", "LATIN7"), ("14", "LATIN8"),
                                             ("15", "LATIN9"), ("16", "LATIN10"))},
    **{f"windows{n}": f"WIN{n}" for n in (866, 874, *range(1250, 1259))},
}
"""Other names Postgres takes for the encodings of CODECS, cleaned (see `_clean`)."""


def _clean(name: str) -> str:
    """An encoding name as Postgres looks it up: ASCII letters and digits only, lower case."""
    return "".join(c for c in name.lower() if c.isascii() and c.isalnum())


_NAMED = {**{_clean(name): name for name in CODECS}, **ALIASES}


def encoding_named(value: str) -> str | None:
    """The encoding of CODECS a client_encoding value names (as SET takes it: any case, any
    punctuation, or an alias such as ISO-8859-1 or windows-1252); None for any other value,
    including the client-only encodings and names Postgres does not know."""
    return _NAMED.get(_clean(value))


def codec(name: str) -> str | None:
    """The Python codec for a client_encoding Postgres reports (its canonical name, or UNICODE
    as set: Postgres keeps that alias for old JDBC drivers); None: not supported here."""
    canonical = encoding_named(name)
    return CODECS[canonical] if canonical is not None else None


def _hex(raw: bytes) -> str:
    return " ".join(f"0x{b:02x}" for b in raw)


def invalid_text(raw: bytes, encoding: str) -> CharacterNotInRepertoire:
    """Postgres's error for client bytes `raw` that are no text in `encoding` (its name)."""
    return CharacterNotInRepertoire(f'invalid byte sequence for encoding "{encoding}": {_hex(raw)}')


def untranslatable(e: UnicodeEncodeError, encoding: str) -> UntranslatableCharacter:
    """Postgres's error for a character the client encoding (its name) lacks, from Python's."""
    return UntranslatableCharacter(
        f'character with byte sequence {_hex(e.object[e.start : e.end].encode("utf-8"))} in '
        f'encoding "UTF8" has no equivalent in encoding "{encoding}"')


def encoding_help(name: str) -> tuple[str, str]:
    """Why the proxy refuses the client_encoding `name`, and what to use instead."""
    return UnsupportedEncoding(name).detail, f"use UTF8, or another encoding the proxy reads: {READABLE}"


class UnsupportedEncoding(Exception):
    """The session's client_encoding is one the proxy cannot read SQL in as Postgres does."""

    def __init__(self, name: str) -> None:
        super().__init__(f"client_encoding {name} is not supported")
        self.name = name

    @property
    def detail(self) -> str:
        if encoding_named(self.name) is None and _clean(self.name) in _CLIENT_ONLY_NAMES:
            return (f"in {self.name}, bytes inside multibyte characters can be ASCII letters or "
                    "backslashes, so the proxy could read a statement differently from Postgres")
        return f"the proxy has no codec for {self.name}"


__all__ = [
    "ALIASES",
    "CLIENT_ONLY",
    "CODECS",
    "READABLE",
    "UnsupportedEncoding",
    "codec",
    "encoding_help",
    "encoding_named",
    "invalid_text",
    "untranslatable",
]
