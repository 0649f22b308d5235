"""Partition ownership across processes: leases, fencing, take-over, and order per key under faults.

Broker level: a stale owner (its lease taken over) gets every ack and settle refused by the
fencing check, changing nothing. End to end: real worker processes (tests/apps/ownerapp.py) over
an 8-partition queue, SIGKILLed and restarted at random, one SIGSTOPped past its lease and resumed;
the handler applies (key, seq) through its Redis effects (fenced, atomic with the ack) and checks
that no key runs in two instances at once.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import time

import anyio
import orjson
import pytest
import redis

from broker import ConfigurationError, DestinationSpec, Envelope, LeaseLost, RedisBroker
from framework import Queue, SyncClient
from framework.runtime.ownership import assign
from tests.conftest import run_cli
from tests.workers import Workers, wait_for

# -- assignment -------------------------------------------------------------------------------------


def test_assignment_is_fair_deterministic_and_moves_little() -> None:
    three = assign(8, ["c", "a", "b"])
    assert three == assign(8, ["a", "b", "c"])
    loads = sorted(list(three.values()).count(m) for m in "abc")
    assert loads == [2, 3, 3]
    four = assign(8, ["a", "b", "c", "d"])
    assert sorted(list(four.values()).count(m) for m in "abcd") == [2, 2, 2, 2]
    assert assign(8, []) == {}
    assert set(assign(8, ["solo"]).values()) == {"solo"}


# -- broker level: leases and fencing ------------------------------------------------------------------


@pytest.mark.anyio
async def test_leases_expire_and_every_acquisition_raises_the_token(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("own.lease", "command", partitions=2))
    view = (await broker.subscribe(spec, "g"))[0]
    first = await broker.acquire_lease(view, "a", 300)
    assert first == 1
    assert await broker.acquire_lease(view, "b", 300) == 0  # live lease held by a
    assert await broker.renew_leases([(view, first)], "a", 300) == [True]
    await anyio.sleep(0.4)
    second = await broker.acquire_lease(view, "b", 300)
    assert second == 2
    assert await broker.renew_leases([(view, first)], "a", 300) == [False]  # taken over
    assert not await broker.release_lease(view, "a", first)
    state = await broker.lease_state(view)
    assert (state.owner, state.token, state.live) == ("b", 2, True)
    assert await broker.release_lease(view, "b", second)
    assert (await broker.lease_state(view)).owner == ""
    assert await broker.acquire_lease(view, "a", 300) == 3  # tokens never go back
    assert await broker.heartbeat("own.lease", "g", "b", 300) == ["b"]
    assert await broker.heartbeat("own.lease", "g", "a", 300) == ["a", "b"]
    assert await broker.heartbeat("own.lease", "g", "b", 300, leave=True) == ["a"]


@pytest.mark.anyio
async def test_a_stale_owner_gets_every_ack_and_settle_refused(broker: RedisBroker) -> None:
    spec = await broker.declare(DestinationSpec("own.fenced", "command", partitions=2))
    views = await broker.subscribe(spec, "g")
    await broker.publish(
        [
            Envelope(destination="own.fenced", kind="command", type="T", key="k", body=orjson.dumps({"n": n}))
            for n in range(4)
        ]
    )
    view = [v for v in views if await broker.redis.xlen(v.stream) == 4][0]  # noqa: RUF015 - awaits inside
    stale = await broker.acquire_lease(view, "old", 200)
    deliveries = await broker.read(view, "old", 10, 0)
    assert len(deliveries) == 4
    await anyio.sleep(0.3)  # the old owner pauses past its lease; a new owner takes over
    current = await broker.acquire_lease(view, "new", 5000)
    assert current > stale
    d0, d1, d2, d3 = deliveries
    effects_key = f"{broker.namespace}:own:effects"
    refused = 0
    for call in (
        lambda: broker.ack(view, [d0], inbox=True, token=stale),
        lambda: broker.retry_later(d1, 0, token=stale),
        lambda: broker.dead_letter(d2, {"dlq-reason": "x"}, token=stale),
        lambda: broker.commit_effects(d3, [["SET", effects_key, "1"]], [effects_key], token=stale),
    ):
        with pytest.raises(LeaseLost):
            await call()
        refused += 1
    assert refused == 4
    # nothing changed: every entry still pending, no retry parked, no dead letter, no effect
    assert len(await broker.redis.execute_command("XPENDING", view.stream, "g", "-", "+", 10)) == 4
    assert await broker.redis.zcard(view.keys.delayed) == 0
    assert await broker.redis.xlen(view.keys.dlq) == 0
    assert await broker.redis.get(effects_key) is None
    # the new owner takes the entries over and settles them with its token
    cursors: dict[str, str] = {}
    taken = await broker.take_over(view, "new", 10, cursors)
    while not broker.taken_over(cursors):
        taken += await broker.take_over(view, "new", 10, cursors)
    assert [d.entry_id for d in taken] == [d.entry_id for d in deliveries]
    assert all(d.delivery_count == 2 for d in taken)
    assert await broker.ack(view, taken[:1], token=current) == 1
    assert await broker.retry_later(taken[1], 0, token=current)
    assert await broker.dead_letter(taken[2], {"dlq-reason": "x"}, token=current) is not None
    assert await broker.commit_effects(taken[3], [["SET", effects_key, "1"]], [effects_key], token=current)
    assert await broker.redis.get(effects_key) == b"1"
    # without a token (an unowned destination) nothing is checked
    await broker.publish([Envelope(destination="own.fenced", kind="command", type="T", key="k", body=b"{}")])
    [fresh] = await broker.read(view, "anyone", 10, 0)
    assert await broker.ack(view, [fresh]) == 1


@pytest.mark.anyio
async def test_changing_the_partition_count_of_a_live_destination_is_refused(broker: RedisBroker) -> None:
    """Keys would move between partitions and reorder: refused, with what to do instead."""
    await broker.declare(DestinationSpec("own.resized", "command", partitions=2))
    with pytest.raises(ConfigurationError, match=r"already has 2 partition.*cannot be declared with 8"):
        await broker.declare(DestinationSpec("own.resized", "command", partitions=8))
    with pytest.raises(ConfigurationError, match="use a new destination name"):
        await broker.subscribe(DestinationSpec("own.resized", "command", partitions=8), "g")


# -- end to end: worker processes under faults -------------------------------------------------------

KEYS = 100
LEASE_TTL = "2"  # seconds: kills move partitions within about this plus a heartbeat
NAMES = ("w0", "w1", "w2")
SEQ = Queue("owner.seq", partitions=8)  # as declared by tests/apps/ownerapp.py


def _partition_owners(r: redis.Redis, namespace: str) -> dict[int, str]:
    out = {}
    for p in range(8):
        owner = r.hget(f"{namespace}:{{owner.seq:{p}}}:g:owner:lease", "owner")
        out[p] = owner.decode() if owner else ""
    return out


def _last_runner(r: redis.Redis, namespace: str) -> dict[int, tuple[str, int]]:
    out = {}
    for p, v in r.hgetall(f"{namespace}:t:last").items():
        pid, at = v.decode().split(":")
        out[int(p)] = (pid, int(at))
    return out


def _settled(r: redis.Redis, namespace: str) -> bool:
    for p in range(8):
        stream = f"{namespace}:{{owner.seq:{p}}}"
        for s in (stream, f"{stream}:g:owner:redeliver"):
            for g in r.xinfo_groups(s):
                if g["pending"] or g.get("lag"):
                    return False
        if r.zcard(f"{stream}:g:owner:delayed"):
            return False
    return True


@pytest.mark.slow
@pytest.mark.fault
def test_keys_keep_their_order_across_workers_killed_restarted_and_paused(
    workers: Workers, redis_url: str, namespace: str
) -> None:
    """3 workers, 8 partitions, 100 keys, 6,000 messages sent over about 20 s while workers are
    SIGKILLed and restarted at random and one is SIGSTOPped past its lease, then resumed."""
    rng = random.Random(12)
    r = redis.Redis.from_url(redis_url)
    opts = ("--prefetch", "50", "--concurrency", "16", "--shutdown-timeout", "5")
    env = {"FRAMEWORK_LEASE_TTL": LEASE_TTL, "FRAMEWORK_OWNERSHIP": "partitioned"}
    procs = {name: workers.start("ownerapp:owner", name, *opts, **env) for name in NAMES}
    pids = [(name, p.pid) for name, p in procs.items()]  # every process run, for the failure messages
    seq = dict.fromkeys(range(KEYS), 0)
    sent = 0
    moves: list[float] = []
    events = {8: "kill", 20: "kill", 32: "stop", 46: "kill"}
    paused: tuple[str, float] | None = None
    stopped = ("", 0.0)
    resumed_at = 0.0  # wall time of the SIGCONT
    paused_pid = ""

    def send(client: SyncClient, n: int) -> None:
        nonlocal sent
        batch = []
        for _ in range(n):
            k = rng.randrange(KEYS)
            batch.append({"k": f"k{k}", "s": seq[k]})
            seq[k] += 1
        client.send_many(SEQ, batch, key=lambda m: m["k"])
        sent += n

    with SyncClient(redis_url, namespace=namespace) as client:
        wait_for(lambda: len(set(_partition_owners(r, namespace).values()) - {""}) == 3, 30, "3 owners")
        for rnd in range(60):  # 100 messages a round, a round every ~0.33 s, plus those sent after kills
            send(client, 100)
            action = events.get(rnd)
            if action == "kill":
                owners = _partition_owners(r, namespace)
                name = rng.choice([n for n in NAMES if paused is None or n != paused[0]])
                theirs = [p for p, o in owners.items() if o == name]  # (none when it has just restarted)
                pid = str(procs[name].pid)
                procs[name].send_signal(signal.SIGKILL)
                procs[name].wait()
                killed_at = time.time()

                def moved(theirs: list[int] = theirs, pid: str = pid, killed_at: float = killed_at) -> bool:
                    last = _last_runner(r, namespace)
                    return all(p in last and last[p][0] != pid and last[p][1] / 1000 > killed_at for p in theirs)

                # keep sending while waiting: a moved partition shows up as applications by another pid
                deadline = time.monotonic() + 30
                while not moved() and time.monotonic() < deadline:
                    send(client, 20)
                    time.sleep(0.05)
                assert moved(), f"partitions {theirs} of killed {name} did not run elsewhere within 30 s"
                if theirs:
                    moves.append(time.time() - killed_at)
                procs[name] = workers.start("ownerapp:owner", name, *opts, **env)
                pids.append((name, procs[name].pid))
            elif action == "stop":
                name = rng.choice(NAMES)
                procs[name].send_signal(signal.SIGSTOP)
                paused = stopped = (name, time.monotonic())
                paused_pid = str(procs[name].pid)
            if paused is not None and time.monotonic() - paused[1] > float(LEASE_TTL) + 3:
                procs[paused[0]].send_signal(signal.SIGCONT)
                resumed_at = time.time()
                # resumed: it finds its partitions taken over, and drops their work (fenced meanwhile)
                resumed = paused[0]
                wait_for(lambda n=resumed: "lost ownership of a partition" in workers.log(n), 15, "the resumed loss")
                paused = None
            time.sleep(0.33)
    if paused is not None:
        procs[paused[0]].send_signal(signal.SIGCONT)

    def all_applied() -> bool:
        return sum(r.llen(f"{namespace}:t:applied:k{k}") for k in range(KEYS)) >= sent

    wait_for(all_applied, 90, f"all {sent} messages to be applied")
    wait_for(lambda: _settled(r, namespace), 30, "lag and pending to return to zero")
    inversions, missing, duplicates = 0, 0, 0
    examples = []
    for k in range(KEYS):
        raw = [x.decode() for x in r.lrange(f"{namespace}:t:applied:k{k}", 0, -1)]
        applied = [int(x.split("@")[0]) for x in raw]
        bad = [i for i, (a, b) in enumerate(itertools.pairwise(applied)) if b <= a]
        inversions += len(bad)
        examples += [f"k{k}: {raw[max(i - 3, 0) : i + 4]}" for i in bad[:2]]
        missing += len(set(range(seq[k])) - set(applied))
        duplicates += len(applied) - len(set(applied))
    overlaps = [x.decode() for x in r.lrange(f"{namespace}:t:overlaps", 0, -1)]
    print(f"\nownership: {sent} messages, kill -> partitions running elsewhere: {[round(m, 2) for m in moves]} s")
    assert (inversions, missing, duplicates) == (0, 0, 0), (examples, pids, stopped)
    # Two instances ran one key at once only as docs/partition-ownership.md allows: a handler the
    # paused process had already entered when it froze went on when it resumed (its effects are
    # fenced: checked above). A handler entered after the resume, or any other pair, is a defect.
    unexplained = []
    for entry in overlaps:
        _k, _s, _p, pid_a, at_a, pid_b, at_b, _at = entry.split(":")
        runs = {pid_a: int(at_a), pid_b: int(at_b)}
        if paused_pid not in runs or runs[paused_pid] / 1000 >= resumed_at:
            unexplained.append(entry)
    assert unexplained == [], (unexplained, pids, stopped, resumed_at)
    assert stopped[0] and "lost ownership of a partition" in workers.log(stopped[0])
    logs = "".join(workers.log(n) for n in NAMES)
    assert "took over pending entries of an owned partition" in logs
    # framework status: an owner per partition, with lease age, token and lag (table and --json)
    status = run_cli("status", "--json", "owner.seq", env=workers.env)
    assert status.returncode == 0, status.stderr
    [dest] = json.loads(status.stdout)
    leases = [g["lease"] for p in dest["per_partition"] for g in p["groups"]]
    assert len(leases) == 8 and all(lease["owner"] in NAMES and lease["token"] >= 1 for lease in leases), leases
    assert sum(g["lag"] + g["pending"] for p in dest["per_partition"] for g in p["groups"]) == 0
    table = run_cli("status", "owner.seq", env=workers.env)
    assert "partition owners" in table.stdout and any(n in table.stdout for n in NAMES), table.stdout
    for name in NAMES:
        procs[name].send_signal(signal.SIGTERM)
    for name in NAMES:
        assert procs[name].wait(timeout=30) == 0
    assert all(o == "" for o in _partition_owners(r, namespace).values())  # released on SIGTERM
