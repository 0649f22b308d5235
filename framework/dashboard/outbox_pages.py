"""The dashboard's Outbox page: refused outbox rows, retried or discarded (one, or the ticked ones).

Shown when the dashboard has the services' outbox database. An action names the message ids the
operator saw and ticked (never "all"), is counted and confirmed first, and goes through
:mod:`framework.operations.outbox` (audit log, the relay's own refusal check on retry).
"""

from __future__ import annotations

from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from framework.dashboard.context import broker_of, render, state
from framework.dashboard.posts import checked_form
from framework.operations.outbox import discard_refused, refused_outbox, retry_refused

__all__ = ["outbox_apply", "outbox_confirm", "outbox_page"]

_ACTIONS = ("retry", "discard")


def _no_outbox(request: Request) -> Response | None:
    if state(request).outbox_engine is None:
        note = state(request).outbox_note or "no outbox database given (--database-url or $DATABASE_URL)"
        return render(request, "error.html", 404, message=note)
    return None


async def outbox_page(request: Request) -> Response:
    """Refused outbox rows, oldest first, with their reason and body (secrets redacted)."""
    missing = _no_outbox(request)
    if missing is not None:
        return missing
    try:
        rows, total = await refused_outbox(state(request).outbox_engine)
    except Exception as exc:  # a missing table, a database down: said on the page, not a crash
        text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return render(request, "error.html", 503, message=text[0] if text else type(exc).__name__)
    return render(request, "outbox.html", rows=rows, total=total, done=request.query_params.get("done"))


def _action_of(form: dict[str, list[str]]) -> tuple[str, list[str]]:
    """The action and the message ids a form names: a row's own button, else the ticked rows."""
    for action in _ACTIONS:
        one = [v for v in form.get(f"{action}_one", []) if v]
        if one:
            return action, one[:1]
    action = (form.get("action") or [""])[0]
    if action not in _ACTIONS:
        raise ValueError(f"unknown action {action!r}: retry or discard")
    ids = [v for v in form.get("ids", []) if v]
    if not ids:
        raise ValueError(f"nothing selected: tick the refused outbox rows to {action}")
    return action, ids


async def outbox_confirm(request: Request) -> Response:
    """Count what a retry or discard would act on, and ask."""
    checked = await checked_form(request)
    if isinstance(checked, Response):
        return checked
    missing = _no_outbox(request)
    if missing is not None:
        return missing
    try:
        action, ids = _action_of(checked[1])
    except ValueError as exc:
        return render(request, "error.html", 400, message=str(exc))
    return render(request, "outbox_confirm.html", action=action, ids=ids, count=len(ids))


async def outbox_apply(request: Request) -> Response:
    """Run a confirmed retry or discard on exactly the ids named; back to the page, saying what it did."""
    checked = await checked_form(request)
    if isinstance(checked, Response):
        return checked
    missing = _no_outbox(request)
    if missing is not None:
        return missing
    guard, form = checked
    try:
        action, ids = _action_of(form)
    except ValueError as exc:
        return render(request, "error.html", 400, message=str(exc))
    engine, who = state(request).outbox_engine, guard.who(request)
    if action == "retry":
        r = await retry_refused(engine, broker_of(request), ids, who=who)
        note, gone = f"{r.requeued} of {len(ids)} put back in line", len(r.unknown)
        if r.still_refused:
            note += f"; {len(r.still_refused)} stay refused (the broker would refuse them again at once)"
    else:
        d = await discard_refused(engine, ids, who=who)
        note, gone = f"{d.done} of {len(ids)} discarded", d.gone
    if gone:
        note += f"; {gone} no longer refused (sent, retried or discarded meanwhile)"
    return RedirectResponse(f"{request.scope.get('root_path', '')}/outbox?{urlencode({'done': note})}", 303)
