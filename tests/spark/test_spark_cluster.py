"""The Spark bridge on a real 3-master Redis Cluster: an export reads every partition, on whichever node.

The cluster is started by the module (embedded Valkey, own directory, free ports). The shared
Spark session stays registered with the suite's server: the export names the cluster in its
options, as a job pointed at another broker would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from broker.redis.embedded_cluster import RunningCluster, start_cluster
from broker.redis.keys import KeySpace
from broker.redis.sync_client import sync_client
from framework import Client, Topic
from framework.testing import delete_namespace, unique_namespace
from spark_bridge.export import ExportJob, start_export

pytestmark = pytest.mark.spark

PARTITIONS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = start_cluster(tmp_path_factory.mktemp("valkey-cluster"), nodes=3)
    yield running
    running.stop()


def test_an_export_of_a_partitioned_topic_reads_every_partition_on_every_node(
    spark: Any, cluster: RunningCluster, tmp_path: Path
) -> None:
    ns = unique_namespace("cluster-spark")
    topic = Topic("cl.export", partitions=PARTITIONS)

    async def publish() -> list[str]:
        async with Client(cluster.url, namespace=ns) as client:
            async with client.batch() as b:
                ids = [b.publish(topic, {"n": n}, key=f"k{n}") for n in range(1000)]
            return [i for i in ids if i]

    client = sync_client(cluster.url)
    try:
        assert isinstance(client, redis.RedisCluster)
        sent = anyio.run(publish)
        streams = [KeySpace(ns).partition(topic.name, p).stream for p in range(PARTITIONS)]
        assert len({client.get_node_from_key(s).name for s in streams}) >= 2  # the topic spans nodes
        out = tmp_path / "export"
        job = ExportJob(topics=(topic.name,), to=str(out), url=cluster.url, namespace=ns, max_events_per_trigger=600)
        query = start_export(spark, job)
        query.awaitTermination()
        rows = spark.read.parquet(str(out)).select("event_id", "partition").collect()
        assert sorted(r.event_id for r in rows) == sorted(sent)  # every event, once
        assert {r.partition for r in rows} == set(range(PARTITIONS))
        batch = spark.read.format("eventlog").option("url", cluster.url).option("namespace", ns)
        assert batch.option("topics", topic.name).load().count() == len(sent)  # a batch read too
    finally:
        client.close()
        delete_namespace(cluster.url, ns)
