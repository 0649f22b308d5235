"""Command line: ``python -m spark_bridge export --topics T1,T2 --to PATH`` (also runs under spark-submit).

Wrong arguments exit 2 with one line saying what is wrong; an unreachable broker or a failed query
exits 1; a finished (or signalled) export exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

if __package__ in (None, ""):  # run as a file (spark-submit .../spark_bridge/__main__.py): don't shadow modules
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

from broker.errors import BrokerUnavailable, ConfigurationError
from broker.topology import validate_name
from spark_bridge.export import ExportJob, run_export

__all__ = ["build_parser", "main", "parse_interval"]

_INTERVAL = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_interval(text: str) -> float:
    """Seconds in ``10s``, ``500ms``, ``2m`` or ``1h``; raise ``argparse.ArgumentTypeError`` otherwise."""
    match = _INTERVAL.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an interval: use a number and ms, s, m or h, like 10s")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _topics(text: str) -> tuple[str, ...]:
    topics = tuple(t.strip() for t in text.split(",") if t.strip())
    if not topics:
        raise argparse.ArgumentTypeError("give at least one topic, like orders.placed,payments.captured")
    for topic in topics:
        try:
            validate_name("topic", topic)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return topics


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m spark_bridge`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m spark_bridge", description="Spark bridge to the event log.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export",
        help="stream topics into Parquet partitioned by topic and date, exactly once",
        description="Stream topics into Parquet (PATH/topic=T/date=YYYY-MM-DD/), exactly once across restarts "
        "and kills: read it back with spark.read.parquet(PATH).",
    )
    export.add_argument("--topics", required=True, type=_topics, help="comma-separated topics to export")
    export.add_argument("--to", required=True, metavar="PATH", help="output directory or URI (file:, hdfs:, s3a:)")
    export.add_argument("--checkpoint", metavar="PATH", help="checkpoint location (default: PATH/_checkpoint)")
    export.add_argument(
        "--trigger",
        choices=("available-now", "continuous"),
        default="available-now",
        help="available-now: export what is there and stop (default); continuous: every --interval until stopped",
    )
    export.add_argument(
        "--interval",
        type=parse_interval,
        metavar="DURATION",
        help="time between micro-batches with --trigger continuous, like 10s (default 10s)",
    )
    export.add_argument(
        "--master",
        help="Spark master, like local[*] or spark://host:7077 "
        "(default: $SPARK_MASTER, else local[*]; ignored under spark-submit)",
    )
    export.add_argument("--redis-url", help="broker URL (default: $REDIS_URL, else the embedded Valkey)")
    export.add_argument("--namespace", help="key namespace (default: $FRAMEWORK_NAMESPACE or fw)")
    export.add_argument(
        "--starting-offsets",
        default="earliest",
        metavar="WHERE",
        help="where a new checkpoint starts: earliest (default), latest, a time, or JSON per partition",
    )
    export.add_argument(
        "--max-events-per-trigger", type=_positive, metavar="N", help="at most N events per micro-batch"
    )
    export.add_argument(
        "--no-fail-on-data-loss",
        dest="fail_on_data_loss",
        action="store_false",
        help="log events trimmed before they were exported, instead of failing",
    )
    export.add_argument("--verbose", action="store_true", help="keep Spark's own logs (warnings, stack traces)")
    return parser


def _check_topics(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Fail fast, before Spark starts: the broker must answer and know every topic."""
    from broker.connect import default_namespace, resolve_url
    from spark_bridge.offsets import load_topics, open_client
    from spark_bridge.options import parse_position

    try:
        parse_position("--starting-offsets", args.starting_offsets)
    except ConfigurationError as exc:
        parser.error(str(exc))
    url = resolve_url(args.redis_url)
    client = open_client(url)
    try:
        load_topics(client, args.namespace or default_namespace(), args.topics, url)
    except ConfigurationError as exc:
        parser.error(str(exc))
    finally:
        client.close()
    return url


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.interval is not None and args.trigger != "continuous":
        parser.error("--interval applies to --trigger continuous only")
    try:
        url = _check_topics(parser, args)
    except BrokerUnavailable as exc:
        print(f"python -m spark_bridge: {exc}", file=sys.stderr)
        return 1
    job = ExportJob(
        topics=args.topics,
        to=args.to,
        checkpoint=args.checkpoint,
        trigger=args.trigger,
        interval_s=args.interval or 10.0,
        url=url,
        namespace=args.namespace,
        starting_offsets=args.starting_offsets,
        max_events_per_trigger=args.max_events_per_trigger,
        fail_on_data_loss=args.fail_on_data_loss,
    )
    return run_export(job, master=args.master, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
