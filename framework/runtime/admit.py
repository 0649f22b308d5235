"""Admit: decide what fetched deliveries become, and queue the runnable ones on the lanes.

For each fetched batch (:meth:`Admission.admit`): hold every delivery in the ledger; when several
handlers of the service share the group (or one has a filter), pick each delivery's handler from its
type and headers before decoding and ack what none wants (:mod:`framework.runtime.dispatch`); dead-letter
what cannot run (undecodable, an invalid payload, a failing key function: poison); drop duplicates
through the inbox (:func:`framework.inbox.check_inbox`); decode payloads and sort the rest:
keyed work to one lane per key (:mod:`framework.runtime.lanes`), keyless work to any free lane, and redelivered work
through the crash-loop rule (:meth:`Admission.sort_redeliveries`), isolating suspects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from broker import Delivery
from broker.headers import DEADLINE, DLQ_REASON
from framework._payloads import PayloadError
from framework.dead_letters.reasons import poison_reason
from framework.inbox import check_inbox
from framework.logs import debug_enabled
from framework.observability import logcontext
from framework.replies import deadline_passed
from framework.runtime.dispatch import Routed, Routes
from framework.runtime.lanes import Worker
from framework.runtime.ledger import Ledger
from framework.runtime.settle import Settlement
from framework.runtime.wiring import Wiring

__all__ = ["Admission", "Work"]

Work = tuple[Delivery, Any]  # a delivery and its decoded payload
Isolated = tuple[Work, bool, Any]  # (work, suspect, key): run one at a time


class Admission:
    """The admit stage of one consumer; ``worker`` is what the lanes call to process its batches."""

    def __init__(self, wiring: Wiring, settle: Settlement, worker: Worker) -> None:
        self.wiring = wiring
        self.settle = settle
        self.worker = worker
        self.handler = wiring.handler
        self.lanes = wiring.lanes
        self.submit: Callable[..., None] | None = None  # where admitted work goes if not to the lanes (batches)
        self.scope = wiring.scope
        self.observer = wiring.observer  # None unless tracing or metrics are on
        self.debug = debug_enabled()  # a line per message received (and settled, see the settle stage)
        self.bodies = logcontext.body_logging() if self.debug else None  # field names to redact
        self.watching = self.observer is not None or self.debug
        self.routes: Routes | None = None  # set by the consumer when handlers share this group

    async def admit(self, ledger: Ledger, deliveries: list[Delivery], channel: Any = None) -> None:
        """Hold fetched deliveries, settle the ones that cannot run, queue the rest on lanes.

        ``channel`` is the caller's own connection, if it has one (the fetcher's).
        """
        handler = self.handler
        decode = handler.decode
        key_fn = handler.key
        lanes = self.lanes
        scope = self.scope
        by_key: dict[Any, list[Work]] = {}
        keyless: list[Work] = []
        isolated: list[Isolated] = []
        redelivered: list[tuple[Delivery, Any, Any]] = []  # (delivery, payload, key), once one is met
        gates = lanes.gates
        self.wiring.stats.fetched += len(deliveries)
        ledger.hold(deliveries, time.monotonic())
        if self.debug:
            self._log_received(deliveries)
        runnable = [d for d in deliveries if d.envelope is not None]
        poison = [
            (d, poison_reason(handler, d, f"undecodable message: {d.error}")) for d in deliveries if d.envelope is None
        ]
        routed = None
        if self.routes is not None and runnable:  # before the inbox: what nobody wants is acked at once
            runnable, routed = self.routes.pick_all(self, ledger, runnable, poison)
        if handler.inbox and runnable:
            checked = runnable
            runnable = await check_inbox(self.wiring, ledger, runnable, channel)
            if self.watching and len(runnable) < len(checked):
                self._dropped_duplicates(ledger, checked, runnable)
        if routed is not None:  # each handler's read-ahead for the messages it takes
            for route in {id(r): r for r in routed.values() if r.handler.prepare is not None}.values():
                mine = [d for d in runnable if routed[id(d)] is route]
                if mine:
                    await self._prepare(ledger, mine, channel, route.handler.prepare)
        elif handler.prepare is not None and runnable:
            await self._prepare(ledger, runnable, channel, handler.prepare)
        expired: list[Delivery] = []
        for d in runnable:
            env = d.envelope
            assert env is not None
            if DEADLINE in env.headers and deadline_passed(env):  # a request nobody waits for any more
                expired.append(d)
                continue
            try:
                if routed is None:
                    payload = decode(env.body)
                    lane_key = key_fn(payload) if key_fn is not None else env.key
                else:  # decoded by the handler its filter picked, which runs it (see Consumer.process)
                    payload, lane_key = routed[id(d)].decode(env)
            except PayloadError as exc:
                owner = handler if routed is None else routed[id(d)].handler
                poison.append((d, poison_reason(owner, d, f"invalid payload: {exc}")))
                continue
            except Exception as exc:
                owner = handler if routed is None else routed[id(d)].handler
                poison.append((d, poison_reason(owner, d, f"key function failed: {type(exc).__name__}: {exc}")))
                continue
            if redelivered or d.delivery_count > 1:  # sorted below, once the redeliveries are counted
                redelivered.append((d, payload, lane_key))
            elif lane_key is None:
                keyless.append((d, payload))
            elif gates and lanes.gated(scope, lane_key):  # isolated work of this key runs first
                isolated.append(((d, payload), False, lane_key))
            else:
                works = by_key.get(lane_key)
                if works is None:
                    by_key[lane_key] = [(d, payload)]
                else:
                    works.append((d, payload))
        for d, reason in poison:
            await self._dead_letter(ledger, d, reason)
        if expired:
            self._expired(ledger, expired)
        if redelivered:
            await self.sort_redeliveries(ledger, redelivered, by_key, keyless, isolated)
        (self.submit or lanes.submit)(self.worker, ledger, by_key, keyless, isolated, scope)

    async def _prepare(self, ledger: Ledger, runnable: list[Delivery], channel: Any, prepare: Any) -> None:
        """The handler's read-ahead for the batch (see ``Handler.prepare``): a failure is logged,
        never the batch's (its runs then read what they need themselves)."""
        try:
            await prepare(self.wiring.broker, runnable, ledger.fence, channel)
        except Exception as exc:
            self.settle.log_unsettled("read-ahead failed; the runs read for themselves", exc, count=len(runnable))

    async def sort_redeliveries(
        self,
        ledger: Ledger,
        items: list[tuple[Delivery, Any, Any]],
        by_key: dict[Any, list[Work]],
        keyless: list[Work],
        isolated: list[Isolated],
    ) -> None:
        """Count redelivered messages and sort them (with any fresh ones among ``items``) into work.

        The crash-loop rule: a message whose worker died while holding it is redelivered. Its
        first redelivered run is counted here, for a whole fetch in one round trip, and it runs
        like fresh work (concurrently): most redelivered messages are bystanders of a crash, not
        its cause. A message whose counter shows an earlier redelivered run that never completed
        is a *suspect*: it runs isolated (one suspect at a time in the process, on an isolation
        lane beside the others, see :mod:`framework.runtime.lanes`), counted again just before it
        starts (:meth:`count_suspect_run`), so a message that kills every worker is dead-lettered
        after ``max_attempts`` runs while the suspects queued behind it are not charged for its
        crashes. Work with a suspect's key is isolated behind it, keeping per-key order.

        With ``max_attempts`` below 3 every redelivery is a suspect (the old one-at-a-time rule):
        a bystander held through two crashes would otherwise reach the limit without ever
        having run alone.
        """
        candidates = [
            d for d, p, _ in items if d.delivery_count > 1 and _owner(self, p).handler.retry.max_attempts >= 3
        ]
        first: dict[int, bool] = {}
        if candidates:
            try:
                flags = await self.wiring.broker.count_first_redeliveries(candidates)
            except Exception as exc:
                self.settle.log_unsettled("could not count redeliveries; they stay pending", exc, count=len(candidates))
                ledger.forget(candidates)
                dropped = {id(d) for d in candidates}
                items = [item for item in items if id(item[0]) not in dropped]
            else:
                first = {id(d): flag for d, flag in zip(candidates, flags, strict=True)}
        kept: list[tuple[Delivery, Any, Any, bool]] = []
        for d, payload, key in items:
            suspect = False
            if d.delivery_count > 1:
                if first.get(id(d), False):  # its first redelivered run, counted just now
                    assert d.envelope is not None
                    attempt = d.envelope.attempt + 1
                    owner = _owner(self, payload)  # the handler that runs it (a shared group's member)
                    if attempt > owner.handler.retry.max_attempts:
                        await owner._dead_letter(ledger, d, owner._crash_loop_reason(d, attempt))
                        continue
                    d.delivery_count = 2  # so d.attempt is this run's attempt number
                else:
                    suspect = True
            kept.append((d, payload, key, suspect))
        lanes = self.lanes
        scope = self.scope
        suspect_keys = {key for _, _, key, suspect in kept if suspect and key is not None}
        for d, payload, key, suspect in kept:
            work = (d, payload)
            if suspect:
                isolated.append((work, True, key))
            elif key is None:
                keyless.append(work)
            elif key in suspect_keys or lanes.gated(scope, key):
                isolated.append((work, False, key))
            else:
                by_key.setdefault(key, []).append(work)

    async def count_suspect_run(self, ledger: Ledger, d: Delivery) -> bool:
        """Count a suspect's run just before it starts; dead-letter it instead when it keeps killing workers.

        The delivery count also rises for messages fetched by a worker that died before it ran
        them, so it cannot tell a crash loop on its own: redelivered runs are counted in Redis
        (first deliveries are not, which saves a write per message, so a first delivery a worker
        died holding counts as one attempt, whether it started or not; so does a first
        redelivery, counted when it is fetched, see :meth:`sort_redeliveries`).
        Sets ``d.delivery_count`` so that ``d.attempt`` is this run's attempt number.
        """
        assert d.envelope is not None
        try:
            runs = await self.wiring.broker.count_attempt(d)
        except Exception as exc:
            self.settle.log_unsettled("could not count a redelivery; it stays pending", exc, message_id=d.message_id)
            ledger.forget([d])
            return False
        attempt = d.envelope.attempt + runs
        if attempt > self.handler.retry.max_attempts:
            await self._dead_letter(ledger, d, self._crash_loop_reason(d, attempt))
            return False
        d.delivery_count = attempt - d.envelope.attempt + 1
        return True

    async def _dead_letter(self, ledger: Ledger, d: Delivery, reason: dict[str, str]) -> None:
        """Dead-letter a message that cannot run (no handler attempt): on its trace too."""
        await self.settle.dead_letter(ledger, d, reason)
        if self.observer is not None:
            self.observer.dropped(d, "dead_letter", reason.get(DLQ_REASON))

    def _expired(self, ledger: Ledger, expired: list[Delivery]) -> None:
        """Ack requests whose deadline passed unrun (their requester gave up: no reply), counted and logged."""
        self.wiring.stats.expired += len(expired)
        ledger.queue_acks(expired)
        for d in expired:
            self.wiring.log.warning("request not run: its deadline passed before it started", message_id=d.message_id)
            if self.observer is not None:
                self.observer.dropped(d, "duplicate", "request deadline passed")

    def _dropped_duplicates(self, ledger: Ledger, checked: list[Delivery], runnable: list[Delivery]) -> None:
        """Report the Redis inbox's duplicates among ``checked`` (acked, never run): a short span
        each, a debug line each. Entries leased to another consumer were forgotten, duplicates
        stay held until their ack is sent: that tells them apart."""
        kept = {id(d) for d in runnable}
        held = ledger.held
        for d in checked:
            if id(d) in kept or d.entry_id not in held:
                continue
            if self.observer is not None:
                self.observer.dropped(d, "duplicate")
            if self.debug:
                self.settle.log_settled(d, "duplicate", d.attempt)

    def _log_received(self, deliveries: list[Delivery]) -> None:
        """The debug line per message received (its body only if FRAMEWORK_LOG_BODIES asks, redacted)."""
        log = self.wiring.log
        bodies = self.bodies
        for d in deliveries:
            env = d.envelope
            if env is None:
                log.debug("message received", entry_id=d.entry_id, undecodable=d.error, partition=d.source.partition)
                continue
            fields = {"body": logcontext.loggable_body(env.body, bodies)} if bodies is not None else {}
            log.debug(
                "message received",
                message_id=env.id,
                type=env.type,
                key=env.key,
                partition=d.source.partition,
                attempt=d.attempt,
                delivery_count=d.delivery_count,
                size=len(env.body),
                **fields,
            )

    def _crash_loop_reason(self, d: Delivery, attempt: int) -> dict[str, str]:
        """The dead-letter reason of a message redelivered past ``max_attempts`` (``attempt`` is the next)."""
        max_attempts = self.handler.retry.max_attempts
        return poison_reason(
            self.handler,
            d,
            f"delivered {attempt - 1} times (max_attempts {max_attempts}) without completing: "
            "the worker holding it crashed or stalled past the visibility timeout each time",
            attempts=attempt - 1,
        )


def _owner(admission: Admission, payload: Any) -> Admission:
    """The admit stage of the handler that runs a work: a routed work's member's, else ``admission``."""
    return payload.member.admission if type(payload) is Routed else admission
