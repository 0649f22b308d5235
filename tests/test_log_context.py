"""Log lines written inside a handler carry the message's context and its span's trace id.

In process: the structlog processor and the stdlib ``logging.Filter`` of
:mod:`framework.observability.logcontext` add service, handler, destination, message id and
attempt to lines an async handler and a sync handler (in its worker thread) write, and the
trace and span ids of the CONSUMER span they run in; lines outside handlers get none of it.
For real: ``framework run --log-level debug`` (JSON) prints those fields on structlog and stdlib
lines alike, one line per message received and one per message settled, and bodies only with
``FRAMEWORK_LOG_BODIES=1``, redacted.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

from framework import Context, Queue, RetryPolicy, Service, SyncClient, enable_tracing
from framework.observability import disable_tracing
from framework.observability.logcontext import MessageContextFilter, add_message_context
from framework.testing import ServiceHarness
from tests.test_tracing import memory_exporter

pytestmark = pytest.mark.anyio


class Records(logging.Handler):
    """A stdlib handler that keeps its records (with the filter under test on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(MessageContextFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[tuple[structlog.testing.LogCapture, Records]]:
    """structlog with the context processor into a capture; a stdlib logger into :class:`Records`."""
    before = structlog.get_config()
    capture = structlog.testing.LogCapture()
    structlog.configure(processors=[add_message_context, capture], cache_logger_on_first_use=False)
    records = Records()
    std = logging.getLogger("tests.logcontext")
    std.addHandler(records)
    std.setLevel(logging.INFO)
    std.propagate = False
    try:
        yield capture, records
    finally:
        std.removeHandler(records)
        structlog.configure(**before)


CONTEXT = ("service", "handler", "destination", "message_id", "attempt")


@pytest.mark.parametrize("tracing", [True, False], ids=["tracing", "no-tracing"])
async def test_lines_inside_handlers_carry_the_message_and_its_span(
    redis_url: str, namespace: str, captured: tuple[structlog.testing.LogCapture, Records], tracing: bool
) -> None:
    capture, records = captured
    exporter = memory_exporter()
    exporter.clear()
    if tracing:
        enable_tracing(trace.get_tracer_provider())
    std = logging.getLogger("tests.logcontext")
    svc = Service("logging", retry=RetryPolicy(max_attempts=2, immediate=1))

    @svc.command(Queue("logs.async"))
    async def on_async(job: dict, ctx: Context) -> None:
        structlog.get_logger("app").info("inside", via="structlog", kind="async")
        std.info("inside", extra={"via": "stdlib", "kind": "async"})
        if ctx.attempt == 1:
            raise RuntimeError("again")  # the second attempt logs attempt=2

    @svc.command(Queue("logs.sync"))
    def on_sync(job: dict) -> None:  # a worker thread
        structlog.get_logger("app").info("inside", via="structlog", kind="sync")
        std.info("inside", extra={"via": "stdlib", "kind": "sync"})

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            first = await h.client.send("logs.async", {"n": 1})
            second = await h.client.send("logs.sync", {"n": 2})
            await h.run_until_idle()
        structlog.get_logger("app").info("outside")
        std.info("outside")
    finally:
        disable_tracing()

    lines = [
        *({**entry, "source": "structlog"} for entry in capture.entries if entry["event"] in ("inside", "outside")),
        *(
            {**vars(r), "event": r.getMessage(), "source": "stdlib"}
            for r in records.records
            if r.getMessage() in ("inside", "outside")
        ),
    ]
    inside = [line for line in lines if line["event"] == "inside"]
    assert len(inside) == 6  # async twice (two attempts), sync once; structlog and stdlib each
    spans: dict[tuple[str, int], ReadableSpan] = {}
    for span in exporter.get_finished_spans():
        attributes = dict(span.attributes or {})
        if span.name.startswith("process "):
            spans[(str(attributes["messaging.message.id"]), int(attributes["framework.attempt"]))] = span
    for line in inside:
        async_ = line["kind"] == "async"
        assert line["service"] == "logging"
        assert line["handler"] == ("on_async" if async_ else "on_sync")
        assert line["destination"] == ("logs.async" if async_ else "logs.sync")
        assert line["message_id"] == (first if async_ else second)
        if tracing:
            span = spans[(line["message_id"], line["attempt"])]
            assert line["trace_id"] == format(span.context.trace_id, "032x")
            assert line["span_id"] == format(span.context.span_id, "016x")
        else:
            assert "trace_id" not in line and "span_id" not in line
    assert sorted(line["attempt"] for line in inside if line["kind"] == "async") == [1, 1, 2, 2]
    assert all(line["attempt"] == 1 for line in inside if line["kind"] == "sync")
    outside = [line for line in lines if line["event"] == "outside"]
    assert len(outside) == 2
    for line in outside:
        assert not set(CONTEXT) & set(line) and "trace_id" not in line, line


# -- for real: `framework run` ---------------------------------------------------------------------------

APP = """
import logging

import structlog
from opentelemetry import trace

from framework import Service, Topic

stdlog = logging.getLogger("logapp")
withbodies = Service("withbodies")
nobodies = Service("nobodies")


def _log(kind):
    span = trace.get_current_span().get_span_context()
    ids = {"expected_trace": format(span.trace_id, "032x"), "expected_span": format(span.span_id, "016x")}
    structlog.get_logger("logapp").info("charging", via="structlog", kind=kind, **ids)
    stdlog.warning("charging", extra={"via": "stdlib", "kind": kind, **ids})


@withbodies.event(Topic("logs.orders"))
async def charge(order: dict) -> None:
    _log("async")


@nobodies.event(Topic("logs.orders"))
def audit(order: dict) -> None:
    _log("sync")
"""


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" in entry:
            out.append(entry)
    return out


def test_framework_run_at_debug_logs_context_receipts_settlements_and_redacted_bodies(
    worker_env: dict[str, str], redis_url: str, namespace: str, tmp_path: Path
) -> None:
    (tmp_path / "logapp.py").write_text(textwrap.dedent(APP))
    env = {k: v for k, v in worker_env.items() if not k.startswith("OTEL_") and not k.startswith("FRAMEWORK_LOG_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), worker_env["PYTHONPATH"]]),
        FRAMEWORK_LOG_FORMAT="json",
        OTEL_TRACES_EXPORTER="console",  # spans to stdout (discarded): tracing on, no collector needed
    )
    bodies = {**env, "FRAMEWORK_LOG_BODIES": "1", "FRAMEWORK_LOG_REDACT": "password, Card_Number"}
    procs = []
    for target, extra in (("logapp:withbodies", bodies), ("logapp:nobodies", env)):
        with open(tmp_path / f"{target.split(':')[1]}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "framework", "run", target, "--log-level", "debug"],
                    env=extra,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    cwd=tmp_path,
                )
            )
    logs = {name: tmp_path / f"{name}.log" for name in ("withbodies", "nobodies")}
    try:
        deadline = time.monotonic() + 30
        while not all(any(e["event"] == "runtime started" for e in _json_lines(p)) for p in logs.values()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), {
                k: v.read_text() for k, v in logs.items()
            }
            time.sleep(0.05)
        order = {"order_id": "o-1", "password": "hunter2", "card": {"card_number": "4111111111111111", "exp": "12/30"}}
        with SyncClient(redis_url, namespace=namespace) as client:
            message_id = client.publish("logs.orders", order)
        while not all(any(e["event"] == "message settled" for e in _json_lines(p)) for p in logs.values()):
            assert time.monotonic() < deadline, {k: v.read_text() for k, v in logs.items()}
            time.sleep(0.05)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0]

    for name, path in logs.items():
        text = path.read_text()
        assert "hunter2" not in text and "4111111111111111" not in text  # never, bodies or not
        entries = _json_lines(path)
        charging = [e for e in entries if e["event"] == "charging"]
        assert sorted(e["via"] for e in charging) == ["stdlib", "structlog"], charging
        for e in charging:
            assert (e["service"], e["destination"], e["message_id"], e["attempt"]) == (
                name,
                "logs.orders",
                message_id,
                1,
            )
            assert e["handler"] == ("charge" if name == "withbodies" else "audit")
            assert e["trace_id"] == e["expected_trace"] and e["span_id"] == e["expected_span"], e
            assert len(e["trace_id"]) == 32 and len(e["span_id"]) == 16
        [received] = [e for e in entries if e["event"] == "message received"]
        [settled] = [e for e in entries if e["event"] == "message settled"]
        assert received["message_id"] == settled["message_id"] == message_id
        assert received["level"] == settled["level"] == "debug"
        assert settled["outcome"] == "success" and settled["service"] == name
        if name == "withbodies":
            assert json.loads(received["body"]) == {
                "order_id": "o-1",
                "password": "[redacted]",
                "card": {"card_number": "[redacted]", "exp": "12/30"},
            }
        else:
            assert "body" not in received


def test_a_second_configure_logging_reaches_loggers_already_in_use() -> None:
    # A CLI command run in-process (framework.cli.main) configures logging again: loggers cached
    # before it must follow, and structlog.testing.capture_logs must still see their lines.
    from framework.logconfig import configure_logging
    from framework.logs import get_logger

    before = structlog.get_config()
    log = get_logger("framework.test.cached")
    try:
        configure_logging("info", "json")
        log.info("first use caches the logger")
        configure_logging("info", "console")
        with structlog.testing.capture_logs() as logs:
            log.info("seen by the capture")
        assert [e["event"] for e in logs] == ["seen by the capture"]
    finally:
        structlog.configure(**before)


def test_processes_sharing_stderr_write_whole_lines(tmp_path: Path) -> None:
    """The workers of ``framework run --workers N`` share their stderr: each JSON line is written
    in one piece, its newline included, so no line ends up inside another (print wrote the text
    and its newline apart, and lines of two processes ran together under load)."""
    script = textwrap.dedent(
        """
        import logging, sys
        from framework.logconfig import configure_logging
        configure_logging("info", "json")
        log = __import__("structlog").get_logger("writer")
        std = logging.getLogger("writer.std")
        for i in range(1500):
            log.info("line", writer=sys.argv[1], n=i, pad="x" * 200)
            if i % 10 == 0:
                std.warning("stdlib line %d", i)
        """
    )
    out = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with out.open("w") as shared:
        procs = [
            subprocess.Popen([sys.executable, "-c", script, str(w)], stderr=shared, stdout=subprocess.DEVNULL, env=env)
            for w in range(4)
        ]
        for p in procs:
            assert p.wait(timeout=60) == 0
    lines = out.read_text().splitlines()
    broken = [line[:120] for line in lines if not line.startswith("{") or not line.endswith("}")]
    assert not broken, f"{len(broken)} of {len(lines)} lines are parts of lines: {broken[:3]}"
    records = [json.loads(line) for line in lines]
    assert sum(r["event"] == "line" for r in records) == 4 * 1500
    assert sum(r["event"].startswith("stdlib line") for r in records) == 4 * 150
