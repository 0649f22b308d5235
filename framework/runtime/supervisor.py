"""Supervision: an actor that fails is restarted with backoff.

Every long-lived task of the runtime (fetchers, ack flushers, claimers, lanes, schedulers) runs
under :func:`supervise` inside a task group owned by its parent, so nothing runs detached and
cancelling the parent stops the whole subtree.

A lost or timed-out broker connection is not a crash: it is reported once per outage (see
:mod:`framework.runtime.connectivity`) and retried quickly, waiting 0.1 s, then doubling up to 1 s. A
crash (any other error) is logged with its traceback and retried after 0.1 s, doubling up to
10 s. The backoff starts again from 0.1 s once the actor has done useful work since its last
start: it called :func:`framework.runtime.connectivity.healthy`, or it ran for 30 s.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from broker.errors import is_connection_error
from framework.logs import get_logger
from framework.runtime import connectivity

__all__ = ["is_connection_error", "supervise"]

log = get_logger("framework.runtime.supervisor")

_STABLE_AFTER = 30.0  # an actor that ran this long before failing restarts with the initial backoff
_CONNECTION_MAXIMUM = 1.0  # seconds: the longest wait before retrying a lost connection


async def supervise(
    name: str,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    initial: float = 0.1,
    maximum: float = 10.0,
) -> None:
    """Run ``fn(*args)`` until it returns; restart it after a failure (see the module docstring)."""
    backoff = initial
    progress = connectivity.Progress()
    connectivity.track(progress)  # fn runs in this task (and its children inherit the marker)
    while True:
        started = time.monotonic()
        progress.made = False
        try:
            await fn(*args)
            return
        except Exception as exc:
            if progress.made or time.monotonic() - started > _STABLE_AFTER:
                backoff = initial
            if is_connection_error(exc):
                connectivity.lost(name, exc)
                backoff = min(backoff, _CONNECTION_MAXIMUM)
                log.debug("broker unreachable; retrying", actor=name, error=str(exc), retry_in=round(backoff, 2))
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _CONNECTION_MAXIMUM)
                continue
            log.error("actor crashed; restarting", actor=name, retry_in=round(backoff, 2), exc_info=exc)
        await anyio.sleep(backoff)
        backoff = min(backoff * 2, maximum)
