"""Replies the proxy composes itself: a DPError as an ErrorResponse, a notice, and the one
FATAL error a connection the proxy cannot take gets (light: the supervisor of
`[listen] workers` answers with it too, without importing the DP engine)."""

from __future__ import annotations

import asyncio
from typing import cast

from dp_core.errors import DPError
from server import wire as p


def error_response(err: DPError) -> p.ErrorResponse:
    fields = [
        (p.FIELD_SEVERITY, err.severity),
        (p.FIELD_SEVERITY_V, err.severity),
        (p.FIELD_CODE, err.sqlstate),
        (p.FIELD_MESSAGE, err.message),
    ]
    if err.detail:
        fields.append((p.FIELD_DETAIL, err.detail))
    if err.hint:
        fields.append((p.FIELD_HINT, err.hint))
    return p.ErrorResponse(tuple(fields))


def notice_response(message: str, detail: str | None = None) -> p.NoticeResponse:
    fields = [(p.FIELD_SEVERITY, "NOTICE"), (p.FIELD_SEVERITY_V, "NOTICE"),
              (p.FIELD_CODE, "00000"), (p.FIELD_MESSAGE, message)]
    if detail:
        fields.append((p.FIELD_DETAIL, detail))
    return p.NoticeResponse(tuple(fields))


class Refuse(asyncio.Protocol):
    """Answers a connection over the limit with one FATAL error and closes it."""

    def __init__(self, err: DPError) -> None:
        self.err = err

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        # answer SSL/GSS requests with 'N' so the client reads the error in clear
        if len(data) >= 8 and data[4:8] in (
            p.SSLRequest().encode()[4:], p.GSSENCRequest().encode()[4:]
        ):
            self.transport.write(b"N")
            return
        self.transport.write(error_response(self.err).encode())
        self.transport.close()
