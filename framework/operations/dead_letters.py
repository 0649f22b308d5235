"""Dead letters for operators: filtered pages newest first, their classes, and frozen selections.

Every DLQ stream (one per destination, partition and group) is read newest first from a cursor
(the ``dead_letter_pages`` capability: XREVRANGE on Redis) and the streams are merged by entry id,
so the first page of a DLQ of 100,000 entries costs what a DLQ of 10 does. A filter on text, type
or handler reads on until the page is full or ``scan`` entries were looked at, and says where it
stopped (the next cursor). A page carries ``upto``, the newest entry id when the first page was
read: later pages and bulk actions over a filter never reach past it, so a bulk action works on
the set the operator saw, never on entries that arrived after the page loaded.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator

import attrs

from broker import Broker, GroupPartition
from broker.capabilities import as_dead_letter_admin
from broker.operators import DEAD_LETTER_PAGES, as_dead_letter_pages
from framework.dead_letters import DeadLetter

__all__ = [
    "DeadLetterClass",
    "DeadLetterFilter",
    "DeadLetterPage",
    "classes",
    "dead_letter_views",
    "get_dead_letter",
    "page",
    "refs_upto",
    "scan",
    "view_of_ref",
]

_FIRST_BATCH = 16  # entries read per stream by the first round trip (doubling after, up to _BATCH)
_BATCH = 1000
_NUMBERS = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F-]{27,}|0x[0-9a-fA-F]+|\d+(\.\d+)?")


def reason_class(reason: str) -> str:
    """A reason with its ids and numbers taken out, so failures of one kind fall in one class."""
    return _NUMBERS.sub("#", reason)[:200]


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@attrs.frozen
class DeadLetterFilter:
    """Which dead letters: by destination, group, handler, exception type, reason class, text, id, time.

    ``text`` matches (any case) the reason, exception type and message, message type and handler;
    ``ident`` a message id or a ref exactly; ``since_ms``/``until_ms`` bound the time it died.
    """

    destination: str | None = None
    group: str | None = None
    handler: str | None = None
    error_type: str | None = None
    reason: str | None = None  # a reason class (reason_class)
    text: str | None = None
    ident: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    def matches(self, d: DeadLetter) -> bool:
        """Whether ``d`` passes every condition set."""
        if self.handler and d.handler != self.handler:
            return False
        if self.error_type and d.error_type != self.error_type:
            return False
        if self.reason and reason_class(d.reason) != self.reason:
            return False
        if self.ident and self.ident not in (d.message_id, d.ref):
            return False
        if self.text:
            t = self.text.lower()
            fields = (d.reason, d.error_type, d.error_message, d.type, d.handler, d.message_id)
            if not any(t in f.lower() for f in fields):
                return False
        return True

    @property
    def narrows(self) -> bool:
        """Whether the filter looks inside entries (not only at which DLQ and when)."""
        return any((self.handler, self.error_type, self.reason, self.text, self.ident))


@attrs.frozen
class DeadLetterPage:
    """One page, newest first; ``next_cursor`` None on the last; ``upto`` the frozen bound."""

    items: list[DeadLetter]
    next_cursor: str | None
    upto: str | None
    scanned: int


@attrs.frozen
class DeadLetterClass:
    """Dead letters failing alike: same DLQ group, handler, exception type and reason class."""

    destination: str
    group: str
    handler: str
    error_type: str
    reason: str
    count: int


async def dead_letter_views(broker: Broker, f: DeadLetterFilter) -> list[GroupPartition]:
    """The DLQs (destination, partition, group) the filter's destination and group select."""
    views: list[GroupPartition] = []
    for dest, grp in await broker.list_subscriptions():
        if (f.group and grp != f.group) or (f.destination and dest != f.destination):
            continue
        spec = await broker.get_destination(dest)
        if spec is not None:
            views += [broker.group_partition(spec, p, grp) for p in range(spec.partitions)]
    return views


async def view_of_ref(broker: Broker, ref: str) -> tuple[GroupPartition, str]:
    """The DLQ and entry id a ref names (ValueError when it names none)."""
    parts = ref.split("/")
    if len(parts) < 4 or not parts[-3].isdigit():
        raise ValueError(f"not a dead-letter ref: {ref!r} (want destination/partition/group/entry-id)")
    entry_id, group, partition = parts[-1], parts[-2], int(parts[-3])
    destination = "/".join(parts[:-3])
    spec = await broker.get_destination(destination)
    if spec is None or partition >= spec.partitions:
        raise ValueError(f"no destination {destination!r} with partition {partition} (ref {ref!r})")
    return broker.group_partition(spec, partition, group), entry_id


async def get_dead_letter(broker: Broker, ref: str) -> DeadLetter:
    """The dead letter a ref names, read directly (KeyError when it is gone)."""
    view, entry_id = await view_of_ref(broker, ref)
    stream = _Stream(broker, view, entry_id, entry_id)
    await stream.fill()
    if not stream.buf or stream.buf[0][0] != entry_id:
        raise KeyError(f"no dead letter {ref!r} (redriven or purged meanwhile?)")
    return DeadLetter.from_entry(view, *stream.buf[0])


class _Stream:
    """One DLQ read newest first in batches, from an inclusive end bound."""

    def __init__(self, broker: Broker, view: GroupPartition, end: str, start: str) -> None:
        self.broker, self.view, self.end, self.start = broker, view, end, start
        self.buf: list[tuple[str, dict[bytes, bytes]]] = []
        self.done = False
        self.batch = _FIRST_BATCH  # a first page costs little whatever the DLQ holds; a long scan grows

    async def fill(self) -> None:
        if self.buf or self.done:
            return
        if DEAD_LETTER_PAGES in self.broker.capabilities:
            pages = as_dead_letter_pages(self.broker)
            rows = await pages.dead_letter_page(self.view, end=self.end, start=self.start, count=self.batch)
            self.done = len(rows) < self.batch
            self.batch = min(self.batch * 2, _BATCH)
        else:  # no pages: the whole DLQ once, bounded here
            rows = list(reversed(await as_dead_letter_admin(self.broker).dead_letter_entries(self.view)))
            hi = None if self.end == "+" else _key(self.end.lstrip("("))
            lo = None if self.start == "-" else _key(self.start)
            rows = [
                r
                for r in rows
                if (hi is None or _key(r[0]) < hi or (_key(r[0]) == hi and not self.end.startswith("(")))
                and (lo is None or _key(r[0]) >= lo)
            ]
            self.done = True
        if rows:
            self.end = "(" + rows[-1][0]
        self.buf = rows

    def head(self) -> tuple[tuple[int, int], str]:
        eid = self.buf[0][0]
        return _key(eid), f"{self.view.spec.name}/{self.view.partition}/{self.view.group}/{eid}"


def _cursor(key: tuple[int, int], ref: str) -> str:
    return f"{key[0]}-{key[1]} {ref}"


def _parse_cursor(cursor: str) -> tuple[tuple[int, int], str]:
    eid, _, ref = cursor.partition(" ")
    try:
        return _key(eid), ref
    except ValueError:
        raise ValueError(f"not a dead-letter cursor: {cursor!r} (use the links the page gives)") from None


async def scan(
    broker: Broker, f: DeadLetterFilter, *, cursor: str | None = None, upto: str | None = None
) -> AsyncIterator[tuple[DeadLetter | None, str, str]]:
    """Every dead letter the filter selects, newest first, no newer than ``upto``, after ``cursor``.

    Yields (the letter, or None when the filter refused it; its cursor; the ``upto`` in force:
    the newest entry id seen when none was given).
    """
    after = _parse_cursor(cursor) if cursor else None
    end = upto or "+"
    if after is not None:
        end = f"{after[0][0]}-{after[0][1]}" if upto is None or after[0] < _key(upto) else upto
    start = f"{f.since_ms}-0" if f.since_ms is not None else "-"
    if f.until_ms is not None and (end == "+" or _key(end) > (f.until_ms, 2**63)):
        end = f"{f.until_ms}-{2**63 - 1}"
    streams = [_Stream(broker, v, end, start) for v in await dead_letter_views(broker, f)]
    while True:
        for s in streams:
            await s.fill()
        live = [s for s in streams if s.buf]
        if not live:
            return
        best = max(live, key=lambda s: s.head())
        key, ref = best.head()
        entry_id, fields = best.buf.pop(0)
        if upto is None:
            upto = f"{key[0]}-{key[1]}"
        if after is not None and (key, ref) >= after:
            continue
        d = DeadLetter.from_entry(best.view, entry_id, fields)
        yield (d if f.matches(d) else None), _cursor(key, ref), upto


async def refs_upto(broker: Broker, f: DeadLetterFilter, upto: str) -> list[str]:
    """Refs of every dead letter the filter selects that is no newer than ``upto``.

    A filter that looks inside entries goes through :func:`scan`; one that selects only by DLQ
    and time reads entry ids and nothing else (a bulk action over 100,000 entries stays cheap).
    """
    if f.narrows:
        return [d.ref async for d, _, _ in scan(broker, f, upto=upto) if d is not None]
    start = f"{f.since_ms}-0" if f.since_ms is not None else "-"
    end = upto
    if f.until_ms is not None and _key(end) > (f.until_ms, 2**63):
        end = f"{f.until_ms}-{2**63 - 1}"
    refs: list[str] = []
    for view in await dead_letter_views(broker, f):
        stream = _Stream(broker, view, end, start)
        prefix = f"{view.spec.name}/{view.partition}/{view.group}/"
        while True:
            await stream.fill()
            if not stream.buf:
                break
            refs += [prefix + eid for eid, _ in stream.buf]
            stream.buf = []
    return refs


async def page(
    broker: Broker,
    f: DeadLetterFilter,
    *,
    cursor: str | None = None,
    upto: str | None = None,
    limit: int = 50,
    budget: int = 5000,
) -> DeadLetterPage:
    """Up to ``limit`` dead letters the filter selects, looking at ``budget`` entries at most."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit!r}")
    items: list[DeadLetter] = []
    scanned = 0
    last: str | None = None
    more = False
    async for d, at, bound in scan(broker, f, cursor=cursor, upto=upto):
        upto = bound
        if len(items) >= limit or scanned >= budget:
            more = True
            break
        scanned += 1
        last = at
        if d is not None:
            items.append(d)
    return DeadLetterPage(items, last if more else None, upto, scanned)


async def classes(
    broker: Broker, f: DeadLetterFilter, *, upto: str | None = None, budget: int = 2000
) -> tuple[list[DeadLetterClass], int]:
    """The classes of the newest ``budget`` dead letters the filter selects, largest first; and how
    many entries were looked at (the classes cover only those when the DLQs hold more)."""
    counts: Counter[tuple[str, str, str, str, str]] = Counter()
    seen = 0
    async for d, _, _ in scan(broker, f, upto=upto):
        seen += 1
        if d is not None:
            counts[(d.destination, d.group, d.handler, d.error_type, reason_class(d.reason))] += 1
        if seen >= budget:
            break
    out = [DeadLetterClass(*k, count=n) for k, n in counts.most_common()]
    return out, seen
