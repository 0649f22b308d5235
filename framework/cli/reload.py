"""``framework run --reload``: notice a changed ``.py`` file by polling modification times.

No dependency: every 0.5 s the watcher lists the ``.py`` files under its roots (the working
directory and the directories of the service modules), skipping hidden directories, virtual
environments and caches, and compares their modification times and sizes with the last listing.
A file added, removed or changed counts. Meant for development trees, not for whole disks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ChangeWatcher", "service_directories"]

POLL_INTERVAL = 0.5
_SKIP = {"__pycache__", "node_modules", "site-packages", "venv", "env", "build", "dist"}

Snapshot = dict[str, tuple[int, int]]


def service_directories(targets: Iterable[str]) -> list[Path]:
    """Directories of the targets' modules (looked up, not imported, where the module is top-level)."""
    found: list[Path] = []
    for target in targets:
        name = target.partition(":")[0]
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            found.append(Path(spec.origin).resolve().parent)
    return found


class ChangeWatcher:
    """Tells whether a ``.py`` file under ``roots`` changed since the last look."""

    def __init__(self, roots: Iterable[Path]) -> None:
        unique: list[Path] = []
        for root in sorted({Path(r).resolve() for r in roots}):
            if not any(root.is_relative_to(other) for other in unique):
                unique.append(root)
        self.roots = unique
        self.snapshot = self.scan()
        self.checked = time.monotonic()

    @classmethod
    def for_targets(cls, targets: Iterable[str]) -> ChangeWatcher:
        """Watch the working directory and the service modules' directories."""
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)  # as the workers do: modules in the working directory are found
        return cls([Path(cwd), *service_directories(targets)])

    def scan(self) -> Snapshot:
        """(modification time, size) of every watched ``.py`` file."""
        found: Snapshot = {}
        for root in self.roots:
            for directory, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP]
                for name in files:
                    if name.endswith(".py"):
                        path = os.path.join(directory, name)
                        try:
                            st = os.stat(path)
                        except OSError:
                            continue
                        found[path] = (st.st_mtime_ns, st.st_size)
        return found

    def changed(self) -> str | None:
        """A changed, added or removed file since the last call (polled at most every 0.5 s), or None."""
        now = time.monotonic()
        if now - self.checked < POLL_INTERVAL:
            return None
        self.checked = now
        snapshot = self.scan()
        previous, self.snapshot = self.snapshot, snapshot
        for path, stamp in snapshot.items():
            if previous.get(path) != stamp:
                return path
        for path in previous:
            if path not in snapshot:
                return path
        return None
