"""``python -m benchmarks inbox-steps`` (issue #33) at a tiny size against the real server: each step
of a drain is timed on the server, the inbox's records show in the ack, and nothing is left behind."""

from __future__ import annotations

import anyio
import pytest
import redis

from benchmarks import inbox_steps
from framework.testing import unique_namespace


def test_each_step_is_timed_and_the_inbox_shows_in_the_ack(redis_url: str) -> None:
    namespace = unique_namespace("test-steps")
    on = anyio.run(inbox_steps.steps, redis_url, 2000, 500, True, namespace)
    off = anyio.run(inbox_steps.steps, redis_url, 2000, 500, False, namespace)
    assert list(on) == ["read", "claim", "ack"] and list(off) == ["read", "ack"]
    assert on["read"]["total"] > 0 and "xreadgroup" in on["read"]
    assert on["claim"]["total"] > 0 and on["claim"]["lua"] >= 0
    assert on["ack"]["total"] > off["ack"]["total"]  # recording the ids costs the server
    assert "xack" in on["ack"] and "xack" in off["ack"]
    client = redis.Redis.from_url(redis_url)
    try:
        assert not list(client.scan_iter(match=f"{namespace}*", count=1000))  # its namespace is deleted
    finally:
        client.close()


def test_a_bad_argument_gets_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        inbox_steps.main("redis://unused", ["--batch", "0"])
    assert exc.value.code == 2
    assert "--messages and --batch must be at least 1" in capsys.readouterr().err
