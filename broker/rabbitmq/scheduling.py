"""The RabbitMQ broker's scheduling role: the ``scheduling`` capability over a schedule kept beside the
server (:class:`~broker.rabbitmq.side.SideSchedule`; :func:`broker.connect` gives the Redis one that
shares the Redis inbox's server).

With it, a message sent with a due time is stored there (listed and cancelled by ``framework
schedule``), and every runtime's mover publishes due ones to their queues; recurring jobs' ticks
are fired once across processes there and published the same way. Publishing to RabbitMQ comes
before the store forgets a message, so a mover that dies in between makes a duplicate (same message
id, dropped by the inbox), never a loss. Built without it (``?inbox=none``) the broker declares no
``scheduling``: delayed messages still work through the delay chain, unlisted.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.envelope import COMMAND, Envelope
from broker.rabbitmq.introspection import Inspection
from broker.rabbitmq.side import SideSchedule
from broker.scheduling import MoveResult, ScheduledMessage

__all__ = ["Scheduling"]


class Scheduling(Inspection):
    """The ``scheduling`` capability (see the module's docstring)."""

    def _schedule(self) -> SideSchedule:
        if self.side_schedule is None:
            raise TypeError(
                "the rabbitmq transport has no 'scheduling' capability here: it keeps scheduled messages in the "
                "Redis beside it, which the broker URL turns off (?inbox=none)"
            )
        return self.side_schedule

    async def _forward(self, envelopes: Sequence[Envelope]) -> None:
        """Publish due envelopes now, confirmed, straight to their queues (the ``deliver-at`` header stays,
        as on Redis)."""
        await self._publish(envelopes, None, hold=False)

    async def move_scheduled(self, now_ms: int, *, limit: int = 1000, sweep: bool = False) -> MoveResult:
        """Publish due scheduled messages of the namespace to their queues (see the module's docstring)."""
        return await self._schedule().move(now_ms, limit, sweep, self._forward)

    async def cancel_scheduled(self, message_ids: Sequence[str], *, destination: str | None = None) -> int:
        """Cancel scheduled messages by id; returns how many were still scheduled."""
        return await self._schedule().cancel(message_ids, destination)

    async def scheduled_messages(
        self, *, destination: str | None = None, limit: int = 100, message_ids: Sequence[str] = ()
    ) -> list[ScheduledMessage]:
        """Scheduled messages, earliest due first (or those among ``message_ids``)."""
        return await self._schedule().messages(destination, limit, message_ids)

    async def count_scheduled(self, destination: str | None = None) -> int:
        """How many messages wait for their due time."""
        return await self._schedule().count(destination)

    async def fire_tick(self, queue: str, tick_ms: int, envelope: Envelope) -> int:
        """Publish a recurring job's tick to ``queue`` unless it (or a later tick) was fired: 1 fired,
        0 fired before, -1 first tick seen (recorded, not fired)."""
        spec = self._specs.get(queue) or await self.route(queue, COMMAND)
        return await self._schedule().fire_tick(spec, tick_ms, envelope, self._forward)
