"""Checks of the state store: guarded commits with the ack (once or not at all), duplicates, timeouts, fencing."""

from __future__ import annotations

from broker.capabilities import StateStore, as_ownership, as_scheduler, as_state
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Names, command, numbers, one_broker, raises
from broker.envelope import now_ms
from broker.errors import EffectsConflict, LeaseLost
from broker.protocol import Broker, Delivery, GroupPartition
from broker.state import Effects, ScheduleMessage, SetFields
from broker.topology import DestinationSpec

__all__: list[str] = []

FIELDS = ("v", "s", "t")


async def _setup(broker: Broker, names: Names, n: int = 1) -> tuple[StateStore, GroupPartition, list[Delivery], str]:
    """A queue with ``n`` commands of key ``o-1`` read by group ``g``: the store, the view, the deliveries and
    the key of ``o-1``'s state beside their partition."""
    store = as_state(broker)
    spec = await broker.declare(DestinationSpec(names("state.steps"), "command", partitions=2))
    views = await broker.subscribe(spec, "g")
    view = views[spec.partition_for("o-1", "")]
    await broker.publish([command(spec.name, i, key="o-1") for i in range(n)])
    deliveries = await broker.read(view, "c", 10, 10)
    assert len(deliveries) == n, f"{len(deliveries)} of {n} commands delivered"
    return store, view, deliveries, store.state_key(spec.name, view.partition, "o-1")


async def _outbox(broker: Broker, names: Names) -> tuple[str, GroupPartition]:
    """A queue for a commit's outgoing messages and its group's view."""
    spec = await broker.declare(DestinationSpec(names("state.out"), "command"))
    [view] = await broker.subscribe(spec, "out")
    return spec.name, view


def _save(store: StateStore, key: str, version: int, state: bytes, expected: int | None = None) -> Effects:
    """A commit's operations saving ``state`` at ``version``, guarded by ``expected`` (None: absent)."""
    effects = store.effects()
    effects.expect(key, "v", expected)
    effects.add(SetFields(key, {"v": version, "s": state}))
    return effects


@check(requires=("state",))
async def check_a_guarded_commit_applies_once_with_its_messages_and_ack(
    make: BrokerFactory, features: Features
) -> None:
    """A commit whose guard holds writes its state, sends its messages and acks its entry, at once; the
    same commit again (a retry after a lost reply) finds the entry settled and does nothing."""
    names = Names()
    async with one_broker(make) as broker:
        store, view, [d], key = await _setup(broker, names)
        out, out_view = await _outbox(broker, names)
        other = store.state_key(view.spec.name, view.partition, "o-2")
        assert key != other, "two correlations share a state key"
        assert await store.read_state(key, FIELDS) == [None, None, None], "a state exists before any commit"
        effects = store.effects()
        effects.expect(key, "v", None)
        effects.add(SetFields(key, {"v": 1, "s": b'{"n": 1}'}))
        assert await store.commit_effects(d, effects, [command(out, 1)]) is True, "a guarded commit did not apply"
        assert await store.read_state(key, FIELDS) == [b"1", b'{"n": 1}', None], "the state was not written"
        rows = await store.read_states([key, other], ("v", "s"))
        assert rows == [[b"1", b'{"n": 1}'], [None, None]], f"read_states gave {rows}"
        assert numbers(await broker.read(out_view, "o", 10, 10)) == [1], "the commit's message was not sent once"
        assert await broker.read_own_pending(view, "c", 10) == [], "a committed entry is still pending"
        again = store.effects()
        again.add(SetFields(key, {"v": 9}))
        assert await store.commit_effects(d, again, [command(out, 2)]) is False, "a settled entry committed again"
        assert await store.read_state(key, ("v",)) == [b"1"], "a second commit of one entry wrote its state"
        assert await broker.read(out_view, "o", 10, 10) == [], "a second commit of one entry sent its message"


@check(requires=("state",))
async def check_a_stale_expected_version_conflicts_and_writes_nothing(make: BrokerFactory, features: Features) -> None:
    """A commit guarded by a version the state has moved on from raises EffectsConflict having written, sent
    and acked nothing (its entry stays pending); with the stored version it applies."""
    names = Names()
    async with one_broker(make) as broker:
        store, view, [first, second], key = await _setup(broker, names, 2)
        out, out_view = await _outbox(broker, names)
        assert await store.commit_effects(first, _save(store, key, 1, b"one"))
        stale = _save(store, key, 1, b"stale", expected=None)  # read before the first commit: absent
        with raises(EffectsConflict, doing="a commit guarded by a stale version"):
            await store.commit_effects(second, stale, [command(out, 1)])
        assert await store.read_state(key, ("v", "s")) == [b"1", b"one"], "a conflicting commit wrote its state"
        assert await broker.read(out_view, "o", 10, 10) == [], "a conflicting commit sent its message"
        pending = await broker.read_own_pending(view, "c", 10)
        assert [p.entry_id for p in pending] == [second.entry_id], "a conflicting commit settled its entry"
        fresh = _save(store, key, 2, b"two", expected=1)
        assert await store.commit_effects(second, fresh, [command(out, 2)]) is True
        assert await store.read_state(key, ("v", "s")) == [b"2", b"two"]
        assert numbers(await broker.read(out_view, "o", 10, 10)) == [2]


@check(requires=("state",))
async def check_a_duplicate_deliverys_commit_is_skipped(make: BrokerFactory, features: Features) -> None:
    """A second entry of a message whose commit applied (a copy published twice) commits nothing: acked only,
    its state write not applied, whatever its guard."""
    names = Names()
    async with one_broker(make) as broker:
        store = as_state(broker)
        spec = await broker.declare(DestinationSpec(names("state.dups"), "command"))
        [view] = await broker.subscribe(spec, "g")
        copy = command(spec.name, 1, key="o-1")
        await broker.publish([copy, copy])
        one, two = await broker.read(view, "c", 10, 10)
        assert one.message_id == two.message_id
        key = store.state_key(spec.name, view.partition, "o-1")
        assert await store.commit_effects(one, _save(store, key, 1, b"once")) is True
        assert await store.commit_effects(two, _save(store, key, 2, b"twice", expected=1)) is False
        assert await store.read_state(key, ("v", "s")) == [b"1", b"once"], "a duplicate's commit wrote its state"
        assert await broker.read_own_pending(view, "c", 10) == [], "a duplicate's entry was not acknowledged"


@check(requires=("state", "scheduling"))
async def check_a_timeout_scheduled_by_a_commit_moves_when_due(make: BrokerFactory, features: Features) -> None:
    """A ScheduleMessage of a commit is stored only if the commit applies (not on a conflict), waits until
    due, and is then delivered once to its partition, under its id."""
    names = Names()
    async with one_broker(make) as broker:
        store, view, [first, second], key = await _setup(broker, names, 2)
        sched = as_scheduler(broker)
        due = now_ms() + 60_000
        lost = command(view.spec.name, 6, key="o-1")
        conflicting = _save(store, key, 1, b"x", expected=5)
        conflicting.add(ScheduleMessage(lost, due))
        with raises(EffectsConflict, doing="a conflicting commit with a timeout"):
            await store.commit_effects(first, conflicting)
        assert await sched.count_scheduled(view.spec.name) == 0, "a conflicting commit stored its timeout"
        timeout = command(view.spec.name, 7, key="o-1")
        effects = _save(store, key, 1, b"waiting")
        effects.add(ScheduleMessage(timeout, due))
        assert await store.commit_effects(first, effects) is True
        [stored] = await sched.scheduled_messages(destination=view.spec.name)
        assert (stored.message_id, stored.due_ms, stored.partition) == (timeout.id, due, view.partition), stored
        await broker.ack(view, [second])
        await sched.move_scheduled(now_ms(), sweep=True)
        assert await broker.read(view, "c", 10, 10) == [], "a timeout was delivered before it was due"
        await sched.move_scheduled(due + 1, sweep=True)
        moved = await broker.read(view, "c", 10, 10)
        assert [(d.message_id, d.envelope.key if d.envelope else None) for d in moved] == [(timeout.id, "o-1")]
        assert numbers(moved) == [7], "a due timeout was not delivered once"
        await sched.move_scheduled(due + 2, sweep=True)
        assert await broker.read(view, "c", 10, 10) == [], "a timeout was delivered twice"


@check(requires=("state", "ownership"))
async def check_a_commit_is_fenced_by_the_partition_token(make: BrokerFactory, features: Features) -> None:
    """A commit under a token that is no longer the partition's raises LeaseLost having written, scheduled
    and acked nothing; under the current token it applies."""
    names = Names()
    async with one_broker(make) as broker:
        store, view, [d], key = await _setup(broker, names)
        token = await as_ownership(broker).acquire_lease(view, "me", 30_000)
        assert token > 0
        timeout = command(view.spec.name, 7, key="o-1")
        effects = _save(store, key, 1, b"fenced")
        effects.add(ScheduleMessage(timeout, now_ms() + 60_000))
        with raises(LeaseLost, doing="a commit under a stale token"):
            await store.commit_effects(d, effects, token=token + 1)
        assert await store.read_state(key, ("v",)) == [None], "a fenced commit wrote its state"
        if features.scheduling:
            assert await as_scheduler(broker).count_scheduled(view.spec.name) == 0, "a fenced commit scheduled"
        assert len(await broker.read_own_pending(view, "c", 10)) == 1, "a fenced commit settled its entry"
        assert await store.commit_effects(d, effects, token=token) is True
        assert await store.read_state(key, ("v",)) == [b"1"]
