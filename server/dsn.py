"""Parse libpq connection strings (URI or key=value form) into what a backend login needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit


class DSNError(ValueError):
    """The connection string cannot be understood."""


@dataclass(frozen=True)
class DSN:
    host: str
    """A host name, an IP address, or a directory holding the Unix socket."""
    port: int
    user: str
    database: str
    password: str | None = None

    @property
    def is_unix(self) -> bool:
        return self.host.startswith("/")

    @property
    def socket_path(self) -> str:
        return os.path.join(self.host, f".s.PGSQL.{self.port}")

    def uri(self, user: str | None = None, database: str | None = None) -> str:
        """A URI for asyncpg and libpq (password included when present)."""
        u = user or self.user
        auth = u if self.password is None else f"{u}:{_q(self.password)}"
        db = database or self.database
        if self.is_unix:
            return f"postgresql://{auth}@/{db}?host={self.host}&port={self.port}"
        return f"postgresql://{auth}@{self.host}:{self.port}/{db}"


def _q(s: str) -> str:
    from urllib.parse import quote

    return quote(s, safe="")


def parse_dsn(text: str) -> DSN:
    """Parse `postgresql://user:pw@host:port/db?host=/sock` or `host=... user=...` text."""
    params: dict[str, str] = {}
    if text.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(text)
        if parts.username:
            params["user"] = unquote(parts.username)
        if parts.password is not None:
            params["password"] = unquote(parts.password)
        if parts.hostname:
            params["host"] = parts.hostname
        try:
            if parts.port:
                params["port"] = str(parts.port)
        except ValueError:
            raise DSNError("invalid port in connection URI") from None
        if parts.path and parts.path != "/":
            params["dbname"] = unquote(parts.path.lstrip("/"))
        for k, v in parse_qsl(parts.query):
            params[k] = v
    else:
        for token in text.split():
            key, sep, value = token.partition("=")
            if not sep:
                raise DSNError(f"missing '=' after {key!r} in connection string")
            params[key] = value.strip("'")
    unknown = set(params) - {"host", "port", "user", "password", "dbname", "sslmode",
                             "application_name", "connect_timeout"}
    if unknown:
        raise DSNError(f"unsupported connection parameters: {', '.join(sorted(unknown))}")
    host = params.get("host") or os.environ.get("PGHOST") or "/var/run/postgresql"
    try:
        port = int(params.get("port") or os.environ.get("PGPORT") or 5432)
    except ValueError:
        raise DSNError("port is not a number") from None
    user = params.get("user") or os.environ.get("PGUSER")
    if not user:
        raise DSNError("no user in connection string")
    return DSN(
        host=host,
        port=port,
        user=user,
        database=params.get("dbname") or user,
        password=params.get("password"),
    )
