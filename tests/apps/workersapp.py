"""Services for the supervisor tests (``framework run --workers N``): one that cannot start."""

from __future__ import annotations

from framework import Service

broken = Service("broken")  # no handlers: the runtime refuses to start it (exit status 1)
