"""Retry policy: immediate attempts, then delayed ones with exponential backoff and full jitter.

Attempts are numbered from 1 (the first delivery). After a failed attempt ``n``:

* a fatal exception (listed in ``fatal``, or not an instance of ``retry_on``) dead-letters at once;
* if ``n >= max_attempts`` the message is dead-lettered;
* if ``n <= immediate`` the handler runs again at once, in its lane;
* otherwise it is retried after ``delay(n)``: through the group's retry path (the message is
  acknowledged and parked in a sorted set, so the lane moves on and later messages with the same
  key may run first), or in place when ``in_place`` is set (the lane sleeps and retries, so per-key
  order holds but the lane is blocked meanwhile).

A handler may raise :class:`RetryAfter` to choose the delay itself (a rate-limited API said
"retry after 30 s"); it still counts as an attempt. A handler that runs past its timeout is
cancelled and fails with :class:`HandlerTimeout`, retried through the retry path.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Literal, cast

import attrs

from broker.errors import MessageTooLarge

__all__ = ["Decision", "HandlerTimeout", "RetryAfter", "RetryPolicy"]


class RetryAfter(Exception):
    """Raise from a handler to be retried after ``seconds`` (counts as an attempt)."""

    def __init__(self, seconds: float, reason: str = "") -> None:
        super().__init__(reason or f"retry requested after {seconds:g}s")
        self.seconds = float(seconds)


class HandlerTimeout(TimeoutError):
    """A handler ran past its ``timeout`` and was cancelled; it counts as a failed attempt.

    Retried through the group's retry path (never in place: the lane moves on), dead-lettered
    after ``max_attempts``. A sync handler's thread cannot be interrupted: it is abandoned and runs on.
    """


@attrs.frozen
class Decision:
    """What to do after a failed attempt: ``retry`` now, ``delay`` for ``seconds``, or ``dead``."""

    action: Literal["retry", "delay", "dead"]
    seconds: float = 0.0
    reason: str = ""


def _exception_types(value: object) -> tuple[type[BaseException], ...]:
    # anything not iterable raises TypeError from tuple(), as a wrong element does below
    items: tuple[object, ...] = (value,) if isinstance(value, type) else tuple(cast("Iterable[object]", value))
    types: list[type[BaseException]] = []
    for t in items:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"expected exception types, got {t!r}")
        types.append(t)
    return tuple(types)


@attrs.frozen
class RetryPolicy:
    """How a failing handler is retried; see the module docstring for the exact rules."""

    max_attempts: int = attrs.field(default=5)
    immediate: int = 1
    backoff: float = 1.0
    multiplier: float = 2.0
    max_delay: float = 300.0
    jitter: bool = True
    fatal: tuple[type[BaseException], ...] = attrs.field(default=(), converter=_exception_types)
    retry_on: tuple[type[BaseException], ...] = attrs.field(default=(Exception,), converter=_exception_types)
    in_place: bool = False

    @max_attempts.validator
    def _check(self, _attribute: object, value: int) -> None:
        if value < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.immediate < 0 or self.backoff < 0 or self.max_delay < 0 or self.multiplier < 1:
            raise ValueError("immediate, backoff and max_delay must be >= 0 and multiplier >= 1")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (a delayed one): full-jitter backoff."""
        step = max(attempt - self.immediate, 1)
        cap = min(self.max_delay, self.backoff * self.multiplier ** (step - 1))
        return random.uniform(0, cap) if self.jitter else cap

    def is_fatal(self, exc: BaseException) -> bool:
        """Whether ``exc`` is never retried (a message over the size limit would be as large again)."""
        if isinstance(exc, RetryAfter):
            return False
        if isinstance(exc, MessageTooLarge):
            return True
        return isinstance(exc, self.fatal) or not isinstance(exc, self.retry_on)

    def decide(self, attempt: int, exc: BaseException) -> Decision:
        """The decision after attempt ``attempt`` failed with ``exc``."""
        if self.is_fatal(exc):
            return Decision("dead", reason="fatal error (not retried)")
        if attempt >= self.max_attempts:
            return Decision("dead", reason=f"failed {attempt} of {self.max_attempts} attempts")
        if isinstance(exc, RetryAfter):
            return Decision("delay", exc.seconds)
        if attempt <= self.immediate:
            return Decision("retry")
        return Decision("delay", self.delay(attempt))


DEFAULT_RETRY = RetryPolicy()
