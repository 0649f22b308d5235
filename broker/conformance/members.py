"""Checks that a broker has every member of the protocols it claims and declares its capabilities honestly."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from broker import capabilities as caps
from broker.conformance.features import CAPABILITY_FEATURES, BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import one_broker, raises
from broker.introspection import Introspection
from broker.protocol import Broker

__all__ = ["CAPABILITY_PROTOCOLS", "member_problems", "protocol_members"]

CAPABILITY_PROTOCOLS: dict[str, tuple[type, Callable[[Broker], Any]]] = {
    caps.INBOX: (caps.InboxStore, caps.as_inbox),
    caps.OWNERSHIP: (caps.PartitionOwnership, caps.as_ownership),
    caps.SCHEDULING: (caps.Scheduler, caps.as_scheduler),
    caps.DEAD_LETTER_ADMIN: (caps.DeadLetterAdmin, caps.as_dead_letter_admin),
    caps.INTROSPECTION: (Introspection, caps.as_introspection),
    caps.STATE: (caps.StateStore, caps.as_state),
    caps.REDIS: (caps.RedisStore, caps.as_redis),
    caps.REPLIES: (caps.ReplyStore, caps.as_replies),
}
"""Every capability name of :mod:`broker.capabilities`: its protocol and the function narrowing to it."""


def protocol_members(proto: type) -> set[str]:
    """The public methods and attributes ``proto`` and its protocol bases declare."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls is object or cls.__module__ == "typing" or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return names


def member_problems(obj: object, proto: type) -> list[str]:
    """What ``obj`` lacks of ``proto``: missing members, and methods whose parameters differ in kind or
    default from the protocol's (or that require parameters it does not have)."""
    problems: list[str] = []
    for name in sorted(protocol_members(proto)):
        if not hasattr(obj, name):
            problems.append(f"no {name!r}")
            continue
        declared = inspect.getattr_static(proto, name, None)
        if not inspect.isfunction(declared):
            continue  # an attribute or a property
        want = inspect.signature(declared).parameters
        have = inspect.signature(getattr(obj, name)).parameters
        for param in list(want.values())[1:]:  # without self
            got = have.get(param.name)
            if got is None:
                problems.append(f"{name}() lacks parameter {param.name!r}")
            elif (got.kind, got.default) != (param.kind, param.default):
                problems.append(f"{name}({param.name}) is {got.kind.description}={got.default!r}, not as declared")
        extra = [p.name for p in have.values() if p.name not in want and p.default is inspect.Parameter.empty]
        extra = [
            p for p in extra if have[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if extra:
            problems.append(f"{name}() requires parameters the protocol does not have: {extra}")
    return problems


@check()
async def check_the_broker_has_every_member_of_its_protocols(make: BrokerFactory, features: Features) -> None:
    """The broker has every member of :class:`~broker.protocol.Broker` and of each capability protocol it
    declares, with the declared parameters (kinds and defaults)."""
    async with one_broker(make) as broker:
        problems = {"Broker": member_problems(broker, Broker)}
        for name in sorted(broker.capabilities & set(CAPABILITY_PROTOCOLS)):
            proto, _ = CAPABILITY_PROTOCOLS[name]
            problems[proto.__name__] = member_problems(broker, proto)
        found = {k: v for k, v in problems.items() if v}
        assert not found, f"the {broker.transport} broker does not match its protocols: {found}"


@check()
async def check_capabilities_are_declared_honestly(make: BrokerFactory, features: Features) -> None:
    """The broker names its transport and declares known capabilities (at least those the features claim);
    narrowing to a declared one gives the broker, to an undeclared one raises TypeError naming both."""
    async with one_broker(make) as broker:
        assert isinstance(broker.transport, str) and broker.transport, f"transport is {broker.transport!r}"
        declared = broker.capabilities
        assert isinstance(declared, frozenset), f"capabilities is a {type(declared).__name__}, not a frozenset"
        unknown = sorted(declared - set(CAPABILITY_PROTOCOLS))
        assert not unknown, f"declared capabilities {unknown} are not names of broker.capabilities"
        claimed = {cap for feature, cap in CAPABILITY_FEATURES.items() if features.has(feature)}
        assert claimed <= declared, (
            f"the features claim {sorted(claimed - declared)}, which the broker does not declare"
        )
        assert caps.missing(broker, CAPABILITY_PROTOCOLS) == sorted(set(CAPABILITY_PROTOCOLS) - declared)
        for name, (proto, narrow) in CAPABILITY_PROTOCOLS.items():
            if name in declared:
                assert caps.supports(broker, name) and narrow(broker) is broker, f"narrowing to {name} failed"
                assert isinstance(broker, proto), f"the broker declares {name} but is no {proto.__name__}"
                continue
            assert not caps.supports(broker, name)
            pattern = f"{broker.transport}.*{name}"
            with raises(TypeError, pattern, doing=f"narrowing the {broker.transport} broker to undeclared {name}"):
                narrow(broker)
