"""Typed columns: the schema of an attrs payload class, parsed in the reader and by from_json."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

import attrs
import orjson
import pytest
import redis
from cattrs.preconf.orjson import make_converter
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from broker.redis.keys import KeySpace
from broker.topology import DestinationSpec
from spark_bridge import EVENT_SCHEMA, parse_payload, payload_schema, read_events

pytestmark = pytest.mark.spark

TOPIC = "orders.placed"
converter = make_converter()  # what the framework encodes payloads with


class Channel(enum.Enum):
    WEB = "web"
    STORE = "store"


@attrs.frozen
class Line:
    sku: str
    quantity: int
    unit_price: float


@attrs.frozen
class Address:
    city: str
    postcode: str | None = None


@attrs.frozen
class OrderPlaced:
    order_id: str
    total_cents: int
    placed_at: datetime
    channel: Channel
    lines: list[Line]
    ship_to: Address
    tags: tuple[str, ...]
    attributes: dict[str, int]
    gift: bool
    note: str | None = None


ORDERS = [
    OrderPlaced(
        "o-1",
        1250,
        datetime(2024, 5, 1, 12, 30, 15, 250000, tzinfo=UTC),
        Channel.WEB,
        [Line("sku-1", 2, 5.0), Line("sku-2", 1, 2.5)],
        Address("Lyon", "69001"),
        ("new",),
        {"points": 12},
        False,
    ),
    OrderPlaced(
        "o-2",
        99,
        datetime(2024, 5, 2, 8, 0, tzinfo=UTC),
        Channel.STORE,
        [],
        Address("Oslo"),
        (),
        {},
        True,
        "ring twice",
    ),
]


def test_payload_schema_maps_attrs_fields_to_spark_types() -> None:
    line = StructType(
        [StructField("sku", StringType()), StructField("quantity", LongType()), StructField("unit_price", DoubleType())]
    )
    assert payload_schema(OrderPlaced) == StructType(
        [
            StructField("order_id", StringType()),
            StructField("total_cents", LongType()),
            StructField("placed_at", TimestampType()),
            StructField("channel", StringType()),
            StructField("lines", ArrayType(line)),
            StructField(
                "ship_to", StructType([StructField("city", StringType()), StructField("postcode", StringType())])
            ),
            StructField("tags", ArrayType(StringType())),
            StructField("attributes", MapType(StringType(), LongType())),
            StructField("gift", BooleanType()),
            StructField("note", StringType()),
        ]
    )
    with pytest.raises(TypeError, match=r"OrderPlaced\.x: a union of several types"):
        payload_schema(attrs.make_class("OrderPlaced", {"x": attrs.field(type=int | str)}))


def _plain(row: Any) -> dict[str, Any]:
    """A row's payload columns as plain values, timestamps as Unix seconds."""
    out = row.asDict(recursive=True)
    out["placed_at"] = out["placed_at"].timestamp() if out["placed_at"] else None
    return out


def test_typed_columns_match_the_attrs_class(spark: Any, publish: Any, namespace: str, sync_redis: redis.Redis) -> None:
    sent = publish(TOPIC, 2, partitions=1, body=lambda i: converter.dumps(ORDERS[i]))
    odd = publish(TOPIC, 1, partitions=1, start=2, body=lambda i: orjson.dumps({"order_id": 5, "total_cents": "x"}))
    stream = KeySpace(namespace).partition(TOPIC, 0).stream
    sync_redis.xadd(stream, {"id": "broken-1", "type": "OrderPlaced", "ts": "1714521600000"})  # no body

    typed = read_events(spark, TOPIC, payload=OrderPlaced, stream=False, namespace=namespace)

    fields = payload_schema(OrderPlaced).fieldNames()
    assert typed.columns == EVENT_SCHEMA.fieldNames() + fields
    rows = {r.event_id: r for r in typed.collect()}
    assert len(rows) == 4
    for env, order in zip(sent, ORDERS, strict=True):
        row = rows[env.id]
        expected = orjson.loads(converter.dumps(order))
        expected["placed_at"] = order.placed_at.timestamp()
        assert {f: _plain(row)[f] for f in fields} == expected
    assert rows[odd[0].id]["order_id"] == "5" and rows[odd[0].id]["total_cents"] is None  # what fits, else null
    broken = rows["broken-1"]
    assert broken.payload is None and all(broken[f] is None for f in fields)
    assert broken.decode_error == "entry has no 'body' field"

    # from_json over the payload column gives the same values
    plain = read_events(spark, TOPIC, stream=False, namespace=namespace)
    parsed = {r.event_id: r for r in parse_payload(plain, OrderPlaced).collect()}
    for env in sent:
        assert {f: _plain(parsed[env.id])[f] for f in fields} == {f: _plain(rows[env.id])[f] for f in fields}


def test_payload_class_option_imports_the_class_by_name(spark: Any, publish: Any, namespace: str) -> None:
    specs = [DestinationSpec("a.b", "event", partitions=3), DestinationSpec("c", "command", retention_ms=None)]
    publish("specs", 2, partitions=1, body=lambda i: orjson.dumps(specs[i].to_json()))

    df = (
        spark.read.format("eventlog")
        .option("topics", "specs")
        .option("namespace", namespace)
        .option("payloadClass", "broker.topology:DestinationSpec")
        .load()
    )

    got = sorted((r.name, r.kind, r.partitions, r.retention_ms) for r in df.collect())
    assert got == [("a.b", "event", 3, 604800000), ("c", "command", 1, None)]
    publish("quiet", 0)
    assert read_events(spark, "quiet", stream=False, namespace=namespace).count() == 0  # no events, no error
    with pytest.raises(Exception, match=r"option payloadClass='broker.nope:Spec': cannot import it"):
        spark.read.format("eventlog").option("topics", "specs").option("namespace", namespace).option(
            "payloadClass", "broker.nope:Spec"
        ).load()
