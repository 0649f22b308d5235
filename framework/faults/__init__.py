"""Fault injection for tests and demos: real worker processes, SIGKILL, SIGSTOP past the lease,
connection resets and duplicate deliveries, and what the framework did about them.

Public through :mod:`framework.testing` (see docs/testing.md, "Testing under faults").
"""

from framework.faults.workers import COUNTERS, Fault, Recovery, WorkerPool, free_port, scrape_counters, wait_for

__all__ = ["COUNTERS", "Fault", "Recovery", "WorkerPool", "free_port", "scrape_counters", "wait_for"]
