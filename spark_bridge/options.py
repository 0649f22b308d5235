"""The read options of the ``eventlog`` data source: parsed once, checked, and explained when wrong.

Spark hands options over as a case-insensitive string map; :func:`parse_read_options` turns it
into a :class:`ReadOptions` whose fields are plain values (picklable, JSON-able). Positions are
written the way Spark's Kafka source takes them::

    earliest | latest                             every partition of every topic
    2024-05-01T00:00:00Z | 1714521600000          a time (ISO 8601, or Unix ms): events published then or later
    {"orders.placed": {"0": "1714521600000-0", "1": "earliest"}}   per topic and partition

A starting entry id is inclusive (the first event read); an ending one is exclusive (the first
event not read); partitions a JSON position leaves out start at ``earliest`` / end at ``latest``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import attrs
import orjson

from broker.errors import ConfigurationError
from broker.topology import validate_name

__all__ = ["OPTION_NAMES", "Position", "ReadOptions", "parse_position", "parse_read_options"]

# name as documented -> what it does (the lower-cased name is what Spark hands over)
OPTION_NAMES: dict[str, str] = {
    "topics": "comma-separated topic names (required)",
    "namespace": "key prefix of the deployment (default: $FRAMEWORK_NAMESPACE or 'fw')",
    "url": "broker URL (default: the one given to spark_bridge.register, else $REDIS_URL)",
    "startingOffsets": "where a new query starts: earliest, latest, a time, or JSON per partition",
    "endingOffsets": "batch reads only: where to stop: latest (default), a time, or JSON per partition",
    "maxEventsPerTrigger": "streaming: at most this many events per micro-batch, spread over partitions",
    "failOnDataLoss": "true (default): fail when retention trimmed unread events; false: log and go on",
    "payloadClass": "'package.module:Class' of an attrs payload class: its fields become columns",
    "payloadSchema": "a Spark schema as JSON (StructType.json()): its fields become columns",
    "fetchSize": "entries per XRANGE page on an executor (default 5000)",
}
_BY_LOWER = {name.lower(): name for name in OPTION_NAMES}
_ENTRY_ID = re.compile(r"^\d+(-\d+)?$")

Position = str | int | dict[str, dict[str, str]]
"""``"earliest"``, ``"latest"``, a Unix-ms time (int), or ``{topic: {partition: "earliest"|"latest"|entry id}}``."""


@attrs.frozen
class ReadOptions:
    """Checked read options; every field is a plain value so the whole thing pickles and prints."""

    topics: tuple[str, ...]
    namespace: str
    url: str | None = attrs.field(repr=False)  # may carry a password: never printed
    starting: Position | None  # None: the default of the read kind (streaming latest, batch earliest)
    ending: Position | None
    max_events_per_trigger: int | None
    fail_on_data_loss: bool
    payload_schema_json: str | None
    fetch_size: int


def _bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigurationError(f"option {name}={value!r}: expected true or false")


def _positive_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ConfigurationError(f"option {name}={value!r}: expected a positive whole number")
    return number


def _time_ms(text: str) -> int | None:
    """Unix ms of an ISO 8601 time (naive means UTC) or of a bare integer; None if neither."""
    if text.isdigit() and "-" not in text:
        return int(text)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def parse_position(name: str, value: str) -> Position:
    """Parse a ``startingOffsets`` / ``endingOffsets`` value, or raise saying what forms are accepted."""
    text = value.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    if text.startswith("{"):
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ConfigurationError(f"option {name}: not valid JSON ({exc})") from None
        out: dict[str, dict[str, str]] = {}
        for topic, parts in raw.items():
            if not isinstance(parts, dict):
                raise ConfigurationError(f"option {name}: {topic!r} must map partition numbers to positions")
            out[topic] = {}
            for partition, where in parts.items():
                where = str(where).strip()
                if not str(partition).isdigit() or not (where in ("earliest", "latest") or _ENTRY_ID.match(where)):
                    raise ConfigurationError(
                        f"option {name}: {topic!r} partition {partition!r} -> {where!r}: use a partition number "
                        "and 'earliest', 'latest' or an entry id like '1714521600000-0'"
                    )
                out[topic][str(int(partition))] = where
        return out
    ms = _time_ms(text)
    if ms is None:
        raise ConfigurationError(
            f"option {name}={value!r}: use earliest, latest, a time (2024-05-01T00:00:00Z or Unix ms), "
            'or JSON per partition like {"orders.placed": {"0": "1714521600000-0"}}'
        )
    return ms


def _payload_schema_json(options: Mapping[str, str]) -> str | None:
    from spark_bridge.schema import payload_schema  # here: schema imports pyspark, options stays light

    cls_path, schema_json = options.get("payloadclass"), options.get("payloadschema")
    if cls_path and schema_json:
        raise ConfigurationError("give payloadClass or payloadSchema, not both")
    if schema_json:
        from pyspark.sql.types import StructType

        try:
            return StructType.fromJson(orjson.loads(schema_json)).json()
        except Exception as exc:
            raise ConfigurationError(
                f"option payloadSchema: not a Spark schema in JSON ({exc}); pass StructType.json(), "
                "or use payloadClass / spark_bridge.payload_schema(cls).json()"
            ) from None
    if not cls_path:
        return None
    if ":" in cls_path:
        module_name, _, qualname = cls_path.partition(":")
    else:
        module_name, _, qualname = cls_path.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigurationError(
            f"option payloadClass={cls_path!r}: cannot import it ({exc}). Use 'package.module:Class' of a module "
            "Spark's Python workers can import, or pass payloadSchema=spark_bridge.payload_schema(Class).json()"
        ) from None
    return payload_schema(target).json()


def parse_read_options(options: Mapping[str, str], defaults: Mapping[str, str] | None = None) -> ReadOptions:
    """Check ``options`` (Spark's map, keys any case) over ``defaults``; raise naming the wrong option."""
    merged = {k.lower(): v for k, v in (defaults or {}).items()}
    merged.update({k.lower(): v for k, v in options.items()})
    merged.pop("path", None)  # load(path) is not used by this source; Spark may still pass an empty one
    unknown = sorted(k for k in merged if k not in _BY_LOWER)
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} for the eventlog source; known: {', '.join(OPTION_NAMES)}"
        )
    topics = tuple(t.strip() for t in merged.get("topics", "").split(",") if t.strip())
    if not topics:
        raise ConfigurationError('the eventlog source needs option topics, e.g. .option("topics", "orders.placed")')
    for topic in topics:
        validate_name("topic", topic)
    from broker.connect import default_namespace
    from broker.redis.keys import KeySpace

    namespace = merged.get("namespace") or default_namespace()
    KeySpace(namespace)  # validates
    starting = parse_position("startingOffsets", merged["startingoffsets"]) if "startingoffsets" in merged else None
    ending = parse_position("endingOffsets", merged["endingoffsets"]) if "endingoffsets" in merged else None
    for position in (starting, ending):
        if isinstance(position, dict):
            strays = sorted(set(position) - set(topics))
            if strays:
                raise ConfigurationError(f"offsets name topic(s) not in option topics: {', '.join(strays)}")
    max_events = merged.get("maxeventspertrigger")
    return ReadOptions(
        topics=topics,
        namespace=namespace,
        url=merged.get("url") or None,
        starting=starting,
        ending=ending,
        max_events_per_trigger=_positive_int("maxEventsPerTrigger", max_events) if max_events else None,
        fail_on_data_loss=_bool("failOnDataLoss", merged.get("failondataloss", "true")),
        payload_schema_json=_payload_schema_json(merged),
        fetch_size=_positive_int("fetchSize", merged.get("fetchsize", "5000")),
    )
