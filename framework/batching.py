"""Batch handlers' declarations: :class:`BatchPolicy` (how batches form) and :class:`BatchFailed`.

``@svc.command("ledger.post", batch=BatchPolicy(max_size=500, max_wait=0.05))`` hands the handler
a ``list`` of payloads (see docs/batch-handlers.md). This module only declares; the runtime's
batch path is :mod:`framework.runtime.batch`, the handler's context :mod:`framework.batch_context`.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["BatchAborted", "BatchFailed", "BatchPolicy", "batch_element_type", "checked_failures"]


def _positive_int(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"BatchPolicy: {attribute.name} must be a whole number of messages >= 1, got {value!r}")


def _wait(_: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 60:
        raise ValueError(f"BatchPolicy: max_wait must be seconds between 0 and 60, got {value!r}")


@attrs.frozen
class BatchPolicy:
    """How a batch handler's batches form, per partition (one batch of a partition at a time).

    A batch is handed to the handler once it holds ``max_size`` messages, or ``max_wait`` seconds
    after its first message arrived, whichever comes first. ``all_or_nothing``: a batch succeeds or
    fails as one (a :class:`BatchFailed` fails every message of it, each retried per the policy).
    """

    max_size: int = attrs.field(default=100, validator=_positive_int)
    max_wait: float = attrs.field(default=0.05, validator=_wait)
    all_or_nothing: bool = False


class BatchFailed(Exception):
    """Raised by a batch handler: the messages at these indexes failed, each with its exception.

    Only they go through the retry and dead-letter path, each with its own reason; the rest of
    the batch succeeded and is acknowledged. Raised inside ``ctx.sql_transaction``, the block
    commits what it did with the inbox rows of the other messages only.
    """

    def __init__(self, failures: Mapping[int, BaseException]) -> None:
        self.failures: dict[Any, Any] = dict(failures)
        shown = ", ".join(f"{i}: {type(e).__name__}: {e}" for i, e in list(self.failures.items())[:5])
        more = f" (and {len(self.failures) - 5} more)" if len(self.failures) > 5 else ""
        super().__init__(f"{len(self.failures)} message(s) of the batch failed: {shown}{more}")


class BatchAborted(Exception):
    """A message of an ``all_or_nothing`` batch failed because another message of the batch did."""


def batch_element_type(annotation: Any) -> Any:
    """The element type of a batch handler's ``list[X]`` annotation (``Any`` for a bare ``list``);
    raises TypeError naming what was found otherwise."""
    if annotation is Any or annotation is list:
        return Any
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006 - typing.List[X] is a list too
        args = typing.get_args(annotation)
        return args[0] if args else Any
    raise TypeError(
        f"a batch handler takes a list of payloads: annotate its first parameter as list[YourPayload], "
        f"not {getattr(annotation, '__name__', annotation)!r}"
    )


def checked_failures(exc: BatchFailed, size: int) -> dict[int, BaseException]:
    """The failures a :class:`BatchFailed` names, checked against a batch of ``size`` messages;
    raises ValueError saying what is wrong (an index outside the batch, not an int, no exception)."""
    failures = exc.failures
    if not failures:
        raise ValueError("BatchFailed names no failed message: pass {index: exception} for the ones that failed")
    for index, error in failures.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"BatchFailed index {index!r} is not an int: use the message's position in the batch")
        if not 0 <= index < size:
            raise ValueError(
                f"BatchFailed index {index} is outside the batch of {size} messages (0..{size - 1}): "
                "no message was acknowledged in its place"
            )
        if not isinstance(error, BaseException):
            raise ValueError(f"BatchFailed[{index}] is {error!r}, not an exception: pass the error that failed it")
    return failures
