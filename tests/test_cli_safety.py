"""Operator safety of the ``framework`` command, against the real server and real worker processes.

``unsubscribe`` refuses while the group's consumers are alive and says what a re-created group
would replay; ``send``/``publish`` refuse unknown destinations; ``delete`` removes unused ones
without a trace; bad durations, log levels and handler modules fail in one line; bodies come from
stdin or a file; ``dlq redrive`` shows progress on a terminal only.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import redis

from broker import connect
from broker.topology import DestinationSpec
from framework.settings import RuntimeSettings


def cli(
    *args: str, env: dict[str, str], stdin: str | bytes = b"", cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m framework ARGS`` with stdin from a pipe: never a terminal, as in CI or cron."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    out = subprocess.run(
        [sys.executable, "-m", "framework", *args], env=env, input=data, capture_output=True, timeout=60, cwd=cwd
    )
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(), out.stderr.decode())


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def wait_for(predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def keys_of(r: redis.Redis, namespace: str, destination: str) -> list[bytes]:
    return sorted(k for k in r.scan_iter(match=f"{namespace}:*", count=1000) if f"{{{destination}:".encode() in k)


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def auditor(worker_env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A real worker consuming the topic ``ledger`` (2 partitions) as group ``auditor``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "framework", "run", "faultapp:auditor"],
        env=worker_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def groups_on(r: redis.Redis, stream: str) -> set[str]:
    try:
        return {g["name"].decode() for g in r.xinfo_groups(stream)}
    except redis.ResponseError:
        return set()


# -- unsubscribe ------------------------------------------------------------------------------------------


def test_unsubscribe_refuses_while_a_worker_consumes_and_then_says_what_replays(
    auditor: subprocess.Popen[bytes], worker_env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    streams = [f"{namespace}:{{ledger:{p}}}" for p in (0, 1)]
    wait_for(lambda: all("auditor" in groups_on(r, s) for s in streams))
    for seq in range(5):
        assert cli("publish", "ledger", json.dumps({"seq": seq}), "--key", f"k{seq}", env=worker_env).returncode == 0
    wait_for(lambda: sum(r.llen(f"{namespace}:test:order:k{seq}") for seq in range(5)) == 5)

    for extra in ([], ["--yes"]):  # confirming does not override the liveness check
        refused = cli("unsubscribe", "ledger", "--group", "auditor", *extra, env=worker_env)
        assert refused.returncode == 2, refused.stderr
        line = one_line(refused)
        assert "has live consumers" in line and "seen" in line and "pass --force" in line, line
    assert all("auditor" in groups_on(r, s) for s in streams)  # the group survives
    assert r.hexists(f"{namespace}:subscriptions", "ledger|auditor")

    auditor.send_signal(signal.SIGTERM)
    assert auditor.wait(timeout=30) == 0
    # stopped: its heartbeat says so at once (no --alive-within wait); only the confirmation is asked
    stopped = cli("unsubscribe", "ledger", "--group", "auditor", env=worker_env)
    assert stopped.returncode == 2 and "live consumers" not in stopped.stderr
    assert "without confirmation" in stopped.stderr, stopped.stderr

    unconfirmed = cli("unsubscribe", "ledger", "--group", "auditor", "--force", env=worker_env)
    assert unconfirmed.returncode == 2
    line = one_line(unconfirmed)
    assert line.startswith("framework unsubscribe: error: refusing to remove group 'auditor' from 'ledger'")
    assert line.endswith("pass --yes") and "all 5 retained entries from 20" in line, line
    assert all("auditor" in groups_on(r, s) for s in streams)

    done = cli("unsubscribe", "ledger", "--group", "auditor", "--force", "--yes", env=worker_env)
    assert done.returncode == 0, done.stderr
    assert "removed group 'auditor' from 'ledger'" in done.stdout
    assert "(start=earliest) it processes all 5 retained entries from 20" in done.stdout, done.stdout
    assert "5 of them it already received" in done.stdout and "effects apply twice" in done.stdout
    assert not any(groups_on(r, s) for s in streams)
    assert not r.hexists(f"{namespace}:subscriptions", "ledger|auditor")
    assert not [k for k in keys_of(r, namespace, "ledger") if b":g:auditor:" in k]


def test_unsubscribe_of_an_idle_group_asks_for_confirmation_on_a_terminal(
    worker_env: dict[str, str], r: redis.Redis, namespace: str, redis_url: str
) -> None:
    async def setup() -> None:
        broker = await connect(redis_url, namespace=namespace)
        try:
            await broker.subscribe(DestinationSpec(name="news", kind="event"), "reader", "latest")
        finally:
            await broker.close()

    anyio.run(setup)
    for n in range(3):
        assert cli("publish", "news", json.dumps({"n": n}), env=worker_env).returncode == 0
    stream = f"{namespace}:{{news:0}}"
    command = shlex.join([sys.executable, "-m", "framework", "unsubscribe", "news", "--group", "reader"])
    answered_no = subprocess.run(
        ["script", "-q", "-e", "-c", command, "/dev/null"],
        env=worker_env,
        input=b"n\n",
        capture_output=True,
        timeout=60,
    )
    text = answered_no.stdout.decode()
    assert "Remove group 'reader' from 'news'? [y/N]" in text, text
    assert "start=latest" in text and "the 3 entries it has not read yet are skipped" in text, text
    assert answered_no.returncode == 1 and "nothing removed" in text
    assert "reader" in groups_on(r, stream)
    answered_yes = subprocess.run(
        ["script", "-q", "-e", "-c", command, "/dev/null"], env=worker_env, input=b"y\n", capture_output=True
    )
    assert answered_yes.returncode == 0, answered_yes.stdout
    assert groups_on(r, stream) == set()


# -- send/publish to unknown destinations, and delete ------------------------------------------------------


def test_send_and_publish_refuse_unknown_destinations_unless_create(
    worker_env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    created = cli("send", "billing.refund", '{"order": 1}', "--create", env=worker_env)
    assert created.returncode == 0, created.stderr
    typo = cli("send", "billing.refnud", '{"order": 1}', env=worker_env)
    assert typo.returncode == 2
    assert one_line(typo) == (
        "framework send: error: unknown queue 'billing.refnud' (did you mean 'billing.refund'?); "
        "known queues: billing.refund; pass --create to declare it"
    )
    topic = cli("publish", "orders.placed", "{}", env=worker_env)
    assert topic.returncode == 2
    assert "unknown topic 'orders.placed'; known topics: none; pass --create" in one_line(topic)
    assert r.hkeys(f"{namespace}:destinations") == [b"billing.refund"]  # nothing created
    assert keys_of(r, namespace, "billing.refnud") == [] and keys_of(r, namespace, "orders.placed") == []
    again = cli("send", "billing.refund", '{"order": 2}', env=worker_env)  # known now: no --create needed
    assert again.returncode == 0, again.stderr
    assert r.xlen(f"{namespace}:{{billing.refund:0}}") == 2


def test_delete_refuses_a_destination_in_use_and_removes_an_unused_one_without_a_trace(
    worker_env: dict[str, str], r: redis.Redis, namespace: str, redis_url: str
) -> None:
    async def setup() -> None:
        broker = await connect(redis_url, namespace=namespace)
        try:
            await broker.declare(DestinationSpec(name="unused.q", kind="command", partitions=3))
            await broker.subscribe(DestinationSpec(name="used.t", kind="event", partitions=2), "g1")
        finally:
            await broker.close()

    anyio.run(setup)
    for n in range(4):
        args = ("publish", "used.t", json.dumps({"n": n}), "--key", str(n), "--idempotency-key", f"i{n}")
        assert cli(*args, env=worker_env).returncode == 0
    r.xadd(f"{namespace}:{{used.t:0}}:g:g1:dlq", {"id": "x", "type": "t", "body": "{}"})
    assert cli("send", "entries.q", "{}", "--create", env=worker_env).returncode == 0

    in_use = cli("delete", "used.t", env=worker_env)
    assert in_use.returncode == 2
    line = one_line(in_use)
    assert "topic 'used.t' is in use: 1 consumer group (g1), 4 stored entries and 1 dead letter" in line, line
    assert "unsubscribe its groups first" in line and "pass --force" in line
    with_entries = cli("delete", "entries.q", env=worker_env)
    assert with_entries.returncode == 2
    assert "0 consumer groups, 1 stored entry and 0 dead letters" in one_line(with_entries)
    unknown = cli("delete", "nope", env=worker_env)
    assert unknown.returncode == 2 and "unknown destination 'nope'; known destinations: " in one_line(unknown)
    assert r.xlen(f"{namespace}:{{used.t:0}}") + r.xlen(f"{namespace}:{{used.t:1}}") == 4  # nothing deleted

    unconfirmed = cli("delete", "unused.q", env=worker_env)
    assert unconfirmed.returncode == 2 and one_line(unconfirmed).endswith("pass --yes")
    assert r.hexists(f"{namespace}:destinations", "unused.q")
    gone = cli("delete", "unused.q", "--yes", env=worker_env)
    assert gone.returncode == 0 and "deleted queue 'unused.q'" in gone.stdout, gone.stderr
    assert not r.hexists(f"{namespace}:destinations", "unused.q")

    assert keys_of(r, namespace, "used.t")  # streams, idempotency keys, group keys
    forced = cli("delete", "used.t", "--force", "--yes", env=worker_env)
    assert forced.returncode == 0, forced.stderr
    assert keys_of(r, namespace, "used.t") == []
    assert not r.hexists(f"{namespace}:destinations", "used.t")
    assert not r.hexists(f"{namespace}:subscriptions", "used.t|g1")
    assert r.hkeys(f"{namespace}:destinations") == [b"entries.q"]
    # a deleted name is unknown again
    assert cli("publish", "used.t", "{}", env=worker_env).returncode == 2


# -- arguments: durations, log levels, handler modules, payloads ---------------------------------------------


@pytest.mark.parametrize(
    "option,value",
    [
        ("--visibility-timeout", "nan"),
        ("--visibility-timeout", "inf"),
        ("--shutdown-timeout", "NaN"),
        ("--inbox-window", "infm"),
        ("--inbox-window", "1e400"),
    ],
)
def test_non_finite_durations_are_refused_in_one_line(option: str, value: str, worker_env: dict[str, str]) -> None:
    out = cli("run", "faultapp:worker", option, value, env=worker_env)
    assert out.returncode == 2
    assert f"argument {option}: must be a finite number of seconds" in one_line(out)


def test_non_finite_rates_and_settings_are_refused(worker_env: dict[str, str]) -> None:
    out = cli("dlq", "redrive", "--all", "--rate", "inf", env=worker_env)
    assert out.returncode == 2 and "must be a finite number per second" in one_line(out)
    for name in ("visibility_timeout", "shutdown_timeout", "inbox_window", "ack_interval"):
        for value in (math.nan, math.inf):
            with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
                RuntimeSettings(**{name: value})


def test_unknown_log_levels_are_refused_in_one_line(worker_env: dict[str, str]) -> None:
    out = cli("status", "--log-level", "bogus", env=worker_env)
    assert out.returncode == 2
    assert "argument --log-level: expected one of debug, info, warning, error, got 'bogus'" in one_line(out)
    out = cli("status", env={**worker_env, "FRAMEWORK_LOG_LEVEL": "verbose"})
    assert out.returncode == 2
    assert one_line(out) == (
        "framework status: error: unknown FRAMEWORK_LOG_LEVEL 'verbose': use one of debug, info, warning, error"
    )
    assert cli("status", "--log-level", "WARNING", env=worker_env).returncode == 0


def test_a_broken_handler_module_is_reported_in_one_line_with_file_and_line(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    (tmp_path / "broken_syntax.py").write_text("from framework import Service\n\ndef f(:\n    pass\n")
    (tmp_path / "broken_import.py").write_text(
        "from framework import Service\nsvc = Service('s')\nLIMITS = {}\nLIMIT = LIMITS['max']\n"
    )
    out = cli("run", "broken_syntax:svc", env=worker_env, cwd=tmp_path)
    assert out.returncode == 2
    assert one_line(out).startswith(
        "framework run: error: cannot import 'broken_syntax': SyntaxError at broken_syntax.py:3: "
    )
    out = cli("run", "broken_import:svc", env=worker_env, cwd=tmp_path)
    assert out.returncode == 2
    assert one_line(out) == "framework run: error: cannot import 'broken_import': KeyError at broken_import.py:4: 'max'"


def test_payloads_from_stdin_and_from_a_file(
    tmp_path: Path, worker_env: dict[str, str], r: redis.Redis, namespace: str
) -> None:
    big = {"text": "x" * 300_000}  # larger than is comfortable on a command line
    sent = cli("send", "bodies.q", "-", "--create", env=worker_env, stdin=json.dumps(big))
    assert sent.returncode == 0, sent.stderr
    path = tmp_path / "body.json"
    path.write_text(json.dumps({"from": "file"}))
    assert cli("send", "bodies.q", f"@{path}", env=worker_env).returncode == 0
    rows = r.xrange(f"{namespace}:{{bodies.q:0}}")
    assert [json.loads(fields[b"body"]) for _, fields in rows] == [big, {"from": "file"}]

    missing = cli("send", "bodies.q", f"@{tmp_path / 'nope.json'}", env=worker_env)
    assert missing.returncode == 2 and f"payload file '{tmp_path / 'nope.json'}' does not exist" in one_line(missing)
    path.write_text("{not json")
    bad = cli("send", "bodies.q", f"@{path}", env=worker_env)
    assert bad.returncode == 2 and f"payload from file '{path}' is not valid JSON" in one_line(bad)
    bad = cli("send", "bodies.q", "-", env=worker_env, stdin="")
    assert bad.returncode == 2 and "payload from stdin is not valid JSON" in one_line(bad)
    assert r.xlen(f"{namespace}:{{bodies.q:0}}") == 2


# -- dlq redrive progress -----------------------------------------------------------------------------------


def _dead_letters(redis_url: str, namespace: str, r: redis.Redis, count: int) -> None:
    async def setup() -> None:
        broker = await connect(redis_url, namespace=namespace)
        try:
            await broker.subscribe(DestinationSpec(name="dead.q", kind="command"), "svc")
        finally:
            await broker.close()

    anyio.run(setup)
    for n in range(count):
        fields = {"id": f"m-{n}", "type": "t", "body": json.dumps({"n": n}), "dlq-reason": "test"}
        r.xadd(f"{namespace}:{{dead.q:0}}:g:svc:dlq", fields)


def test_redrive_prints_one_summary_line_without_a_terminal(
    worker_env: dict[str, str], r: redis.Redis, namespace: str, redis_url: str
) -> None:
    _dead_letters(redis_url, namespace, r, 40)
    out = cli("dlq", "redrive", "--all", env=worker_env)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no progress bar in CI logs
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("redrove 40 dead letter(s) to their group(s) in "), out.stdout
    assert r.xlen(f"{namespace}:{{dead.q:0}}:g:svc:redeliver") == 40


def test_redrive_shows_a_progress_bar_on_a_terminal(
    worker_env: dict[str, str], r: redis.Redis, namespace: str, redis_url: str
) -> None:
    _dead_letters(redis_url, namespace, r, 30)
    command = shlex.join([sys.executable, "-m", "framework", "dlq", "redrive", "--all"])
    env = {**worker_env, "COLUMNS": "100", "TERM": os.environ.get("TERM", "xterm")}
    out = subprocess.run(["script", "-q", "-e", "-c", command, "/dev/null"], env=env, capture_output=True, timeout=60)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text
    assert "redriving" in text and "30/30" in text, text
    assert "redrove 30 dead letter(s)" in text
    assert r.xlen(f"{namespace}:{{dead.q:0}}:g:svc:redeliver") == 30


def test_redrive_reports_progress_before_the_first_letter_and_after_each(
    r: redis.Redis, namespace: str, redis_url: str
) -> None:
    from framework.dead_letters import DeadLetters

    _dead_letters(redis_url, namespace, r, 3)
    calls: list[tuple[int, int]] = []

    async def redrive() -> int:
        broker = await connect(redis_url, namespace=namespace)
        try:
            return await DeadLetters(broker).redrive(everything=True, progress=lambda *p: calls.append(p))
        finally:
            await broker.close()

    assert anyio.run(redrive) == 3
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert r.xlen(f"{namespace}:{{dead.q:0}}:g:svc:redeliver") == 3
