"""The dashboard's pages (GET only, nothing changes): overview, dead letters, one message, scheduled, jobs."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.capabilities import SCHEDULING, as_scheduler
from framework.dashboard.context import broker_of, render, state
from framework.dashboard.sparklines import sparkline
from framework.dead_letters import DeadLetters
from framework.operations import DeadLetterFilter, classes, iso_ms, load_overview, page, redact_body, redact_value
from framework.operations.dead_letters import get_dead_letter
from framework.operations.outbox import outbox_backlog

__all__ = [
    "classes_fragment",
    "dead_letters_page",
    "filter_of",
    "job_page",
    "message_page",
    "overview_json",
    "overview_page",
]

_FILTER_FIELDS = ("destination", "group", "handler", "error_type", "reason", "q", "id", "since", "until")


def _time_ms(text: str, name: str) -> int | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{name}: not a date and time ({text!r}); use YYYY-MM-DDTHH:MM, UTC") from None
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp() * 1000)


def filter_of(params: Mapping[str, str]) -> DeadLetterFilter:
    """The dead-letter filter a query string or form names (ValueError naming a bad field)."""
    g = {k: (params.get(k) or "").strip() for k in _FILTER_FIELDS}
    return DeadLetterFilter(
        destination=g["destination"] or None,
        group=g["group"] or None,
        handler=g["handler"] or None,
        error_type=g["error_type"] or None,
        reason=g["reason"] or None,
        text=g["q"] or None,
        ident=g["id"] or None,
        since_ms=_time_ms(g["since"], "since"),
        until_ms=_time_ms(g["until"], "until"),
    )


def filter_params(params: Mapping[str, str]) -> dict[str, str]:
    """The filter fields set in ``params`` (to carry into links and forms)."""
    return {k: params[k] for k in _FILTER_FIELDS if params.get(k)}


async def overview_page(request: Request) -> Response:
    """Services and groups, live workers, destinations with depth, lag, pending, owners, scheduled."""
    ov = await load_overview(broker_of(request))
    data = ov.to_json()
    st = state(request)
    st.samples.add(
        [(d["name"], g["group"], g["delivered"], g["dead_letters"]) for d in data["destinations"] for g in d["groups"]]
    )
    spark = {
        (d["name"], g["group"]): (
            sparkline(st.samples.rates(d["name"], g["group"], 1), label="throughput"),
            sparkline(st.samples.rates(d["name"], g["group"], 2), label="failures"),
        )
        for d in data["destinations"]
        for g in d["groups"]
    }
    services: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for d in data["destinations"]:
        for g in d["groups"]:
            services.setdefault(g["group"], []).append((d["name"], g))
    owners = [
        (s.spec.name, p.partition, g) for s in ov.states for p in s.partitions for g in p.groups if g.lease is not None
    ]
    outbox = await outbox_backlog(st.outbox_engine) if st.outbox_engine is not None else None
    return render(
        request,
        "overview.html",
        ov=data,
        services=services,
        owners=owners,
        spark=spark,
        outbox=outbox,
        outbox_note=st.outbox_note,
    )


async def overview_json(request: Request) -> Response:
    """The overview as JSON: the same data as ``framework status --json`` (under ``destinations``)."""
    return JSONResponse((await load_overview(broker_of(request))).to_json())


async def dead_letters_page(request: Request) -> Response:
    """Dead letters newest first, filtered, with their classes; cursor paging on a frozen bound."""
    params = request.query_params
    try:
        f = filter_of(params)
        limit = min(max(int(params.get("limit") or 50), 1), 500)
        broker = broker_of(request)
        result = await page(
            broker, f, cursor=params.get("cursor") or None, upto=params.get("upto") or None, limit=limit
        )
    except ValueError as exc:
        return render(request, "error.html", 400, message=str(exc))
    kept = filter_params(params)
    next_link = None
    if result.next_cursor:
        next_link = "?" + urlencode({**kept, "cursor": result.next_cursor, "upto": result.upto or "", "limit": limit})
    return render(
        request,
        "dead_letters.html",
        page=result,
        classes_link="?" + urlencode({**kept, "upto": result.upto or ""}) if not params.get("cursor") else None,
        filters=kept,
        f=f,
        next_link=next_link,
        first_link="?" + urlencode(kept),
        iso=lambda d: d.isoformat(timespec="seconds") if d else "",
        link=lambda **kw: "?" + urlencode({k: v for k, v in kw.items() if v}),
    )


async def classes_fragment(request: Request) -> Response:
    """The classes table of a filter (loaded by the dead-letters page after it is shown)."""
    params = request.query_params
    try:
        f = filter_of(params)
    except ValueError as exc:
        return render(request, "error.html", 400, message=str(exc))
    kinds, looked = await classes(broker_of(request), f, upto=params.get("upto") or None)
    return render(
        request,
        "classes.html",
        classes=kinds,
        classes_looked=looked,
        link=lambda **kw: "?" + urlencode({k: v for k, v in kw.items() if v}),
    )


def _trace_id(headers: Mapping[str, Any]) -> str | None:
    parent = str(headers.get("traceparent") or "")
    parts = parent.split("-")
    return parts[1] if len(parts) >= 3 and len(parts[1]) == 32 else None


async def message_page(request: Request) -> Response:
    """One dead letter: body (secrets redacted), headers, reason, traceback, attempts, trace link."""
    ref = request.query_params.get("ref", "")
    try:
        broker = broker_of(request)
        d = await DeadLetters(broker).get(ref) if ref.count("/") < 3 else await get_dead_letter(broker, ref)
    except (KeyError, ValueError) as exc:
        return render(request, "error.html", 404, message=str(exc.args[0]))
    trace = _trace_id(d.headers)
    trace_url = state(request).trace_url
    headers = orjson.dumps(redact_value(d.headers), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    return render(
        request,
        "message.html",
        d=d,
        body=redact_body(d.body),
        headers_text=headers,
        trace=trace,
        trace_link=trace_url.replace("{trace_id}", trace) if trace and trace_url else None,
        iso=lambda t: t.isoformat(timespec="milliseconds") if t else "",
    )


async def scheduled_page(request: Request) -> Response:
    """Messages waiting for their due time, earliest first (100 at most)."""
    broker = broker_of(request)
    items = []
    if SCHEDULING in broker.capabilities:
        for m in await as_scheduler(broker).scheduled_messages(limit=100):
            env = m.envelope
            items.append(
                {
                    "id": m.message_id,
                    "destination": m.destination,
                    "partition": m.partition,
                    "due": iso_ms(m.due_ms),
                    "type": env.type if env else "(undecodable)",
                    "body": redact_body(env.body) if env else "",
                }
            )
    return render(request, "scheduled.html", items=items, supported=SCHEDULING in broker.capabilities)


async def job_page(request: Request) -> Response:
    """A bulk action's progress (the page refreshes itself until the job is over)."""
    job = state(request).jobs.get(request.path_params["job"])
    if job is None:
        return render(request, "error.html", 404, message="no such job (jobs are kept in memory, the last 100)")
    fragment = request.headers.get("hx-request") == "true"
    return render(request, "job_fragment.html" if fragment else "job.html", job=job)
