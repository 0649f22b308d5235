"""What the stages of one consumer see of the runtime: a narrow, explicit interface.

The stages (fetch, admit, attempt, settle, upkeep) never hold the :class:`~framework.runtime.Runtime`;
each gets a :class:`Wiring` built by the runtime for one handler, with exactly what they use.
A stage can be built and tested alone from a broker, settings and a handler
(see ``tests/test_stages.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import anyio
import attrs

from broker import Broker
from broker.capabilities import InboxStore, PartitionOwnership, StateStore
from framework._messages import Outgoing
from framework.logs import get_logger
from framework.middleware import Middleware
from framework.runtime.lanes import LanePool
from framework.runtime.ledger import ConsumerStats
from framework.service import Handler
from framework.settings import RuntimeSettings

__all__ = ["Publish", "Wiring"]

_log = get_logger("framework.runtime.consumer")

Publish = Callable[[Sequence[Outgoing]], Awaitable[None]]
"""Publishes messages staged by handlers (declaring Queue/Topic objects on first use)."""


@attrs.frozen(eq=False)
class Wiring:
    """One consumer's view of the runtime.

    ``scope`` tells this consumer's keys apart in the shared lanes; ``middleware`` is the chain
    around the handler (the runtime's, then the service's), empty for none; ``observer`` traces
    and measures the handler's messages when tracing or metrics are on (outermost in the chain;
    the admit stage reports messages dropped before any handler runs to it), None when off.
    """

    broker: Broker
    settings: RuntimeSettings
    consumer_name: str
    lanes: LanePool
    publish: Publish
    handler: Handler
    stats: ConsumerStats = attrs.field(factory=ConsumerStats)
    scope: int = 0
    middleware: tuple[Middleware, ...] = ()
    thread_limiter: anyio.CapacityLimiter | None = None
    observer: Any = None  # framework.observability.consumer.Observer when tracing or metrics are on
    log: Any = attrs.field(
        default=attrs.Factory(
            lambda self: _log.bind(
                service=self.handler.service, handler=self.handler.name, destination=self.handler.destination.name
            ),
            takes_self=True,
        )
    )

    @property
    def inbox_store(self) -> InboxStore:
        """The broker as its inbox store (the runtime checked the capability when it wired the handler)."""
        return cast(InboxStore, self.broker)

    @property
    def ownership_store(self) -> PartitionOwnership:
        """The broker as its partition-ownership capability (checked at wiring when partitions are owned)."""
        return cast(PartitionOwnership, self.broker)

    @property
    def effects_store(self) -> StateStore:
        """The broker committing a run's recorded writes with its ack (only reached by runs that recorded
        some: ``ctx.redis_transaction()``, which refuses without the ``redis`` capability, or a saga
        step, whose ``state`` need the runtime checked)."""
        return cast(StateStore, self.broker)

    @property
    def lease_ms(self) -> int:
        """The visibility timeout in milliseconds: how long a fetched entry or inbox lease stays ours."""
        return int(self.settings.visibility_timeout * 1000)
