"""``framework dashboard [--host H] [--port P] [--actions] [--token T]``: the operators' web dashboard.

Serves :func:`framework.dashboard.create_app` with uvicorn on 127.0.0.1:8765 by default, on the
broker every command finds (``--broker-url``, ``$BROKER_URL``, ``$REDIS_URL``, else the embedded
Valkey). Read-only unless ``--actions``. Off loopback it refuses to start without a token
(``--token`` or ``$FRAMEWORK_DASHBOARD_TOKEN``). Needs the ``dashboard`` extra.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from framework.cli.args import positive_int
from framework.cli.common import UsageError, connection_options
from framework.cli.run import load_services

__all__ = ["register"]


def serve(args: argparse.Namespace) -> int:
    """Check the options, build the app, serve it until interrupted."""
    token = args.token or os.environ.get("FRAMEWORK_DASHBOARD_TOKEN") or None
    try:
        import uvicorn

        from framework.dashboard import create_app
        from framework.dashboard.security import is_loopback
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"the dashboard needs the dashboard extra ({exc.name} is missing): pip install 'framework[dashboard]'"
        ) from None
    if not is_loopback(args.host) and token is None:
        raise UsageError(
            f"refusing to serve the dashboard on {args.host} without an access token: pass --token "
            "(or set FRAMEWORK_DASHBOARD_TOKEN), or keep the default --host 127.0.0.1"
        )
    if token is not None and len(token) < 16:
        raise UsageError("the access token is too short: use at least 16 characters (e.g. `openssl rand -hex 24`)")
    services = load_services(args.services) if args.services else []
    app = create_app(
        args.redis_url,
        args.namespace,
        actions=args.actions,
        token=token,
        database_url=args.database_url,
        services=services,
    )
    where = f"http://{args.host}:{args.port}/"
    print(f"dashboard on {where} ({'actions enabled' if args.actions else 'read-only'})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def register(sub: Any) -> None:
    """Add ``dashboard`` to the ``framework`` command."""
    p = sub.add_parser("dashboard", help="the operators' web dashboard (read-only unless --actions)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=positive_int, default=8765, help="port (default 8765)")
    p.add_argument("--actions", action="store_true", help="enable redrive, purge and cancel (default: read-only)")
    p.add_argument(
        "--token",
        default=None,
        help="access token every request must carry (required off loopback; default $FRAMEWORK_DASHBOARD_TOKEN)",
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="the services' outbox database, for the outbox backlog (default $DATABASE_URL; none: not shown)",
    )
    p.add_argument(
        "--services",
        nargs="+",
        metavar="MODULE:SERVICE",
        default=[],
        help="services whose AsyncAPI contract the dashboard shows at /asyncapi (as `framework asyncapi` takes them)",
    )
    connection_options(p)
    p.set_defaults(func=serve)
