"""Secrets and exposure: the embedded server's password and file modes, its per-user location,
no password in any log or output, and the exact ACL rules a worker, a producer and the operator need."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from broker.connect import redact
from broker.redis import EmbeddedServer, default_data_dir
from tests.conftest import run_cli

# The documented rules, read from docs/operations.md ("ACL rules"), with NS for the namespace: the
# test runs what the page tells users to set, so the two cannot drift apart.
_OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def _documented_rules(role: str) -> str:
    text = _OPERATIONS.read_text()
    found = re.search(rf"^    ACL SETUSER {role} on >PASSWORD resetkeys (.+?)\n\n", text, re.M | re.S)
    assert found is not None, f"no ACL rules for {role!r} in {_OPERATIONS}"
    return " ".join(found[1].split()).replace("~fw:*", "~NS:*")


WORKER_RULES = _documented_rules("worker")
PRODUCER_RULES = _documented_rules("producer")
OPERATOR_RULES = _documented_rules("operator")


def _private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode & 0o077 == 0, f"{path} is {oct(mode)}"


def _no_redis_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "REDIS_URL"}


# -- the embedded server --------------------------------------------------------------------------------


def test_the_embedded_server_has_a_password_and_private_files(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "valkey")
    try:
        url = server.ensure_running()
        password = urlsplit(url).password
        assert password and len(password) >= 32
        port = urlsplit(url).port
        with pytest.raises(redis.AuthenticationError):  # no password: refused
            redis.Redis(port=port).ping()
        r = redis.Redis.from_url(url)
        r.xadd("s", {"body": "secret"})
        assert r.config_get("protected-mode")["protected-mode"] == "yes"
        r.close()
        status = server.status()
        assert status.running and status.url == url and password not in (status.safe_url or "")
        assert password not in repr(status)
        time.sleep(1.2)  # appendfsync everysec: the AOF files exist
        files = [p for p in (tmp_path / "valkey").rglob("*")]
        assert any(p.name.endswith(".aof") for p in files)
        for p in [tmp_path / "valkey", *files]:
            _private(p)
    finally:
        server.stop()


def test_an_old_data_dir_gets_a_password_and_tight_modes_on_its_next_start(tmp_path: Path) -> None:
    data = tmp_path / "valkey"
    server = EmbeddedServer(data)
    try:
        url = server.ensure_running()
        r = redis.Redis.from_url(url)
        r.set("k", "v")
        r.config_set("requirepass", "")  # what an older version ran: no password ...
        r.close()
        (data / "password").unlink()
        data.chmod(0o755)  # ... and world-readable files
        (data / "valkey.log").chmod(0o644)
        (data / "appendonlydir").chmod(0o755)
        url2 = server.ensure_running()  # the running server is given a password, live
        assert urlsplit(url2).password and url2 != url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=urlsplit(url2).port).ping()
        assert redis.Redis.from_url(url2).get("k") == b"v"
        for p in (data, data / "valkey.log", data / "appendonlydir", data / "password"):
            _private(p)
        assert server.stop()
        assert server.ensure_running() == url2  # the password is kept across restarts
    finally:
        server.stop()


def test_the_default_location_is_per_user_never_the_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FRAMEWORK_HOME", str(tmp_path / "fh"))
    assert default_data_dir() == tmp_path / "fh" / "valkey"
    monkeypatch.delenv("FRAMEWORK_HOME")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_data_dir() == tmp_path / "state" / "framework" / "valkey"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_data_dir() == tmp_path / "home" / ".local" / "state" / "framework" / "valkey"
    monkeypatch.chdir(tmp_path)
    assert not default_data_dir().is_relative_to(Path.cwd() / ".framework")


def test_cli_commands_anywhere_meet_one_server_and_say_when_they_start_it(tmp_path: Path) -> None:
    env = _no_redis_env()
    env["FRAMEWORK_HOME"] = str(tmp_path / "home")
    env["FRAMEWORK_NAMESPACE"] = f"sec-{uuid.uuid4().hex[:8]}"
    elsewhere = tmp_path / "a" / "b"
    elsewhere.mkdir(parents=True)
    data = tmp_path / "home" / "valkey"
    try:
        first = run_cli("status", env=env)
        assert first.returncode == 0, first.stderr
        notes = [line for line in first.stderr.splitlines() if "started the embedded Valkey" in line]
        assert len(notes) == 1 and str(data) in notes[0] and "127.0.0.1:" in notes[0]
        password = (data / "password").read_text().strip()
        sent = subprocess.run(  # from a subdirectory: the same server, no second start
            [sys.executable, "-m", "framework", "status", "--json"],
            env={**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0 and "started" not in sent.stderr, sent.stderr
        assert not (elsewhere / ".framework").exists()
        status = run_cli("server", "status", env=env)
        assert status.returncode == 0
        st = EmbeddedServer(data).status()
        for shown in (str(data), f"pid: {st.pid}", f"port: {st.port}", "redis://:***@127.0.0.1:"):
            assert shown in status.stdout
        for out in (first, sent, status, run_cli("server", "start", env=env)):
            assert password not in out.stdout + out.stderr
    finally:
        run_cli("server", "stop", env=env)


# -- no password in logs, outputs or errors --------------------------------------------------------------


@pytest.fixture
def acl_user(redis_url: str, namespace: str) -> Iterator[callable]:  # type: ignore[valid-type]
    """Create ACL users (unique names, deleted afterwards) on the test server; returns their URLs."""
    admin = redis.Redis.from_url(redis_url)
    made: list[str] = []

    def make(rules: str) -> str:
        name = f"fwtest-{uuid.uuid4().hex[:10]}"
        password = f"pw-{uuid.uuid4().hex}"
        admin.execute_command(
            "ACL", "SETUSER", name, "reset", "on", f">{password}", *rules.replace("NS", namespace).split()
        )
        made.append(name)
        parts = urlsplit(redis_url)
        return f"redis://{name}:{password}@{parts.hostname}:{parts.port}{parts.path or '/0'}"

    yield make
    for name in made:
        admin.execute_command("ACL", "DELUSER", name)
    admin.close()


def _env(worker_env: dict[str, str], url: str) -> dict[str, str]:
    return {**worker_env, "REDIS_URL": url}


def _wait(predicate: callable, timeout: float = 30) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_exact_acl_rules_run_a_worker_a_producer_and_the_operator_cli_without_secrets_in_output(
    acl_user: callable,  # type: ignore[valid-type]
    worker_env: dict[str, str],
    redis_url: str,
    namespace: str,
) -> None:
    worker_url, producer_url, operator_url = acl_user(WORKER_RULES), acl_user(PRODUCER_RULES), acl_user(OPERATOR_RULES)
    passwords = [urlsplit(u).password for u in (worker_url, producer_url, operator_url)]
    outputs: list[str] = []
    for n in range(3):
        sent = run_cli("send", "--create", "poison.jobs", json.dumps({"n": n}), env=_env(worker_env, producer_url))
        outputs.append(sent.stdout + sent.stderr)
        assert sent.returncode == 0, sent.stderr
    worker = subprocess.Popen(
        # --ownership all: the one-partition queue is owned too, so the lease scripts run under the rules
        [sys.executable, "-m", "framework", "run", "faultapp:poison", "--visibility-timeout=2", "--ownership=all"],
        env=_env(worker_env, worker_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        r = redis.Redis.from_url(redis_url)
        dlq = f"{namespace}:{{poison.jobs:0}}:g:poison:dlq"
        _wait(lambda: r.xlen(dlq) >= 3)
        time.sleep(3)  # upkeep loops (claims, prunes, trims) run meanwhile, with the worker's rules
        worker.send_signal(signal.SIGTERM)
        log, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0, log
    finally:
        if worker.poll() is None:
            worker.kill()
    outputs.append(log)
    assert "runtime started" in log
    assert "permission" not in log.lower() and "NOPERM" not in log and "crashed" not in log, log
    status = run_cli("status", "--json", env=_env(worker_env, operator_url))
    assert status.returncode == 0, status.stderr
    listed = run_cli("dlq", "list", "--json", env=_env(worker_env, operator_url))
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 3, listed.stderr
    redriven = run_cli("dlq", "redrive", json.loads(listed.stdout)[0]["ref"], env=_env(worker_env, operator_url))
    assert redriven.returncode == 0, redriven.stderr
    wrong = urlsplit(operator_url)._replace(
        netloc=f"{urlsplit(operator_url).username}:wrong-{passwords[2]}@"
        f"{urlsplit(operator_url).hostname}:{urlsplit(operator_url).port}"
    )
    refused = run_cli("status", env=_env(worker_env, wrong.geturl()))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "refused the credentials" in refused.stderr
    outputs += [status.stdout + status.stderr, listed.stdout + listed.stderr, redriven.stdout + redriven.stderr]
    outputs.append(refused.stdout + refused.stderr)
    for out in outputs:
        for password in passwords:
            assert password not in out
    assert redact(worker_url) in log or "***" in log


def test_a_missing_permission_is_one_line_naming_the_command_and_the_key_pattern(
    acl_user: callable,  # type: ignore[valid-type]
    worker_env: dict[str, str],
    namespace: str,
) -> None:
    no_hgetall = acl_user(OPERATOR_RULES.replace(" +hgetall", ""))
    out = run_cli("status", env=_env(worker_env, no_hgetall))
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"framework status: permission denied: the broker user may not run HGETALL (keys ~{namespace}:*) (ACL); "
        "see docs/operations.md#acl-rules"
    )
    other_keys = acl_user(PRODUCER_RULES.replace("~NS:*", "~elsewhere:*"))
    out = run_cli("send", "--create", "q", "{}", env=_env(worker_env, other_keys))
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"may not access keys ~{namespace}:*" in out.stderr
    no_xadd = acl_user(PRODUCER_RULES.replace(" +xadd", ""))  # refused inside a Lua script
    out = run_cli("send", "--create", "q", "{}", env=_env(worker_env, no_xadd))
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "permission denied" in out.stderr and "(ACL)" in out.stderr


@pytest.mark.anyio
async def test_the_worker_rules_cover_every_inbox_layout(
    acl_user: callable,  # type: ignore[valid-type]
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flat and fine buckets use GET, APPEND and STRLEN inside the ack script: the documented worker
    rules must allow them, or a group that turns them on would fail every ack."""
    from broker import DestinationSpec, connect, now_ms
    from tests.test_inbox_memory import claim, record, uuid7_at

    monkeypatch.setenv("FRAMEWORK_INBOX_FLAT_BUCKETS", "1")
    monkeypatch.setenv("FRAMEWORK_INBOX_FINE_BUCKETS", "1")
    broker = await connect(acl_user(WORKER_RULES), namespace=namespace)
    try:
        assert broker.scripts["ack"].functions  # the documented rules let the scripts run as functions
        spec = await broker.declare(DestinationSpec("acl.flat", "command"))
        [view] = await broker.subscribe(spec, "g")
        t = now_ms() - 60_000
        burst = [uuid7_at(t + i // 400) for i in range(800)]  # 400 per ms: finer buckets
        await record(broker, view, burst)
        sparse = [uuid7_at(t + 5_000 + 400 * i) for i in range(12)]  # nearly empty buckets, one after another
        for message_id in sparse:
            await record(broker, view, [message_id])
        await record(broker, view, burst[:100])  # again: the bucket is read before anything is appended
        assert await claim(broker, view, [*burst, *sparse, uuid7_at(t + 1)]) == [1] * 812 + [0]
    finally:
        await broker.close()


@pytest.mark.anyio
async def test_worker_rules_without_functions_run_the_scripts_by_evalsha(
    acl_user: callable,  # type: ignore[valid-type]
    namespace: str,
) -> None:
    """A user granted only EVALSHA (the rules of releases before functions) still runs every script:
    the broker finds it may not FCALL or FUNCTION LOAD and falls back, with no error."""
    from broker import DestinationSpec, connect, now_ms
    from tests.test_inbox_memory import claim, record, uuid7_at

    for rules in (
        WORKER_RULES.replace(" +fcall +function|load", ""),
        WORKER_RULES.replace(" +function|load", ""),  # may call, may not load
    ):
        broker = await connect(acl_user(rules), namespace=namespace)
        try:
            assert not broker.scripts["ack"].functions
            spec = await broker.declare(DestinationSpec("acl.eval", "command"))
            [view] = await broker.subscribe(spec, "g")
            ids = [uuid7_at(now_ms() - 1_000 + i) for i in range(20)]
            await record(broker, view, ids[:10])
            assert await claim(broker, view, ids) == [1] * 10 + [0] * 10
        finally:
            await broker.close()
