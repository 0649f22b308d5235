"""Dispatch: one group, several handlers; each message goes to the one handler whose filter takes it.

Handlers of one service on one topic (named, or matched by a pattern) share its consumer group and
its one reader, the lead consumer. Its admit stage asks :meth:`Routes.pick_all` which handler takes
each fetched delivery, *before the body is decoded*: the first filtered handler whose filter matches
the envelope's type and headers, else the default handler (the one without a filter), else nobody:
the message is acknowledged at once and counted (``stats.unwanted``), never dead-lettered. The
chosen handler's decoder and key function then make its work, tagged :class:`Routed`; the works of
every handler go to the lanes together, in the order they were fetched, so messages with one key
keep their order across handlers. The lead's lane runs a routed work with the chosen handler's
consumer stages (its attempt, retry policy, timeout, dead letters, counters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from broker import Delivery, Envelope
from framework.dead_letters.reasons import poison_reason
from framework.handlers import Handler
from framework.runtime.ledger import Ledger

__all__ = ["Route", "Routed", "Routes"]


class _Member(Protocol):
    handler: Handler


class Routed:
    """A work's decoded payload and the member consumer that runs it."""

    __slots__ = ("member", "payload")

    def __init__(self, member: Any, payload: Any) -> None:
        self.member = member
        self.payload = payload


class Route:
    """One member of a shared group: its handler decodes and keys what its filter takes."""

    __slots__ = ("handler", "member")

    def __init__(self, member: _Member) -> None:
        self.member = member
        self.handler = member.handler

    def decode(self, env: Envelope) -> tuple[Routed, Any]:
        """The work's payload (tagged with this member) and its ordering key; raises as decoding does."""
        handler = self.handler
        payload = handler.decode(env.body)
        key = handler.key(payload) if handler.key is not None else env.key
        return Routed(self.member, payload), key


class Routes:
    """The handlers sharing one group, and which one takes each message."""

    def __init__(self, members: Sequence[_Member]) -> None:
        routes = [Route(m) for m in members]
        self.filtered = [(r.handler.filter, r) for r in routes if r.handler.filter is not None]
        self.default = next((r for r in routes if r.handler.filter is None), None)

    def pick(self, env: Envelope) -> Route | None:
        """The route taking ``env`` (None: no handler of the service wants it); raises if a predicate does."""
        for f, route in self.filtered:
            if f.matches(env):
                return route
        return self.default

    def pick_all(
        self, admission: Any, ledger: Ledger, runnable: list[Delivery], poison: list[tuple[Delivery, dict[str, str]]]
    ) -> tuple[list[Delivery], dict[int, Route]]:
        """The deliveries some handler takes and their routes (by ``id``); the unwanted ones are
        queued for acknowledgement, those whose filter raised added to ``poison``."""
        kept: list[Delivery] = []
        routes: dict[int, Route] = {}
        unwanted: list[Delivery] = []
        for d in runnable:
            assert d.envelope is not None
            try:
                route = self.pick(d.envelope)
            except Exception as exc:  # a filter predicate raised: keep the message, say why
                reason = f"a filter predicate raised {type(exc).__name__}: {exc}"
                poison.append((d, poison_reason(admission.handler, d, reason)))
                continue
            if route is None:
                unwanted.append(d)
            else:
                kept.append(d)
                routes[id(d)] = route
        if unwanted:
            admission.wiring.stats.unwanted += len(unwanted)
            ledger.queue_acks(unwanted)  # no handler of the service wants them: settled, not dead
            if admission.debug:
                for d in unwanted:
                    admission.settle.log_settled(d, "unwanted")
        return kept, routes
