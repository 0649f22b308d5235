"""The consumer actor: one per handler, fetching its partitions, dispatching to lanes, settling.

For each partition the consumer runs a fetcher (its own pending entries first, then new ones),
and beside them an ack flusher, a claimer (entries other consumers left idle past the visibility
timeout), an extender (keeps entries it holds from being claimed while handlers run), the retry
mover (due delayed retries back to this group only) and, for topics, the retention trimmer.

A message is acknowledged only after its handler returned and its staged messages were
published; failures go to the handler's RetryPolicy (retry in place, delayed retry through the
group's retry path, or the dead-letter queue, each atomic with the ack).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from broker import Delivery, EffectsFailed, GroupPartition, now_ms
from framework.context import Context
from framework.dead_letters.reasons import base_reason, exception_reason, poison_reason
from framework.effects import AlreadyProcessed
from framework.logs import get_logger
from framework.payloads import PayloadError
from framework.retries import Decision, HandlerTimeout
from framework.runtime.connectivity import healthy
from framework.runtime.lanes import Batch
from framework.runtime.supervisor import is_connection_error, supervise
from framework.service import Handler

if TYPE_CHECKING:
    from framework.runtime import Runtime

__all__ = ["Consumer", "ConsumerStats"]

log = get_logger("framework.runtime.consumer")

Work = tuple[Delivery, Any]  # a delivery and its decoded payload
_SETTLED: Any = object()  # a run whose effects were committed together with its ack
_PRUNE_EVERY = 600.0  # seconds between sweeps of departed consumers
_PRUNE_IDLE = 3600.0  # a consumer idle this long with nothing pending has gone


@attrs.define
class ConsumerStats:
    """Counters of one handler in this process (exported as metrics by the tracing layer)."""

    fetched: int = 0
    processed: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    handler_seconds: float = 0.0


class _Slot:
    """What one lane is running for a consumer right now (the watchdog and shutdown read it).

    The hot path only sets ``delivery``, ``index`` and ``attempt`` and counts ``runs``; the watchdog
    notes when it first saw a run (``seen_run``, ``seen_at``), so no clock is read per message.
    """

    __slots__ = ("attempt", "delivery", "index", "runs", "scope", "seen_at", "seen_run")

    def __init__(self) -> None:
        self.delivery: Delivery | None = None  # set only while the handler itself runs
        self.index = 0  # of the work being run, in the lane's sub-batch
        self.attempt = 0
        self.runs = 0  # handler runs started in this slot
        self.seen_run = -1
        self.seen_at = 0.0
        self.scope: anyio.CancelScope | None = None


class _Finished:
    """Runs that finished in a lane and wait to be settled: published, then acknowledged."""

    __slots__ = ("deliveries", "duplicates", "outgoing", "since")

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.outgoing: list[Any] = []
        self.duplicates = 0
        self.since = 0.0


class _PartitionState:
    """What a consumer tracks for one partition."""

    __slots__ = (
        "ack_buffer",
        "ack_channel",
        "ack_lock",
        "ack_wakeup",
        "capacity",
        "held",
        "in_flight",
        "prune_at",
        "slots",
        "view",
    )

    def __init__(self, view: GroupPartition) -> None:
        self.view = view
        self.held: dict[str, tuple[Delivery, float]] = {}  # entry id -> (delivery, fetched at)
        self.in_flight = 0
        self.capacity = anyio.Event()
        self.ack_buffer: list[Delivery] = []
        self.ack_wakeup = anyio.Event()
        self.ack_channel: Any = None  # the ack flusher's dedicated connection
        self.ack_lock = anyio.Lock()  # one flush at a time (the flusher and shutdown share the channel)
        self.slots: set[_Slot] = set()  # one per lane running this partition's messages
        self.prune_at = 0.0  # monotonic time of the next sweep of departed consumers


class Consumer:
    """Runs one handler of one service over every partition of its destination."""

    def __init__(self, runtime: Runtime, handler: Handler, views: list[GroupPartition], scope: int) -> None:
        self.runtime = runtime
        self.handler = handler
        self.scope = scope  # distinguishes this consumer's keys in the shared lanes
        self.states = {v.partition: _PartitionState(v) for v in views}
        self.stats = ConsumerStats()
        self._fetch_scopes: list[anyio.CancelScope] = []
        self._fetching = True
        self._handed_over = False
        self._log = log.bind(service=handler.service, handler=handler.name, destination=handler.destination.name)

    # -- actor tree ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every task of this consumer until cancelled (fetching stops on :meth:`stop_fetching`)."""
        settings = self.runtime.settings
        async with anyio.create_task_group() as tg:
            for state in self.states.values():
                name = f"{self.handler.label}[{state.view.partition}]"
                tg.start_soon(self._fetchers_guarded, state, name)
                tg.start_soon(supervise, f"{name}.acks", self._ack_loop, state)
                tg.start_soon(supervise, f"{name}.claims", self._every, settings.claim_interval, self._claim, state)
                tg.start_soon(supervise, f"{name}.extend", self._every, settings.extend_interval, self._extend, state)
                tg.start_soon(supervise, f"{name}.retries", self._every, settings.retry_interval, self._move_due, state)
            tg.start_soon(supervise, f"{self.handler.label}.trim", self._every, settings.trim_interval, self._trim)
            if self.handler.timeout is not None:
                every = min(1.0, self.handler.timeout / 4)
                tg.start_soon(supervise, f"{self.handler.label}.watchdog", self._every_local, every, self._watch)

    async def _fetchers_guarded(self, state: _PartitionState, name: str) -> None:
        with anyio.CancelScope() as scope:
            self._fetch_scopes.append(scope)
            if not self._fetching:
                scope.cancel()
            await supervise(f"{name}.fetch", self._fetch_loop, state)

    def stop_fetching(self) -> None:
        """Stop reading new entries (graceful shutdown); in-flight work goes on."""
        self._fetching = False
        for scope in self._fetch_scopes:
            scope.cancel()

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet processed or settled."""
        return sum(s.in_flight for s in self.states.values())

    async def flush_acks(self) -> None:
        """Send every buffered ack now."""
        for state in self.states.values():
            await self._flush(state)

    async def hand_over(self) -> int:
        """At shutdown: make what this consumer holds but does not run claimable by others at once."""
        idle_ms = int(self.runtime.settings.visibility_timeout * 1000) + 1
        self._handed_over = True  # the extender must not touch the released entries again
        released = 0
        for state in self.states.values():
            running = [s.delivery.entry_id for s in state.slots if s.delivery is not None]
            released += await self.runtime.broker.release_own_pending(
                state.view, self.runtime.consumer_name, idle_ms, keep=running
            )
        return released

    @staticmethod
    async def _every(interval: float, fn: Any, *args: Any) -> None:
        """Run a broker duty every ``interval`` seconds; each pass that worked is progress."""
        while True:
            await fn(*args)
            healthy()
            await anyio.sleep(interval)

    @staticmethod
    async def _every_local(interval: float, fn: Any) -> None:
        """Run a duty that needs no broker (the watchdog): it says nothing about connectivity."""
        while True:
            await fn()
            await anyio.sleep(interval)

    # -- fetching and dispatch ---------------------------------------------------------------------

    async def _fetch_loop(self, state: _PartitionState) -> None:
        broker = self.runtime.broker
        consumer = self.runtime.consumer_name
        prefetch = self.runtime.settings.prefetch
        after: dict[str, str] = {}
        while True:  # first our own pending entries: we are back after a crash or restart
            deliveries = await broker.read_own_pending(state.view, consumer, prefetch, after)
            healthy()  # a broker round trip worked: progress (resets the restart backoff)
            fresh = [d for d in deliveries if d.entry_id not in state.held]
            if not deliveries:
                break
            for d in deliveries:
                after[d.stream] = d.entry_id
            if fresh:
                self._log.info("re-reading own pending entries", partition=state.view.partition, count=len(fresh))
                await self._admit(state, fresh)
        block = self.runtime.settings.block_ms
        channel = broker.channel()  # this fetcher's own connection: reads and inbox checks
        try:
            while True:
                while state.in_flight > prefetch:
                    state.capacity = anyio.Event()
                    await state.capacity.wait()
                deliveries = await broker.read(state.view, consumer, prefetch, block, channel=channel)
                healthy()
                if deliveries:  # what was read is dispatched even if fetching stops meanwhile
                    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                        await self._admit(state, deliveries, channel)
        finally:
            if channel is not None:
                with anyio.CancelScope(shield=True):
                    await channel.aclose()

    async def _admit(self, state: _PartitionState, deliveries: list[Delivery], channel: Any = None) -> None:
        """Hold fetched deliveries, settle the ones that cannot run, queue the rest on lanes.

        ``channel`` is the caller's own connection, if it has one (the fetcher's).
        """
        handler = self.handler
        decode = handler.decode
        key_fn = handler.key
        lanes = self.runtime.lanes
        scope = self.scope
        held = state.held
        now = time.monotonic()
        by_lane: dict[int, list[Work]] = {}
        keyless: list[Work] = []
        isolated: list[tuple[Work, bool, Any]] = []  # (work, suspect, key): run one at a time
        redelivered: list[tuple[Delivery, Any, Any]] = []  # (delivery, payload, key), once one is met
        gates = lanes.gates
        poison: list[tuple[Delivery, dict[str, str]]] = []
        self.stats.fetched += len(deliveries)
        for d in deliveries:
            held[d.entry_id] = (d, now)
        state.in_flight += len(deliveries)
        runnable = [d for d in deliveries if d.envelope is not None]
        poison += [
            (d, poison_reason(handler, d, f"undecodable message: {d.error}")) for d in deliveries if d.envelope is None
        ]
        if handler.inbox and runnable:
            runnable = await self._check_inbox(state, runnable, channel)
        for d in runnable:
            env = d.envelope
            assert env is not None
            try:
                payload = decode(env.body)
                lane_key = key_fn(payload) if key_fn is not None else env.key
            except PayloadError as exc:
                poison.append((d, poison_reason(handler, d, f"invalid payload: {exc}")))
                continue
            except Exception as exc:
                poison.append((d, poison_reason(handler, d, f"key function failed: {type(exc).__name__}: {exc}")))
                continue
            if redelivered or d.delivery_count > 1:  # sorted below, once the redeliveries are counted
                redelivered.append((d, payload, lane_key))
            elif lane_key is None:
                keyless.append((d, payload))
            elif gates and lanes.gated(scope, lane_key):  # isolated work of this key runs first
                isolated.append(((d, payload), False, lane_key))
            else:
                index = lanes.lane_for(scope, lane_key)
                works = by_lane.get(index)
                if works is None:
                    by_lane[index] = [(d, payload)]
                else:
                    works.append((d, payload))
        for d, reason in poison:
            await self._dead_letter(state, d, reason)
        if redelivered:
            await self._sort_redeliveries(state, redelivered, by_lane, keyless, isolated)
        lanes.submit(self, state, by_lane, keyless, isolated, scope)

    async def _check_inbox(self, state: _PartitionState, deliveries: list[Delivery], channel: Any) -> list[Delivery]:
        """Ack duplicates at once, leave messages leased elsewhere pending; return those to run."""
        lease_ms = int(self.runtime.settings.visibility_timeout * 1000)
        try:
            statuses = await self.runtime.broker.inbox_claim(state.view, deliveries, lease_ms, channel=channel)
        except BaseException:
            self._forget(state, deliveries)
            raise
        run: list[Delivery] = []
        duplicates: list[Delivery] = []
        elsewhere: list[Delivery] = []
        for d, status in zip(deliveries, statuses, strict=True):
            (run, duplicates, elsewhere)[status].append(d)
        if duplicates:
            self.stats.duplicates += len(duplicates)
            state.ack_buffer += duplicates
            state.ack_wakeup.set()
            self._release(state, len(duplicates))
        if elsewhere:  # the same message id is being processed by another consumer right now
            self._forget(state, elsewhere)
        return run

    # -- processing (runs in lanes) -------------------------------------------------------------------

    async def process(self, state: _PartitionState, batch: Batch) -> None:
        """Take works from ``batch`` in order and run the handler for each, settling as it goes.

        Several lanes may take from one keyless batch at once (see :mod:`framework.runtime.lanes`); each
        settles what it ran. A finished message is acknowledged (after its staged messages are
        published) within about ``ack_interval`` of finishing, not when the whole batch is done,
        so a crash re-runs as little finished work as possible. A handler past its timeout is
        cancelled by the watchdog (:meth:`_watch`); its attempt fails and the lane goes on with
        the next work. A suspect batch (one redelivered message, isolated) is counted before it
        runs and settled at once (:meth:`_run_suspect`).
        """
        works = batch.works
        done = _Finished()
        slot = _Slot()
        slot.index = -1  # the work this lane took and has not settled yet, if any
        state.slots.add(slot)
        started = time.perf_counter()
        try:
            more = True
            while more:
                with anyio.CancelScope() as scope:  # only handler runs await inside: the watchdog's handle
                    slot.scope = scope
                    more = await self._process_from(state, batch, slot, done)
                if scope.cancelled_caught:
                    d = works[slot.index][0]
                    if slot.delivery is d:  # the watchdog cut its handler short
                        await self._timed_out(state, d, slot)
                    else:  # a handler swallowed the cancellation, which then hit its settling: unknown state
                        self._forget(state, [d])  # pending: redelivered after the visibility timeout
                    more = True
                await self._settle_finished(state, done)
                slot.index = -1
        except Exception as exc:  # the broker unreachable, or a framework bug: unsettled works are redelivered
            if is_connection_error(exc):
                self._log.warning("broker unreachable while settling; unsettled messages will be redelivered")
            else:
                log.error("processing failed; unsettled messages will be redelivered", exc_info=exc)
            finished = {id(d) for d in done.deliveries}  # settled below; earlier ones are settled already
            current = [works[slot.index][0]] if slot.index >= 0 else []
            rest, batch.next = works[batch.next :], len(works)  # not taken by any lane: given up too
            self._forget(state, [d for d in current + [d for d, _ in rest] if id(d) not in finished])
        finally:
            slot.delivery = None
            state.slots.discard(slot)
            self.stats.handler_seconds += time.perf_counter() - started
        await self._settle_finished(state, done)

    async def _process_from(self, state: _PartitionState, batch: Batch, slot: _Slot, done: _Finished) -> bool:
        """Take and run works of ``batch``; return False when none is left, True once finished runs
        have waited ``ack_interval`` to be settled (raises if cancelled)."""
        interval = self.runtime.settings.ack_interval
        run = self._run
        clock = time.monotonic
        works = batch.works
        count = len(works)
        suspect = batch.suspect
        began = clock()
        while True:
            index = batch.next
            if index >= count:
                return False
            batch.next = index + 1  # taken: no other lane runs it
            d, payload = works[index]
            slot.index = index
            if suspect:
                ctx = await self._run_suspect(state, d, payload, slot)
            else:
                ctx = await run(state, d, payload, d.attempt, slot)
            ended = clock()
            if ctx is not None and ctx is not _SETTLED:
                if not done.deliveries:
                    done.since = ended
                done.deliveries.append(d)
                if ctx._outgoing:
                    done.outgoing += ctx._outgoing
                if ctx._duplicate:
                    done.duplicates += 1
                # Settle now when finished runs waited long enough, or when this run was slow: the
                # next one likely is too, and a finished message must not wait for it.
                if ended - done.since >= interval or ended - began >= interval:
                    return True
            began = ended

    async def _settle_finished(self, state: _PartitionState, done: _Finished) -> None:
        """Publish what finished handlers staged, then queue their acks (one flush for many)."""
        if not done.deliveries:
            return
        deliveries, outgoing, duplicates = done.deliveries, done.outgoing, done.duplicates
        done.deliveries, done.outgoing, done.duplicates = [], [], 0
        if outgoing:
            try:
                await self.runtime.publish_outgoing(outgoing)
            except Exception as exc:
                self._log.error(
                    "could not publish staged messages; they will be redelivered", count=len(deliveries), exc_info=exc
                )
                self._forget(state, deliveries)
                return
        self.stats.processed += len(deliveries) - duplicates
        state.ack_buffer += deliveries
        state.ack_wakeup.set()
        self._release(state, len(deliveries))  # processed: room to fetch more while the ack is on its way

    async def _call_sync(self, fn: Any, payload: Any, ctx: Context) -> None:
        args = (payload, ctx) if self.handler.takes_context else (payload,)
        # A thread cannot be interrupted: on a timeout or a forced shutdown it is abandoned.
        await anyio.to_thread.run_sync(
            functools.partial(fn, *args), limiter=self.runtime.thread_limiter, abandon_on_cancel=True
        )

    async def _run(self, state: _PartitionState, d: Delivery, payload: Any, attempt: int, slot: _Slot) -> Any:
        """Call the handler until it succeeds (its context) or the failure is settled (None).

        Returns ``_SETTLED`` when the run committed its effects together with its ack.
        """
        handler = self.handler
        fn = handler.fn
        policy = handler.retry
        first_failed: int | None = None
        while True:
            ctx = Context(d, handler, attempt, self.runtime.broker)
            slot.delivery = d
            slot.attempt = attempt
            slot.runs += 1
            try:
                if not handler.is_async:
                    await self._call_sync(fn, payload, ctx)
                elif handler.takes_context:
                    await fn(payload, ctx)
                else:
                    await fn(payload)
                slot.delivery = None
                if ctx._effects is not None:  # a failed commit (the broker unreachable) is a failed attempt
                    return await self._commit_effects(state, d, ctx, attempt)
            except AlreadyProcessed:
                # A SQL transaction found the message recorded: acked like a success, counted as a
                # duplicate. What it staged before the block is published (same derived ids).
                slot.delivery = None
                self.stats.duplicates += 1
                ctx._duplicate = True
                return ctx
            except (Exception, SystemExit) as exc:  # sys.exit() in a handler fails its attempt, not the process
                slot.delivery = None
                self.stats.failed += 1
                first_failed = first_failed or now_ms()
                decision = policy.decide(attempt, exc)
                self._log_failure(d, attempt, exc, decision)
                if decision.action == "retry" or (decision.action == "delay" and policy.in_place):
                    self.stats.retried += 1
                    if decision.seconds:
                        await anyio.sleep(decision.seconds)
                    attempt += 1
                    continue
                await self._settle_failure(state, d, attempt, exc, decision, first_failed)
                return None
            return ctx

    async def _timed_out(self, state: _PartitionState, d: Delivery, slot: _Slot) -> None:
        """Settle a run the watchdog cancelled: a failed attempt, retried through the retry path."""
        timeout = self.handler.timeout or 0.0
        sync = "" if self.handler.is_async else " (a sync handler's thread cannot be stopped: it was abandoned)"
        exc = HandlerTimeout(f"{self.handler.label} ran longer than its {timeout:g} s timeout and was cancelled{sync}")
        slot.delivery = None
        self.stats.failed += 1
        decision = self.handler.retry.decide(slot.attempt, exc)
        if decision.action == "retry":  # never in place: the lane must move on
            decision = attrs.evolve(decision, action="delay")
        self._log_failure(d, slot.attempt, exc, decision)
        with anyio.CancelScope(shield=True):
            await self._settle_failure(state, d, slot.attempt, exc, decision, None)

    async def _watch(self) -> None:
        """Cancel handler runs past their timeout (see :meth:`process`).

        A run is timed from when the watchdog first sees it, so it is cancelled between
        ``timeout`` and ``timeout`` plus two watchdog intervals after it started.
        """
        timeout = self.handler.timeout or math.inf  # the watchdog runs only for handlers with a timeout
        now = time.monotonic()
        for state in self.states.values():
            for slot in state.slots:
                if slot.delivery is None or slot.scope is None:
                    continue
                if slot.seen_run != slot.runs:
                    slot.seen_run, slot.seen_at = slot.runs, now
                elif now - slot.seen_at >= timeout:
                    slot.scope.cancel()

    async def _commit_effects(self, state: _PartitionState, d: Delivery, ctx: Context, attempt: int) -> Any:
        """Commit a handler's Redis writes, outgoing messages, inbox mark and ack in one step."""
        effects = ctx._effects
        assert effects is not None
        broker = self.runtime.broker
        outgoing = [env for env, _ in ctx._outgoing]
        if broker.cluster and outgoing:  # other slots: publish first (deterministic ids dedup a repeat)
            await self.runtime.publish_outgoing(ctx._outgoing)
            outgoing = []
        else:
            for _, spec in ctx._outgoing:
                if spec is not None:
                    await broker.declare(spec)
        try:
            applied = await broker.commit_effects(
                d, effects.commands, effects.keys, outgoing, reason=base_reason(self.handler, d, attempt)
            )
        except EffectsFailed as exc:  # dead-lettered by the same script: a retry would apply them again
            self.stats.dead_lettered += 1
            self._log.error(
                "Redis effects failed part-way; message dead-lettered (Redis has no rollback)",
                message_id=d.message_id,
                error=exc.error,
                applied=exc.applied,
                dlq_entry=exc.dlq_entry,
            )
        else:
            if applied:
                self.stats.processed += 1
            else:
                self.stats.duplicates += 1
        self._forget(state, [d])
        return _SETTLED

    async def _sort_redeliveries(
        self,
        state: _PartitionState,
        items: list[tuple[Delivery, Any, Any]],
        by_lane: dict[int, list[Work]],
        keyless: list[Work],
        isolated: list[tuple[Work, bool, Any]],
    ) -> None:
        """Count redelivered messages and sort them (with any fresh ones among ``items``) into work.

        The crash-loop rule: a message whose worker died while holding it is redelivered. Its
        first redelivered run is counted here, for a whole fetch in one round trip, and it runs
        like fresh work (concurrently): most redelivered messages are bystanders of a crash, not
        its cause. A message whose counter shows an earlier redelivered run that never completed
        is a *suspect*: it runs isolated (one suspect at a time in the process, on an isolation
        lane beside the others, see :mod:`framework.runtime.lanes`), counted again just before it starts
        (:meth:`_count_redelivery`), so a message that kills every worker is dead-lettered after
        ``max_attempts`` runs while the suspects queued behind it are not charged for its crashes.
        Work with a suspect's key is isolated behind it, keeping per-key order.

        With ``max_attempts`` below 3 every redelivery is a suspect (the old one-at-a-time rule):
        a bystander held through two crashes would otherwise reach the limit without ever
        having run alone.
        """
        max_attempts = self.handler.retry.max_attempts
        candidates = [d for d, _, _ in items if d.delivery_count > 1]
        first: dict[int, bool] = {}
        if candidates and max_attempts >= 3:
            try:
                flags = await self.runtime.broker.count_first_redeliveries(candidates)
            except Exception as exc:
                self._log_unsettled("could not count redeliveries; they stay pending", exc, count=len(candidates))
                self._forget(state, candidates)
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
                    if attempt > max_attempts:
                        await self._dead_letter(state, d, self._crash_loop_reason(d, attempt))
                        continue
                    d.delivery_count = 2  # so d.attempt is this run's attempt number
                else:
                    suspect = True
            kept.append((d, payload, key, suspect))
        lanes = self.runtime.lanes
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
                by_lane.setdefault(lanes.lane_for(scope, key), []).append(work)

    async def _run_suspect(self, state: _PartitionState, d: Delivery, payload: Any, slot: _Slot) -> Any:
        """Run a suspect (see :meth:`_sort_redeliveries`): counted first, settled at once.

        The lane pool runs one suspect at a time in the process, so a message that crashes its
        worker takes down no other suspect with it: only the culprit's count of started runs
        grows towards its ``max_attempts``.
        """
        if not await self._count_redelivery(state, d):
            return None
        ctx = await self._run(state, d, payload, d.attempt, slot)
        if ctx is None or ctx is _SETTLED:
            return ctx
        # Settle before the next suspect starts: if that one kills the process, this one's
        # success is already durable and is not counted against it.
        if ctx._outgoing:
            await self.runtime.publish_outgoing(ctx._outgoing)
        await self.runtime.broker.ack(state.view, [d], inbox=self.handler.inbox)
        if not ctx._duplicate:  # a duplicate was counted when it was found
            self.stats.processed += 1
        self._forget(state, [d])
        return _SETTLED

    async def _count_redelivery(self, state: _PartitionState, d: Delivery) -> bool:
        """Count a suspect's run just before it starts; dead-letter it instead when it keeps killing workers.

        The delivery count also rises for messages fetched by a worker that died before it ran
        them, so it cannot tell a crash loop on its own: redelivered runs are counted in Redis
        (first deliveries are not, which saves a write per message, so a first delivery a worker
        died holding counts as one attempt, whether it started or not; so does a first
        redelivery, counted when it is fetched, see :meth:`_sort_redeliveries`).
        Sets ``d.delivery_count`` to the attempt number this run has.
        """
        assert d.envelope is not None
        try:
            runs = await self.runtime.broker.count_attempt(d)
        except Exception as exc:
            self._log_unsettled("could not count a redelivery; it stays pending", exc, message_id=d.message_id)
            self._forget(state, [d])
            return False
        attempt = d.envelope.attempt + runs
        if attempt > self.handler.retry.max_attempts:
            await self._dead_letter(state, d, self._crash_loop_reason(d, attempt))
            return False
        d.delivery_count = attempt - d.envelope.attempt + 1  # so d.attempt is this run's attempt number
        return True

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

    def abandon(self, state: _PartitionState, works: Sequence[Work]) -> None:
        """Forget works after an internal error; they stay pending and are claimed again later."""
        self._forget(state, [d for d, _ in works])

    @staticmethod
    def _release(state: _PartitionState, count: int) -> None:
        """``count`` held messages are processed: the fetcher may read that many more."""
        state.in_flight -= count
        state.capacity.set()

    def _forget(self, state: _PartitionState, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            if state.held.pop(d.entry_id, None) is not None:
                state.in_flight -= 1
        state.capacity.set()

    def _log_unsettled(self, what: str, exc: BaseException, **fields: Any) -> None:
        """Log a broker call that failed: one warning line for a lost connection (the
        connectivity log says the rest), an error with the traceback for anything else."""
        if is_connection_error(exc):
            self._log.warning(what, error=f"{type(exc).__name__}: {exc}", **fields)
        else:
            self._log.error(what, exc_info=exc, **fields)

    def _log_failure(self, d: Delivery, attempt: int, exc: BaseException, decision: Decision) -> None:
        what = {
            "retry": "retrying now",
            "delay": f"retrying in {decision.seconds:.2f}s",
            "dead": "moving to the dead-letter queue",
        }[decision.action]
        self._log.warning(
            f"handler failed; {what}",
            message_id=d.message_id,
            attempt=attempt,
            max_attempts=self.handler.retry.max_attempts,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )

    async def _settle_failure(
        self,
        state: _PartitionState,
        d: Delivery,
        attempt: int,
        exc: BaseException,
        decision: Decision,
        first_failed: int | None,
    ) -> None:
        """Park a failed message for a delayed retry, or dead-letter it; ``first_failed``: Unix ms
        of the first failure this process saw (immediate and in-place retries carry no field)."""
        broker = self.runtime.broker
        try:
            if decision.action == "delay":
                await broker.retry_later(d, now_ms() + int(decision.seconds * 1000), attempt=attempt)
                self.stats.retried += 1
            else:
                reason = exception_reason(self.handler, d, attempt, exc, decision.reason, first_failed_ms=first_failed)
                await self._dead_letter(state, d, reason, forget=False)
        except Exception as err:
            self._log.error(
                "could not settle a failed message; it stays pending and will be redelivered",
                message_id=d.message_id,
                exc_info=err,
            )
        self._forget(state, [d])

    async def _dead_letter(
        self, state: _PartitionState, d: Delivery, reason: dict[str, str], *, forget: bool = True
    ) -> None:
        try:
            entry = await self.runtime.broker.dead_letter(d, reason)
        except Exception as err:
            self._log.error("could not dead-letter a message; it stays pending", message_id=d.message_id, exc_info=err)
        else:
            if entry is not None:
                self.stats.dead_lettered += 1
                self._log.error(
                    "message dead-lettered", message_id=d.message_id, reason=reason.get("dlq-reason"), dlq_entry=entry
                )
        if forget:
            self._forget(state, [d])

    # -- acks ----------------------------------------------------------------------------------------------

    async def _ack_loop(self, state: _PartitionState) -> None:
        interval = self.runtime.settings.ack_interval
        state.ack_channel = channel = self.runtime.broker.channel()
        try:
            await self._ack_forever(state, interval)
        finally:
            state.ack_channel = None
            if channel is not None:
                with anyio.CancelScope(shield=True):
                    await channel.aclose()

    async def _ack_forever(self, state: _PartitionState, interval: float) -> None:
        while True:
            if not state.ack_buffer:  # after a failed flush the buffer is not empty: go at once
                await state.ack_wakeup.wait()
            state.ack_wakeup = anyio.Event()
            if len(state.ack_buffer) < 1000:
                await anyio.sleep(interval)  # let more acks join this call
            await self._flush(state)
            healthy()

    async def _flush(self, state: _PartitionState) -> None:
        async with state.ack_lock:
            await self._flush_locked(state)

    async def _flush_locked(self, state: _PartitionState) -> None:
        if not state.ack_buffer:
            return
        batch, state.ack_buffer = state.ack_buffer, []
        try:
            await self.runtime.broker.ack(state.view, batch, inbox=self.handler.inbox, channel=state.ack_channel)
        except BaseException:
            state.ack_buffer[:0] = batch  # acks are idempotent: keep them for the next flush
            raise
        held = state.held
        for d in batch:  # already released when processed
            held.pop(d.entry_id, None)

    # -- background duties ----------------------------------------------------------------------------------

    async def _claim(self, state: _PartitionState) -> None:
        settings = self.runtime.settings
        if time.monotonic() >= state.prune_at:  # forget consumers gone for good (see prune_consumers)
            state.prune_at = time.monotonic() + _PRUNE_EVERY
            idle_ms = int(max(_PRUNE_IDLE, 10 * settings.visibility_timeout) * 1000)
            pruned = await self.runtime.broker.prune_consumers(state.view, idle_ms, keep=self.runtime.consumer_name)
            if pruned:
                self._log.info("removed departed consumers", partition=state.view.partition, count=pruned)
        if state.in_flight > settings.prefetch:
            return
        deliveries = await self.runtime.broker.claim_idle(
            state.view, self.runtime.consumer_name, int(settings.visibility_timeout * 1000), settings.prefetch
        )
        held = state.held
        fresh = [d for d in deliveries if d.entry_id not in held]
        for d in deliveries:  # held here and ours again (taken, then claimed back): extend it again
            if d.entry_id in held and held[d.entry_id][1] == math.inf:
                held[d.entry_id] = (held[d.entry_id][0], time.monotonic())
        if fresh:
            self._log.info(
                "claimed entries idle past the visibility timeout", partition=state.view.partition, count=len(fresh)
            )
            await self._admit(state, fresh)

    async def _extend(self, state: _PartitionState) -> None:
        """Keep every entry held here longer than an extend interval from being claimed.

        Entries settled while the call was on its way (an ack in flight) are no longer pending:
        that is not a take-over. Entries pending under another consumer were claimed (this process
        stalled past the visibility timeout): they are logged once and no longer extended. They
        stay held, so the fetcher's budget stays right and this process does not claim them back
        while its own copy is queued or running; that copy's settlement settles the entry.
        """
        if self._handed_over:
            return
        horizon = time.monotonic() - self.runtime.settings.extend_interval
        old = [d for d, t in list(state.held.values()) if t < horizon]
        if old:
            lease_ms = int(self.runtime.settings.visibility_timeout * 1000)
            found = await self.runtime.broker.extend(state.view, self.runtime.consumer_name, old, lease_ms=lease_ms)
            if found.taken:
                held = state.held
                taken = [d for d in old if d.entry_id in found.taken]
                for d in taken:
                    if d.entry_id in held:  # never "old" again: not extended, not logged again
                        held[d.entry_id] = (held[d.entry_id][0], math.inf)
                self._log.warning(
                    "entries were claimed by another consumer while held here",
                    partition=state.view.partition,
                    count=len(taken),
                    message_ids=[d.message_id for d in taken[:10]],
                )

    async def _move_due(self, state: _PartitionState) -> None:
        await self.runtime.broker.move_due(state.view, now_ms())

    async def _trim(self) -> None:
        """Apply the topic's retention and forget inbox records older than the dedup window."""
        spec = self.handler.destination.spec()
        now = now_ms()
        broker = self.runtime.broker
        for state in self.states.values():
            await broker.trim(spec, state.view.partition, now)
            if self.handler.inbox:
                await broker.trim_inbox(state.view, now - int(self.runtime.settings.inbox_window * 1000))
