"""Scheduled messages and recurring jobs: when a message is due, and when a job's ticks fall.

Scheduled messages: ``send``/``publish`` (on :class:`~framework.Client`, a handler's ``ctx`` and
:mod:`framework.outbox`) take ``delay=`` (seconds or a timedelta, >= 0) or ``at=`` (an aware
datetime; a naive one is refused, since its zone would be a guess). :func:`due_ms` turns them into
the ``deliver-at`` header (Unix ms); the broker stores the message until then and a mover in every
runtime of the namespace appends it to its destination when due (see ``docs/scheduling.md``). A due
time in the past is delivered at once. The message keeps its id, so :func:`cancel` works by id.

Recurring jobs: ``@service.every(timedelta(minutes=5))`` and ``@service.cron("0 3 * * *", tz=...)``
declare a :class:`Job`. Each tick is fired at most once across all instances (``job_tick.lua``
compares it with the latest tick fired, atomically) as a :class:`Tick` message to the job's own
queue, handled like any command (retries, inbox, dead letters). Ticks missed while no instance ran
collapse into one: the latest, fired on return. A job seen for the first time records its latest
past tick without firing it, so it first fires at its first tick after it is deployed.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs

from broker import COMMAND, Envelope, derive_id, now_ms
from broker.headers import DELIVER_AT

if TYPE_CHECKING:
    from broker.scheduling import ScheduledMessage

__all__ = ["Job", "ScheduleError", "Tick", "cancel", "due_ms", "scheduled"]


class ScheduleError(ValueError):
    """A delay, due time or job schedule that cannot be used; the message says what to change."""


def due_ms(delay: timedelta | float | None = None, at: datetime | None = None) -> int | None:
    """The Unix ms a message is due for ``delay`` (seconds or timedelta from now) or ``at`` (an
    aware datetime); None when neither is given (deliver now)."""
    if delay is not None and at is not None:
        raise ScheduleError("give delay= or at=, not both")
    if delay is not None:
        if isinstance(delay, timedelta):
            seconds = delay.total_seconds()
        elif isinstance(delay, int | float) and not isinstance(delay, bool):
            seconds = float(delay)
        else:
            raise ScheduleError(f"delay must be seconds or a timedelta, not {delay!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise ScheduleError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
        return now_ms() + int(seconds * 1000)
    if at is not None:
        if not isinstance(at, datetime):
            raise ScheduleError(f"at must be a datetime, not {at!r}")
        if at.tzinfo is None or at.utcoffset() is None:
            raise ScheduleError(
                f"at={at.isoformat()} has no time zone: pass an aware datetime, "
                "e.g. datetime.now(UTC) + timedelta(hours=1) or datetime(..., tzinfo=ZoneInfo('Europe/Berlin'))"
            )
        return int(at.timestamp() * 1000)
    return None


def with_due(
    headers: dict[str, str] | None, delay: timedelta | float | None, at: datetime | None
) -> dict[str, str] | None:
    """``headers`` with the ``deliver-at`` header set for ``delay``/``at`` (unchanged when neither)."""
    due = due_ms(delay, at)
    if due is None:
        return headers
    out = dict(headers) if headers else {}
    out[DELIVER_AT] = str(due)
    return out


async def cancel(broker: Any, message_id: str, *, destination: str | None = None) -> bool:
    """Cancel a scheduled message by id; False when it is not scheduled (delivered, cancelled, unknown)."""
    return bool(await broker.cancel_scheduled([message_id], destination=destination))


async def scheduled(broker: Any, *, destination: str | None = None, limit: int = 100) -> list[ScheduledMessage]:
    """Messages waiting for their due time, earliest first."""
    return list(await broker.scheduled_messages(destination=destination, limit=limit))


# -- recurring jobs ------------------------------------------------------------------------------


@attrs.frozen
class Tick:
    """The payload a recurring job's handler receives: which job, and which tick (UTC)."""

    job: str
    at: datetime


def _zone(tz: str | None) -> ZoneInfo | None:
    if tz is None:
        return None
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ScheduleError(f"unknown time zone {tz!r} ({exc}); use an IANA name like 'Europe/Berlin'") from None


@attrs.frozen
class Job:
    """A recurring job of a service: every ``interval_ms`` (aligned to the Unix epoch), or per a
    cron expression in zone ``tz`` (UTC when None). ``queue`` is where its ticks go."""

    service: str
    name: str
    queue: str
    interval_ms: int | None = None
    cron: str | None = None
    tz: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.interval_ms is None) == (self.cron is None):
            raise ScheduleError(f"job {self.name!r}: give an interval or a cron expression")
        if self.interval_ms is not None and self.interval_ms < 1000:
            raise ScheduleError(f"job {self.name!r}: the interval must be at least one second")
        if self.cron is not None:
            from croniter import croniter

            if not croniter.is_valid(self.cron):
                raise ScheduleError(f"job {self.name!r}: {self.cron!r} is not a valid cron expression")
            _zone(self.tz)

    @property
    def label(self) -> str:
        """``service.job`` for logs."""
        return f"{self.service}.{self.name}"

    def last_tick(self, now: int) -> int:
        """The latest tick at or before ``now`` (Unix ms)."""
        if self.interval_ms is not None:
            return now - now % self.interval_ms
        from croniter import croniter

        zone = _zone(self.tz) or UTC
        # get_prev gives the latest tick strictly before its start: start a millisecond after now
        prev = croniter(self.cron, datetime.fromtimestamp((now + 1) / 1000, zone)).get_prev(datetime)
        return int(prev.timestamp() * 1000)

    def next_tick(self, now: int) -> int:
        """The first tick after ``now`` (Unix ms)."""
        if self.interval_ms is not None:
            return now - now % self.interval_ms + self.interval_ms
        from croniter import croniter

        zone = _zone(self.tz) or UTC
        nxt = croniter(self.cron, datetime.fromtimestamp(now / 1000, zone)).get_next(datetime)
        return int(nxt.timestamp() * 1000)

    def tick_envelope(self, tick: int) -> Envelope:
        """The message of tick ``tick``: its id derives from the job and the tick alone."""
        from framework._messages import build_envelope

        payload = Tick(job=self.name, at=datetime.fromtimestamp(tick / 1000, UTC))
        message_id = derive_id(f"{tick:012x}", f"tick/{self.service}/{self.name}")
        env, _ = build_envelope(self.queue, COMMAND, payload, message_id=message_id)
        return env
