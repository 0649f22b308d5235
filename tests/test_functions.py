"""The Lua scripts as server functions (FCALL) where the server has them, EVALSHA elsewhere: every
script loads as a library, a lost library is loaded again, and one call's state never leaks into
the next (a library's state outlives its calls)."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aredis

from broker import DestinationSpec, Envelope, connect, now_ms
from broker.protocol import GroupPartition
from broker.redis import RedisBroker
from broker.redis.scripts import Script, functions_usable, load_scripts
from tests.test_inbox_memory import claim, record, uuid7_at

pytestmark = pytest.mark.anyio

MODES = pytest.mark.parametrize("functions", ["1", "0"], ids=["fcall", "evalsha"])


@pytest.fixture
async def moded(redis_url: str, namespace: str, functions: str, monkeypatch: pytest.MonkeyPatch) -> RedisBroker:
    """A broker whose scripts run as functions ("1") or by EVALSHA ("0", $FRAMEWORK_REDIS_FUNCTIONS)."""
    monkeypatch.setenv("FRAMEWORK_REDIS_FUNCTIONS", functions)
    broker = await connect(redis_url, namespace=namespace)
    assert broker.scripts["ack"].functions is (functions == "1")
    yield broker  # type: ignore[misc]
    await broker.close()


async def test_every_script_loads_as_a_function_library(redis_url: str) -> None:
    client = aredis.Redis.from_url(redis_url)
    try:
        assert await functions_usable(client)  # the test servers (Valkey, Redis 7) have functions
        scripts = load_scripts(functions=True)
        for script in scripts.values():
            assert await client.execute_command(*script.load_command()) == script.function.encode()
        names = {s.function for s in scripts.values()}
        assert len(names) == len(scripts) and all(n.startswith("fw_") for n in names)
    finally:
        await client.aclose()


async def _recorded(
    broker: RedisBroker, name: str, first: int, second: int
) -> tuple[GroupPartition, list[str], list[str]]:
    """A group on a new queue, ``first`` ids recorded (one slot, a ms apart) and ``second`` more to record."""
    spec = await broker.declare(DestinationSpec(name, "command"))
    [view] = await broker.subscribe(spec, "g")
    t = now_ms() - 1_000
    ids = [uuid7_at(t + i) for i in range(first)], [uuid7_at(t + 200 + i) for i in range(second)]
    await record(broker, view, ids[0])
    return view, *ids


def _unloaded(script: Script) -> Script:
    """``script`` under a name (and SHA) the server has never seen: as a restart without
    persistence or a FLUSH leaves it, without flushing anything shared."""
    source = script.source + f"\n-- {uuid.uuid4().hex}\n"
    return Script(script.name, source, prelude=script.prelude, flags=script.flags, functions=script.functions)


@MODES
async def test_a_script_the_server_lost_is_loaded_again_and_the_call_runs_once(moded: RedisBroker) -> None:
    broker = moded
    view, first, second = await _recorded(broker, "fn.lost", 50, 50)
    for name in ("ack", "publish_batch"):
        broker.scripts[name] = _unloaded(broker.scripts[name])
    ack = broker.scripts["ack"]
    await record(broker, view, second)  # Script.__call__: not found, loaded, called again
    assert await claim(broker, view, [*first, *second, uuid7_at(now_ms())]) == [1] * 100 + [0]
    for body in (b"1", b"2"):  # the broker's own pipeline of script calls (RedisCore._run_quick)
        await broker.publish([Envelope(destination="fn.lost", kind="command", type="C", body=body)])
    assert await broker.redis.xlen(view.stream) == 2
    if ack.functions:
        listed = await broker.redis.execute_command("FUNCTION", "LIST", "LIBRARYNAME", ack.function)
        assert len(listed) == 1
        for name in ("ack", "publish_batch"):  # (these two are this test's own)
            await broker.redis.execute_command("FUNCTION", "DELETE", broker.scripts[name].function)
    else:
        assert await broker.redis.script_exists(ack.sha) == [True]


@MODES
async def test_one_calls_state_never_reaches_the_next(moded: RedisBroker) -> None:
    """The ack's library caches the slots it read (and queues ids) while it runs; the next call must
    read them again: here the group's inbox keys vanish between two acks of one slot, as keys
    expiring would, and the second ack's count starts from nothing."""
    broker = moded
    view, first, second = await _recorded(broker, "fn.state", 40, 30)
    keys = [k async for k in broker.redis.scan_iter(f"{view.keys.inbox}:*", count=1000)]
    slots = [k for k in keys if k.count(b":") == view.keys.inbox.count(":") + 1 and not k.endswith(b":info")]
    assert len(slots) == 1 and int(await broker.redis.hget(slots[0], "n")) == 40
    await broker.redis.delete(*[k for k in keys if not k.endswith(b":info")])
    await record(broker, view, second)
    assert int(await broker.redis.hget(slots[0], "n")) == 30  # (a cached slot would say 70)
    assert await claim(broker, view, [*second, first[0]]) == [1] * 30 + [0]
