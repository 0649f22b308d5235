"""The operators' service layer on a real Valkey: dead-letter pages, frozen sets, classes, redaction.

What the dashboard and ``framework status`` rely on: pages newest first across partitions with
no entry lost or repeated between cursors; a page's ``upto`` keeping later arrivals out of
paging and of bulk actions; a purge by refs removing exactly those; secrets redacted.
"""

from __future__ import annotations

import orjson
import pytest

from broker import DestinationSpec, Envelope
from broker.redis import RedisBroker
from framework.operations import DeadLetterFilter, classes, frozen_refs, page, purge, redact_body, redrive
from framework.operations.dead_letters import get_dead_letter, reason_class

pytestmark = pytest.mark.anyio


async def _dead(broker: RedisBroker, n: int, *, start: int = 0, why: str = "order {i} not found") -> list[str]:
    """Dead-letter ``n`` messages of ``ops.charges`` (3 partitions, group ``billing``); their message ids."""
    spec = DestinationSpec(name="ops.charges", kind="command", partitions=3)
    views = await broker.subscribe(spec, "billing")
    envs = [
        Envelope("ops.charges", "command", "Charge", orjson.dumps({"i": i, "password": "hunter2"}), key=f"k{i}")
        for i in range(start, start + n)
    ]
    await broker.publish(envs)
    for view in views:
        for d in await broker.read(view, "c", 1000, 0):
            i = orjson.loads(d.envelope.body)["i"] if d.envelope else -1
            error = "ValueError" if i % 2 else "KeyError"
            reason = {
                "dlq-reason": f"handler failed: {error}: " + why.format(i=i),
                "dlq-error-type": f"builtins.{error}",
                "dlq-handler": "billing.charge",
            }
            assert await broker.dead_letter(d, reason)
    return [e.id for e in envs]


async def test_cursor_pages_cover_every_partition_once_newest_first(broker: RedisBroker) -> None:
    ids = await _dead(broker, 45)
    seen: list[str] = []
    cursor = upto = None
    pages = 0
    while True:
        p = await page(broker, DeadLetterFilter(), cursor=cursor, upto=upto, limit=10)
        seen += [d.ref for d in p.items]
        keys = [tuple(int(x) for x in d.entry_id.split("-")) for d in p.items]
        assert keys == sorted(keys, reverse=True)  # newest first, across the three partition DLQs
        pages += 1
        if p.next_cursor is None:
            break
        cursor, upto = p.next_cursor, p.upto
    assert pages == 5 and len(seen) == 45 == len(set(seen))
    got = {(await get_dead_letter(broker, ref)).message_id for ref in seen}
    assert got == set(ids)


async def test_upto_keeps_later_arrivals_out_of_pages_and_bulk_actions(broker: RedisBroker) -> None:
    await _dead(broker, 6)
    first = await page(broker, DeadLetterFilter(), limit=4)
    assert first.upto is not None and first.next_cursor is not None
    late = set(await _dead(broker, 5, start=100))  # failed after the page loaded
    rest = await page(broker, DeadLetterFilter(), cursor=first.next_cursor, upto=first.upto, limit=50)
    assert len(first.items) + len(rest.items) == 6
    assert not {d.message_id for d in rest.items} & late
    frozen = await frozen_refs(broker, DeadLetterFilter(), first.upto)
    assert len(frozen) == 6
    result = await purge(broker, frozen, who="test")
    assert result.done == 6
    left = await page(broker, DeadLetterFilter(), limit=50)
    assert {d.message_id for d in left.items} == late  # exactly the later ones are left


async def test_filters_classes_and_redrive_by_ref(broker: RedisBroker) -> None:
    await _dead(broker, 10)
    f = DeadLetterFilter(error_type="builtins.KeyError")
    found = await page(broker, f, limit=50)
    assert len(found.items) == 5 and all("KeyError" in d.reason for d in found.items)
    texts = await page(broker, DeadLetterFilter(text="ORDER 7 NOT"), limit=50)
    assert [orjson.loads(d.body)["i"] for d in texts.items] == [7]
    kinds, looked = await classes(broker, DeadLetterFilter())
    assert looked == 10
    assert sorted((c.error_type, c.reason, c.count) for c in kinds) == [
        ("builtins.KeyError", "handler failed: KeyError: order # not found", 5),
        ("builtins.ValueError", "handler failed: ValueError: order # not found", 5),
    ]
    one = kinds[0]
    same = await page(broker, DeadLetterFilter(reason=one.reason, handler="billing.charge"), limit=50)
    assert len(same.items) == one.count
    ref = found.items[0].ref
    result = await redrive(broker, [ref, ref], who="test")
    assert (result.done, result.gone) == (1, 1)  # the second time it was gone: counted, not replaced
    with pytest.raises(KeyError):
        await get_dead_letter(broker, ref)


def test_secret_fields_are_redacted_at_any_depth() -> None:
    body = orjson.dumps({"order": {"card_number": "4111", "items": [{"API-Key": "k", "sku": "A"}]}, "Password": "p"})
    shown = redact_body(body)
    assert "4111" not in shown and '"k"' not in shown and '"p"' not in shown
    assert shown.count("[redacted]") == 3 and '"sku": "A"' in shown
    assert redact_body(b"plain text") == "plain text"
    assert reason_class("order 12 of 0x1f, id 01a217a7-d80a-7fa0-ba01-9c6209e1fa25") == "order # of #, id #"


async def test_time_ranges_select_by_when_the_letter_died(broker: RedisBroker) -> None:
    from broker import now_ms

    before = now_ms() - 1
    await _dead(broker, 4)
    after = now_ms() + 1
    assert len((await page(broker, DeadLetterFilter(since_ms=before), limit=50)).items) == 4
    assert (await page(broker, DeadLetterFilter(since_ms=after), limit=50)).items == []
    assert (await page(broker, DeadLetterFilter(until_ms=before - 1), limit=50)).items == []
    assert len((await page(broker, DeadLetterFilter(since_ms=before, until_ms=after), limit=50)).items) == 4


async def test_pages_without_the_pages_capability_read_whole_dead_letter_queues() -> None:
    """The memory transport has no ``dead_letter_pages``: the same pages, read the slow way."""
    from broker import new_id
    from broker.memory import connect_memory, reset

    name = f"memory://ops-{new_id()}"
    memory = connect_memory(name, namespace="t")
    try:
        ids = await _dead(memory, 12)  # type: ignore[arg-type]
        first = await page(memory, DeadLetterFilter(), limit=5)
        rest = await page(memory, DeadLetterFilter(), cursor=first.next_cursor, upto=first.upto, limit=50)
        assert {d.message_id for d in first.items + rest.items} == set(ids) and len(first.items) == 5
        assert rest.next_cursor is None
    finally:
        await memory.close()
        reset(name)
