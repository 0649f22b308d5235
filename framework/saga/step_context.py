"""What a saga step receives: SagaContext, with the instance's state, its sends, timeouts and completion."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from broker import derive_id
from framework._payloads import type_name
from framework.saga.policy import SagaError
from framework.scheduling import due_ms

if TYPE_CHECKING:
    from framework.context import Context, _Staged
    from framework.handlers import Queue, Topic

__all__ = ["SagaContext", "SagaInfo"]

S = TypeVar("S")


class SagaInfo(Protocol):
    """What a step's context reads of its saga (a :class:`framework.saga.Saga`)."""

    name: str
    queue: Queue
    _timeout_steps: dict[str, Any]

    @property
    def label(self) -> str:
        """``service.saga`` for logs."""


def _no_delay(options: Mapping[str, Any]) -> None:
    # A scheduled send is stored by its own script before the step's commit, so it could leave
    # for a step whose save then fails: refused, with the way that commits atomically.
    if options.get("delay") is not None or options.get("at") is not None:
        raise SagaError(
            "a saga step cannot send with delay=/at=: call ctx.request_timeout(delay, payload) and send "
            "from the timeout step (a timeout is saved atomically with the state)"
        )


class SagaContext(Generic[S]):
    """What a saga step receives: the instance's ``state``, and ``send``/``publish``,
    ``request_timeout``, ``cancel_timeout`` and ``complete``.

    Everything a step does takes effect only if its state is saved: the state, its timeouts and
    its outgoing messages commit in one atomic step with the inbox mark and the ack. Change
    ``state`` in place (or assign a new one); it is saved when the step returns.
    """

    __slots__ = ("_completed", "_pending", "_saga", "_timeouts", "context", "correlation", "sql", "state", "version")

    def __init__(
        self,
        context: Context,
        saga: SagaInfo,
        state: S,
        correlation: str,
        version: int,
        pending: dict[str, str],
        sql: Any = None,
    ) -> None:
        self.context = context
        """The plain handler :class:`~framework.Context` of the message (headers, ids, attempt)."""
        self._saga = saga
        self.state = state
        """The instance's state (a fresh ``state()`` when this message started it)."""
        self.correlation = correlation
        """The instance's correlation id (the key every message of it carries on the saga queue)."""
        self.version = version
        """The state's version as loaded (0: this message starts the instance)."""
        self.sql = sql
        """The SQL connection of the step's transaction when the saga keeps its state in SQL
        (``sql=``; else None): rows the step writes with it commit with the state, or not at all."""
        self._pending = pending
        self._timeouts: list[tuple[str, Any, int]] = []
        self._completed = False

    @property
    def message_id(self) -> str:
        """The id of the message this step handles (the forwarded copy's, derived from the original's)."""
        return self.context.message_id

    @property
    def is_new(self) -> bool:
        """Whether this message started the instance."""
        return self.version == 0

    @property
    def completed(self) -> bool:
        """Whether :meth:`complete` was called in this step."""
        return self._completed

    @property
    def pending_timeouts(self) -> Mapping[str, str]:
        """Timeouts requested and not fired or cancelled yet: id -> payload type name."""
        return dict(self._pending)

    def send(self, queue: str | Queue, command: Any, *, key: str | None = None, **kw: Any) -> _Staged:
        """Stage a command; it leaves only if this step's state is saved (``headers=``, ``type=`` as
        for :meth:`Context.send`; ``delay=``/``at=`` only when the state is in SQL, else use
        :meth:`request_timeout` and send from its step)."""
        if self.sql is None:
            _no_delay(kw)
        return self.context.send(queue, command, key=key, **kw)

    def publish(self, topic: str | Topic, event: Any, *, key: str | None = None, **kw: Any) -> _Staged:
        """Stage an event; it leaves only if this step's state is saved."""
        if self.sql is None:
            _no_delay(kw)
        return self.context.publish(topic, event, key=key, **kw)

    def request_timeout(self, delay: timedelta | float | None, payload: Any, *, at: datetime | None = None) -> str:
        """Deliver ``payload`` to this instance's timeout step for ``type(payload)`` after ``delay``
        (seconds or timedelta) or ``at`` (an aware datetime). Stored only if this step's state is
        saved; ignored when it fires after :meth:`complete` or :meth:`cancel_timeout`. Returns its id."""
        if self._saga._timeout_steps.get(type_name(payload)) is None:
            raise SagaError(
                f"saga {self._saga.label}: no timeout step for {type_name(payload)}; declare one with "
                f"@{self._saga.name}.timeout"
            )
        due = due_ms(delay, at)
        if due is None:
            due = due_ms(0)
        assert due is not None
        n = len(self._timeouts)
        timeout_id = derive_id(self.context.message_id, f"{self._saga.queue.name}/timeout/{n}")
        self._timeouts.append((timeout_id, payload, due))
        self._pending[timeout_id] = type_name(payload)
        return timeout_id

    def cancel_timeout(self, timeout_id: str) -> bool:
        """Forget a pending timeout: when it fires it is ignored. False when it is not pending."""
        return self._pending.pop(timeout_id, None) is not None

    def complete(self) -> None:
        """End the instance: its state is replaced by a tombstone when this step commits; later
        messages and timeouts for it are ignored (for ``keep_completed``)."""
        self._completed = True
