"""Versioned state per key committed with a delivery's ack: the typed operations and the recorder of a run's.

A handler run (a saga step) records what it writes in an :class:`Effects` the transport made
(:meth:`broker.capabilities.StateStore.effects`); the transport applies it with the delivery's
inbox mark, its outgoing messages and its ack in one atomic step
(:meth:`~broker.capabilities.StateStore.commit_effects`). A state is a hash of fields under a key
the transport names (:meth:`~broker.capabilities.StateStore.state_key`); the operations are
plain tuples (``NamedTuple``: no allocation beyond the tuple itself), which each transport
translates into its own writes (Redis: the same commands of one ``commit_effects.lua`` call).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from broker.envelope import Envelope

__all__ = ["DeleteKey", "Effects", "ExpectField", "ExpireKey", "ScheduleMessage", "SetFields", "StateOp"]


class ExpectField(NamedTuple):
    """A guard, not a write: nothing of the commit applies (it raises
    :class:`~broker.errors.EffectsConflict`, the entry stays pending) unless field ``field`` of the
    state at ``key`` holds ``value`` ('' = absent) when it commits. Guards are checked before any write."""

    key: str
    field: str
    value: str


class SetFields(NamedTuple):
    """Set ``fields`` (name -> bytes, str or int) of the state at ``key``, keeping its other fields and its expiry."""

    key: str
    fields: Mapping[str, bytes | str | int]


class DeleteKey(NamedTuple):
    """Delete the state at ``key``: every field, and its expiry."""

    key: str


class ExpireKey(NamedTuple):
    """Delete the state at ``key`` ``ms`` milliseconds after the commit (a later ExpireKey or DeleteKey
    replaces that)."""

    key: str
    ms: int


class ScheduleMessage(NamedTuple):
    """Store ``envelope`` until ``due_ms`` (Unix ms), then deliver it to its destination's partition as
    a scheduled publish is (moved by :meth:`~broker.capabilities.Scheduler.move_scheduled`, cancelled by
    id); an envelope of that id scheduled already is replaced. It must go to the partition the
    delivery came from (on Redis that partition's hash tag holds the whole commit): a saga's timeout
    to its own queue, keyed by its instance."""

    envelope: Envelope
    due_ms: int


StateOp = ExpectField | SetFields | DeleteKey | ExpireKey | ScheduleMessage
"""One typed operation of a commit."""


class Effects:
    """The operations one handler run records, applied when it succeeds (see the module docstring).

    ``ops`` keeps them in the order recorded (a transport may record its own kinds of operations
    beside these: Redis commands, :mod:`broker.redis.effects`); ``applied`` the functions to call
    once a commit applied them.
    """

    __slots__ = ("applied", "ops")

    def __init__(self) -> None:
        self.ops: list[object] = []
        self.applied: list[Callable[[], object]] = []

    def add(self, op: StateOp) -> None:
        """Record one typed operation."""
        self.ops.append(op)

    def expect(self, key: str, field: str, value: str | int | None) -> None:
        """A guard (:class:`ExpectField`): apply nothing unless ``key``'s ``field`` still holds ``value``
        (None: absent) at commit. A changed value makes the commit raise
        :class:`~broker.errors.EffectsConflict` having written, sent and acked nothing."""
        self.ops.append(ExpectField(key, field, "" if value is None else str(value)))

    def after_commit(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` in the worker once these writes were applied (not when the message turned out a
        duplicate, a guard failed, the commit failed or its outcome is unknown)."""
        self.applied.append(fn)
