"""``framework server start|stop|status``: the per-user embedded Valkey that the other commands default to.

With ``--cluster N`` the same actions manage a local Redis Cluster of N embedded Valkey masters
(:mod:`broker.redis.embedded_cluster`); the other commands use it through ``REDIS_URL``, which
``start --cluster`` prints as a shell line reading the password file.

Its output names the password file, never the password. ``status --json`` prints the same as one
JSON object (``running``, ``url`` with the password as ``***``, ``port``, ``pid``, ``data_dir``,
``password_file``; with ``--cluster``: ``nodes``). ``start --port N`` starts the server on port N;
when one already runs on another port, it is refused in one line naming that port (stop it first).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from framework.cli.args import port as port_number
from framework.cli.common import UsageError, print_json

__all__ = ["register"]


def manage_server(args: argparse.Namespace) -> int:
    """Start, stop or show the per-user embedded Valkey; exit status 3 when ``status`` finds it stopped."""
    if args.cluster is not None:
        return manage_cluster(args)
    from broker.redis.embedded import EmbeddedServer

    server = EmbeddedServer(args.data_dir)
    if args.action == "start":
        st = server.status()
        if st.running and args.port is not None and st.port != args.port:
            raise UsageError(
                f"the embedded Valkey already runs on port {st.port} (pid {st.pid}, data in {server.data_dir}): "
                f"--port {args.port} not applied; stop it first (framework server stop) to move it"
            )
        server.ensure_running(port=args.port)
        st = server.status()
        print(
            f"embedded Valkey running at redis://127.0.0.1:{st.port}/0 pid {st.pid} "
            f"(data in {server.data_dir}; password in {server.data_dir / 'password'})"
        )
    elif args.action == "stop":
        print("stopped" if server.stop() else f"not running (data dir {server.data_dir})")
    else:
        st = server.status()
        if args.json:
            print_json(
                {
                    "running": st.running,
                    "url": st.safe_url,
                    "port": st.port,
                    "pid": st.pid,
                    "data_dir": str(st.data_dir),
                    "password_file": str(st.data_dir / "password"),
                }
            )
            return 0 if st.running else 3
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


def manage_cluster(args: argparse.Namespace) -> int:
    """``--cluster``: start, stop or show the local cluster; exit status 3 when ``status`` finds it stopped."""
    from broker.redis.embedded_cluster import LocalCluster

    cluster = LocalCluster(args.data_dir)
    password_file = cluster.data_dir / "password"
    if args.action == "start":
        if args.cluster < 1:
            raise SystemExit("framework server: --cluster needs a number of masters, at least 1 (e.g. --cluster 3)")
        st = cluster.status()
        if st.running and args.port is not None and st.nodes[0].port != args.port:
            raise UsageError(
                f"the local cluster already runs on ports {', '.join(str(n.port) for n in st.nodes)}: "
                f"--port {args.port} not applied; stop it first (framework server stop --cluster) to move it"
            )
        cluster.ensure_running(args.cluster, base_port=args.port)
        st = cluster.status()
        ports = ", ".join(str(n.port) for n in st.nodes)
        first = st.nodes[0].port
        print(f"local cluster of {len(st.nodes)} Valkey masters running on 127.0.0.1 ports {ports}")
        print(f"data in {cluster.data_dir}; password in {password_file}")
        print("use it from a shell with:")
        print(f'  export REDIS_URL="redis://:$(cat {shlex.quote(str(password_file))})@127.0.0.1:{first}/0"')
    elif args.action == "stop":
        print("stopped the local cluster" if cluster.stop() else f"local cluster not running (dir {cluster.data_dir})")
    else:
        st = cluster.status()
        if args.json:
            print_json(
                {
                    "running": st.running,
                    "url": st.safe_url if st.running else None,
                    "data_dir": str(st.data_dir),
                    "password_file": str(password_file),
                    "nodes": [{"port": n.port, "bus_port": n.bus_port, "pid": n.pid} for n in st.nodes],
                }
            )
            return 0 if st.running else 3
        if not st.running:
            print(f"local cluster not running (dir {st.data_dir}); start it with `framework server start --cluster 3`")
            return 3
        info = cluster.cluster_info()
        print(f"running: {st.safe_url} (cluster_state:{info.get('cluster_state', '?')})")
        print(f"data dir: {st.data_dir}")
        for i, node in enumerate(st.nodes):
            print(f"node {i}: port {node.port} (bus {node.bus_port}) pid {node.pid}")
        print(f"password: in {password_file}")
    return 0


def register(sub: Any) -> None:
    """Add ``server`` to the ``framework`` command."""
    server = sub.add_parser("server", help="manage the embedded Valkey server (or a local cluster: --cluster N)")
    server.add_argument("action", choices=("start", "stop", "status"))
    server.add_argument(
        "--data-dir",
        default=None,
        help="default: $FRAMEWORK_HOME/valkey (with --cluster: $FRAMEWORK_HOME/valkey-cluster)",
    )
    server.add_argument(
        "--cluster",
        type=int,
        nargs="?",
        const=3,
        default=None,
        metavar="N",
        help="a local Redis Cluster of N masters (default 3) instead of the single server",
    )
    server.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="with start: the server's port (with --cluster: the first node's, then +1, +2...); default: the "
        "previous one, else a free one; refused when it already runs on another",
    )
    server.add_argument("--json", action="store_true", help="with status: one JSON object (exit status 3: stopped)")
    server.set_defaults(func=manage_server)
