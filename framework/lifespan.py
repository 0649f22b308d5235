"""A service's lifespan: resources opened once per worker process before its first message, closed after the drain.

A resource is an async generator function declared with :meth:`Service.resource
<framework.service.Service.resource>`: the code before its ``yield`` opens the value (a database
engine, an HTTP client), the code after it closes it, as in FastAPI's dependencies with ``yield``
and pytest's fixtures. Handlers read the value through their context, typed by the declaration::

    @billing.resource
    async def db() -> AsyncIterator[AsyncEngine]:
        engine = create_async_engine(DATABASE_URL)
        yield engine
        await engine.dispose()

    @billing.command("billing.charge")
    async def charge(cmd: Charge, ctx: Context) -> None:
        engine = ctx.resources[db]  # an AsyncEngine for the type checker too

:meth:`Service.on_startup <framework.service.Service.on_startup>` and :meth:`on_shutdown
<framework.service.Service.on_shutdown>` declare plain async hooks without a value. The runtime runs
the hooks in declaration order (services in the order given) before any consumer starts, and
closes them in the reverse order once the runtime has drained (in-flight handlers finished, acks
flushed), on a graceful stop or a crash alike. A hook that raises at startup stops the runtime
with :class:`StartupError` naming it; ``framework run`` then exits with status
:data:`EXIT_STARTUP_FAILED` and one line, having consumed nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio

from framework.logs import get_logger

__all__ = ["EXIT_STARTUP_FAILED", "Lifespan", "Resource", "Resources", "StartupError", "startup_failure"]

log = get_logger("framework.lifespan")

T = TypeVar("T")

EXIT_STARTUP_FAILED = 3
"""``framework run``'s exit status when a startup hook raised (a supervisor should not restart it at once)."""


class StartupError(Exception):
    """A service's startup hook (or a resource's opening) raised; nothing was consumed."""

    def __init__(self, hook: str, error: Exception) -> None:
        super().__init__(f"startup hook {hook} failed: {type(error).__name__}: {error}")
        self.hook = hook
        self.error = error


class Resource(Generic[T]):
    """A value a service opens once per worker process; handlers read it with ``ctx.resources[resource]``."""

    __slots__ = ("_open", "label")

    def __init__(self, label: str, open: Callable[[], AsyncIterator[T]]) -> None:
        self.label = label  # ``service.function`` in logs and errors
        self._open = open

    def __repr__(self) -> str:
        return f"Resource({self.label})"


class _Hook:
    """A startup or shutdown hook without a value."""

    __slots__ = ("fn", "label", "when")

    def __init__(self, label: str, fn: Callable[[], Awaitable[None]], when: str) -> None:
        self.label, self.fn, self.when = label, fn, when


LifespanEntry = Resource[Any] | _Hook


def declare(service: str, fn: Any, what: str) -> LifespanEntry:
    """The entry for ``fn`` declared with ``@service.<what>``; HandlerError-ready ValueError when it is unusable."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    label = f"{service}.{name}"
    if what == "resource":
        if not inspect.isasyncgenfunction(fn):
            raise ValueError(
                f"@{service}.resource {label}: expected an async generator function that takes no arguments "
                "(async def ...: open; yield value; close), got " + repr(fn)
            )
        return Resource(label, fn)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"@{service}.{what} {label}: expected an async function that takes no arguments, got {fn!r}")
    return _Hook(label, fn, what)


class _ServiceLike(Protocol):
    lifespan: list[LifespanEntry]


_OPEN: contextvars.ContextVar[dict[Resource[Any], Any] | None]
_OPEN = contextvars.ContextVar("framework_resources", default=None)


class Resources:
    """The resources open in this runtime, read by their declaration: ``ctx.resources[db]``."""

    __slots__ = ()

    def __getitem__(self, resource: Resource[T]) -> T:
        opened = _OPEN.get()
        if opened is None or resource not in opened:
            raise LookupError(
                f"resource {resource.label} is not open here: resources open while a runtime (framework run, "
                "ServiceHarness) runs the service that declared them, for its handlers"
            )
        value: T = opened[resource]
        return value

    def __contains__(self, resource: object) -> bool:
        opened = _OPEN.get()
        return opened is not None and resource in opened


RESOURCES = Resources()


class Lifespan:
    """A runtime's services' hooks: :meth:`open`, :meth:`installed` for the handlers, then :meth:`close`."""

    def __init__(self, services: Sequence[_ServiceLike]) -> None:
        self._entries = [entry for s in services for entry in s.lifespan]
        self._values: dict[Resource[Any], Any] = {}
        self._closers: list[tuple[str, Callable[[], Awaitable[Any]]]] = []  # closed in reverse

    async def open(self, stop: anyio.Event | None = None) -> bool:
        """Run the startup side of every hook in order; False if ``stop`` was set meanwhile (the hook
        running then is cancelled). On a failure or a stop, what opened is closed; a failure raises
        :class:`StartupError`."""
        failure: StartupError | None = None
        async with anyio.create_task_group() as tg:
            if stop is not None:
                tg.start_soon(_cancel_when_set, stop, tg.cancel_scope)
            try:
                await self._open_all()
            except StartupError as exc:
                failure = exc  # raised outside the task group: not wrapped in an exception group
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if stop is not None and stop.is_set():
            await self.close(timeout=10.0)
            return False
        if self._entries:
            log.info("service resources opened", hooks=[e.label for e in self._entries])
        return True

    async def _open_all(self) -> None:
        for entry in self._entries:
            try:
                if isinstance(entry, Resource):
                    cm = contextlib.asynccontextmanager(entry._open)()
                    self._values[entry] = await cm.__aenter__()
                    self._closers.append((entry.label, _exit(cm)))
                elif entry.when == "on_startup":
                    await entry.fn()
                else:
                    self._closers.append((entry.label, entry.fn))
            except BaseException as exc:
                await self.close(timeout=10.0)
                if isinstance(exc, Exception):
                    raise StartupError(entry.label, exc) from exc
                raise

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Make the opened resources what ``ctx.resources`` reads in tasks started inside (the lanes)."""
        token = _OPEN.set(self._values)
        try:
            yield
        finally:
            _OPEN.reset(token)

    async def close(self, timeout: float) -> None:
        """Run the shutdown side of every opened hook, last opened first, within ``timeout`` seconds in all.

        A hook that raises is logged and the others still run; one past the timeout is abandoned.
        """
        closers, self._closers = self._closers, []
        with anyio.move_on_after(timeout, shield=True) as scope:
            while closers:
                label, close = closers.pop()
                try:
                    await close()
                except Exception as exc:
                    log.error("shutdown hook failed", hook=label, error=f"{type(exc).__name__}: {exc}")
        if scope.cancelled_caught:
            log.warning("shutdown hooks did not finish in time", timeout=timeout, abandoned=[c[0] for c in closers])
        self._values.clear()


async def _cancel_when_set(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _exit(cm: contextlib.AbstractAsyncContextManager[Any]) -> Callable[[], Awaitable[Any]]:
    async def close() -> Any:
        return await cm.__aexit__(None, None, None)

    return close


def startup_failure(exc: BaseException) -> StartupError | None:
    """The :class:`StartupError` in ``exc`` (itself or inside exception groups), else None."""
    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = startup_failure(inner)
            if found is not None:
                return found
    return None
