"""Partition ownership: each partition of a group is run by one live instance at a time.

Without it every worker process reads every partition, so two processes interleave one key's
messages. With it (``RuntimeSettings.ownership``; docs/partition-ownership.md), one :class:`Ownership` per
consumer (a group on a destination) keeps, every ``heartbeat_interval`` (a third of ``lease_ttl``):

* a heartbeat in the group's members zset, which lists the live instances (sorted);
* the assignment (:func:`assign`): every instance computes the same partition -> instance map from
  the members (rendezvous hashing, balanced to at most ceil(partitions / instances) each), and
  works toward its own share;
* its leases: renewed in one round trip; a renewal refused (taken over) or not done in time
  (the local clock passed the lease's end: a pause, the broker unreachable) ends that tenure;
* partitions beyond its share are handed back cooperatively (:meth:`Ownership.release`): stop
  fetching, do not start queued messages, let running handlers finish, flush the acks, then give
  the lease back, so the next owner starts with nothing running here;
* partitions of its share that are free or expired are acquired: a new fencing token, a new
  :class:`~framework.runtime.ledger.Ledger` (a *tenure*), whose fetcher first takes over every
  entry pending in the partition, oldest first, then reads new ones.

Every settle call of a tenure carries its fencing token; once another instance acquired the
partition, the scripts refuse (see ``broker/redis/settlement.py``). A tenure that lost its
lease never starts another message (:meth:`~framework.runtime.ledger.Lease.usable`), so a
process resumed after a pause cannot run or settle what the new owner took over.

A kill moves an instance's partitions after at most ``lease_ttl`` plus a heartbeat; a
graceful stop (SIGTERM) releases them at once.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc

from broker import GroupPartition, LeaseLost
from framework.runtime.connectivity import healthy
from framework.runtime.ledger import Lease, Ledger
from framework.runtime.supervisor import is_connection_error
from framework.runtime.wiring import Wiring

if TYPE_CHECKING:
    from framework.runtime.settle import Settlement

__all__ = ["Ownership", "PartitionRunner", "assign"]

_MARGIN = 0.15  # of lease_ttl: a lease counts as ours locally until its renewal's send time + ttl less this
_DRAIN_WARN = 10.0  # seconds a hand-back may wait for running handlers before it says so


def _rank(instance: str, partition: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{instance}|{partition}".encode(), digest_size=8).digest(), "big")


def assign(partitions: int, instances: list[str]) -> dict[int, str]:
    """Partition -> instance, the same on every instance that sees the same members.

    Rendezvous hashing (a partition goes to the instance ranking it highest), capped at
    ceil(partitions / instances) per instance so the share is fair; an instance joining or
    leaving moves few partitions besides its own share.
    """
    if not instances:
        return {}
    members = sorted(set(instances))
    cap = math.ceil(partitions / len(members))
    load = dict.fromkeys(members, 0)
    out: dict[int, str] = {}
    for p in range(partitions):
        for m in sorted(members, key=lambda m: _rank(m, p), reverse=True):
            if load[m] < cap:
                out[p] = m
                load[m] += 1
                break
    return out


class PartitionRunner(Protocol):
    """What ownership needs of its consumer (:class:`~framework.runtime.consumer.Consumer`): the
    ledgers of the partitions it runs, their settlement, and running one partition's tasks."""

    states: dict[int, Ledger]
    settle: Settlement

    async def serve(
        self, ledger: Ledger, intake: anyio.CancelScope | None = None, intake_done: anyio.Event | None = None
    ) -> None:
        """Run one partition's tasks until cancelled (``intake``: the scope of those bringing messages in)."""


class _Tenure:
    """One partition held by this instance: its ledger and the scopes of its tasks."""

    __slots__ = ("intake", "intake_done", "ledger", "scope")

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.scope = anyio.CancelScope()  # every task of the partition
        self.intake = anyio.CancelScope()  # fetch, claims, due retries: cancelled first on a hand-back
        self.intake_done = anyio.Event()  # set once they have ended (no read of ours is blocked on the server)

    async def close_intake(self) -> None:
        """Stop fetching and claiming, and wait until the fetcher's connection is closed (bounded).

        A lease is freed only after this, so no read or claim of this tenure is still on its way
        when the next owner takes over (they are fenced on the server too: owned_intake.lua)."""
        self.intake.cancel()
        with anyio.move_on_after(5, shield=True):
            await self.intake_done.wait()


class Ownership:
    """Keeps this instance's share of a consumer's partitions (see the module docstring)."""

    def __init__(self, wiring: Wiring, consumer: PartitionRunner, views: list[GroupPartition]) -> None:
        self.wiring = wiring
        self.consumer = consumer
        self.views = {v.partition: v for v in views}
        self.broker = wiring.broker
        self.leases = wiring.ownership_store  # checked at wiring: partitions are owned only where it exists
        self.instance = wiring.consumer_name
        self.ttl = wiring.settings.lease_ttl
        self.ttl_ms = int(self.ttl * 1000)
        self.interval = wiring.settings.heartbeat_interval
        self.tenures: dict[int, _Tenure] = {}
        self.members: list[str] = []
        self.wake = anyio.Event()
        self.stopped = False  # shutdown: acquire nothing more
        self.log = wiring.log
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def destination(self) -> str:
        """The destination whose partitions are owned."""
        return self.wiring.handler.destination.name

    @property
    def group(self) -> str:
        """The consumer group (the service)."""
        return self.wiring.handler.service

    def owned(self) -> list[int]:
        """Partitions held now (tenures not lost)."""
        return sorted(p for p, t in self.tenures.items() if t.ledger.lease and not t.ledger.lease.lost)

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Beat, renew, hand back and acquire every heartbeat interval (and at once when woken)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                while True:
                    await self.tick()
                    healthy()
                    with anyio.move_on_after(self.interval):
                        await self.wake.wait()
                    self.wake = anyio.Event()
            finally:  # (a crash restarts the loop: its tenures' tasks die with it, so they end here)
                self._tg = None
                tg.cancel_scope.cancel()
                for p, tenure in list(self.tenures.items()):
                    self._drop(p, tenure)

    def _woken(self) -> None:
        self.wake.set()

    async def tick(self) -> None:
        """One round: heartbeat, renewals, losses, hand-backs, acquisitions."""
        if self.stopped:  # shutting down: keep what is held until the hand-over frees it, join nothing
            await self.renew()
            return
        self.members = await self.leases.heartbeat(self.destination, self.group, self.instance, self.ttl_ms)
        mine = {p for p, who in assign(len(self.views), self.members).items() if who == self.instance}
        await self.renew()
        for p, tenure in list(self.tenures.items()):
            lease = tenure.ledger.lease
            assert lease is not None
            if lease.lost:
                self.end(p)
            elif p not in mine and not lease.releasing and not self.stopped:
                lease.releasing = True
                assert self._tg is not None
                self._tg.start_soon(self.release, p)
        if self.stopped:
            return
        acquired: dict[int, int] = {}
        for p in sorted(mine - set(self.tenures)):
            started = time.monotonic()
            token = await self.leases.acquire_lease(self.views[p], self.instance, self.ttl_ms)
            if token:
                self.start(p, token, started)
                acquired[p] = token
        if acquired:
            self.log.info(
                "acquired partitions",
                partitions=sorted(acquired),
                tokens=[acquired[p] for p in sorted(acquired)],
                owned=self.owned(),
                instances=len(self.members),
            )

    async def renew(self) -> None:
        """Renew every lease held in one round trip; a refused renewal loses that tenure."""
        held = [(p, t) for p, t in self.tenures.items() if t.ledger.lease is not None and not t.ledger.lease.lost]
        if not held:
            return
        sent = time.monotonic()
        pairs = [(self.views[p], t.ledger.lease.token) for p, t in held if t.ledger.lease is not None]
        renewed = await self.leases.renew_leases(pairs, self.instance, self.ttl_ms)
        for (_, t), ok in zip(held, renewed, strict=True):
            lease = t.ledger.lease
            assert lease is not None
            if ok:
                if not lease.lost:
                    lease.valid_until = sent + self.ttl * (1 - _MARGIN)
            else:
                lease.lose("its lease was taken over by another instance")

    # -- tenures -----------------------------------------------------------------------------------

    def start(self, p: int, token: int, sent: float) -> None:
        """Begin a tenure of partition ``p`` under fencing token ``token``."""
        ledger = Ledger(self.views[p])
        ledger.lease = Lease(token, sent + self.ttl * (1 - _MARGIN), self._woken)
        tenure = _Tenure(ledger)
        self.tenures[p] = tenure
        self.consumer.states[p] = ledger
        assert self._tg is not None
        self._tg.start_soon(self._serve, tenure)

    async def _serve(self, tenure: _Tenure) -> None:
        try:
            with tenure.scope:
                await self.consumer.serve(tenure.ledger, tenure.intake, tenure.intake_done)
        finally:
            tenure.intake_done.set()

    def _drop(self, p: int, tenure: _Tenure) -> None:
        """Forget a tenure here: its tasks are cancelled, its queued messages never start."""
        if self.tenures.get(p) is tenure:
            del self.tenures[p]
        ledger = tenure.ledger
        if self.consumer.states.get(p) is ledger:
            del self.consumer.states[p]
        tenure.intake.cancel()
        tenure.scope.cancel()
        if ledger.lease is not None:
            ledger.lease.on_lost = None
            ledger.lease.lose("the ownership loop stopped")

    def end(self, p: int) -> None:
        """End a lost tenure now (its queued messages never start; logged once), and wind it down."""
        tenure = self.tenures[p]
        lease = tenure.ledger.lease
        assert lease is not None
        self._drop(p, tenure)
        self.log.warning(
            "lost ownership of a partition: its messages here are dropped (the owner delivers them again)",
            partition=p,
            token=lease.token,
            why=lease.why,
        )
        assert self._tg is not None
        self._tg.start_soon(self._wind_down, p, tenure)

    async def _wind_down(self, p: int, tenure: _Tenure) -> None:
        """After a loss: close the fetcher, let handlers still running finish (bounded), send the acks
        of messages finished before the loss, and free the lease if it is still ours (a loss seen on
        the local clock only), so another instance need not wait for it to lapse. Freed only once
        nothing of the tenure runs here, so no key of it runs in two instances at once."""
        ledger = tenure.ledger
        lease = ledger.lease
        assert lease is not None
        await tenure.close_intake()
        with anyio.move_on_after(_DRAIN_WARN):
            while any(s.delivery is not None for s in ledger.slots):
                await anyio.sleep(0.02)
        with anyio.move_on_after(2, shield=True):
            try:
                async with ledger.ack_lock:
                    batch = ledger.take_acks()
                    if batch:
                        try:
                            await self.broker.ack(
                                ledger.view, batch, inbox=self.wiring.handler.inbox, token=lease.token
                            )
                        finally:
                            self.consumer.settle.writes_settled(ledger, batch)
                if not any(s.delivery is not None for s in ledger.slots):
                    await self.leases.release_lease(self.views[p], self.instance, lease.token)
            except LeaseLost:
                pass
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
        with anyio.move_on_after(2, shield=True):
            try:  # after the acks: a transport pushing the partition to this process stops (its next owner gets it)
                await self.leases.stop_reading(self.views[p])
            except Exception as exc:
                if not is_connection_error(exc):
                    raise

    async def release(self, p: int) -> None:
        """Hand partition ``p`` back: stop fetching, let running handlers finish, flush acks, free the lease."""
        tenure = self.tenures.get(p)
        if tenure is None:
            return
        ledger = tenure.ledger
        lease = ledger.lease
        assert lease is not None
        began = time.monotonic()
        await tenure.close_intake()  # no more fetches or claims; queued messages are not started (Lease.usable)
        warned = False
        while ledger.in_flight > 0 or any(s.delivery is not None for s in ledger.slots):
            if lease.lost:
                return  # the loop ends the tenure
            if not warned and time.monotonic() - began > _DRAIN_WARN:
                warned = True
                self.log.warning("handing back a partition waits for its running handlers", partition=p)
            await anyio.sleep(0.02)
        try:
            await self.consumer.settle.flush(ledger)
        except Exception as exc:
            if not is_connection_error(exc):
                raise
            lease.lose("its acks could not be flushed before the hand-back")
            return
        if lease.lost or self.tenures.get(p) is not tenure:
            return
        del self.tenures[p]
        if self.consumer.states.get(p) is ledger:
            del self.consumer.states[p]
        tenure.scope.cancel()
        await self.leases.release_lease(self.views[p], self.instance, lease.token)
        self.log.info(
            "handed back partition", partition=p, token=lease.token, seconds=round(time.monotonic() - began, 3)
        )
        self.wake.set()

    async def leave(self) -> None:
        """At shutdown (after the acks are flushed): free every lease and leave the members."""
        self.stopped = True
        for p, tenure in list(self.tenures.items()):
            lease = tenure.ledger.lease
            assert lease is not None
            lease.releasing = True
            await tenure.close_intake()
            if not lease.lost:
                await self.leases.release_lease(self.views[p], self.instance, lease.token)
        await self.leases.heartbeat(self.destination, self.group, self.instance, self.ttl_ms, leave=True)
