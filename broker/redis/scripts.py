"""The Lua scripts in ``broker/redis/lua/``, loaded once per connection and called by SHA.

Each script's header documents the keys it touches. A script missing on the server (after a
restart or SCRIPT FLUSH) is loaded again and the call repeated; the scripts are written so that
a repeated call after NOSCRIPT is safe, since NOSCRIPT means the first call did not run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["Script", "load_scripts"]

_NAMES = (
    "ack",
    "dead_letter",
    "retry_later",
    "move_due",
    "extend",
    "trim",
    "publish_once",
    "redrive",
    "inbox_claim",
    "commit_effects",
    "publish_batch",
    "lease",
    "owned_intake",
    "intake",
    "members",
    "schedule_add",
    "schedule_batch",
    "schedule_move",
    "schedule_cancel",
    "schedule_read",
    "job_tick",
    "read_hashes",
    "reply_open",
    "reply_send",
    "worker_beat",
    "workers_read",
)


class Script:
    """A Lua script called by EVALSHA, reloaded on NOSCRIPT."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on ``client`` (a client, not a pipeline)."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)

    async def on(self, channel: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on a :class:`broker.redis.wire.Channel`."""
        try:
            return await channel.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await channel.execute("SCRIPT", "LOAD", self.source)
            return await channel.execute("EVALSHA", self.sha, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Add a call to a pipeline; the caller handles NoScriptError results (see RedisBroker)."""
        # execute_command, not pipe.evalsha: redis-py's cluster pipeline blocks evalsha() but routes
        # EVALSHA by its keys like any command.
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


_INCLUDE = "--#include "
"""A line ``--#include NAME`` in a script is replaced by ``broker/redis/lua/NAME.lua`` (shared Lua code:
the inbox's buckets, ``inbox_store.lua``); the SHA is that of the expanded source."""


def _expand(base: Any, source: str) -> str:
    lines = []
    for line in source.splitlines(keepends=True):
        if line.startswith(_INCLUDE):  # (included files may include others)
            line = _expand(base, (base / f"{line[len(_INCLUDE) :].strip()}.lua").read_text())
        lines.append(line)
    return "".join(lines)


def load_scripts() -> dict[str, Script]:
    """Read every script shipped in ``broker/redis/lua``."""
    base = resources.files("broker.redis") / "lua"
    return {name: Script(name, _expand(base, (base / f"{name}.lua").read_text())) for name in _NAMES}
