"""The client's guard against typos in destination names: the code path's "did you mean".

A producer naming a destination by string (``client.send("refunds.isue", ...)``) declares it on
first use. When nobody declared that name yet:

* a declared destination whose name is a near match (:func:`framework._near.near_match`) means a
  typo: :class:`UnknownDestination` is raised, naming it, and nothing is stored or declared;
* no near match: the destination is created (a new topic before its first subscriber is normal),
  with a :class:`NewDestinationWarning` (Python's ``warnings``: on stderr, once per name and
  process, never on stdout; ``warnings.filterwarnings`` silences it) saying nobody consumes it yet.

``create=True`` (or a :class:`~framework.Queue`/:class:`~framework.Topic` object) creates on
purpose, without the check. A name checked once is not checked again by the same client.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable

from broker import Broker, ConfigurationError
from broker.errors import transport_errors
from framework._messages import Outgoing
from framework._near import near_match

__all__ = ["DestinationGuard", "NewDestinationWarning", "UnknownDestination"]


class NewDestinationWarning(UserWarning):
    """A send or publish created a destination nobody declared (and no near name exists)."""


class UnknownDestination(ConfigurationError):
    """A send or publish named an undeclared destination close to a declared one (a typo):
    nothing was stored. Fix the name, or pass ``create=True`` to create it on purpose."""

    def __init__(self, name: str, noun: str, near: str) -> None:
        super().__init__(
            f"unknown {noun} {name!r} (did you mean {near!r}?): nothing was sent; fix the name, or pass "
            f"create=True (or a {'Queue' if noun == 'queue' else 'Topic'} object) to create {name!r} on purpose"
        )
        self.name = name
        self.near = near


class DestinationGuard:
    """Checks the names a client sends to, once per name (see the module docstring)."""

    def __init__(self) -> None:
        self._checked: set[str] = set()

    async def check(self, broker: Broker, items: Iterable[Outgoing], created: Collection[str] = ()) -> None:
        """Raise :class:`UnknownDestination` for a name that looks like a typo; warn once for a new one.

        Items with a spec (Queue/Topic objects) and names in ``created`` are not checked.
        """
        for env, spec in items:
            name = env.destination
            if spec is not None or name in self._checked or name in created:
                continue
            if await broker.get_destination(name) is None:
                await self._new(broker, name, "queue" if env.kind == "command" else "topic")
            self._checked.add(name)

    async def _new(self, broker: Broker, name: str, noun: str) -> None:
        try:
            known = [s.name for s in await broker.list_destinations()]
        except transport_errors():  # a producer's ACL need not list destinations: no hint possible
            known = []
        near = near_match(name, known)
        if near is not None:
            raise UnknownDestination(name, noun, near)
        warnings.warn(
            f"creating {noun} {name!r} on first use: nothing consumes it until a service subscribes "
            "(pass create=True to say it is on purpose)",
            NewDestinationWarning,
            stacklevel=2,
        )
