"""A saga instance's state as this worker keeps it between steps, and its writes sent with the acks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from broker import GuardedWrite
from framework._payloads import converter


class _Kept:
    """An instance's state as this process saved it last, kept for its next step (see
    :meth:`Saga._keep_state`): one object an instance, reused by its next steps, so a step
    allocates nothing that outlives its ack (no garbage for the collector's older generations).
    ``write``: its last save sent with the acks while that ack has not run (see
    :meth:`Saga._save_with_ack`); ``applied``: False once a save sent with the acks was not."""

    __slots__ = ("applied", "fence", "key", "pending", "size", "state", "until", "version", "write")

    def __init__(self, key: str) -> None:
        self.key = key
        self.write: _StateWrite | None = None
        self.applied = True
        self.until = 0.0  # (monotonic) usable until then; 0: only its write is kept, for the next read to wait for
        self.version: int | None = 0
        self.state: Any = None
        self.pending: dict[str, str] = {}
        self.size = 0  # bytes of the state's JSON (and its timeouts'), counted against the budget
        self.fence: int | None = None  # the tenure that saved it


class _StateWrite(GuardedWrite):
    """A saga state write sent with the acks (see :meth:`Saga._save_with_ack`), for ``entry``;
    ``note`` is the saga's :meth:`Saga._written`."""

    __slots__ = ("entry",)

    def __init__(
        self,
        entry: _Kept,
        expected: str,
        names: tuple[str, ...],
        values: tuple[Any, ...],
        note: Callable[[GuardedWrite], None],
    ) -> None:
        super().__init__(entry.key, "v", expected, names, values, note)
        self.entry = entry


_STATE_FIELDS = ("v", "s", "t", "done")
"""The fields of a saga instance's state hash a step reads: version, state, timeouts, completed."""

_SAVED = ("v", "s")  # the fields a step's save sent with the ack writes: version, state
_SAVED_WITH_TIMEOUTS = ("v", "s", "t")  # (and the timeouts, once the instance has had some)


def _state_json(state: Any) -> bytes:
    """A state's JSON: a ``dict`` of types orjson writes itself as orjson writes it (what the payload
    converter would give for them), anything else through the converter."""
    if type(state) is dict:
        try:
            return orjson.dumps(state)
        except TypeError:  # (sets, bytes, attrs instances, non-str keys...: the converter knows them)
            pass
    return orjson.dumps(converter.unstructure(state))
