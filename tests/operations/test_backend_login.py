"""The pass-through link logs in to a Postgres that asks for passwords: SCRAM-SHA-256 and MD5."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from server import backend
from server.dsn import DSN, parse_dsn
from server.embedded import EmbeddedPostgres
from server.scram import make_verifier


@pytest.fixture(scope="module")
def password_pg() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(tcp=True, host_auth="md5") as pg:

        async def setup() -> None:
            conn = await asyncpg.connect(pg.dsn())
            try:
                await conn.execute("SET password_encryption = 'scram-sha-256'")
                await conn.execute("CREATE ROLE scram_user LOGIN PASSWORD 'scram-pw'")
                # a verifier made by dp-proxy is accepted by Postgres as a stored password
                await conn.execute(f"CREATE ROLE ours LOGIN PASSWORD '{make_verifier('ours-pw')}'")
                await conn.execute("SET password_encryption = 'md5'")
                await conn.execute("CREATE ROLE md5_user LOGIN PASSWORD 'md5-pw'")
            finally:
                await conn.close()

        asyncio.run(setup())
        yield pg


async def _login(dsn: DSN) -> tuple[dict[str, str], bytes]:
    link = await backend.connect(dsn, {"application_name": "dp-proxy-test"})
    try:
        return link.parameters, link.tx_status
    finally:
        link.close()


@pytest.mark.live  # its own Postgres (password_pg)
@pytest.mark.parametrize(("user", "password"), [("scram_user", "scram-pw"), ("md5_user", "md5-pw"),
                                                ("ours", "ours-pw")])
def test_login_with_password(password_pg: EmbeddedPostgres, user: str, password: str) -> None:
    dsn = parse_dsn(f"postgresql://{user}:{password}@127.0.0.1:{password_pg.port}/postgres")
    params, status = asyncio.run(_login(dsn))
    assert params["application_name"] == "dp-proxy-test"
    assert status == b"I"


@pytest.mark.live  # its own Postgres (password_pg)
@pytest.mark.parametrize("user", ["scram_user", "md5_user"])
def test_wrong_backend_password(password_pg: EmbeddedPostgres, user: str) -> None:
    dsn = parse_dsn(f"postgresql://{user}:nope@127.0.0.1:{password_pg.port}/postgres")
    with pytest.raises(backend.BackendError) as exc:
        asyncio.run(_login(dsn))
    assert dict(exc.value.fields)["C"] == "28P01"


@pytest.mark.live  # its own Postgres (password_pg)
def test_missing_backend_password(password_pg: EmbeddedPostgres) -> None:
    dsn = parse_dsn(f"postgresql://scram_user@127.0.0.1:{password_pg.port}/postgres")
    with pytest.raises(backend.BackendError, match="asks for a password"):
        asyncio.run(_login(dsn))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:p%40ss@h:5433/db", DSN("h", 5433, "u", "db", "p@ss")),
        ("postgresql://u@/db?host=/tmp/sock&port=6000", DSN("/tmp/sock", 6000, "u", "db")),
        ("host=h port=5 user=u dbname=d password=x", DSN("h", 5, "u", "d", "x")),
        ("postgres://u@h", DSN("h", 5432, "u", "u")),
    ],
)
def test_parse_dsn(text: str, expected: DSN) -> None:
    assert parse_dsn(text) == expected


def test_parse_dsn_errors() -> None:
    from server.dsn import DSNError

    with pytest.raises(DSNError, match="unsupported connection parameters: sslcert"):
        parse_dsn("postgresql://u@h/db?sslcert=x")
    with pytest.raises(DSNError, match="missing '='"):
        parse_dsn("host")
