"""The operators' service layer behind ``framework status`` and the dashboard.

* :mod:`~framework.operations.overview`: destinations, groups, live workers (heartbeats), owners,
  scheduled messages (``framework status --json`` and the overview page show the same data);
* :mod:`~framework.operations.dead_letters`: filtered pages of dead letters newest first, their
  classes (handler, exception type, reason), frozen bounds for bulk actions;
* :mod:`~framework.operations.actions`: redrive, purge (exactly the refs named), cancel a
  scheduled message, each written to the audit log;
* :mod:`~framework.operations.outbox`: the outbox backlog, refused rows retried or discarded by
  message id (audited; needs the ``sql`` extra, imported on use);
* :mod:`~framework.operations.redaction`: secret fields out of bodies before a screen shows them.
"""

from framework.operations.actions import ActionResult, audit, cancel_scheduled, frozen_refs, purge, redrive
from framework.operations.dead_letters import DeadLetterClass, DeadLetterFilter, DeadLetterPage, classes, page, scan
from framework.operations.overview import Overview, iso_ms, load_overview, worker_json
from framework.operations.redaction import redact_body, redact_value

__all__ = [
    "ActionResult",
    "DeadLetterClass",
    "DeadLetterFilter",
    "DeadLetterPage",
    "Overview",
    "audit",
    "cancel_scheduled",
    "classes",
    "frozen_refs",
    "iso_ms",
    "load_overview",
    "page",
    "purge",
    "redact_body",
    "redact_value",
    "redrive",
    "scan",
    "worker_json",
]
