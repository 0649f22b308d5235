"""The inbox: how a service processes each message once although it may be delivered twice.

A message can reach a service more than once: a producer retried a publish, a worker crashed
after its handler ran and before the ack, a claim raced a slow worker. Two inboxes drop the
copies, both keyed by message id per service (consumer group):

* **The Redis inbox** (on by default, ``Service(inbox=...)``). Each id is first *leased* to the
  consumer that will run it (for the visibility timeout, extended with the entry while the handler
  runs) by the read that fetched it (``InboxStore.read_leased``: one round trip; a backlog read in
  full batches is checked here instead, one call per batch: :func:`check_inbox`), then
  made *final* atomically with the ack (``RedisBroker.ack(..., inbox=True)``), or with the
  handler's Redis effects (``ctx.redis_transaction()``, see :mod:`framework.effects`). A fetched
  id already final is a duplicate: acknowledged at once, its handler not run. An id leased to
  another consumer is being processed there right now: the entry is left pending (redelivered
  later; by then it is final, or its lease expired). A redelivery of our own entry takes a stale
  lease over. Ids are forgotten after ``RuntimeSettings.inbox_window`` (the trimmer).
* **The SQL inbox** (``ctx.sql_transaction(engine)``): ``framework.outbox.claim_inbox`` inserts
  the message id in the same database transaction as the handler's writes, so the effects and the
  "processed" mark commit together; a second run finds the row and raises
  :class:`~framework.effects.AlreadyProcessed` (acknowledged as a duplicate). Use it when the
  handler's effects live in SQL: the Redis inbox then only saves the second run its work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from broker import Delivery

if TYPE_CHECKING:  # the runtime imports this module: no import back at run time
    from framework.runtime.ledger import Ledger
    from framework.runtime.wiring import Wiring

__all__ = ["check_inbox"]

RUN, DUPLICATE, ELSEWHERE = 0, 1, 2  # inbox_claim's statuses


async def check_inbox(
    wiring: Wiring, ledger: Ledger, deliveries: Sequence[Delivery], channel: Any = None
) -> list[Delivery]:
    """Lease the new ids among ``deliveries`` and return those to run (a delivery whose read took
    its lease, ``inbox_status`` set, is not checked again).

    Duplicates are queued for acknowledgement at once (counted in ``stats.duplicates``); entries
    leased elsewhere are forgotten (they stay pending), and a copy of a message running in this very
    partition is checked again once that run has settled (:meth:`Ledger.defer_copies`). If the
    broker call fails, every delivery is forgotten (pending, redelivered later) and the error
    propagates. ``channel`` is the
    caller's own connection, if it has one.
    """
    unchecked = [d for d in deliveries if d.inbox_status is None]  # (a leased read checked the others)
    if unchecked:
        try:
            statuses = await wiring.inbox_store.inbox_claim(
                ledger.view,
                unchecked,
                wiring.lease_ms,
                channel=channel,
                window_ms=int(wiring.settings.inbox_window * 1000),
            )
        except BaseException:
            ledger.forget(deliveries)
            raise
        for d, status in zip(unchecked, statuses, strict=True):
            d.inbox_status = status
    run: list[Delivery] = []
    duplicates: list[Delivery] = []
    elsewhere: list[Delivery] = []
    for d in deliveries:
        (run, duplicates, elsewhere)[d.inbox_status or 0].append(d)
    if duplicates:
        wiring.stats.duplicates += len(duplicates)
        ledger.queue_acks(duplicates)
    if elsewhere:  # the same message id is being processed right now: elsewhere, or here
        ledger.forget(elsewhere)
        here = {d.message_id for d, _ in ledger.held.values()}
        copies = [d for d in elsewhere if d.message_id in here]
        if copies:  # checked again once the run here has settled (not after the visibility timeout)
            ledger.defer_copies(copies)
    return run
