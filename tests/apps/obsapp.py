"""Services run as real workers by the observability tests (tests/test_dashboard.py, test_otlp_wire.py).

``observed`` has one handler of each outcome, so every metric series and span outcome exists after
a few messages: ``work`` succeeds and publishes ``obs.done``, ``flaky`` fails its first attempt and
succeeds on the retry, ``reject`` dead-letters every message (a fatal error). ``notifier`` consumes
``obs.done``, so one message sent to ``obs.work`` makes a trace across two handlers.
"""

from __future__ import annotations

from framework import Context, Queue, RetryPolicy, Service, Topic

WORK = Queue("obs.work", partitions=2)
FLAKY = Queue("obs.flaky")
REJECTED = Queue("obs.rejected")
DONE = Topic("obs.done")


class Rejected(Exception):
    """A message this service refuses: retrying cannot help."""


observed = Service("observed", retry=RetryPolicy(max_attempts=3, immediate=1, backoff=0.05, fatal=(Rejected,)))


@observed.command(WORK, key=lambda c: str(c["n"]))
async def work(cmd: dict, ctx: Context) -> None:
    """Succeed, announcing the work as done."""
    ctx.publish(DONE, {"n": cmd["n"]})


@observed.command(FLAKY)
async def flaky(cmd: dict, ctx: Context) -> None:
    """Fail the first attempt (retried at once), succeed the second."""
    if ctx.attempt == 1:
        raise TimeoutError(f"upstream timed out for {cmd['n']}")


@observed.command(REJECTED)
async def reject(cmd: dict, ctx: Context) -> None:
    """Refuse every message: it goes to the dead-letter queue with the reason."""
    raise Rejected(f"cannot handle {cmd['n']}")


notifier = Service("notifier")


@notifier.event(DONE)
async def notify(event: dict, ctx: Context) -> None:
    """Succeed (the end of the chain)."""
