"""Fault injection for tests and demos: real worker processes, SIGKILL, SIGSTOP past the lease,
connection resets and duplicate deliveries, what the framework did about them, and the check that
every message's effect was applied exactly once.

Public through :mod:`framework.testing` (docs/testing.md, "Testing under faults").
"""

from framework.faults.chaos import Chaos, ExactlyOnce, exactly_once
from framework.faults.netproxy import NetProxy
from framework.faults.workers import COUNTERS, Fault, Recovery, WorkerPool, free_port, scrape_counters, wait_for

__all__ = [
    "COUNTERS",
    "Chaos",
    "ExactlyOnce",
    "Fault",
    "NetProxy",
    "Recovery",
    "WorkerPool",
    "exactly_once",
    "free_port",
    "scrape_counters",
    "wait_for",
]
