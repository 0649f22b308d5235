"""The runtime: the root of a worker process's actor tree, and its graceful shutdown.

Tree: ``Runtime`` (root task group) owns the :class:`~framework.runtime.lanes.LanePool` (``concurrency``
lanes shared by every handler, the process's global bound) and one
:class:`~framework.runtime.consumer.Consumer` per handler, each owning its fetchers, ack flusher,
claimer, extender, retry mover and trimmer. A message's life is a pipeline of stage modules
(``fetch`` -> ``admit`` -> ``lanes`` -> ``attempt`` -> ``settle``, ``upkeep`` beside them, the
accounts in ``ledger``); the stages see the runtime only through a
:class:`~framework.runtime.wiring.Wiring`. Crashed actors restart with backoff (see
:mod:`framework.runtime.supervisor`).

Middleware (:mod:`framework.middleware`) given here wraps every handler of every service, outside
the services' own middleware.

Shutdown (:meth:`Runtime.stop`, SIGTERM/SIGINT from the CLI): stop fetching, let in-flight handlers
finish within ``shutdown_timeout``, flush acks, close. Whatever is left unacknowledged stays
pending and is delivered again (to this consumer when it restarts, or claimed by another).
The services' resources and startup hooks (:mod:`framework.lifespan`) run before any consumer
starts; their shutdown side runs after that drain.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import attrs

from broker import Broker, DestinationSpec, GroupPartition, connect, redact
from broker.capabilities import OWNERSHIP, SCHEDULING, as_inbox, as_introspection
from framework._messages import Outgoing
from framework.group_commit import GroupCommits
from framework.lifespan import Lifespan
from framework.logs import get_logger
from framework.middleware import Middleware
from framework.observability import hooks
from framework.runtime.batch import consumer_for
from framework.runtime.consumer import Consumer
from framework.runtime.identity import ConsumerIdentity
from framework.runtime.lanes import LanePool
from framework.runtime.presence import Presence
from framework.runtime.requirements import check_requirements
from framework.runtime.scheduler import Scheduler
from framework.runtime.subscribing import Subscriptions
from framework.runtime.supervisor import is_connection_error
from framework.runtime.wiring import Wiring
from framework.service import Handler, HandlerError, Service
from framework.settings import RuntimeSettings

__all__ = ["Runtime"]

log = get_logger("framework.runtime")


class Runtime:
    """Runs services' handlers in this process until stopped."""

    def __init__(
        self,
        services: Sequence[Service],
        *,
        broker: Broker | None = None,
        url: str | None = None,
        namespace: str | None = None,
        settings: RuntimeSettings | None = None,
        outbox_database_url: str | None = None,
        middleware: Sequence[Middleware] = (),
    ) -> None:
        """``outbox_database_url`` also runs an outbox relay in this process (see framework.outbox);
        ``middleware`` wraps every handler, outermost first (see framework.middleware)."""
        if not services:
            raise HandlerError("no services to run")
        names = [s.name for s in services]
        if len(set(names)) != len(names):
            raise HandlerError(f"a service is listed twice: {names}")
        for s in services:
            if not s.handlers:
                raise HandlerError(
                    f"service {s.name!r} has no handlers: declare some with @{s.name}.command(...) or .event(...)"
                )
        self.services = list(services)
        self.middleware: tuple[Middleware, ...] = tuple(middleware)
        for mw in self.middleware:
            if not callable(mw):
                raise HandlerError(f"middleware must be async functions (message, ctx, call_next), got {mw!r}")
        self.settings = settings or RuntimeSettings()
        self._broker = broker
        self._owns_broker = broker is None
        self._url = url
        self._namespace = namespace
        self.consumers: list[Consumer] = []
        self._scopes = 0  # consumers built: each one's scope in the shared lanes
        self._look_now = anyio.Event()  # refresh the pattern subscriptions now
        self.consumer_name = ""
        self._stop: anyio.Event | None = None
        self._stopping = False
        self.started = False
        self._outbox_url = outbox_database_url
        self.relay: Any = None

    @property
    def broker(self) -> Broker:
        """The connected broker (available once :meth:`run` has started)."""
        if self._broker is None:
            raise RuntimeError("the runtime has not started")
        return self._broker

    async def run(self, *, task_status: anyio.abc.TaskStatus[Runtime] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, subscribe, process until :meth:`stop`, then shut down gracefully."""
        self._stop = anyio.Event()
        if self._stopping:
            self._stop.set()
        if self._broker is None:
            self._broker = await connect(self._url, namespace=self._namespace)
        exclusive = getattr(self.broker, "exclusive_partitions", False)
        if exclusive and OWNERSHIP not in self.broker.capabilities and self.settings.ownership != "off":
            # the server keeps one reader per partition (RabbitMQ's single active consumer) and no leases exist
            self.settings = attrs.evolve(self.settings, ownership="off")
        identity = ConsumerIdentity(self.broker.namespace, self.settings.consumer)
        self.consumer_name = identity.name
        try:
            self.lanes = LanePool(self.settings.concurrency)
            self.thread_limiter = anyio.CapacityLimiter(self.settings.concurrency)
            check_requirements(self.broker, self.services, self.settings)
            if any(h.inbox and not h.sql_inbox for s in self.services for h in s.handlers):
                await as_inbox(self.broker).inbox_ready()  # a store beside the transport: reachable?
            self.subscriptions = Subscriptions(self.broker, self.services, self._consumer)
            await self._check_orphan_subscriptions()
            self.consumers = await self.subscriptions.wire()
            log.info(
                "runtime started",
                services=[s.name for s in self.services],
                handlers=len(self.consumers),
                consumer=self.consumer_name,
                broker=redact(self.broker.url),  # never the password
                namespace=self.broker.namespace,
                concurrency=self.settings.concurrency,
                prefetch=self.settings.prefetch,
            )
            engine = await self._outbox_engine()
            groups = GroupCommits(self.settings)  # ctx.sql_transaction's group commit, per engine
            lifespan = Lifespan(self.services)
            if not await lifespan.open(self._stop):  # resources and startup hooks, before any consumer starts
                log.info("stopped while the startup hooks ran: nothing was consumed")
                return
            try:
                with groups.installed(), lifespan.installed():  # the lanes inherit them
                    await self._serve(engine, task_status)
            finally:
                try:
                    await groups.aclose()  # the lanes have stopped: connections back to the pools
                finally:
                    await lifespan.close(self.settings.shutdown_timeout)  # drained: resources close last
            if engine is not None:
                await engine.dispose()
        finally:
            identity.release()
            if self._owns_broker and self._broker is not None:
                with anyio.CancelScope(shield=True):
                    await self._broker.close()
                self._broker = None

    def _consumer(self, service: Service, handler: Handler, views: list[GroupPartition]) -> Consumer:
        """The consumer of ``handler`` over ``views`` (none: a member of a group another consumer reads)."""
        middleware = self.middleware + tuple(service.middleware_chain)
        observer = hooks.observer(handler) if hooks.ANY else None  # off: no cost
        if observer is not None and middleware:  # outermost: user middleware runs in its span
            middleware = (observer, *middleware)  # (without middleware: the direct path calls it)
        wiring = Wiring(
            broker=self.broker,
            settings=self.settings,
            consumer_name=self.consumer_name,
            lanes=self.lanes,
            publish=self.publish_outgoing,
            handler=handler,
            scope=self._scopes,
            middleware=middleware,
            thread_limiter=self.thread_limiter,
            observer=observer,
        )
        self._scopes += 1
        return consumer_for(wiring, views)

    async def _refresh_patterns(self, tg: anyio.abc.TaskGroup) -> None:
        """Every ``pattern_refresh`` seconds: wire and start the topics created since that a pattern matches."""
        while True:
            with anyio.move_on_after(self.settings.pattern_refresh):
                await self._look_now.wait()  # is_idle saw a new matching topic: wire it at once
            self._look_now = anyio.Event()
            try:
                new = await self.subscriptions.wire()
            except Exception as exc:  # the broker unreachable for a moment: look again next time
                log.warning("could not refresh pattern subscriptions", error=f"{type(exc).__name__}: {exc}")
                new = self.subscriptions.take()  # those wired before the failure
            self.consumers += new
            for consumer in new:
                tg.start_soon(consumer.run)
            if new and hooks.METRICS:
                hooks.track_runtime(self)  # the new topics' consumers counted too

    async def _serve(self, engine: Any, task_status: anyio.abc.TaskStatus[Runtime]) -> None:
        """Run the lanes, consumers and relay until :meth:`stop`, then shut down gracefully."""
        assert self._stop is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.lanes.run)

            def groups() -> list[tuple[str, str]]:  # (pattern subscriptions add consumers while running)
                return [(v.spec.name, v.group) for c in self.consumers for v in c.views[:1]]

            presence = Presence(
                self.broker, self.consumer_name, groups, self.settings.lease_ttl, [s.name for s in self.services]
            )
            tg.start_soon(presence.run)
            if SCHEDULING in self.broker.capabilities:  # scheduled messages, recurring jobs
                tg.start_soon(Scheduler(self.broker, self.services).run)
            for consumer in self.consumers:
                tg.start_soon(consumer.run)
            if hooks.METRICS:  # lag, pending and dead letters, read every few seconds
                tg.start_soon(hooks.track_runtime(self), self)
            if engine is not None:
                from framework.outbox import OutboxRelay

                self.relay = OutboxRelay(engine, self.broker)
                await tg.start(self.relay.run)
            refresh = anyio.CancelScope()
            if self.subscriptions.patterns:
                tg.start_soon(self._refresh_in, refresh, tg)
            self.started = True
            task_status.started(self)
            await self._stop.wait()
            refresh.cancel()  # no new topics while shutting down
            left = await self._shutdown()
            if left > 0:  # the broker answered the settling: say so within what is left of the bound
                await presence.leave(timeout=left)
            tg.cancel_scope.cancel()

    async def _refresh_in(self, scope: anyio.CancelScope, tg: anyio.abc.TaskGroup) -> None:
        with scope:
            await self._refresh_patterns(tg)

    async def _outbox_engine(self) -> Any:
        """The outbox database engine when an in-process relay was asked for (tables checked first)."""
        if self._outbox_url is None:
            return None
        try:
            from framework import outbox, sql
        except ImportError as exc:  # the sql extra is not installed
            raise HandlerError(
                f"--outbox-relay needs the sql extra ({exc.name} is missing): pip install 'framework[sql]'"
            ) from None

        engine = sql.create_engine(self._outbox_url or None)
        await sql.ping(engine)
        await outbox.create_tables(engine)
        return engine

    async def _check_orphan_subscriptions(self) -> None:
        """Refuse to start when a service's group exists on a destination it no longer handles.

        Messages would pile up there unprocessed (and hold back topic trimming) without a word.
        """
        services = {s.name: s for s in self.services}
        for destination, group in await self.broker.list_subscriptions():
            if group in services and not self.subscriptions.handles(services[group], destination):
                raise HandlerError(
                    f"service {group!r} is subscribed to {destination!r} (from an earlier version) but has no "
                    f"handler for it now, so its messages would wait there forever. Add a handler, or drop the "
                    f"subscription with `framework unsubscribe {destination} --group {group}`."
                )

    @property
    def stopping(self) -> bool:
        """Whether a graceful shutdown was asked for (:meth:`stop`)."""
        return self._stopping

    def stop(self) -> None:
        """Ask for a graceful shutdown (idempotent; returns at once)."""
        self._stopping = True
        if self._stop is not None:
            self._stop.set()

    async def _shutdown(self) -> float:
        """Finish in flight, settle, hand over; return the seconds left for leaving (0: the broker
        did not answer, so leaving would only wait)."""
        started = time.monotonic()
        for consumer in self.consumers:
            consumer.stop_fetching()
        in_flight = sum(c.in_flight for c in self.consumers)
        log.info("shutting down: fetching stopped, finishing in-flight handlers", in_flight=in_flight)
        with anyio.move_on_after(self.settings.shutdown_timeout) as scope:
            await self.lanes.wait_idle()
        if scope.cancelled_caught:
            left = sum(c.in_flight for c in self.consumers)
            log.warning("shutdown timeout: unfinished messages will be redelivered", unfinished=left)
        handed_over = 0
        # Acks and the hand-over take what is left of shutdown_timeout (at least 1 s, at most 10 s):
        # with the broker unreachable they would wait for their command timeouts, past the bound.
        budget = min(10.0, max(1.0, started + self.settings.shutdown_timeout - time.monotonic()))
        unreachable: BaseException | None = None
        with anyio.move_on_after(budget, shield=True) as settle:
            try:
                for consumer in self.consumers:
                    await consumer.flush_acks()
                # Entries fetched but not run (a read cut short, a handler past the timeout) stay
                # pending: let live consumers claim them now rather than after the visibility timeout.
                for consumer in self.consumers:
                    handed_over += await consumer.hand_over()
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                unreachable = exc
        if settle.cancelled_caught or unreachable is not None:
            log.warning(
                "shutdown: the broker did not answer; unsettled entries stay pending and are redelivered",
                error=str(unreachable or f"no reply within {budget:g} s"),
            )
        if handed_over:
            log.info("handed over unfinished entries to other consumers", entries=handed_over)
        if self.relay is not None:
            self.relay.stop()  # finishes the batch in progress
        totals = {
            name: sum(getattr(c.stats, name) for c in self.consumers)
            for name in ("processed", "duplicates", "failed", "retried", "dead_lettered")
        }
        log.info("runtime stopped", seconds=round(time.monotonic() - started, 3), **totals)
        if settle.cancelled_caught or unreachable is not None:
            return 0.0
        return min(2.0, max(0.5, started + self.settings.shutdown_timeout - time.monotonic()))

    async def publish_outgoing(self, outgoing: Sequence[Outgoing]) -> None:
        """Publish messages staged by handlers (declaring Queue/Topic objects on first use)."""
        for _, spec in outgoing:
            if spec is not None:
                await self.broker.ensure_declared(spec)  # cached by the broker: no round trip once declared
        envelopes = [env for env, _ in outgoing]
        await self.broker.publish(envelopes)  # their PRODUCER spans were made when they were staged
        if hooks.METRICS:
            hooks.count_sent(envelopes)

    # -- observation, mostly for tests and `framework.testing` ---------------------------------------------

    @property
    def in_flight(self) -> int:
        """Messages fetched by this process and not yet settled."""
        return sum(c.in_flight for c in self.consumers)

    def stats(self) -> dict[str, Any]:
        """Counters per handler (``service.handler`` -> counters)."""
        import attrs

        out: dict[str, Any] = {}
        for c in self.consumers:  # a pattern handler has a consumer per matching topic: summed
            counts = attrs.asdict(c.stats)
            mine = out.setdefault(c.handler.label, dict.fromkeys(counts, 0))
            for name, value in counts.items():
                mine[name] += value
        return out

    async def is_idle(self, *, include_delayed: bool = True) -> bool:
        """True when nothing is in flight here and every group of ours has nothing left to deliver."""
        if self.lanes.busy or self.in_flight:
            return False
        if await self.subscriptions.unwired():  # a new topic for a pattern: its messages are ours too
            self._look_now.set()
            return False
        inspect = as_introspection(self.broker)
        for consumer in self.consumers:
            for view in consumer.views:  # every partition, owned here or not
                g = await inspect.group_state(view)
                if not g.idle or (include_delayed and g.delayed):
                    return False
        return True

    async def wait_idle(self, *, timeout: float = 30.0, include_delayed: bool = True, poll: float = 0.02) -> None:
        """Wait until :meth:`is_idle` holds twice in a row; raise TimeoutError after ``timeout``."""
        with anyio.fail_after(timeout):
            streak = 0
            while streak < 2:
                streak = streak + 1 if await self.is_idle(include_delayed=include_delayed) else 0
                await anyio.sleep(poll)

    def declared(self) -> list[DestinationSpec]:
        """Specs of the destinations this runtime consumes (once running: patterns resolved)."""
        return [c.handler.spec for c in self.consumers if c.views]
