"""Checks of the destination registry: declaring, conflicts, one owner per queue, declare on first use, listing."""

from __future__ import annotations

import re

from broker.capabilities import as_dead_letter_admin
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Brokers, Names, command, event, one_broker, raises
from broker.errors import ConfigurationError
from broker.topology import DestinationSpec

__all__: list[str] = []


@check()
async def check_a_queue_has_one_owning_service(make: BrokerFactory, features: Features) -> None:
    """A second group subscribing to a queue is refused: a queue has one owning service."""
    names = Names()
    async with one_broker(make) as broker:
        spec = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        await broker.subscribe(spec, "billing")
        await broker.subscribe(spec, "billing")  # the owner again: idempotent
        with raises(ConfigurationError, "one owning service", doing="a second group subscribing to a queue"):
            await broker.subscribe(spec, "shipping")


@check()
async def check_declaring_a_conflicting_destination_is_a_clear_error(make: BrokerFactory, features: Features) -> None:
    """Declaring a destination again with another partition count, or sending the other kind to it, is refused."""
    names = Names()
    async with one_broker(make) as broker:
        topic = names("orders.placed")
        spec = DestinationSpec(topic, "event", partitions=2)
        assert await broker.declare(spec) == spec, "declare returns the stored spec"
        assert await broker.declare(spec) == spec, "declaring the same spec again is idempotent"
        with raises(ConfigurationError, "2 partition", doing="declaring a 2-partition topic with 3"):
            await broker.declare(DestinationSpec(topic, "event", partitions=3))
        with raises(ConfigurationError, "topic", doing="publishing a command to a topic"):
            await broker.publish([command(topic, 1)])


@check(requires=("shared_state",))
async def check_route_declares_on_first_use_and_refuses_the_other_kind(make: BrokerFactory, features: Features) -> None:
    """``route`` (and so ``publish``) declares an unknown destination in the shared registry, keeps an
    existing one's partitions, and refuses the other kind or an invalid name."""
    names = Names()
    async with Brokers(make) as brokers:
        a, b = await brokers(), await brokers()
        log = names("audit.log")
        spec = await a.route(log, "event", partitions=3)
        assert (spec.name, spec.kind, spec.partitions) == (log, "event", 3), f"route declared {spec}"
        assert await b.get_destination(log) == spec, "route's declaration is not in the registry other brokers read"
        assert await b.route(log, "event") == spec, "an existing destination keeps its partitions"
        pattern = rf"cannot send\(\) a command to '{re.escape(log)}': it is declared as a topic"
        with raises(ConfigurationError, pattern, doing="routing a command to a topic"):
            await b.route(log, "command")
        with raises(ConfigurationError, "invalid destination name", doing="routing to 'no spaces'"):
            await a.route("no spaces", "event")
        fresh = names("fresh.topic")
        [entry] = await a.publish([event(fresh, 1)])  # publish routes the same way
        assert entry, "publishing to a new destination stores the message"
        assert await b.get_destination(fresh) == DestinationSpec(fresh, "event"), "publish declares with defaults"


@check(requires=("shared_state", "dead_letter_admin"))
async def check_ensure_declared_declares_once_per_broker_and_reports_conflicts(
    make: BrokerFactory, features: Features
) -> None:
    """``ensure_declared`` declares a spec once per broker (the latest retention wins) and reports
    kind and partition conflicts."""
    names = Names()
    async with Brokers(make) as brokers:
        a, b = await brokers(), await brokers()
        name = names("billing.refund")
        spec = DestinationSpec(name, "command", partitions=2)
        assert await a.ensure_declared(spec) == spec
        with raises(ConfigurationError, "2 partition", doing="ensure_declared with another partition count"):
            await b.ensure_declared(DestinationSpec(name, "command", partitions=3))
        with raises(ConfigurationError, "already declared as a queue", doing="ensure_declared with another kind"):
            await b.ensure_declared(DestinationSpec(name, "event", partitions=2))
        shorter = DestinationSpec(name, "command", partitions=2, retention_ms=1000)
        assert await b.ensure_declared(shorter) == shorter, "another retention is declared again: the latest wins"
        assert await (await brokers()).get_destination(name) == shorter, "the registry keeps the latest retention"
        assert await a.ensure_declared(spec) == spec, "a's own spec again: declared again, as it differs from b's"
        await as_dead_letter_admin(b).delete_destination(spec)  # behind a's back
        assert await a.ensure_declared(spec) == spec, "a holds the spec: it does not declare it again"
        assert await (await brokers()).get_destination(name) is None, "ensure_declared declared a held spec again"


@check()
async def check_destinations_and_subscriptions_are_listed(make: BrokerFactory, features: Features) -> None:
    """Declared destinations and subscribed (destination, group) pairs are listed, sorted; an unknown
    destination is None."""
    names = Names()
    async with one_broker(make) as broker:
        topic = await broker.declare(DestinationSpec(names("orders.placed"), "event", partitions=2))
        queue = await broker.declare(DestinationSpec(names("billing.refund"), "command"))
        await broker.subscribe(topic, "shipping")
        await broker.subscribe(topic, "billing")
        await broker.subscribe(queue, "billing")
        listed = await broker.list_destinations()
        assert [s.name for s in listed] == sorted(s.name for s in listed), "destinations are not sorted by name"
        ours = [s for s in listed if s.name.endswith(names.tag)]
        assert ours == sorted([topic, queue], key=lambda s: s.name), f"listed {ours}, declared {topic}, {queue}"
        subs = await broker.list_subscriptions()
        assert subs == sorted(subs), "subscriptions are not sorted"
        mine = [s for s in subs if s[0].endswith(names.tag)]
        want = sorted([(topic.name, "billing"), (topic.name, "shipping"), (queue.name, "billing")])
        assert mine == want, f"listed subscriptions {mine}, expected {want}"
        assert await broker.get_destination(topic.name) == topic
        assert await broker.get_destination(names("never.declared")) is None
        view = broker.group_partition(topic, 1, "billing")
        assert (view.spec, view.partition, view.group) == (topic, 1, "billing"), f"group_partition gave {view}"
        assert view == (await broker.subscribe(topic, "billing"))[1], "group_partition differs from subscribe's view"
