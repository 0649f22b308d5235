"""What runs and what waits: destinations, groups, live workers, owners, scheduled messages.

One view for ``framework status --json`` and the dashboard's overview page, so both show the same
figures. Live workers come from heartbeats (the ``workers`` capability, :mod:`broker.operators`):
a worker that stopped is listed as gone and not counted. Where a transport keeps no heartbeats,
a group's live workers are the consumers the server reports for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import attrs

from broker import Broker
from broker.capabilities import SCHEDULING, as_introspection, as_scheduler
from broker.introspection import DestinationState
from broker.operators import WORKERS, WorkerBeat, as_workers

__all__ = ["Overview", "heartbeats_for", "iso_ms", "load_overview", "worker_json"]


def iso_ms(ms: int) -> str:
    """A server time in ms as an ISO 8601 UTC string (milliseconds)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def worker_json(w: WorkerBeat) -> dict[str, Any]:
    """Plain data of one worker: name, live or gone, last seen (ISO time and seconds ago), groups."""
    return {
        "name": w.name,
        "alive": w.alive,
        "last_seen": iso_ms(w.seen_ms),
        "last_seen_ago_s": round(w.ago_ms / 1000, 1),
        "groups": [f"{d}|{g}" for d, g in w.groups],
        **{k: w.info[k] for k in ("host", "pid", "services") if k in w.info},
    }


@attrs.frozen
class Overview:
    """Every destination's state with its groups' live workers, the workers themselves, scheduled total.

    ``workers`` is None when the transport keeps no heartbeats (live counts are then the server's
    consumer counts).
    """

    namespace: str
    transport: str
    states: list[DestinationState]
    workers: list[WorkerBeat] | None
    scheduled: int

    def live_for(self, destination: str, group: str) -> list[WorkerBeat]:
        """The live workers consuming ``group`` on ``destination``."""
        return [w for w in self.workers or [] if w.alive and (destination, group) in w.groups]

    def seen_for(self, destination: str, group: str) -> list[WorkerBeat]:
        """Every worker (live or gone) that consumed ``group`` on ``destination``, live ones first."""
        return sorted(
            (w for w in self.workers or [] if (destination, group) in w.groups), key=lambda w: (not w.alive, w.ago_ms)
        )

    def destinations_json(self) -> list[dict[str, Any]]:
        """``framework status --json``: each destination, each group with ``live_workers`` and ``workers``."""
        out = []
        for s in self.states:
            data = s.to_json()
            for g in data["groups"]:
                if self.workers is None:
                    g["live_workers"] = g["consumers"]
                    g["workers"] = []
                else:
                    g["live_workers"] = len(self.live_for(s.spec.name, g["group"]))
                    g["workers"] = [worker_json(w) for w in self.seen_for(s.spec.name, g["group"])]
            out.append(data)
        return out

    def to_json(self) -> dict[str, Any]:
        """Everything, as plain data (the dashboard's ``/api/overview``)."""
        return {
            "namespace": self.namespace,
            "transport": self.transport,
            "destinations": self.destinations_json(),
            "workers": None if self.workers is None else [worker_json(w) for w in self.workers],
            "scheduled": self.scheduled,
            "dead_letters": sum(g["dead_letters"] for s in self.states for g in s.to_json()["groups"]),
        }


async def load_overview(broker: Broker, names: Sequence[str] | None = None) -> Overview:
    """Read the overview from ``broker`` (only ``names`` when given; ValueError naming unknown ones)."""
    states = await as_introspection(broker).describe(list(names) if names else None)
    workers = await as_workers(broker).workers() if WORKERS in broker.capabilities else None
    scheduled = await as_scheduler(broker).count_scheduled() if SCHEDULING in broker.capabilities else 0
    return Overview(broker.namespace, broker.transport, states, workers, scheduled)


async def heartbeats_for(broker: Broker, destination: str, group: str) -> list[WorkerBeat] | None:
    """The workers whose heartbeats say they consume ``group`` on ``destination`` (live or gone);
    None when the transport keeps no heartbeats or no worker of the group has beaten yet (workers
    of an earlier version): callers then fall back on the server's consumer list."""
    if WORKERS not in broker.capabilities:
        return None
    beats = [w for w in await as_workers(broker).workers() if (destination, group) in w.groups]
    return beats or None
