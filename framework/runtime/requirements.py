"""What services need of their transport, checked when the runtime wires them (before any message).

A handler that needs an optional capability its transport does not declare (see
:mod:`broker.capabilities`) stops the start with one error naming the handler, the capability
and why it is needed, instead of failing on its first message.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker import Broker
from broker.capabilities import INBOX, INTROSPECTION, OWNERSHIP, SCHEDULING
from framework.service import HandlerError, Service
from framework.settings import RuntimeSettings

__all__ = ["check_requirements", "requirements"]


def requirements(services: Sequence[Service], settings: RuntimeSettings) -> list[tuple[str, str, str]]:
    """(who, capability, why) for everything ``services`` need of a transport beyond the core contract."""
    needs: list[tuple[str, str, str]] = []
    for service in services:
        if service.jobs:
            needs.append((service.name, SCHEDULING, "recurring jobs fire their ticks through it"))
        for h in service.handlers:
            who = f"{h.service}.{h.name}"
            if h.inbox and not h.sql_inbox:
                needs.append((who, INBOX, "the inbox drops duplicates (inbox=False turns it off)"))
            if h.pattern is None and settings.owns_partitions(h.spec.partitions):  # (a pattern: per topic)
                why = f"{h.spec.partitions} partitions are each owned by one instance to keep order per key"
                needs.append((who, OWNERSHIP, why))
            needs += [(who, name, why) for name, why in sorted(getattr(h, "needs", {}).items())]
    return needs


def check_requirements(broker: Broker, services: Sequence[Service], settings: RuntimeSettings) -> None:
    """Raise :class:`HandlerError` listing every need ``broker``'s transport cannot meet."""
    lacking = [(who, cap, why) for who, cap, why in requirements(services, settings) if cap not in broker.capabilities]
    if INTROSPECTION not in broker.capabilities:
        lacking.append(("the runtime", INTROSPECTION, "run_until_idle and the lag metrics read group states"))
    if lacking:
        lines = "; ".join(f"{who} needs {cap!r} ({why})" for who, cap, why in lacking)
        raise HandlerError(
            f"the {broker.transport} transport lacks what these services need: {lines}. "
            "Use a transport that offers it (see docs/transports.md) or change the handler."
        )
