"""Services with resources and lifespan hooks, run as real worker processes by tests/test_lifespan.py.

Every hook appends a line to the file ``$LIFESPAN_LOG`` (pid first), so the test sees what each
process opened, handled and closed, in order.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import anyio

from framework import Context, Service


def _write(line: str) -> None:
    with open(os.environ["LIFESPAN_LOG"], "a") as f:
        f.write(f"{os.getpid()} {line}\n")


class Journal:
    """Stands for a connection pool: opened once per process, used by every handler run."""

    def __init__(self) -> None:
        self.id = f"{os.getpid()}-{id(self)}"
        self.handled = 0

    def record(self, what: str) -> None:
        self.handled += 1
        _write(f"handled {what} with {self.id}")


service = Service("lifesvc")


@service.on_startup
async def announce() -> None:
    _write("startup")


@service.resource
async def journal() -> AsyncIterator[Journal]:
    j = Journal()
    _write(f"open {j.id}")
    yield j
    _write(f"close {j.id} after {j.handled}")


@service.on_shutdown
async def goodbye() -> None:
    _write("shutdown")


@service.command("lifesvc.jobs")
async def job(cmd: dict, ctx: Context) -> None:
    if cmd.get("sleep"):
        _write(f"slow {cmd['n']} started")
        await anyio.sleep(cmd["sleep"])
    ctx.resources[journal].record(str(cmd["n"]))


broken = Service("broken")


@broken.resource
async def connect_database() -> AsyncIterator[str]:
    _write("connecting")
    raise ConnectionRefusedError("database at db:5432 refused the connection")
    yield "never"


@broken.command("broken.jobs")
async def never(cmd: dict) -> None:
    _write(f"consumed {cmd}")


hanging = Service("hanging")


@hanging.resource
async def cache() -> AsyncIterator[dict[str, str]]:
    _write("open cache")
    yield {}
    _write("close cache")


@hanging.on_startup
async def wait_for_the_database() -> None:
    _write("waiting")
    await anyio.sleep_forever()  # a database that never answers


@hanging.command("hanging.jobs")
async def hanging_job(cmd: dict) -> None:
    _write(f"consumed {cmd}")
