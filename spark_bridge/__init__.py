"""The event log as a Spark table: a streaming and batch data source, typed columns, a sink, the export job.

    import spark_bridge
    spark = spark_bridge.spark_session()            # or spark_bridge.register(existing_session)
    df = spark.readStream.format("eventlog").option("topics", "orders.placed").load()

``spark_bridge`` builds on ``broker`` only (never on the service runtime). See the "Spark bridge"
section of the project's ``README.md``.
"""

from spark_bridge.export import ExportJob, run_export, start_export
from spark_bridge.fetch import DataLossError
from spark_bridge.java import JavaNotFound, ensure_java
from spark_bridge.rows import EVENT_SCHEMA
from spark_bridge.schema import parse_payload, payload_schema
from spark_bridge.session import register, spark_session
from spark_bridge.source import FORMAT, EventLogSource, read_events

__all__ = [
    "EVENT_SCHEMA",
    "FORMAT",
    "DataLossError",
    "EventLogSource",
    "ExportJob",
    "JavaNotFound",
    "ensure_java",
    "parse_payload",
    "payload_schema",
    "read_events",
    "register",
    "run_export",
    "spark_session",
    "start_export",
]
