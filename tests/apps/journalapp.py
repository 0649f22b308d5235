"""A saga whose steps only change its state, on an owned 4-partition queue, so every step saves its
state with its message's ack (see docs/sagas.md); run as worker processes by tests/test_sagas.py.

Its input is partitioned as well: the forwarding hop of an input consumed by several processes at
once (one partition, not owned) would pass one key's messages on in whatever order the processes
happen to finish them.

Each step appends the message's sequence number to its instance's list: a lost, repeated or
reordered step shows in the list.
"""

from __future__ import annotations

from framework import Queue, Service
from framework.saga import SagaContext

APPEND = Queue("ledger.append", partitions=4)  # owned too: each key's messages are forwarded in order

ledger = Service("ledger")
journal = ledger.saga("journal", state=dict, partitions=4)


@journal.command(APPEND, correlate=lambda c: c["k"])
async def append(cmd: dict, ctx: SagaContext[dict]) -> None:
    ctx.state.setdefault("seq", []).append(cmd["s"])
