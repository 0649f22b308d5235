"""The embedded Valkey: shared by processes, started once, data kept across restarts (AOF)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis

from broker.redis import EmbeddedServer


def _ensure_in_subprocess(data_dir: Path) -> str:
    code = f"from broker.redis import EmbeddedServer; print(EmbeddedServer({str(data_dir)!r}).ensure_running())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_processes_meet_on_one_server_and_data_survives_a_restart(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "valkey")
    try:
        urls = {_ensure_in_subprocess(tmp_path / "valkey") for _ in range(3)}
        assert len(urls) == 1  # started once, found by the others
        url = urls.pop()
        status = server.status()
        assert status.running and status.url == url
        r = redis.Redis.from_url(url)
        r.xadd("s", {"k": "v"})
        r.close()
        assert server.stop()
        assert not server.status().running
        url2 = server.ensure_running()
        r2 = redis.Redis.from_url(url2)
        assert r2.xlen("s") == 1  # from the AOF
        assert r2.config_get("appendonly")["appendonly"] == "yes"
        r2.close()
    finally:
        server.stop()


def test_a_crashed_server_is_started_again_on_its_data(tmp_path: Path) -> None:
    import os
    import signal

    server = EmbeddedServer(tmp_path)
    try:
        url = server.ensure_running()
        r = redis.Redis.from_url(url)
        r.set("k", "v")
        r.execute_command("BGREWRITEAOF")
        pid = server.status().pid
        assert pid is not None
        import time

        time.sleep(1.2)  # appendfsync everysec
        os.kill(pid, signal.SIGKILL)
        url2 = server.ensure_running()
        assert redis.Redis.from_url(url2).get("k") == b"v"
    finally:
        server.stop()
