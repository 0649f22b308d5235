"""The dashboard as an ASGI app: :func:`create_app` builds it; ``framework dashboard`` serves it.

One broker connection per app, opened by the app's lifespan (or given), and the same broker
discovery as every command (``url`` None: ``$BROKER_URL``, else ``$REDIS_URL``, else the embedded
Valkey). Mount it in a team's own ASGI app like any Starlette app::

    from framework.dashboard import create_app
    app.mount("/ops", create_app(token=os.environ["DASHBOARD_TOKEN"], actions=True))
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from broker import Broker, connect
from framework.dashboard import contract, outbox_pages, pages, posts
from framework.dashboard.context import DashboardState
from framework.dashboard.jobs import Jobs
from framework.dashboard.security import Guard
from framework.dashboard.sparklines import Samples
from framework.service import Service

__all__ = ["create_app"]

_HERE = Path(__file__).parent


def create_app(
    url: str | None = None,
    namespace: str | None = None,
    *,
    actions: bool = False,
    token: str | None = None,
    broker: Broker | None = None,
    trace_url: str | None = None,
    database_url: str | None = None,
    services: Sequence[Service] = (),
) -> Any:
    """The dashboard app (read-only unless ``actions``; without ``token`` it serves loopback only).

    ``broker`` uses a connection the caller owns instead of opening one; ``trace_url`` (default
    ``$FRAMEWORK_TRACE_URL``) links trace ids to a tracing UI: ``{trace_id}`` is replaced;
    ``database_url`` (default ``$DATABASE_URL``) is the services' outbox database, whose backlog
    the overview then shows, with an Outbox page of refused rows (needs the ``sql`` extra);
    ``services``: their AsyncAPI contract is served at ``/asyncapi`` (and ``/asyncapi.json``).
    """
    templates = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE / "templates"), autoescape=True, undefined=jinja2.StrictUndefined
    )
    st = DashboardState(
        broker=broker,
        actions=actions,
        templates=templates,
        jobs=Jobs(),
        samples=Samples(),
        trace_url=trace_url or os.environ.get("FRAMEWORK_TRACE_URL") or None,
        services=list(services),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        opened = st.broker is None
        if opened:
            st.broker = await connect(url, namespace=namespace)
        outbox_url = database_url or os.environ.get("DATABASE_URL")
        if outbox_url:
            try:
                from framework.outbox import create_engine as outbox_engine

                st.outbox_engine = outbox_engine(outbox_url)
            except ImportError as exc:
                st.outbox_note = f"the outbox backlog needs the sql extra ({exc.name} is missing)"
        else:
            st.outbox_note = "no outbox database given (--database-url or $DATABASE_URL)"
        try:
            yield
        finally:
            if st.outbox_engine is not None:
                await st.outbox_engine.dispose()
            if opened and st.broker is not None:
                await st.broker.close()
                st.broker = None

    routes = [
        Route("/", pages.overview_page),
        Route("/api/overview", pages.overview_json),
        Route("/dead-letters", pages.dead_letters_page),
        Route("/dead-letters/message", pages.message_page),
        Route("/dead-letters/classes", pages.classes_fragment),
        Route("/scheduled", pages.scheduled_page),
        Route("/jobs/{job}", pages.job_page),
        Route("/asyncapi", contract.asyncapi_page),
        Route("/asyncapi.json", contract.asyncapi_json),
        Route("/asyncapi.css", contract.asyncapi_css),
        Route("/dead-letters/confirm", posts.confirm, methods=["POST"]),
        Route("/dead-letters/apply", posts.apply, methods=["POST"]),
        Route("/scheduled/cancel", posts.cancel, methods=["POST"]),
        Route("/outbox", outbox_pages.outbox_page),
        Route("/outbox/confirm", outbox_pages.outbox_confirm, methods=["POST"]),
        Route("/outbox/apply", outbox_pages.outbox_apply, methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dashboard = st
    app.add_middleware(Guard, token=token, actions=actions)
    return app
