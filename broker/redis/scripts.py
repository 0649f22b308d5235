"""The Lua scripts in ``broker/redis/lua/``, loaded once per server and called by name or SHA.

Each script's header documents the keys it touches. On a server with functions (Redis 7+, Valkey),
each script is a function library of its own (``FUNCTION LOAD``) called by ``FCALL``: the code it
includes (the inbox's buckets, ``inbox_store.lua``) is built once, when the library loads, not on
every call as under ``EVALSHA`` (about 16 µs of server time per call, 33 µs at a low rate: most of
an ack's or a leased read's cost on the latency path). Elsewhere (Redis 6, an ACL without ``+fcall
+function|load``, a Cluster, ``$FRAMEWORK_REDIS_FUNCTIONS=0``) the same code runs by ``EVALSHA``.

A script missing on the server (a restart without persistence, ``SCRIPT FLUSH``, ``FUNCTION
FLUSH``) is loaded again and the call repeated; the scripts are written so that a repeated call is
safe, since "not found" means the first call did not run.

Under ``maxmemory`` a function is refused whole (nothing done) unless flagged ``allow-oom``, where
``EVALSHA`` refused only a script's first write: the consumers' reads and settlements (their first
write takes, claims, acknowledges or trims entries) are ``allow-oom``, so a full server can still be
drained; the rest (publishing, scheduling, effects commits, claims) is refused with the OOM error
and changes nothing, as their callers expect.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

__all__ = ["Script", "functions_usable", "load_scripts", "script_missing"]

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

_FLAGS = {
    **dict.fromkeys(("ack", "intake", "owned_intake", "extend", "trim"), ("allow-oom",)),
    **dict.fromkeys(("read_hashes", "workers_read", "schedule_read"), ("no-writes",)),
}
"""Function flags by script (see the module docstring); the others have none."""


def script_missing(reply: Any) -> bool:
    """Whether ``reply`` says the script or function is not on the server (so the call did not run)."""
    return isinstance(reply, NoScriptError) or (
        isinstance(reply, ResponseError) and str(reply).startswith("Function not found")
    )


class Script:
    """A Lua script called by ``FCALL`` (``functions``) or ``EVALSHA``, loaded again when missing."""

    __slots__ = ("flags", "function", "functions", "library", "name", "prelude", "sha", "source")

    def __init__(
        self, name: str, source: str, *, prelude: str = "", flags: Sequence[str] = (), functions: bool = False
    ) -> None:
        """``source``: the script as ``EVALSHA`` runs it; ``prelude``: the code it includes (in
        ``source`` too), which a function library defines once, outside the function;
        ``functions``: called by ``FCALL``."""
        self.name = name
        self.source = source
        self.prelude, self.flags = prelude, tuple(flags)
        self.functions = functions
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        code = _library(source, prelude, flags)
        # A new release's code gets new names: workers of two releases each call their own.
        self.function = f"fw_{name}_{hashlib.sha1(code.encode()).hexdigest()[:16]}"
        self.library = f"#!lua name={self.function}\n" + code.replace("<NAME>", self.function)

    def command(self, keys: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """The command that runs the script on ``keys`` and ``args``."""
        if self.functions:
            return ["FCALL", self.function, len(keys), *keys, *args]
        return ["EVALSHA", self.sha, len(keys), *keys, *args]

    def load_command(self) -> list[Any]:
        """The command that puts the script on a single server (idempotent; for a channel)."""
        if self.functions:
            return ["FUNCTION", "LOAD", "REPLACE", self.library]
        return ["SCRIPT", "LOAD", self.source]

    async def load(self, client: Any) -> None:
        """Put the script on ``client``'s server (on every primary of a Cluster)."""
        if self.functions:
            await client.function_load(self.library, replace=True)
        else:
            await client.script_load(self.source)

    async def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on ``client`` (a client, not a pipeline)."""
        command = self.command(keys, args)
        try:
            return await client.execute_command(*command)
        except ResponseError as exc:
            if not script_missing(exc):
                raise
            await self.load(client)
            return await client.execute_command(*command)

    async def on(self, channel: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run the script on a :class:`broker.redis.wire.Channel`."""
        command = self.command(keys, args)
        try:
            return await channel.execute(*command)
        except ResponseError as exc:
            if not script_missing(exc):
                raise
            await channel.execute(*self.load_command())
            return await channel.execute(*command)

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        """Add a call to a pipeline; the caller handles :func:`script_missing` results (see RedisCore)."""
        # execute_command, not pipe.evalsha: redis-py's cluster pipeline blocks evalsha() but routes
        # EVALSHA by its keys like any command.
        pipe.execute_command(*self.command(keys, args))


_BEGIN = re.compile(r"^local function (\w+_begin)\(\)", re.MULTILINE)


def _library(source: str, prelude: str, flags: Sequence[str]) -> str:
    """A function library running ``source``: ``prelude`` at its top (built once, when it loads;
    only literals there: the standard libraries are out of reach while a library loads), the rest
    of the script as the function's body (``KEYS`` and ``ARGV`` its arguments). An included file
    keeping state for one call (caches, queued ids) resets it in a ``<file>_begin()`` function,
    called first: a library's state outlives the call."""
    body = source.replace(prelude, "", 1) if prelude else source
    begin = "".join(f"{fn}()\n" for fn in _BEGIN.findall(prelude))
    flag_list = ", ".join(f"'{f}'" for f in flags)
    return (
        f"{_STD_LOCALS}{prelude}\nredis.register_function{{function_name='<NAME>', callback=function(KEYS, ARGV)\n"
        f"{_STD_FIRST}{begin}{body}\nend, flags={{{flag_list}}}}}\n"
    )


_STD = "string, math, table, tonumber, tostring, unpack, type, ipairs, pairs, select, next"
_STD_LOCALS = f"local function fw_std() return {_STD} end\nlocal {_STD}\n"
_STD_FIRST = f"if not string then {_STD} = fw_std() end\n"
"""A function reaches a global through its library's environment, a table that looks names up in
another (one more step for every ``string.byte`` or ``math.floor``): the standard library is kept
in the library's own locals instead, taken once, by its first call (a library's top level cannot
reach it)."""


_INCLUDE = "--#include "
"""A line ``--#include NAME`` in a script is replaced by ``broker/redis/lua/NAME.lua`` (shared Lua code:
the inbox's buckets, ``inbox_store.lua``); the SHA is that of the expanded source."""


def _expand(base: Any, source: str) -> tuple[str, str]:
    """``source`` with its includes expanded, and the text they expanded to (its prelude)."""
    lines, prelude = [], []
    for line in source.splitlines(keepends=True):
        if line.startswith(_INCLUDE):  # (included files may include others)
            line = _expand(base, (base / f"{line[len(_INCLUDE) :].strip()}.lua").read_text())[0]
            prelude.append(line)
        lines.append(line)
    return "".join(lines), "".join(prelude)


def load_scripts(*, functions: bool = False) -> dict[str, Script]:
    """Read every script shipped in ``broker/redis/lua``; ``functions``: called by ``FCALL``."""
    base = resources.files("broker.redis") / "lua"
    scripts = {}
    for name in _NAMES:
        source, prelude = _expand(base, (base / f"{name}.lua").read_text())
        scripts[name] = Script(name, source, prelude=prelude, flags=_FLAGS.get(name, ()), functions=functions)
    return scripts


_PROBE = "fw_probe_1"
_PROBE_LIBRARY = (
    f"#!lua name={_PROBE}\n"
    f"redis.register_function{{function_name='{_PROBE}', callback=function() return 1 end, flags={{'no-writes'}}}}"
)


async def functions_usable(client: Any) -> bool:
    """Whether the scripts can run as functions on ``client``'s server: it has them (Redis 7+,
    Valkey), the user may ``FUNCTION LOAD`` and ``FCALL``, and ``$FRAMEWORK_REDIS_FUNCTIONS`` is not
    ``0``. Loads a one-line library (``fw_probe_1``, replacing itself) and calls it: both rights are
    needed, since a library may be lost (a restart without persistence, ``FUNCTION FLUSH``) and has
    to be loaded again by whoever calls it next."""
    if os.environ.get("FRAMEWORK_REDIS_FUNCTIONS", "").strip() == "0":
        return False
    try:
        await client.execute_command("FUNCTION", "LOAD", "REPLACE", _PROBE_LIBRARY)
        return bool(await client.execute_command("FCALL", _PROBE, 0) == 1)
    except ResponseError:  # an unknown command (Redis 6), an ACL without +function|load or +fcall
        return False
