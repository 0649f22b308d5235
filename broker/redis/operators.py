"""The operators' roles on Redis: worker heartbeats (``workers``) and dead letters by page (``dead_letter_pages``).

Heartbeats live in one hash per namespace (``<ns>:workers``, :mod:`broker.redis.keys`), written by
``worker_beat.lua`` with the server's time, so a worker's last-seen time survives neither a client
clock's skew nor an AOF reload's reset of idle times. Pages are XREVRANGE reads from a cursor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from broker.operators import WorkerBeat
from broker.protocol import GroupPartition
from broker.redis.core import text
from broker.redis.topology import Topology

__all__ = ["Operators"]


class Operators(Topology):
    """Worker heartbeats and dead-letter pages."""

    async def beat_worker(
        self, name: str, groups: Sequence[tuple[str, str]], ttl_ms: int, info: Mapping[str, str]
    ) -> None:
        """Record that worker ``name`` runs now, consuming ``groups``; it beats again within ``ttl_ms``."""
        payload = orjson.dumps({"groups": [list(g) for g in groups], "info": dict(info)}).decode()
        await self.scripts["worker_beat"](self.redis, [self.keyspace.workers], [name, int(ttl_ms), payload])

    async def leave_worker(self, name: str) -> None:
        """Mark worker ``name`` gone now (a graceful stop); it is forgotten an hour later."""
        await self.scripts["worker_beat"](self.redis, [self.keyspace.workers], [name, 0, ""])

    async def workers(self) -> list[WorkerBeat]:
        """Every worker recorded (live or gone for less than an hour), sorted by name."""
        secs, micros, flat = await self.scripts["workers_read"](self.redis, [self.keyspace.workers], [])
        now = int(secs) * 1000 + int(micros) // 1000
        out = []
        for field, value in zip(flat[::2], flat[1::2], strict=True):
            try:
                seen, ttl, body = text(value).split("|", 2)
                data: dict[str, Any] = orjson.loads(body)
                groups = tuple((str(d), str(g)) for d, g in data.get("groups", []))
                info = {str(k): str(v) for k, v in (data.get("info") or {}).items()}
                out.append(WorkerBeat(text(field), int(seen), now, int(ttl), groups, info))
            except (ValueError, TypeError, orjson.JSONDecodeError):
                continue  # not ours to read: skip rather than fail the whole view
        return sorted(out, key=lambda w: w.name)

    async def dead_letter_page(
        self, view: GroupPartition, *, end: str = "+", start: str = "-", count: int = 100
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """At most ``count`` dead letters of ``view`` from ``end`` down to ``start``, newest first."""
        rows = await self.redis.execute_command("XREVRANGE", view.keys.dlq, end, start, "COUNT", count)
        return [(text(eid), dict(zip(flat[::2], flat[1::2], strict=True))) for eid, flat in rows]
