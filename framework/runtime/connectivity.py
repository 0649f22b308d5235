"""Whether this process can reach the broker, logged once per outage.

Actors report a lost connection through :func:`lost` (the supervisor does it for them) and
success through :func:`healthy` (the fetchers and ack flushers, once per round trip). The first
``lost`` of an outage logs "connection to the broker lost"; the first ``healthy`` after it logs
"connection to the broker restored". Retries in between log nothing, so a flapping network
costs two log lines per outage, not one per task per retry.

:func:`healthy` also marks the calling actor as having done useful work since its last
(re)start, which resets its restart backoff (see :mod:`framework.runtime.supervisor`). It costs a context
variable look-up and two attribute accesses: cheap enough to call per round trip.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from framework.logs import get_logger

__all__ = ["Progress", "healthy", "is_down", "lost"]

log = get_logger("framework.runtime.connectivity")


class Progress:
    """Set by :func:`healthy` in the actor a supervisor runs; the supervisor reads and clears it."""

    __slots__ = ("made",)

    def __init__(self) -> None:
        self.made = False


class _State:
    __slots__ = ("down", "error", "since")

    def __init__(self) -> None:
        self.down = False
        self.since = 0.0
        self.error = ""


_state = _State()
_progress: ContextVar[Progress | None] = ContextVar("framework_actor_progress", default=None)


def healthy() -> None:
    """Record a successful broker round trip: progress for the calling actor, and the end of an
    outage if one was under way."""
    progress = _progress.get()
    if progress is not None:
        progress.made = True
    if _state.down:
        _state.down = False
        log.info("connection to the broker restored", down_for=round(time.monotonic() - _state.since, 2))


def lost(actor: str, error: BaseException) -> None:
    """Record that ``actor`` lost its connection; logs only the first loss of an outage."""
    if _state.down:
        return
    _state.down = True
    _state.since = time.monotonic()
    _state.error = str(error)
    log.warning(
        "connection to the broker lost; retrying until it is back",
        actor=actor,
        error=f"{type(error).__name__}: {error}",
    )


def is_down() -> bool:
    """Whether an outage is under way (a loss was reported and no success since)."""
    return _state.down


def track(progress: Progress) -> None:
    """Make ``progress`` the current actor's marker (the supervisor calls this before each run)."""
    _progress.set(progress)
