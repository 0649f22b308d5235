"""``framework asyncapi``: the services' AsyncAPI 3.0.0 document, checked against the official schema.

tests/schemas/asyncapi-3.0.0.json is the AsyncAPI Initiative's JSON Schema of AsyncAPI 3.0.0
(npm package @asyncapi/specs, Apache-2.0): every exported document must validate against it, and
every ``$ref`` in it must resolve.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import os
import pkgutil
import re
import sys
import typing
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from framework.asyncapi import AsyncAPIError, SchemaBuilder, UnsupportedType, build_document, render_html
from framework.cli import main
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "tests" / "schemas" / "asyncapi-3.0.0.json").read_text())
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "apps"), str(ROOT)])}


def assert_valid(document: dict[str, Any]) -> None:
    """The document validates against the official AsyncAPI 3.0.0 schema and its $refs resolve."""
    errors = sorted(jsonschema.Draft7Validator(SCHEMA).iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors]
    for ref in _refs(document):
        target: Any = document
        for segment in ref.removeprefix("#/").split("/"):
            segment = segment.replace("~1", "/").replace("~0", "~")
            assert isinstance(target, dict) and segment in target, f"unresolved $ref {ref}"
            target = target[segment]


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def resolve(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = document
        for segment in node["$ref"].removeprefix("#/").split("/"):
            target = target[segment]
        node = target
    return node


class Money:
    __json_schema__: typing.ClassVar = {"type": "integer", "description": "cents"}


@dataclasses.dataclass
class Price:
    amount: Money
    at: dt.datetime


class Opaque:
    pass


@dataclasses.dataclass
class Wrapper:
    inner: list[Opaque]


@pytest.fixture(scope="module")
def shapes_doc() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "apps"))
    try:
        import asyncapiapp
    finally:
        sys.path.remove(str(ROOT / "tests" / "apps"))
    return build_document([asyncapiapp.shapes, asyncapiapp.listener], title="Shapes", version="2.3.0")


def test_the_schema_is_the_official_one_and_rejects_a_wrong_document() -> None:
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema"
    assert SCHEMA["properties"]["asyncapi"]["const"] == "3.0.0"
    wrong = {"asyncapi": "3.0.0", "info": {"title": "x", "version": "1"}, "operations": {"o": {"action": "consume"}}}
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(wrong))


def test_example_services_export_validates_and_names_destinations_groups_partitions() -> None:
    out = run_cli("asyncapi", "example_services.quickstart", env=ENV)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert_valid(doc)
    assert doc["asyncapi"] == "3.0.0" and doc["info"]["title"] == "orders, billing"
    place, placed = doc["channels"]["orders.place"], doc["channels"]["orders.placed"]
    assert place["address"] == "orders.place" and place["x-framework-kind"] == "queue"
    assert place["x-framework-partitions"] == 2 and place["x-framework-groups"] == ["orders"]
    assert placed["address"] == "orders.placed" and placed["x-framework-kind"] == "topic"
    assert placed["x-framework-partitions"] == 2 and placed["x-framework-retention-ms"] == 7 * 24 * 3600 * 1000
    charge = doc["operations"]["billing.charge"]
    assert charge["action"] == "receive" and charge["channel"] == {"$ref": "#/channels/orders.placed"}
    assert charge["x-framework-group"] == "billing"
    assert charge["x-framework-retry"]["fatal"] == ["example_services.quickstart.PaymentDeclined"]
    assert doc["operations"]["orders.place_order"]["x-framework-group"] == "orders"
    message = resolve(doc, charge["messages"][0])
    assert message["name"] == "OrderPlaced" and message["contentType"] == "application/json"
    payload = resolve(doc, message["payload"])
    assert payload["required"] == ["order_id", "customer", "total_cents", "card"]
    assert payload["properties"]["total_cents"] == {"type": "integer"}
    headers = resolve(doc, message["headers"])["properties"]
    assert {"id", "key", "type", "correlation-id", "causation-id", "traceparent"} <= set(headers)
    assert message["correlationId"]["location"] == "$message.header#/correlation-id"


EXAMPLES = sorted(
    m.name for m in pkgutil.iter_modules([str(ROOT / "example_services")]) if m.name not in ("demo", "__main__")
)


@pytest.mark.parametrize("module", EXAMPLES)
def test_every_example_module_with_services_exports_a_valid_document(module: str) -> None:
    out = run_cli("asyncapi", f"example_services.{module}", env=ENV)
    if out.returncode == 2 and "defines no Service" in out.stderr:
        pytest.skip(f"example_services.{module} defines no Service")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert_valid(doc)
    assert doc["operations"] and all(op["action"] == "receive" for op in doc["operations"].values())


def test_every_payload_shape_is_described_and_validates(shapes_doc: dict[str, Any]) -> None:
    doc = shapes_doc
    assert_valid(doc)
    assert doc["info"] == {**doc["info"], "title": "Shapes", "version": "2.3.0"}
    schemas = doc["components"]["schemas"]
    props = schemas["Everything"]["properties"]
    assert props["order_id"] == {"type": "string"}  # NewType
    assert props["at"] == {"type": "string", "format": "date-time"}
    assert props["day"] == {"type": "string", "format": "date"}
    assert props["colour"] == {"$ref": "#/components/schemas/Colour"}
    assert schemas["Colour"]["enum"] == ["red", "green"] and schemas["Colour"]["type"] == "string"
    assert schemas["Priority"] == {"title": "Priority", "enum": [1, 2], "type": "integer"}
    assert props["mode"] == {"enum": ["fast", "slow"]}
    assert props["lines"] == {"type": "array", "items": {"$ref": "#/components/schemas/Line"}}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    assert props["pair"]["items"] == [{"type": "integer"}, {"type": "string"}] and props["pair"]["maxItems"] == 2
    assert props["many"] == {"type": "array", "items": {"type": "integer"}}
    assert props["scores"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["anything"] == {} and props["weight"] == {"type": "number"}  # Any; Annotated
    assert props["maybe"] == {"type": ["integer", "null"]}
    assert props["either"] == {"anyOf": [{"type": "integer"}, {"$ref": "#/components/schemas/Line"}]}
    parent = {"anyOf": [{"$ref": "#/components/schemas/Everything"}, {"type": "null"}], "default": None}
    assert props["parent"] == parent  # recursive
    assert props["label"] == {"type": "string", "default": "none"}
    assert "parent" not in schemas["Everything"]["required"] and "order_id" in schemas["Everything"]["required"]
    assert schemas["Address"]["required"] == ["street"]  # TypedDict: NotRequired zip
    line = schemas["Line"]
    assert line["required"] == ["sku"] and line["description"] == "One line of an order."
    assert line["properties"]["quantity"] == {"type": "integer", "default": 1}
    assert line["properties"]["note"] == {"type": ["string", "null"], "default": None}
    messages = doc["components"]["messages"]
    assert messages["shapes.happened"]["name"] == "shapes.happened"  # __message_type__
    assert messages["bytes"]["contentType"] == "application/octet-stream"
    assert messages["json"]["payload"] == {"type": "object"} and messages["json"]["name"] == "json"
    lines = resolve(doc, doc["operations"]["shapes.lines"]["messages"][0])
    assert lines["payload"] == {"type": "array", "items": {"$ref": "#/components/schemas/Line"}}
    anon = doc["operations"]["shapes._lambda_"]  # operation keys are valid AsyncAPI keys whatever the handler's name
    assert anon["x-framework-handler"] == "shapes.<lambda>" and resolve(doc, anon["messages"][0])["name"] == "json"
    union = resolve(doc, doc["operations"]["shapes.union"]["messages"][0])
    assert union["payload"] == {"type": ["integer", "string"]}


def test_the_command_prints_only_the_document_on_stdout() -> None:
    out = run_cli("asyncapi", "asyncapiapp:shapes", env=ENV)  # the module print()s at import
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert_valid(doc)
    assert doc["info"]["x-framework-services"] == ["shapes"] and "asyncapiapp: imported" in out.stderr


def test_a_topic_with_two_subscribing_services_has_two_groups(shapes_doc: dict[str, Any]) -> None:
    doc = shapes_doc
    channel = doc["channels"]["shapes.events"]
    assert channel["x-framework-partitions"] == 4
    assert channel["x-framework-retention-ms"] == 3_600_000 and channel["x-framework-max-length"] == 1000
    receivers = {
        op["x-framework-group"]: op
        for op in doc["operations"].values()
        if op["channel"] == {"$ref": "#/channels/shapes.events"}
    }
    assert set(receivers) == {"shapes", "listener"}
    assert channel["x-framework-groups"] == ["shapes", "listener"]
    assert receivers["shapes"]["x-framework-start"] == "latest"
    assert receivers["listener"]["summary"] == "Log every event."
    # each operation refers to its own message of the channel; the channel holds both
    names = {resolve(doc, op["messages"][0]).get("name") for op in receivers.values()}
    assert names == {"shapes.happened", "json"}
    assert len(channel["messages"]) == 2
    for op in receivers.values():
        ref = op["messages"][0]["$ref"]
        assert ref.startswith("#/channels/shapes.events/messages/")


def test_jobs_and_sagas_have_their_queues(shapes_doc: dict[str, Any]) -> None:
    doc = shapes_doc
    job = doc["channels"]["shapes.job.sweep"]
    assert job["x-framework-job"] == {"name": "sweep", "interval_ms": 300_000}
    assert resolve(doc, job["messages"]["Tick"])["name"] == "Tick"
    saga = doc["channels"]["shapes.saga.payments"]
    assert saga["x-framework-saga"] == "shapes.payments" and saga["x-framework-partitions"] == 2
    assert set(saga["messages"]) == {"Paid", "PaymentLate"}  # the saga's inputs and its timeout
    assert doc["operations"]["shapes.saga_payments_paid"]["channel"] == {"$ref": "#/channels/shapes.paid"}


def test_an_unsupported_payload_type_is_one_line_naming_the_handler_and_the_type() -> None:
    out = run_cli("asyncapi", "asyncapibad:bad", env=ENV)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert "handler bad.pay" in out.stderr and "asyncapibad.Money" in out.stderr and "Payment.amount" in out.stderr
    assert "--lenient" in out.stderr
    lenient = run_cli("asyncapi", "asyncapibad:bad", "--lenient", env=ENV)
    assert lenient.returncode == 0, lenient.stderr
    doc = json.loads(lenient.stdout)
    assert_valid(doc)
    message = resolve(doc, doc["operations"]["bad.pay"]["messages"][0])
    assert message["payload"] == {} and "asyncapibad.Money" in message["x-framework-unsupported"]


def test_bad_targets_and_no_service_are_one_line_errors() -> None:
    out = run_cli("asyncapi", "no_such_module_here:svc", env=ENV)
    assert out.returncode == 2 and "cannot import 'no_such_module_here'" in out.stderr
    assert out.stderr.count("\n") == 1
    with pytest.raises(AsyncAPIError, match="no service"):
        build_document([])


def test_output_file_and_yaml(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    as_json = tmp_path / "api.json"
    out = run_cli("asyncapi", "example_services.quickstart", "-o", str(as_json), "--version", "4.5.6", env=ENV)
    assert out.returncode == 0 and out.stdout == "", out.stderr
    doc = json.loads(as_json.read_text())
    assert doc["info"]["version"] == "4.5.6"
    as_yaml = tmp_path / "api.yaml"
    out = run_cli(
        "asyncapi", "example_services.quickstart", "--yaml", "-o", str(as_yaml), "--version", "4.5.6", env=ENV
    )
    assert out.returncode == 0, out.stderr
    text = as_yaml.read_text()
    assert text.startswith("asyncapi: 3.0.0\n") and "&id" not in text  # no YAML anchors
    assert yaml.safe_load(text) == doc
    stdout = run_cli("asyncapi", "example_services.quickstart:billing", "--yaml", env=ENV)
    assert stdout.returncode == 0 and yaml.safe_load(stdout.stdout)["channels"]["orders.placed"]
    unwritable = run_cli("asyncapi", "example_services.quickstart", "-o", str(tmp_path / "no" / "dir.json"), env=ENV)
    assert unwritable.returncode == 2 and "cannot write" in unwritable.stderr


def test_yaml_without_pyyaml_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    assert main(["asyncapi", "example_services.quickstart", "--yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install pyyaml" in err and "JSON" in err


def test_html_view_is_self_contained(tmp_path: Path, shapes_doc: dict[str, Any]) -> None:
    page = tmp_path / "api.html"
    out = run_cli("asyncapi", "example_services.quickstart", "--html", "-o", str(page), env=ENV)
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert html.startswith("<!doctype html>")
    for text in ("orders.place", "orders.placed", "billing.charge", "OrderPlaced", "total_cents", "<details"):
        assert text in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html, re.I)  # no remote asset
    assert "<script" not in html.lower() and "<link" not in html.lower() and "@import" not in html
    shapes = render_html(shapes_doc)
    assert "shapes.saga.payments" in shapes and "id='schema-Everything'" in shapes
    assert "href='#schema-Line'" in shapes  # $refs become links within the page


def test_hostile_names_are_escaped_in_the_html() -> None:
    doc = {"asyncapi": "3.0.0", "info": {"title": "<script>alert(1)</script>", "version": "1"}}
    html = render_html(doc)
    assert "<script>alert" not in html and "&lt;script&gt;" in html


def test_scalars_pydantic_free_types_and_custom_schemas() -> None:
    builder = SchemaBuilder()
    assert builder.schema(uuid.UUID) == {"type": "string", "format": "uuid"}
    assert builder.schema(decimal.Decimal) == {"type": "string", "format": "decimal"}
    assert builder.schema(dt.time) == {"type": "string", "format": "time"}
    assert builder.schema(typing.Optional[str]) == {"type": ["string", "null"]}  # noqa: UP045
    assert builder.schema(typing.Sequence[int]) == {"type": "array", "items": {"type": "integer"}}

    ref = builder.schema(Price)
    assert builder.components["Price"]["properties"]["amount"] == {"$ref": "#/components/schemas/Money"}
    assert builder.components["Money"] == {"type": "integer", "description": "cents"}
    assert ref == {"$ref": "#/components/schemas/Price"}

    with pytest.raises(UnsupportedType, match=r"Opaque.*at Wrapper\.inner\[\]"):
        builder.schema(Wrapper)
    assert "Wrapper" not in builder.components  # a failed class leaves no half-built schema


def test_two_classes_with_one_name_get_two_schemas() -> None:
    def make(field_type: type) -> type:
        return dataclasses.make_dataclass("Item", [("value", field_type)])

    builder = SchemaBuilder()
    first, second = builder.schema(make(int)), builder.schema(make(str))
    assert first != second
    assert {
        builder.components[r["$ref"].rsplit("/", 1)[1]]["properties"]["value"]["type"] for r in (first, second)
    } == {
        "integer",
        "string",
    }


def test_pydantic_models_use_their_own_schema() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        sku: str
        quantity: int = 1

    class Order(pydantic.BaseModel):
        order_id: str
        items: list[Item]
        note: str | None = None

    builder = SchemaBuilder()
    assert builder.schema(Order) == {"$ref": "#/components/schemas/Order"}
    order = builder.components["Order"]
    assert order["properties"]["items"]["items"] == {"$ref": "#/components/schemas/Item"}
    assert builder.components["Item"]["required"] == ["sku"] and "$defs" not in order
    doc = {
        "asyncapi": "3.0.0",
        "info": {"title": "t", "version": "1"},
        "components": {"schemas": builder.components},
    }
    assert_valid(doc)


def test_a_pydantic_model_nesting_a_model_named_like_another_schema_keeps_both() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Line(pydantic.BaseModel):  # the same name as tests/apps/asyncapiapp.Line (a dataclass)
        sku: str
        gift: bool = False

    class Basket(pydantic.BaseModel):
        lines: list[Line]

    builder = SchemaBuilder()
    builder.schema(Price)
    builder.schema(dataclasses.make_dataclass("Line", [("sku", str), ("quantity", int)]))
    builder.schema(Basket)
    basket_line = builder.components["Basket"]["properties"]["lines"]["items"]["$ref"].rsplit("/", 1)[1]
    assert basket_line != "Line" and "gift" in builder.components[basket_line]["properties"]
    assert "quantity" in builder.components["Line"]["properties"]
    assert_valid(
        {"asyncapi": "3.0.0", "info": {"title": "t", "version": "1"}, "components": {"schemas": builder.components}}
    )


def test_a_service_with_a_pydantic_payload_exports_its_model() -> None:
    pydantic = pytest.importorskip("pydantic")
    from framework import HandlerError, Service

    class Refund(pydantic.BaseModel):
        order_id: str
        cents: int

    service = Service("refunds")
    try:
        service.command("refunds.request")(_refund_handler(Refund))
    except HandlerError as exc:  # this framework version does not accept Pydantic payloads yet
        pytest.skip(str(exc))
    doc = build_document([service])
    assert_valid(doc)
    message = resolve(doc, doc["operations"]["refunds.refund"]["messages"][0])
    assert message["name"] == "Refund"
    assert resolve(doc, message["payload"])["required"] == ["order_id", "cents"]


def _refund_handler(model: type) -> Any:
    async def refund(request: Any) -> None: ...

    refund.__annotations__ = {"request": model, "return": None}
    return refund


def test_the_dashboard_serves_the_contract_under_its_content_security_policy(redis_url: str) -> None:
    """``framework dashboard --services ...`` (here ``create_app(services=...)``) serves the page at
    /asyncapi with its stylesheet from its own origin (no inline style the CSP would block), the document
    at /asyncapi.json (valid), and says how to give services when it has none."""
    from starlette.testclient import TestClient

    from framework.cli.run import load_services
    from framework.dashboard import create_app

    token = "t" * 24
    auth = {"Authorization": f"Bearer {token}"}
    services = load_services(["example_services.quickstart"])
    app = create_app(redis_url, f"contract-{os.getpid()}", token=token, services=services)
    with TestClient(app) as client:
        page = client.get("/asyncapi", headers=auth)
        assert page.status_code == 200, page.text
        csp = page.headers["content-security-policy"]
        assert "style-src 'self'" in csp and "unsafe-inline" not in csp, csp
        assert "<style" not in page.text and 'href="/asyncapi.css"' in page.text
        doc = client.get("/asyncapi.json", headers=auth).json()
        assert_valid(doc)
        for channel in doc["channels"].values():
            assert channel["address"] in page.text
        css = client.get("/asyncapi.css", headers=auth)
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    with TestClient(create_app(redis_url, f"contract-{os.getpid()}", token=token)) as client:
        none = client.get("/asyncapi", headers=auth)
        assert none.status_code == 404 and "--services" in none.text
