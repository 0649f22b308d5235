"""``framework server start|stop|status``: the per-user embedded Valkey that the other commands default to.

Its output names the password file, never the password.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def manage_server(args: argparse.Namespace) -> int:
    """Start, stop or show the per-user embedded Valkey; exit status 3 when ``status`` finds it stopped."""
    from broker.embedded import EmbeddedServer

    server = EmbeddedServer(args.data_dir)
    if args.action == "start":
        server.ensure_running()
        st = server.status()
        print(
            f"embedded Valkey running at redis://127.0.0.1:{st.port}/0 pid {st.pid} "
            f"(data in {server.data_dir}; password in {server.data_dir / 'password'})"
        )
    elif args.action == "stop":
        print("stopped" if server.stop() else f"not running (data dir {server.data_dir})")
    else:
        st = server.status()
        if st.running:
            print(f"running: {st.safe_url}")
            print(f"data dir: {st.data_dir}")
            print(f"pid: {st.pid}")
            print(f"port: {st.port}")
            print(f"password: in {st.data_dir / 'password'} (clients find it there)")
        else:
            print(f"not running (data dir {st.data_dir}); start it with `framework server start`")
            return 3
    return 0


def register(sub: Any) -> None:
    """Add ``server`` to the ``framework`` command."""
    server = sub.add_parser("server", help="manage the embedded Valkey server")
    server.add_argument("action", choices=("start", "stop", "status"))
    server.add_argument("--data-dir", default=None, help="default: $FRAMEWORK_HOME/valkey")
    server.set_defaults(func=manage_server)
