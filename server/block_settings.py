"""A session's dp.* settings, kept with Postgres's transaction semantics for SET."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dp_core.classify import Effect
from dp_core.settings import DPSettings

if TYPE_CHECKING:
    from server.backend import BackendLink


@dataclass
class _Block:
    """dp.* settings of a session whose open transaction block changed them."""

    start: DPSettings
    """Before the block: what a rollback goes back to."""
    session: DPSettings
    """With the block's SETs but not its SET LOCALs: what a commit keeps."""
    savepoints: list[tuple[str, DPSettings, DPSettings]] = field(default_factory=list)
    """Savepoints made since the block first changed dp.* settings, oldest first: name, and
    the settings and `session` to go back to."""


class BlockSettings:
    """The dp.* settings of one session as Postgres keeps a setting: inside a block, a SET
    lasts if the block commits and a SET LOCAL until the block ends either way; outside one,
    a SET LOCAL only warns (the extended protocol's implicit transaction up to Sync counts
    as a block that ends there); ROLLBACK TO SAVEPOINT undoes what was set since.

    The backend link notes how blocks end (`BackendLink.tx_ends`, watched while a block
    has changed settings); every method takes the link as it is then."""

    __slots__ = ("_block", "_now")

    def __init__(self, defaults: DPSettings) -> None:
        self._now = defaults
        self._block: _Block | None = None

    def now(self, link: BackendLink | None) -> DPSettings:
        """The settings in force."""
        self.settle(link)
        return self._now

    def changed_in_block(self, link: BackendLink | None) -> bool:
        """Whether the open block has changed settings (its savepoints must be followed)."""
        self.settle(link)
        return self._block is not None

    def settle(self, link: BackendLink | None) -> None:
        """Settle the settings of a block that changed them and has ended since."""
        if self._block is not None and link is not None and link.tx_ends:
            self._end(link, committed=link.tx_ends[0])

    def _end(self, link: BackendLink, committed: bool) -> None:
        block = self._block
        assert block is not None
        self._now = block.session if committed else block.start
        self._block = None
        link.watch_tx = False
        link.tx_ends.clear()

    def assign(self, link: BackendLink, change: Callable[[DPSettings], DPSettings],
               is_local: bool, extended: bool) -> bool:
        """Change the settings as a SET [LOCAL] (`is_local`) does; True when Postgres would
        warn that SET LOCAL is outside a block (on the extended protocol only where no
        statement ran before it in the batch: one may have begun a block)."""
        new = change(self.now(link))
        outside = link.tx_status == b"I"
        warn = outside and is_local and (not extended or link.batch_started is None)
        if outside and not extended:
            if is_local:
                return warn
        else:
            if self._block is None:
                self._block = _Block(start=self._now, session=self._now)
                link.tx_ends.clear()
                link.watch_tx = True
            if not is_local:
                self._block.session = change(self._block.session)
        self._now = new
        return warn

    def follow_savepoint(self, link: BackendLink, effect: Effect | None, name: str | None) -> None:
        """SAVEPOINT, RELEASE, ROLLBACK TO and ... AND CHAIN run in a block whose settings
        have changed (before they changed, nothing needs following: going back to a
        savepoint made then is going back to the block's start)."""
        self.settle(link)
        block = self._block
        if block is None:
            return
        if effect in (Effect.ROLLBACK_AND_CHAIN, Effect.COMMIT_AND_CHAIN):
            # the next block has changed nothing; a COMMIT AND CHAIN that committed was settled
            # above (the relay notes it), so this one was of a failed block: rolled back
            self._end(link, committed=False)
            return
        marks = block.savepoints
        if effect is Effect.SAVEPOINT:
            assert name is not None
            marks.append((name, self._now, block.session))
            return
        # the newest savepoint of the name; one we do not know was made before the first
        # change, so every one we know of is later
        at = next((i for i in range(len(marks) - 1, -1, -1) if marks[i][0] == name), None)
        if effect is Effect.RELEASE:
            del marks[0 if at is None else at:]
        elif at is None:  # ROLLBACK TO a savepoint made before the first change
            self._now = block.session = block.start
            marks.clear()
        else:  # ROLLBACK TO: the savepoint stays, the ones after it go
            _, self._now, block.session = marks[at]
            del marks[at + 1:]
