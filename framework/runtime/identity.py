"""Consumer names that survive restarts: host name plus the lowest free slot number on this host.

A slot is held by an exclusive lock on a file in the temp directory; the operating system drops
the lock when the process dies, so a process that restarts takes the same slot again and, under
its old consumer name, re-reads the entries it left pending. Two live processes never share a name.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["ConsumerIdentity"]


class ConsumerIdentity:
    """A consumer name held for the life of this object (or the process)."""

    def __init__(self, namespace: str, name: str | None = None, *, lock_dir: Path | None = None) -> None:
        self._file: IO[str] | None = None
        explicit = name or os.environ.get("FRAMEWORK_CONSUMER")
        if explicit:
            self.name = explicit
            return
        host = socket.gethostname().split(".")[0] or "host"
        directory = lock_dir or Path(tempfile.gettempdir()) / "framework-consumers"
        directory.mkdir(parents=True, exist_ok=True)
        slot = 0
        while True:
            f = open(directory / f"{namespace}-{host}-{slot}.lock", "a+")  # noqa: SIM115 - held while we live
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                slot += 1
                continue
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            self._file = f
            self.name = f"{host}-{slot}"
            return

    def release(self) -> None:
        """Give the name back (the next process on this host may take it)."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
