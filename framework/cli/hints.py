"""What the ``framework`` commands say about a name that does not exist: near matches, other namespaces.

``require_destination`` is the one "no such destination" check of the commands that take a
destination (``dlq``, ``peek``); ``other_namespaces`` finds the namespaces that do hold declared
destinations, for ``status`` in a namespace that holds none.
"""

from __future__ import annotations

from typing import Any

import anyio

from broker import Broker, DestinationSpec
from broker.capabilities import REDIS, as_redis, supports
from broker.errors import transport_errors
from framework._near import did_you_mean, listed
from framework.cli.common import UsageError

__all__ = ["namespace_hint", "other_namespaces", "require_destination", "require_group"]

_SCAN_SECONDS = 2.0  # the namespace hint gives up after this (a large keyspace is scanned, not listed)
_SUFFIX = ":destinations"  # the registry hash of a namespace (broker/redis/keys.py)


async def _known_names(broker: Broker) -> list[str] | None:
    try:
        return [s.name for s in await broker.list_destinations()]
    except transport_errors():  # an ACL without HGETALL: no list, the refusal still stands
        return None


async def require_destination(broker: Broker, name: str) -> DestinationSpec:
    """The spec of ``name``; UsageError "no such destination" with the near match and the known names."""
    spec = await broker.get_destination(name)
    if spec is not None:
        return spec
    known = await _known_names(broker)
    if known is None:
        raise UsageError(f"no such destination {name!r}")
    raise UsageError(f"no such destination {name!r}{did_you_mean(name, known)}; known destinations: {listed(known)}")


async def require_group(broker: Broker, group: str, destination: str | None = None) -> None:
    """UsageError naming the near match when no destination (or not ``destination``) has ``group`` subscribed."""
    subscriptions = await broker.list_subscriptions()
    groups = sorted({g for d, g in subscriptions if destination is None or d == destination})
    if group in groups:
        return
    where = f" on {destination!r}" if destination else ""
    raise UsageError(f"no group {group!r} subscribed{where}{did_you_mean(group, groups)}; groups: {listed(groups)}")


async def other_namespaces(broker: Broker, *, limit: int = 20) -> list[str] | None:
    """Namespaces of this server with declared destinations (Redis: a bounded SCAN), or None when
    the transport cannot tell or the scan took too long."""
    if not supports(broker, REDIS):
        return None
    client: Any = as_redis(broker).redis
    found: set[str] = set()
    with anyio.move_on_after(_SCAN_SECONDS) as scope:
        try:
            async for key in client.scan_iter(match=f"*{_SUFFIX}", count=1000, _type="hash"):
                text = key.decode() if isinstance(key, bytes) else str(key)
                found.add(text[: -len(_SUFFIX)])
                if len(found) >= limit:
                    break
        except Exception:  # best effort: an ACL without SCAN, a client that scans differently
            return None
    if scope.cancelled_caught:
        return None
    found.discard(broker.namespace)
    return sorted(found)


async def namespace_hint(broker: Broker) -> str:
    """What to say when the namespace holds no declared destination: the namespaces that do."""
    others = await other_namespaces(broker)
    here = f"namespace {broker.namespace!r} has no destinations declared yet"
    if others:
        return f"{here}; namespaces with destinations on this server: {listed(others)} (pass --namespace NAME)"
    return f"{here} (publish a message or run a service first, or check --namespace / $FRAMEWORK_NAMESPACE)"
