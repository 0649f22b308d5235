"""The registry of checks (:data:`CHECKS`, filled by the :func:`check` decorator) and :func:`run_all`."""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal, TypeVar

import anyio
import attrs

from broker.conformance.features import BrokerFactory, Features

__all__ = ["CHECKS", "Check", "CheckFn", "Outcome", "check", "run_all", "run_check"]

CheckFn = Callable[[BrokerFactory, Features], Awaitable[None]]
"""A check: makes its brokers with the factory, raises AssertionError saying what broke the contract."""

F = TypeVar("F", bound=CheckFn)


@attrs.frozen
class Check:
    """One registered check: its function, the features it needs and its one-line description."""

    name: str
    fn: CheckFn = attrs.field(repr=False)
    requires: tuple[str, ...]
    role: str
    doc: str
    unless: tuple[str, ...] = ()
    """Features whose absence the check asserts (a documented degraded behaviour): skipped when claimed."""

    def missing(self, features: Features) -> list[str]:
        """The required features ``features`` does not claim."""
        return [name for name in self.requires if not features.has(name)]

    def skip_reason(self, features: Features) -> str | None:
        """Why the check does not apply to a transport with ``features``, or None when it does."""
        missing = self.missing(features)
        if missing:
            return f"{self.name} needs {', '.join(missing)}, which the transport does not claim"
        claimed = [name for name in self.unless if features.has(name)]
        if claimed:
            return f"{self.name} checks the behaviour without {', '.join(claimed)}, which the transport claims"
        return None

    async def __call__(self, make: BrokerFactory, features: Features) -> None:
        await self.fn(make, features)

    def __str__(self) -> str:
        return self.name


CHECKS: dict[str, Check] = {}
"""Every check by name (``check_`` dropped), in registration order: grouped by role module."""


def check(*, requires: Iterable[str] = (), unless: Iterable[str] = ()) -> Callable[[F], F]:
    """Register the decorated ``async def check_...(make, features)`` in :data:`CHECKS`, needing ``requires``
    and, with ``unless``, asserting the degraded behaviour of transports lacking those (names of
    :class:`Features` fields); the function itself is returned unchanged."""
    needed = tuple(requires)
    lacking = tuple(unless)
    unknown = (set(needed) | set(lacking)) - Features.names()
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}: use names of Features fields")

    def register(fn: F) -> F:
        name = fn.__name__.removeprefix("check_")
        if name in CHECKS:
            raise ValueError(f"check {name!r} is registered twice")
        doc = (fn.__doc__ or name.replace("_", " ")).strip().splitlines()[0]
        role = fn.__module__.rpartition(".")[2]
        CHECKS[name] = Check(name=name, fn=fn, requires=needed, role=role, doc=doc, unless=lacking)
        return fn

    return register


@attrs.frozen
class Outcome:
    """What running one check gave: ``passed``, ``skipped`` (``detail``: why) or ``failed`` (the error)."""

    check: str
    status: Literal["passed", "skipped", "failed"]
    detail: str = ""


async def run_check(chk: Check, make: BrokerFactory, features: Features, *, timeout_s: float = 120) -> Outcome:
    """Run one check (skipped when it needs a feature that is off); never raises for a failed check."""
    reason = chk.skip_reason(features)
    if reason is not None:
        return Outcome(chk.name, "skipped", reason)
    try:
        with anyio.fail_after(timeout_s):
            await chk(make, features)
    except AssertionError as exc:
        return Outcome(chk.name, "failed", f"{exc}\n{traceback.format_exc(limit=-3)}")
    except Exception as exc:
        return Outcome(chk.name, "failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}")
    return Outcome(chk.name, "passed")


async def run_all(
    make: BrokerFactory,
    features: Features | None = None,
    *,
    only: Iterable[str] | None = None,
    raise_on_failure: bool = True,
) -> list[Outcome]:
    """Run every check (or those named in ``only``) one after another against ``make``'s transport.

    ``features`` defaults to :meth:`Features.detect` (the capabilities the transport declares).
    Returns each check's :class:`Outcome`; with ``raise_on_failure`` an AssertionError listing the
    failed checks is raised after all ran. Checks name their destinations uniquely, so one
    namespace serves them all; a fresh one per run keeps namespace-wide counts (scheduled
    messages) to the run's own.
    """
    if features is None:
        features = await Features.detect(make)
    wanted = list(CHECKS) if only is None else list(only)
    unknown = [name for name in wanted if name not in CHECKS]
    if unknown:
        raise ValueError(f"no such checks: {unknown}")
    outcomes = [await run_check(CHECKS[name], make, features) for name in wanted]
    failed = [o for o in outcomes if o.status == "failed"]
    if failed and raise_on_failure:
        lines = "\n\n".join(f"{o.check}: {o.detail}" for o in failed)
        raise AssertionError(f"{len(failed)} of {len(outcomes)} conformance checks failed:\n\n{lines}")
    return outcomes
