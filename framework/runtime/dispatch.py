"""Dispatch: one group, several handlers; each message goes to the one handler whose filter takes it.

Handlers of one service on one topic (named, or matched by a pattern) share its consumer group and
its one reader (the lead consumer's fetcher). The admit stage of the lead hands each fetched
delivery here *before its body is decoded*: the first filtered handler whose filter matches the
envelope's type and headers takes it, else the default handler (the one without a filter), else
nobody: the message is acknowledged at once and counted (``stats.unwanted``), never dead-lettered.
Each handler then admits, decodes, runs and settles its own messages with its own stages, on the
lead's ledger (one ack stream per partition).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from broker import Delivery
from framework.dead_letters.reasons import poison_reason
from framework.handlers import Handler
from framework.runtime.ledger import Ledger

__all__ = ["Routes"]


class _Admits(Protocol):
    handler: Handler

    async def admit_runnable(
        self, ledger: Ledger, runnable: list[Delivery], poison: list[tuple[Delivery, dict[str, str]]], channel: Any
    ) -> None: ...


class Routes:
    """The handlers (their admit stages) sharing one group, and which one takes each message."""

    def __init__(self, members: Sequence[_Admits]) -> None:
        self.members = list(members)
        self.filtered = [(m.handler.filter, m) for m in self.members if m.handler.filter is not None]
        self.default = next((m for m in self.members if m.handler.filter is None), None)

    def pick(self, d: Delivery) -> _Admits | None:
        """The member taking ``d`` (None: no handler of the service wants it); raises if a predicate does."""
        env = d.envelope
        assert env is not None
        for f, member in self.filtered:
            if f.matches(env):
                return member
        return self.default

    async def dispatch(
        self,
        lead: Any,
        ledger: Ledger,
        runnable: list[Delivery],
        poison: list[tuple[Delivery, dict[str, str]]],
        channel: Any,
    ) -> None:
        """Split the lead's held ``runnable`` deliveries among the members; ack the unwanted ones now."""
        chosen: dict[int, list[Delivery]] = {}
        unwanted: list[Delivery] = []
        for d in runnable:
            try:
                member = self.pick(d)
            except Exception as exc:  # a filter predicate raised: keep the message, say whose
                reason = f"a filter predicate raised {type(exc).__name__}: {exc}"
                poison.append((d, poison_reason(lead.handler, d, reason)))
                continue
            if member is None:
                unwanted.append(d)
            else:
                chosen.setdefault(id(member), []).append(d)
        if unwanted:
            lead.wiring.stats.unwanted += len(unwanted)
            ledger.queue_acks(unwanted)  # no handler of the service wants them: settled, not dead
            if lead.debug:
                for d in unwanted:
                    lead.settle.log_settled(d, "unwanted")
        await lead.admit_runnable(ledger, chosen.pop(id(lead), []), poison, channel)  # the lead is a member
        for member in self.members:
            mine = chosen.get(id(member))
            if mine and member is not lead:
                await member.admit_runnable(ledger, mine, [], channel)
