"""What a handler's SQL block needs of the run it belongs to, and the error for a message processed before.

:mod:`framework.effects` (one transaction per block) and :mod:`framework.group_commit` (blocks
as members of a shared transaction) both run ``ctx.sql_transaction`` blocks; they see the
handler's :class:`~framework.Context` through :class:`SqlRun`, so neither imports the context
(which calls them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from framework._messages import Outgoing

__all__ = ["AlreadyProcessed", "SqlRun"]


class AlreadyProcessed(Exception):
    """The message was processed before (found in the inbox): the runtime acks it, no retry."""

    __module__ = "framework.effects"  # its public home (and the type name dead letters would record)


class SqlRun(Protocol):
    """The handler run (:class:`framework.Context`) a ``ctx.sql_transaction`` block belongs to."""

    attempt: int

    @property
    def service(self) -> str:
        """The handling service's name (the inbox group)."""

    @property
    def message_id(self) -> str:
        """The incoming message's id (the inbox row)."""

    @property
    def outgoing(self) -> list[Outgoing]:
        """Messages staged so far: those staged inside the block go to the outbox table."""

    def _unstage_from(self, position: int) -> list[Outgoing]:
        """Take back messages staged since ``position`` (the block wrote them to its outbox)."""

    def _sql_committed(self) -> None:
        """The block's transaction committed."""

    def _sql_failed(self, error: BaseException) -> None:
        """The block's transaction did not commit: the run fails with ``error``."""
