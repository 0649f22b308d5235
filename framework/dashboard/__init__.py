"""The operators' web dashboard: overview, dead letters, scheduled messages, and (opt-in) actions.

``framework dashboard`` serves it on 127.0.0.1; :func:`create_app` returns the ASGI app to mount in
a team's own service. Server-rendered (Starlette + Jinja2, htmx vendored under ``static/``), no
front-end build, no CDN. Needs the ``dashboard`` extra. See docs/dashboard.md.
"""

from framework.dashboard.app import create_app

__all__ = ["create_app"]
