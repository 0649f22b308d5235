"""The dashboard's actions (POST only, with actions enabled, same-origin and CSRF checked by the guard).

Bulk dead-letter actions go in two steps: ``confirm`` counts the frozen set and asks, ``apply``
runs it as a job with progress. The frozen set is either the refs the page showed (a selection,
or one message) or a filter with ``upto``, the newest entry id when the page loaded: entries
that arrived after are never part of it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from framework.dashboard.context import broker_of, render, state
from framework.dashboard.jobs import Job
from framework.dashboard.pages import filter_of, filter_params
from framework.dashboard.security import Guard, form_data
from framework.operations import ActionResult, cancel_scheduled, frozen_refs, purge, redrive

__all__ = ["apply", "cancel", "checked_form", "confirm"]

_ACTIONS = ("redrive", "purge")


async def checked_form(request: Request) -> tuple[Guard, dict[str, list[str]]] | Response:
    """The guard and the form of a POST the guard lets through, else its refusal (read-only, CSRF...)."""
    guard: Guard = request.scope["state"]["guard"]
    refused = await guard.check_post(request)
    if refused is not None:
        return refused
    return guard, await form_data(request)


async def _frozen_set(request: Request, form: dict[str, list[str]]) -> tuple[list[str], dict[str, str]]:
    """The refs an action acts on, and the form fields that name them again (refs, or filter + upto)."""
    refs = [r for r in form.get("refs", []) if r]
    if refs:
        return refs, {}
    one = {k: v[0] for k, v in form.items() if v}
    upto = one.get("upto", "")
    if not upto:
        raise ValueError("nothing selected: tick dead letters, or act on the whole filter of a page")
    fields = {**filter_params(one), "upto": upto}
    return await frozen_refs(broker_of(request), filter_of(one), upto), fields


async def _dead_letter_post(request: Request) -> tuple[Guard, str, list[str], dict[str, str]] | Response:
    """The guard, the action and its frozen set (refs, and the fields naming them again) of a bulk
    dead-letter POST, else the response refusing it."""
    checked = await checked_form(request)
    if isinstance(checked, Response):
        return checked
    guard, form = checked
    action = (form.get("action") or [""])[0]
    if action not in _ACTIONS:
        return render(request, "error.html", 400, message=f"unknown action {action!r}: redrive or purge")
    try:
        refs, fields = await _frozen_set(request, form)
    except ValueError as exc:
        return render(request, "error.html", 400, message=str(exc))
    return guard, action, refs, fields


async def confirm(request: Request) -> Response:
    """Count what a redrive or purge would act on, and ask."""
    post = await _dead_letter_post(request)
    if isinstance(post, Response):
        return post
    _, action, refs, fields = post
    return render(
        request, "confirm.html", action=action, refs=refs if not fields else [], count=len(refs), fields=fields
    )


async def apply(request: Request) -> Response:
    """Run a confirmed redrive or purge on the frozen set, as a job; go to its progress page."""
    post = await _dead_letter_post(request)
    if isinstance(post, Response):
        return post
    guard, action, refs, _ = post
    broker = broker_of(request)
    who = guard.who(request)

    async def run(job: Job) -> ActionResult:
        if action == "redrive":
            return await redrive(broker, refs, who=who, progress=job.progress)
        return await purge(broker, refs, who=who, progress=job.progress)

    job = state(request).jobs.start(f"{action} {len(refs)} dead letter(s)", len(refs), run)
    return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{job.id}", 303)


async def cancel(request: Request) -> Response:
    """Cancel one scheduled message before it is delivered."""
    checked = await checked_form(request)
    if isinstance(checked, Response):
        return checked
    guard, form = checked
    message_id = (form.get("id") or [""])[0]
    if not message_id:
        return render(request, "error.html", 400, message="say which scheduled message to cancel (its id)")
    result = await cancel_scheduled(broker_of(request), [message_id], who=guard.who(request))
    note = "cancelled" if result.done else "already delivered or cancelled"
    return RedirectResponse(f"{request.scope.get('root_path', '')}/scheduled?done={note}", 303)
