"""What the DP path knows of the client that asks: analyst, settings, caps, encoding, search_path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dp_core.settings import Caps, DPSettings


@dataclass(frozen=True)
class DPRequest:
    """One DP statement's asker, as the session sees it when the statement runs."""

    analyst: str
    admin: bool
    """The analyst may call the admin functions (`dp_reset_budget`, others' `dp_ledger`)."""
    process_id: int
    """The session's key, for the logs."""
    settings: DPSettings
    """The session's dp.* settings now (a query's OPTIONS override them)."""
    caps: Caps
    codec: str
    """The client encoding's Python codec: Bind parameters are text in it."""
    encoding: str
    """The client encoding's Postgres name."""
    charged: Callable[[], None]
    """Told once the answer is charged: from then on a CancelRequest no longer stops it."""
    search_path: tuple[str, ...] | None = None
    """The schemas the session's backend looks relation names up in, in order, implicit ones
    included (`current_schemas(true)`: pg_catalog, the session's temporary schema; only those
    the analyst may use): a DP query's names mean what they mean there. None: not asked
    (names as written; a protected table's in its configured schema)."""
    timezone: str | None = None
    """The session's TimeZone, for the relative dates a DP query fixes when it is planned and
    for the pushdown (`date_trunc('day', t)`, `t::date` as the session reads them)."""
