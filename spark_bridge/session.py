"""A quiet SparkSession that can read the event log: Java found, Python workers set, the source registered.

:func:`spark_session` is for scripts and the export job; :func:`register` is the one call needed
on a session you built yourself. Under ``spark-submit`` the session already exists: its master and
JVM settings are left as submitted, and only SQL settings are applied.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from broker.connect import default_namespace, redact, resolve_url
from broker.errors import BrokerUnavailable
from broker.redis.keys import KeySpace
from spark_bridge.java import ensure_java
from spark_bridge.source import source_with_defaults

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["QUIET_LOG4J2", "SQL_SETTINGS", "register", "spark_session"]

QUIET_LOG4J2 = """\
# Written by spark_bridge: Spark logs errors only (set spark_session(quiet=False) to see more).
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
# Spark's launcher sets a "shell" level of WARN (and says so) unless its own logger is configured.
logger.submit.name = org.apache.spark.deploy.SparkSubmit
logger.submit.level = error
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
"""

SQL_SETTINGS = {
    "spark.sql.session.timeZone": "UTC",  # published_at and export dates are UTC whatever the machine's zone
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}


def _log4j2_file() -> Path:
    path = Path(tempfile.gettempdir()) / f"spark_bridge-log4j2-{os.getuid()}.properties"
    if not path.exists() or path.read_text() != QUIET_LOG4J2:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(QUIET_LOG4J2)
        tmp.replace(path)
    return path


def register(spark: SparkSession, *, url: str | None = None, namespace: str | None = None) -> str:
    """Register the ``eventlog`` source and sink on ``spark``; reads and writes default to this broker.

    ``url`` defaults to ``$REDIS_URL``, else the embedded Valkey (found, or started). Raises
    :class:`~broker.errors.BrokerUnavailable` saying how to start a broker if none answers. Returns
    the URL used.
    """
    resolved = resolve_url(url)
    ns = namespace or default_namespace()
    KeySpace(ns)  # validates the name
    client = redis.Redis.from_url(resolved, socket_connect_timeout=5)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        raise BrokerUnavailable(
            f"cannot reach the broker at {redact(resolved)}: {str(exc).rstrip('.')}. Start one (`framework server "
            "start` for the embedded Valkey, or `redis-server --port 6379` with REDIS_URL=redis://127.0.0.1:6379/0), "
            "or pass the right url"
        ) from None
    finally:
        client.close()
    spark.dataSource.register(source_with_defaults(resolved, ns))
    return resolved


def spark_session(
    app_name: str = "spark_bridge",
    *,
    master: str | None = None,
    config: Mapping[str, str] | None = None,
    url: str | None = None,
    namespace: str | None = None,
    quiet: bool = True,
) -> SparkSession:
    """Get or create a SparkSession with the ``eventlog`` source registered (see :func:`register`).

    A new local session (``master`` default ``$SPARK_MASTER`` or ``local[*]``) gets a JVM from
    :func:`~spark_bridge.java.ensure_java`, this interpreter for its Python workers, no UI and no
    progress bars, and logs errors only unless ``quiet`` is false. ``config`` adds Spark settings.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    running = SparkContext._active_spark_context is not None or "PYSPARK_GATEWAY_PORT" in os.environ
    if not running:  # we launch the JVM: its settings are ours to choose
        ensure_java()
        chosen = master or os.environ.get("SPARK_MASTER") or "local[*]"
        builder = builder.master(chosen)
        if chosen.startswith("local"):
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers need this venv's packages
            builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.sql.shuffle.partitions", "8")
        builder = builder.config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
        if quiet:
            option = f"-Dlog4j2.configurationFile=file:{_log4j2_file()}"
            builder = builder.config("spark.driver.extraJavaOptions", option)
            builder = builder.config("spark.executor.extraJavaOptions", option)
    for key, value in {**SQL_SETTINGS, **(config or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    for key, value in SQL_SETTINGS.items():
        spark.conf.set(key, value)
    if quiet:
        spark.sparkContext.setLogLevel("ERROR")
    register(spark, url=url, namespace=namespace)
    return spark
