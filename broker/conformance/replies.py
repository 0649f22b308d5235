"""Checks of reply destinations (the ``replies`` capability): stored while they exist, read once, expiring."""

from __future__ import annotations

import anyio

from broker import headers as h
from broker.capabilities import as_replies
from broker.conformance.features import BrokerFactory, Features
from broker.conformance.registry import check
from broker.conformance.support import Brokers, one_broker
from broker.envelope import COMMAND, Envelope
from broker.ids import new_id

__all__: list[str] = []


def _reply(name: str, request_id: str, body: bytes = b'{"ok": true}') -> Envelope:
    return Envelope(
        destination=name, kind=COMMAND, type="T", body=body, headers={h.IN_REPLY_TO: request_id, h.REPLY_STATUS: "ok"}
    )


@check(requires=("replies",))
async def check_replies_are_stored_read_once_in_order_and_survive_a_reconnect(
    make: BrokerFactory, features: Features
) -> None:
    """Replies to an open destination are read in order from the cursor, each once, by another connection too."""
    name = f"rq-{new_id()}"
    async with Brokers(make) as brokers:
        first = await brokers()
        store = as_replies(first)
        await store.open_replies(name, 30_000)
        assert await store.replies_exist(name)
        assert await store.send_replies([_reply(name, "a"), _reply(name, "b", b"[1]")]) == 2
        cursor, got = await store.read_replies(name, "0", block_ms=2000)
        if len(got) < 2:
            cursor, more = await store.read_replies(name, cursor, block_ms=2000)
            got += more
        assert [r.headers[h.IN_REPLY_TO] for r in got] == ["a", "b"] and got[1].body == b"[1]"
        assert got[0].destination == name and got[0].type == "T"
        assert await store.send_replies([_reply(name, "c")]) == 1
        if features.shared_state:  # the connection drops; a new one reads on from the cursor
            await anyio.sleep(0.1)
            await first.close()
            store = as_replies(await brokers())
        cursor, got = await store.read_replies(name, cursor, block_ms=2000)
        assert [r.headers[h.IN_REPLY_TO] for r in got] == ["c"]
        assert (await store.read_replies(name, cursor))[1] == []
        await store.close_replies(name)
        assert not await store.replies_exist(name)


@check(requires=("replies", "blocking_reads"))
async def check_a_blocked_reply_read_wakes_for_a_reply(make: BrokerFactory, features: Features) -> None:
    """A read waiting with ``block_ms`` returns a reply stored meanwhile, well before its block ends."""
    name = f"rq-{new_id()}"
    async with Brokers(make) as brokers:
        reader, writer = as_replies(await brokers()), as_replies(await brokers())
        await reader.open_replies(name, 30_000)
        got: list[Envelope] = []

        async def wait() -> None:
            got.extend((await reader.read_replies(name, "0", block_ms=4000))[1])

        with anyio.fail_after(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.sleep(0.2)
                await writer.send_replies([_reply(name, "x")])
        assert [r.headers[h.IN_REPLY_TO] for r in got] == ["x"]
        await reader.close_replies(name)


@check(requires=("replies",))
async def check_a_reply_destination_expires_and_takes_no_reply_after(make: BrokerFactory, features: Features) -> None:
    """An open destination not kept alive is gone after its time to live; a reply to it is dropped (0 stored)."""
    name = f"rq-{new_id()}"
    async with one_broker(make) as broker:
        store = as_replies(broker)
        assert await store.send_replies([_reply(name, "never-opened")]) == 0
        assert not await store.replies_exist(name)
        await store.open_replies(name, 300)
        await store.send_replies([_reply(name, "a")])
        await store.open_replies(name, 300)  # kept alive: the expiry moves, the replies stay
        # (not polled: asking whether it exists may count as a use that keeps it, as on RabbitMQ)
        await anyio.sleep(1.5)
        assert not await store.replies_exist(name), "the reply destination outlived its time to live"
        assert await store.send_replies([_reply(name, "late")]) == 0
        assert not await store.replies_exist(name)
        assert (await store.read_replies(name, "0"))[1] == []
