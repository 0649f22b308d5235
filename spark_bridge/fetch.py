"""Reading one partition's range on an executor: XRANGE pages, each checked for a retention gap.

A Spark task gets an :class:`EventRange` (pickled: everything ``read()`` needs is in it) and
reads the entries ``(after, until]`` of one partition stream with a plain sync client (a cluster
client on a Redis Cluster, so the task reads from the node owning the stream's slot). Each page
is read in one MULTI together with ``XINFO STREAM``, so the check is exact: retention trims from
the head, so ``entries-added - length`` entries are gone, and if that is more than the entries up
to the last one read (``n``, carried in the offsets), unread events were deleted. The task then
fails with :class:`DataLossError`, or with ``failOnDataLoss=false`` logs the gap and goes on, as
Spark's Kafka source does. (Redis 6.2 does not count entries: there gaps go undetected.)
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Iterator

import orjson
import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import StructType

from spark_bridge.offsets import StreamInfo, id_key, open_client
from spark_bridge.rows import BatchBuilder

__all__ = ["DataLossError", "EventRange", "read_range"]

log = logging.getLogger("spark_bridge")


class DataLossError(RuntimeError):
    """Events a query had not read yet were deleted (by retention) before it read them."""


@dataclasses.dataclass(frozen=True)
class EventRange(InputPartition):
    """One Spark input partition: the entries ``(after, until]`` of one topic partition."""

    url: str = dataclasses.field(repr=False)  # may carry a password: never printed
    stream: str
    topic: str
    partition: int
    after: str  # exclusive: the last entry id already read
    after_n: int | None  # entries the stream had received up to `after` (None: unknown, no gap check)
    until: str  # inclusive
    fail_on_data_loss: bool
    fetch_size: int
    schema_json: str
    cluster: bool = False  # a Redis Cluster (the driver checked): the task opens a cluster client


def _lost(r: EventRange, cursor: str, count: int | None, info: StreamInfo) -> None:
    """Raise :class:`DataLossError`, or log the gap when ``failOnDataLoss`` is false."""
    what = f"{count} event(s)" if count is not None else "events"
    still = (
        f"the oldest event still retained is {info.first}"
        if info.exists and info.length
        else "no event is retained"
        if info.exists
        else "the partition's stream no longer exists"
    )
    message = (
        f"data loss in topic {r.topic!r} partition {r.partition}: {what} after offset {cursor} were deleted "
        f"(trimmed by retention) before this query read them; {still}. The bridge keeps its position in "
        "Spark's checkpoint, not in a consumer group, so retention does not wait for it. Set option "
        "failOnDataLoss=false to log such gaps and go on; to avoid them, run the query more often or raise "
        "the topic's retention."
    )
    if r.fail_on_data_loss:
        raise DataLossError(message)
    log.warning("%s (failOnDataLoss=false: going on)", message)


def read_range(r: EventRange) -> Iterator[pa.RecordBatch]:
    """Yield the range's events as Arrow record batches of at most ``fetch_size`` rows, in stream order."""
    if id_key(r.until) <= id_key(r.after):
        return
    builder = BatchBuilder(StructType.fromJson(orjson.loads(r.schema_json)), r.topic, r.partition)
    client = open_client(r.url, cluster=r.cluster)  # on a Cluster, reads go to the node owning the stream's slot
    cursor, n = r.after, r.after_n
    # Replies hold thousands of small lists; the cycle collector would walk them over and over (about
    # half the decode time) though nothing here forms a cycle. Refcounting frees everything.
    collecting = gc.isenabled()
    gc.disable()
    try:
        while True:
            pipe = client.pipeline(transaction=True)
            pipe.execute_command("XINFO STREAM", r.stream)
            pipe.execute_command("XRANGE", r.stream, f"({cursor}", r.until, "COUNT", r.fetch_size)
            info_reply, entries = pipe.execute(raise_on_error=False)
            if isinstance(info_reply, Exception) and "no such key" not in str(info_reply):
                raise info_reply
            info = StreamInfo(info_reply)
            if not info.exists:
                _lost(r, cursor, None, info)
                return
            deleted = info.deleted
            if n is not None and deleted is not None and not info.has_holes and deleted > n:
                _lost(r, cursor, deleted - n, info)
                n = deleted
            if isinstance(entries, Exception) or not entries:
                return
            yield builder.build(entries)
            cursor = entries[-1][0].decode()
            if n is not None:
                n += len(entries)
            if len(entries) < r.fetch_size or id_key(cursor) >= id_key(r.until):
                return
    finally:
        client.close()
        if collecting:
            gc.enable()
