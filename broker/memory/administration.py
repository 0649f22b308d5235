"""The memory broker's administration role: dead letters (list, redrive, purge), unsubscribe, delete a destination."""

from __future__ import annotations

from collections.abc import Sequence

from broker.errors import ConfigurationError
from broker.memory.streams import parse_id
from broker.memory.topology import Topology
from broker.protocol import GroupPartition
from broker.topology import DestinationSpec

__all__ = ["Administration"]

_DROPPED_ON_REDRIVE = (b"attempt", b"first-failed-at")


class Administration(Topology):
    """Inspects and repairs a group's dead letters; removes groups and destinations."""

    async def dead_letter_entries(
        self, view: GroupPartition, count: int | None = None
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """The group's dead letters on this partition, oldest first: (DLQ entry id, fields)."""
        await self._checkpoint()
        stream = self.server.streams.get(view.keys.dlq)
        if stream is None:
            return []
        ids = stream.ids if count is None else stream.ids[:count]
        out = []
        for entry in ids:
            flat = stream.entries[entry]
            out.append((f"{entry[0]}-{entry[1]}", dict(zip(flat[::2], flat[1::2], strict=True))))
        return out

    async def redrive(self, view: GroupPartition, dlq_entry_id: str) -> str | None:
        """Move one dead letter back to its group only (its redeliver stream), as a first attempt: without
        the ``dlq-*`` fields, ``attempt`` and ``first-failed-at``. None when it is gone (or has no field left)."""
        await self._checkpoint()
        stream = self.server.streams.get(view.keys.dlq)
        entry = parse_id(dlq_entry_id)
        flat = stream.entries.get(entry) if stream is not None else None
        if stream is None or flat is None:
            return None
        fields: list[bytes] = []
        for i in range(0, len(flat) - 1, 2):
            name = flat[i]
            if not name.startswith(b"dlq-") and name not in _DROPPED_ON_REDRIVE:
                fields += (name, flat[i + 1])
        if not fields:
            return None
        new_id = self.server.stream(view.keys.redeliver).add(fields)
        stream.delete([entry])
        return new_id

    async def purge_dead_letters(self, view: GroupPartition, dlq_entry_ids: Sequence[str]) -> int:
        """Delete dead letters for good; return how many existed."""
        await self._checkpoint()
        stream = self.server.streams.get(view.keys.dlq)
        if stream is None or not dlq_entry_ids:
            return 0
        return stream.delete([parse_id(i) for i in dlq_entry_ids])

    async def delete_inbox(self, source: GroupPartition) -> int:
        """Forget the group's inbox on this partition (leases and records); 1 when it held anything, else 0."""
        await self._checkpoint()
        state = self.server.groups.get((source.stream, source.group))
        if state is None or not state.inbox:
            return 0
        state.inbox.leases.clear()
        state.inbox.final.clear()
        state.inbox.records.clear()
        state.inbox.window_ms = 0
        return 1

    def _drop_group(self, view: GroupPartition) -> int:
        """Forget ``view``'s group state beside the partition stream; return how many structures held something
        (its redeliver and dead-letter streams, delayed retries, inbox, attempt counters)."""
        server = self.server
        dropped = 0
        for name in (view.keys.redeliver, view.keys.dlq):
            gone = server.streams.pop(name, None)
            if gone is not None:
                gone.wake()  # blocked reads look again and find the group gone
                dropped += 1
        state = server.groups.pop((view.stream, view.group), None)
        if state is not None:
            dropped += bool(state.delayed) + bool(state.inbox) + bool(state.attempts)
        return dropped

    async def unsubscribe(self, spec: DestinationSpec, group: str) -> None:
        """Remove ``group`` from every partition of ``spec`` with its retries, dead letters, inbox and lease.

        No check here (as on Redis): reads of the group fail afterwards, and a group created again replays
        what the topic retains with its inbox gone.
        """
        await self._checkpoint()
        for p in range(spec.partitions):
            view = self.group_partition(spec, p, group)
            stream = self.server.streams.get(view.stream)
            if stream is not None and stream.groups.pop(group, None) is not None:
                stream.wake()
            self._drop_group(view)
            self.server.leases.pop((view.stream, group), None)
        self.registry.members.pop((spec.name, group), None)
        self.registry.subscriptions.pop((spec.name, group), None)

    async def delete_destination(self, spec: DestinationSpec, *, force: bool = False) -> int:
        """Delete ``spec`` with its streams, idempotency keys, scheduled messages, job state, the states kept
        beside its partitions and every group's retries, dead letters, inbox and counters; return how many
        of those held something.

        Refuses with ``ConfigurationError`` while a group is subscribed (or present on a stream) or entries
        are stored (scheduled ones count), unless ``force``. Partition leases are kept (their tokens never go
        back), as on Redis.
        """
        await self._checkpoint()
        groups = {g for d, g in self.registry.subscriptions if d == spec.name}
        entries = 0
        for p in range(spec.partitions):
            name = self.partition_stream(spec.name, p)
            stream = self.server.streams.get(name)
            if stream is not None:
                groups |= set(stream.groups)
                entries += len(stream)
            state = self.server.partitions.get(name)
            entries += len(state.scheduled) if state is not None else 0
        if (groups or entries) and not force:
            raise ConfigurationError(
                f"{spec.name!r} still has {len(groups)} consumer group(s) ({', '.join(sorted(groups)) or 'none'}) "
                f"and {entries} stored entr{'y' if entries == 1 else 'ies'}: unsubscribe the groups and let them "
                "drain first, or force the delete"
            )
        deleted = 0
        for p in range(spec.partitions):
            name = self.partition_stream(spec.name, p)
            stream = self.server.streams.pop(name, None)
            if stream is not None:
                stream.groups.clear()
                stream.wake()
                deleted += 1
            state = self.server.partitions.pop(name, None)
            if state is not None:
                deleted += bool(state.published) + 2 * bool(state.scheduled) + (state.job_last is not None)
            for group in groups:
                deleted += self._drop_group(self.group_partition(spec, p, group))
            self.registry.scheduled.pop((spec.name, p), None)
            states = [key for key in self.server.hashes if key.startswith(f"{name}:saga:")]  # (the state store's)
            for key in states:
                self.server.delete_hash(key)
            deleted += len(states)
        for group in groups:
            self.registry.subscriptions.pop((spec.name, group), None)
        self.registry.destinations.pop(spec.name, None)
        self._specs.pop(spec.name, None)
        return deleted
