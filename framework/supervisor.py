"""Supervision: an actor that crashes is logged and restarted with exponential backoff.

Every long-lived task of the runtime (fetchers, ack flushers, claimers, lanes, schedulers) runs
under :func:`supervise` inside a task group owned by its parent, so nothing runs detached and
cancelling the parent stops the whole subtree.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from framework.logs import get_logger

__all__ = ["supervise"]

log = get_logger("framework.supervisor")

_STABLE_AFTER = 30.0  # an actor that ran this long before crashing restarts with the initial backoff


async def supervise(
    name: str,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    initial: float = 0.1,
    maximum: float = 10.0,
) -> None:
    """Run ``fn(*args)`` until it returns; restart it after a crash, waiting longer each time."""
    backoff = initial
    while True:
        started = time.monotonic()
        try:
            await fn(*args)
            return
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if time.monotonic() - started > _STABLE_AFTER:
                backoff = initial
            log.warning("broker unreachable; retrying", actor=name, error=str(exc), retry_in=round(backoff, 2))
        except Exception as exc:
            if time.monotonic() - started > _STABLE_AFTER:
                backoff = initial
            log.error("actor crashed; restarting", actor=name, retry_in=round(backoff, 2), exc_info=exc)
        await anyio.sleep(backoff)
        backoff = min(backoff * 2, maximum)
