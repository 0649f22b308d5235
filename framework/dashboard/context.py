"""What the dashboard's pages share: its state (broker, actions on, jobs, samples) and page rendering."""

from __future__ import annotations

from typing import Any

import attrs
import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from broker import Broker
from framework.dashboard.jobs import Jobs
from framework.dashboard.security import Guard
from framework.dashboard.sparklines import Samples

__all__ = ["DashboardState", "broker_of", "render", "state"]


@attrs.define
class DashboardState:
    """What the pages share: the broker, whether actions are on, jobs, samples, the trace link format."""

    broker: Broker | None
    actions: bool
    templates: jinja2.Environment
    jobs: Jobs
    samples: Samples
    trace_url: str | None
    outbox_engine: Any = None  # the services' outbox database (an SQLAlchemy async engine), when given
    outbox_note: str | None = None  # why the outbox backlog is not shown
    services: list[Any] = attrs.field(factory=list)  # framework.Service: their contract at /asyncapi


def state(request: Request) -> DashboardState:
    """The app's shared state."""
    st: DashboardState = request.app.state.dashboard
    return st


def broker_of(request: Request) -> Broker:
    """The connected broker (the app's lifespan opened it)."""
    b = state(request).broker
    if b is None:
        raise RuntimeError("the dashboard's broker is not connected (run the app with its lifespan)")
    return b


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A page from ``templates/`` with what every page needs (base path, CSRF token, actions on)."""
    st = state(request)
    guard: Guard = request.scope["state"]["guard"]
    html = st.templates.get_template(template).render(
        base=request.scope.get("root_path", ""),
        csrf=guard.csrf(request),
        actions=st.actions,
        has_outbox=st.outbox_engine is not None,
        namespace=broker_of(request).namespace,
        request=request,
        **context,
    )
    return HTMLResponse(html, status)
