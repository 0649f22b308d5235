"""Dead-letter queues as a Python API: list, show, redrive (to the failing group only) and purge.

Every (destination, group) pair has a DLQ per partition. A dead letter is named by its *ref*,
``<destination>/<partition>/<group>/<dlq-entry-id>``, or by its message id when that is unique.
The CLI (``framework dlq ...``) is a thin layer over :class:`DeadLetters`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import anyio
import attrs
import orjson

from broker import Broker, GroupPartition
from broker import headers as h
from broker.capabilities import as_dead_letter_admin, as_introspection
from framework.observability.logcontext import redacted_json

__all__ = ["DeadLetter", "DeadLetters", "body_view"]


def body_view(body: bytes) -> dict[str, Any]:
    """A stored body as an operator sees it (``dlq show``, ``peek``): ``body`` is its JSON with the
    secret fields redacted (``FRAMEWORK_LOG_REDACT``, default password, secret, token, card_number);
    a body that is not JSON is shown as text, or as ``body_hex`` when it is not UTF-8."""
    redacted = redacted_json(body)
    if redacted is not None:
        return {"body": redacted}
    try:
        return {"body": body.decode()}
    except UnicodeDecodeError:
        return {"body": None, "body_hex": body.hex()}


def _s(fields: dict[bytes, bytes], name: str) -> str:
    value = fields.get(name.encode())
    return value.decode(errors="replace") if value is not None else ""


def _time(fields: dict[bytes, bytes], name: str) -> datetime | None:
    raw = _s(fields, name)
    return datetime.fromtimestamp(int(raw) / 1000, tz=UTC) if raw.isdigit() else None


@attrs.frozen
class DeadLetter:
    """A message in a dead-letter queue, with the reason it is there."""

    ref: str
    destination: str
    partition: int
    group: str
    entry_id: str
    message_id: str
    type: str
    key: str | None
    headers: dict[str, Any]
    body: bytes
    reason: str
    error_type: str
    error_message: str
    traceback: str
    attempts: int
    handler: str
    first_failed_at: datetime | None
    dead_at: datetime | None

    @classmethod
    def from_entry(cls, view: GroupPartition, entry_id: str, fields: dict[bytes, bytes]) -> DeadLetter:
        """Build from a DLQ stream entry."""
        try:
            headers = orjson.loads(fields[b"headers"]) if b"headers" in fields else {}
        except orjson.JSONDecodeError:
            headers = {"(undecodable)": _s(fields, "headers")}
        attempts = _s(fields, h.DLQ_ATTEMPTS)
        return cls(
            ref=f"{view.spec.name}/{view.partition}/{view.group}/{entry_id}",
            destination=view.spec.name,
            partition=view.partition,
            group=view.group,
            entry_id=entry_id,
            message_id=_s(fields, "id"),
            type=_s(fields, "type"),
            key=_s(fields, "key") or None,
            headers=headers,
            body=fields.get(b"body", b""),
            reason=_s(fields, h.DLQ_REASON),
            error_type=_s(fields, h.DLQ_ERROR_TYPE),
            error_message=_s(fields, h.DLQ_ERROR_MESSAGE),
            traceback=_s(fields, h.DLQ_TRACEBACK),
            attempts=int(attempts) if attempts.isdigit() else 0,
            handler=_s(fields, h.DLQ_HANDLER),
            first_failed_at=_time(fields, h.DLQ_FIRST_FAILED_AT),
            dead_at=_time(fields, h.DLQ_DEAD_AT),
        )

    def to_json(self) -> dict[str, Any]:
        """Plain data; the body as :func:`body_view` shows it (secret fields redacted)."""
        data = attrs.asdict(self)
        data.update(body_view(self.body))
        for name in ("first_failed_at", "dead_at"):
            data[name] = data[name].isoformat() if data[name] else None
        return data


class DeadLetters:
    """Operations on the dead-letter queues of every subscription in a namespace."""

    # annotations spell the builtin ``builtins.list``: in this class body ``list`` names the method

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.admin = as_dead_letter_admin(broker)

    async def _views(self, group: str | None = None, destination: str | None = None) -> builtins.list[GroupPartition]:
        views: builtins.list[GroupPartition] = []
        for dest, grp in await self.broker.list_subscriptions():
            if (group and grp != group) or (destination and dest != destination):
                continue
            spec = await self.broker.get_destination(dest)
            if spec is not None:
                views += [self.broker.group_partition(spec, p, grp) for p in range(spec.partitions)]
        return views

    async def list(
        self, *, group: str | None = None, destination: str | None = None, limit: int | None = None
    ) -> builtins.list[DeadLetter]:
        """Dead letters, filtered by group and/or destination, oldest first per partition."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit!r}")
        out: builtins.list[DeadLetter] = []
        for view in await self._views(group, destination):
            for entry_id, fields in await self.admin.dead_letter_entries(view, limit):
                out.append(DeadLetter.from_entry(view, entry_id, fields))
        out.sort(key=lambda d: d.dead_at or datetime.min.replace(tzinfo=UTC))
        return out[:limit] if limit is not None else out

    async def count(self, *, group: str | None = None, destination: str | None = None) -> int:
        """How many dead letters match."""
        inspect = as_introspection(self.broker)
        return sum([await inspect.dead_letter_count(view) for view in await self._views(group, destination)])

    async def get(self, ident: str) -> DeadLetter:
        """The dead letter with this ref or message id; KeyError if none, ValueError if ambiguous."""
        matches = await self._resolve([ident])
        if not matches:
            raise KeyError(f"no dead letter {ident!r} (use `framework dlq list` to see them)")
        if len(matches) > 1:
            refs = ", ".join(m.ref for m in matches)
            raise ValueError(f"message id {ident!r} is dead in several groups ({refs}); name one by its ref")
        return matches[0]

    async def _resolve(self, idents: Iterable[str]) -> builtins.list[DeadLetter]:
        wanted = set(idents)
        refs = {i for i in wanted if i.count("/") == 3}
        found: builtins.list[DeadLetter] = []
        for d in await self.list():
            if d.ref in refs or d.message_id in wanted:
                found.append(d)
        return found

    async def _select(
        self, idents: Iterable[str] | None, group: str | None, destination: str | None, everything: bool
    ) -> builtins.list[DeadLetter]:
        idents = list(idents or [])
        if idents:
            found = await self._resolve(idents)
            missing = set(idents) - {d.ref for d in found} - {d.message_id for d in found}
            if missing:
                raise KeyError(f"no dead letter {', '.join(sorted(missing))}")
            return found
        if not (group or destination or everything):
            raise ValueError("name dead letters by id, or select them with a group/destination, or all")
        return await self.list(group=group, destination=destination)

    async def redrive(
        self,
        idents: Iterable[str] | None = None,
        *,
        group: str | None = None,
        destination: str | None = None,
        everything: bool = False,
        rate: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Give dead letters back to their failing group only (as first attempts); returns how many.

        ``rate`` caps the moves per second, so a large DLQ does not flood a recovering service.
        ``progress(done, total)`` is called once before the first letter (``done`` 0) and after
        each one; letters already gone (redriven or purged meanwhile) count as done, not as moved.
        """
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be a positive number of dead letters per second, got {rate!r}")
        letters = await self._select(idents, group, destination, everything)
        if progress is not None:
            progress(0, len(letters))
        moved = 0
        for done, d in enumerate(letters, start=1):
            spec = await self.broker.get_destination(d.destination)
            view = self.broker.group_partition(spec, d.partition, d.group) if spec is not None else None
            if view is not None and await self.admin.redrive(view, d.entry_id) is not None:
                moved += 1
                if rate:
                    await anyio.sleep(1 / rate)
            if progress is not None:
                progress(done, len(letters))
        return moved

    async def purge(
        self,
        idents: Iterable[str] | None = None,
        *,
        group: str | None = None,
        destination: str | None = None,
        everything: bool = False,
    ) -> int:
        """Delete dead letters for good; returns how many."""
        removed = 0
        for d in await self._select(idents, group, destination, everything):
            spec = await self.broker.get_destination(d.destination)
            if spec is not None:
                view = self.broker.group_partition(spec, d.partition, d.group)
                removed += await self.admin.purge_dead_letters(view, [d.entry_id])
        return removed
