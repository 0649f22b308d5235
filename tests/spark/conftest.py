"""Spark test fixtures: one SparkSession for the whole run, and a sync publisher into the test's namespace."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
import redis

from broker.codec import encode_fields
from broker.envelope import Envelope
from broker.redis.keys import KeySpace
from broker.topology import DestinationSpec

try:
    import pyspark  # noqa: F401
except ImportError:  # the spark extra is not installed (pip install -e '.[spark]'): nothing here can run
    collect_ignore_glob = ["test_*.py"]

Publish = Callable[..., list[Envelope]]


@pytest.fixture(scope="session")
def spark(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One local[2] session for every Spark test (starting one takes seconds)."""
    from spark_bridge import spark_session

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = spark_session(
        "spark_bridge tests",
        master="local[2]",
        url=redis_url,
        config={"spark.sql.shuffle.partitions": "2", "spark.sql.warehouse.dir": str(warehouse)},
    )
    yield session
    session.stop()


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    """A plain sync client on the test server."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def publish(sync_redis: redis.Redis, namespace: str) -> Publish:
    """``publish(topic, count, partitions=2, start=0, body=None)``: declare the topic and append events.

    Events carry key ``k<i>``, type ``OrderPlaced``, a traceparent header and (by default) the body
    ``{"order_id": "o-<i>", "n": i}``; ``body`` may be a function of ``i`` returning bytes. Returns
    the envelopes, in publication order.
    """
    keyspace = KeySpace(namespace)

    def _publish(
        topic: str,
        count: int,
        *,
        partitions: int = 2,
        start: int = 0,
        body: Callable[[int], bytes] | None = None,
        retention_ms: int | None = None,
    ) -> list[Envelope]:
        spec = DestinationSpec(topic, "event", partitions=partitions, retention_ms=retention_ms)
        sync_redis.hsetnx(keyspace.destinations, topic, orjson.dumps(spec.to_json()))
        out = []
        pipe = sync_redis.pipeline(transaction=False)
        for i in range(start, start + count):
            env = Envelope(
                destination=topic,
                kind="event",
                type="OrderPlaced",
                key=f"k{i}",
                body=body(i) if body else orjson.dumps({"order_id": f"o-{i}", "n": i}),
                headers={"traceparent": f"00-{i:032x}-{i:016x}-01"},
            )
            stream = keyspace.partition(topic, spec.partition_for(env.key, env.id)).stream
            pipe.execute_command("XADD", stream, "*", *encode_fields(env))
            out.append(env)
        pipe.execute()
        return out

    return _publish
