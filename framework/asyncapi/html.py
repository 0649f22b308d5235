"""An AsyncAPI document -> one self-contained HTML page (inline CSS, no script, no external asset).

The page lists the channels, the operations and the messages with their payload schemas as
collapsible tables (``<details>``), and the document itself as JSON at the end. It loads nothing
from the network, so it opens offline; the dashboard serves the same page at ``/asyncapi`` with its
CSS linked from its own origin (``css_href``), under its strict content security policy.
"""

from __future__ import annotations

from html import escape
from typing import Any

import orjson

__all__ = ["render_html", "stylesheet"]

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{margin:0 0 4px}h2{margin-top:32px;border-bottom:2px solid #d9dde5;padding-bottom:4px}
details{background:#fff;border:1px solid #d9dde5;border-radius:6px;margin:8px 0;padding:6px 12px}
summary{cursor:pointer;font-weight:600}summary code{font-size:15px}
table{border-collapse:collapse;width:100%;margin:8px 0}
th,td{text-align:left;border-bottom:1px solid #eceef2;padding:4px 8px;vertical-align:top}
th{font-weight:600;color:#4a5163;width:22%}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px}
.kind{display:inline-block;border-radius:4px;padding:0 6px;font-size:12px;margin-left:6px;color:#fff}
.topic{background:#2f6fdb}.queue{background:#2e8b57}.receive{background:#7a4fd1}.send{background:#c46a12}
.muted{color:#6b7280}.req{color:#b42318;font-size:12px}
pre{background:#0f172a;color:#e2e8f0;padding:12px;border-radius:6px;overflow:auto;font-size:12px}
"""


def stylesheet() -> str:
    """The page's CSS (inlined by :func:`render_html` unless it is given a stylesheet address)."""
    return _CSS


def render_html(document: dict[str, Any], *, css_href: str | None = None) -> str:
    """The page of ``document`` (an AsyncAPI 3.0 dict as :func:`~framework.asyncapi.build_document` gives):
    self-contained, or linking ``css_href`` for :func:`stylesheet` (a page served under a Content-Security-Policy
    that forbids inline styles, as the dashboard's)."""
    info = document.get("info", {})
    components = document.get("components", {})
    title = escape(str(info.get("title", "AsyncAPI")))
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{title}</title>"
        + (f'<link rel="stylesheet" href="{escape(css_href)}">' if css_href else f"<style>{_CSS}</style>")
        + "</head><body><main>",
        f"<h1>{title} <span class='muted'>{escape(str(info.get('version', '')))}</span></h1>",
        f"<p class='muted'>AsyncAPI {escape(str(document.get('asyncapi', '')))}</p>",
    ]
    if info.get("description"):
        parts.append(f"<p>{escape(str(info['description']))}</p>")
    parts.append("<h2>Channels</h2>")
    operations = document.get("operations", {})
    for channel_id, channel in document.get("channels", {}).items():
        parts.append(_channel(channel_id, channel, operations))
    parts.append("<h2>Operations</h2>")
    for operation_id, operation in operations.items():
        parts.append(_operation(operation_id, operation))
    parts.append("<h2>Messages</h2>")
    for message_id, message in components.get("messages", {}).items():
        parts.append(_message(message_id, message))
    parts.append("<h2>Schemas</h2>")
    for schema_id, schema in components.get("schemas", {}).items():
        parts.append(_schema(schema_id, schema))
    raw = escape(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())
    parts.append(f"<h2>Document</h2><details><summary>AsyncAPI JSON</summary><pre>{raw}</pre></details>")
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


def _anchor(prefix: str, name: str) -> str:
    return f"{prefix}-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _link(ref: str) -> str:
    """A ``$ref`` as a link to its section of the page."""
    segments = ref.lstrip("#/").split("/")
    name = segments[-1].replace("~1", "/").replace("~0", "~")
    prefix = {"schemas": "schema", "messages": "message", "channels": "channel"}.get(segments[-2], "x")
    if len(segments) > 2 and segments[0] == "channels" and segments[-2] == "messages":
        prefix = "message"  # #/channels/X/messages/M is the component message M
    return f"<a href='#{_anchor(prefix, name)}'><code>{escape(name)}</code></a>"


def _rows(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _extensions(obj: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in obj.items():
        if key.startswith("x-"):
            shown = value if isinstance(value, str) else orjson.dumps(value).decode()
            rows.append((key, f"<code>{escape(shown)}</code>"))
    return rows


def _channel(channel_id: str, channel: dict[str, Any], operations: dict[str, Any]) -> str:
    kind = str(channel.get("x-framework-kind", ""))
    badge = f"<span class='kind {escape(kind)}'>{escape(kind)}</span>" if kind else ""
    receivers = [
        f"<a href='#{_anchor('operation', op_id)}'><code>{escape(op_id)}</code></a>"
        for op_id, op in operations.items()
        if op.get("channel", {}).get("$ref") == f"#/channels/{channel_id.replace('~', '~0').replace('/', '~1')}"
    ]
    rows = [("address", f"<code>{escape(str(channel.get('address', '')))}</code>")]
    if channel.get("description"):
        rows.append(("description", escape(str(channel["description"]))))
    rows.append(("messages", ", ".join(_link(m["$ref"]) for m in channel.get("messages", {}).values())))
    rows.append(("operations", ", ".join(receivers) or "<span class='muted'>none</span>"))
    rows += _extensions(channel)
    return (
        f"<details open id='{_anchor('channel', channel_id)}'><summary><code>{escape(channel_id)}</code>{badge}"
        f"</summary>{_rows(rows)}</details>"
    )


def _operation(operation_id: str, operation: dict[str, Any]) -> str:
    action = str(operation.get("action", ""))
    rows = [
        ("action", escape(action)),
        ("channel", _link(operation.get("channel", {}).get("$ref", ""))),
        ("messages", ", ".join(_link(m.get("$ref", "")) for m in operation.get("messages", []))),
    ]
    if operation.get("summary"):
        rows.append(("summary", escape(str(operation["summary"]))))
    rows += _extensions(operation)
    return (
        f"<details id='{_anchor('operation', operation_id)}'><summary><code>{escape(operation_id)}</code>"
        f"<span class='kind {escape(action)}'>{escape(action)}</span></summary>{_rows(rows)}</details>"
    )


def _message(message_id: str, message: dict[str, Any]) -> str:
    rows = []
    for key in ("name", "title", "summary", "contentType"):
        if message.get(key):
            rows.append((key, f"<code>{escape(str(message[key]))}</code>"))
    headers = message.get("headers", {})
    if headers:
        rows.append(("headers", _type(headers)))
    rows.append(("payload", _type(message.get("payload", {}))))
    rows += _extensions(message)
    payload = message.get("payload", {})
    inline = _properties(payload) if "properties" in payload else ""
    return (
        f"<details id='{_anchor('message', message_id)}'><summary><code>{escape(message_id)}</code></summary>"
        f"{_rows(rows)}{inline}</details>"
    )


def _schema(schema_id: str, schema: dict[str, Any]) -> str:
    rows = []
    if schema.get("description"):
        rows.append(("description", escape(str(schema["description"]))))
    if "properties" not in schema:
        rows.append(("type", _type(schema)))
    return (
        f"<details id='{_anchor('schema', schema_id)}'><summary><code>{escape(schema_id)}</code></summary>"
        f"{_rows(rows) if rows else ''}{_properties(schema)}</details>"
    )


def _properties(schema: dict[str, Any]) -> str:
    properties = schema.get("properties", {})
    if not properties:
        return ""
    required = set(schema.get("required", []))
    rows = "".join(
        f"<tr><td><code>{escape(name)}</code>{' <span class=req>required</span>' if name in required else ''}</td>"
        f"<td>{_type(prop)}</td><td>{escape(str(prop.get('description', '')))}</td></tr>"
        for name, prop in properties.items()
    )
    return f"<table><tr><th>field</th><th>type</th><th>description</th></tr>{rows}</table>"


def _type(schema: Any) -> str:
    """A schema in one short line: a link for ``$ref``, ``array of X``, ``A | B``, ``one of …``."""
    if not isinstance(schema, dict) or not schema:
        return "<span class='muted'>any JSON</span>"
    if "$ref" in schema:
        return _link(str(schema["$ref"]))
    for combiner in ("anyOf", "oneOf", "allOf"):
        if combiner in schema:
            joiner = " &amp; " if combiner == "allOf" else " | "
            return joiner.join(_type(s) for s in schema[combiner])
    if "enum" in schema:
        return "one of " + ", ".join(f"<code>{escape(orjson.dumps(v).decode())}</code>" for v in schema["enum"])
    if "const" in schema:
        return f"<code>{escape(orjson.dumps(schema['const']).decode())}</code>"
    kind = schema.get("type", "")
    kinds = kind if isinstance(kind, list) else [kind]
    shown = " | ".join(escape(str(k)) for k in kinds if k)
    if schema.get("format"):
        shown += f" ({escape(str(schema['format']))})"
    if "array" in kinds and isinstance(schema.get("items"), dict):
        shown += f" of {_type(schema['items'])}"
    elif "array" in kinds and isinstance(schema.get("items"), list):
        shown += " [" + ", ".join(_type(s) for s in schema["items"]) + "]"
    elif "object" in kinds and isinstance(schema.get("additionalProperties"), dict):
        shown += f" of {_type(schema['additionalProperties'])}"
    return f"<code>{shown or 'any JSON'}</code>"
