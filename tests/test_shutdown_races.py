"""Shutdown steps that wait on the broker while ownership changes what this consumer holds."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from framework import Queue, Service
from framework.testing import ServiceHarness

pytestmark = pytest.mark.anyio


async def test_flushing_acks_survives_a_partition_lost_meanwhile(redis_url: str, namespace: str) -> None:
    """A lease that ran out during a pause is dropped as shutdown flushes the acks (seen after a
    SIGSTOP/SIGCONT then SIGTERM): the flush goes on over what is left, not 'dictionary changed size'."""
    svc = Service("s")

    @svc.command(Queue("jobs", partitions=2))
    async def h(cmd: dict) -> None:
        pass

    async with ServiceHarness([svc], url=redis_url, namespace=namespace) as harness:
        runtime = harness.runtime
        assert runtime is not None
        consumer = runtime.consumers[0]
        with anyio.fail_after(10):
            while len(consumer.states) < 2:
                await anyio.sleep(0.01)
        flush = consumer.settle.flush
        flushed: list[Any] = []

        async def flush_and_lose_the_other(ledger: Any) -> None:
            flushed.append(ledger)
            for p in [p for p, other in consumer.states.items() if other is not ledger]:
                del consumer.states[p]  # what ownership does when the lease runs out on the local clock
            await flush(ledger)

        consumer.settle.flush = flush_and_lose_the_other  # type: ignore[method-assign]
        await consumer.flush_acks()
        assert len(flushed) >= 1
