"""State-changing operations on a frozen set: redrive or purge dead letters named by ref, cancel a
scheduled message; each one written to the audit log with who asked and what happened.

Refs are ``<destination>/<partition>/<group>/<dlq entry id>``: an entry id names one entry of one
DLQ stream, so acting on refs acts on exactly those entries; one that is gone meanwhile (redriven
or purged by someone else) is counted as gone, never replaced by another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import attrs

from broker import Broker
from broker.capabilities import as_dead_letter_admin, as_scheduler
from framework.logs import get_logger
from framework.operations.dead_letters import DeadLetterFilter, refs_upto, view_of_ref

__all__ = ["ActionResult", "audit", "cancel_scheduled", "frozen_refs", "purge", "redrive"]

_audit = get_logger("framework.audit")


@attrs.frozen
class ActionResult:
    """What an action did: ``done`` entries changed of ``asked``; ``gone`` were no longer there."""

    action: str
    asked: int
    done: int

    @property
    def gone(self) -> int:
        """Entries named that were no longer there."""
        return self.asked - self.done


def audit(who: str, action: str, **what: object) -> None:
    """Write one line of the audit log (logger ``framework.audit``): who did what, with its outcome."""
    _audit.warning("operator action", who=who, action=action, **what)


async def frozen_refs(broker: Broker, f: DeadLetterFilter, upto: str) -> list[str]:
    """Refs of every dead letter the filter selects that is no newer than ``upto`` (the page's bound)."""
    return await refs_upto(broker, f, upto)


async def redrive(
    broker: Broker,
    refs: Sequence[str],
    *,
    who: str,
    progress: Callable[[int, int], None] | None = None,
    rate: float | None = None,
) -> ActionResult:
    """Give exactly these dead letters back to their failing group (first attempts)."""
    admin = as_dead_letter_admin(broker)
    moved = 0
    for done, ref in enumerate(refs, start=1):
        view, entry_id = await view_of_ref(broker, ref)
        if await admin.redrive(view, entry_id) is not None:
            moved += 1
            if rate:
                await anyio.sleep(1 / rate)
        if progress is not None:
            progress(done, len(refs))
    result = ActionResult("redrive", len(refs), moved)
    audit(who, "dlq.redrive", asked=len(refs), redriven=moved, refs=list(refs[:20]))
    return result


async def purge(
    broker: Broker, refs: Sequence[str], *, who: str, progress: Callable[[int, int], None] | None = None
) -> ActionResult:
    """Delete exactly these dead letters for good (by entry id: an entry not named is never touched)."""
    admin = as_dead_letter_admin(broker)
    removed = done = 0
    if progress is not None:
        progress(0, len(refs))
    by_dlq: dict[str, list[str]] = {}  # one XDEL per DLQ and 500 entries
    for ref in refs:
        by_dlq.setdefault(ref.rsplit("/", 1)[0], []).append(ref)
    for same in by_dlq.values():
        view, _ = await view_of_ref(broker, same[0])
        for i in range(0, len(same), 500):
            chunk = same[i : i + 500]
            removed += await admin.purge_dead_letters(view, [r.rsplit("/", 1)[1] for r in chunk])
            done += len(chunk)
            if progress is not None:
                progress(done, len(refs))
    result = ActionResult("purge", len(refs), removed)
    audit(who, "dlq.purge", asked=len(refs), purged=removed, refs=list(refs[:20]))
    return result


async def cancel_scheduled(broker: Broker, message_ids: Sequence[str], *, who: str) -> ActionResult:
    """Cancel scheduled messages by id before they are delivered."""
    cancelled = await as_scheduler(broker).cancel_scheduled(list(message_ids))
    audit(who, "schedule.cancel", asked=len(message_ids), cancelled=cancelled, ids=list(message_ids[:20]))
    return ActionResult("cancel", len(message_ids), cancelled)
