"""The dashboard's contract pages: the AsyncAPI document of the services it was given, as a page
(``/asyncapi``), as JSON (``/asyncapi.json``) and the page's stylesheet (``/asyncapi.css``), all local:
the page links its CSS from this origin, so the dashboard's Content-Security-Policy holds.

Services come from ``create_app(services=...)`` or ``framework dashboard --services MODULE:SERVICE``;
without any, the pages say how to give them (404).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from framework.asyncapi import AsyncAPIError, build_document, render_html
from framework.asyncapi.html import stylesheet
from framework.dashboard.context import state

__all__ = ["asyncapi_css", "asyncapi_json", "asyncapi_page"]

_NONE = (
    "no services given to the dashboard: start it with --services MODULE:SERVICE "
    "(or create_app(services=[...])) to see their AsyncAPI contract"
)


def _document(request: Request) -> dict[str, object] | Response:
    services = state(request).services
    if not services:
        return PlainTextResponse(_NONE, 404)
    try:
        return build_document(services, lenient=True)
    except AsyncAPIError as exc:
        return PlainTextResponse(str(exc), 500)


async def asyncapi_page(request: Request) -> Response:
    """The services' contract as a page (its stylesheet linked from this origin)."""
    doc = _document(request)
    if isinstance(doc, Response):
        return doc
    base = request.scope.get("root_path", "")
    return HTMLResponse(render_html(doc, css_href=f"{base}/asyncapi.css"))


async def asyncapi_json(request: Request) -> Response:
    """The services' AsyncAPI 3.0 document."""
    doc = _document(request)
    return doc if isinstance(doc, Response) else JSONResponse(doc)


async def asyncapi_css(request: Request) -> Response:
    """The contract page's stylesheet."""
    return Response(stylesheet(), media_type="text/css")
