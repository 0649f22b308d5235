"""Near matches for a mistyped name: the one "did you mean" of the client and every CLI command.

:func:`near_match` is strict, since the client refuses a send on it: a known name is a typo of the
given one only when both have the same dot-separated words but one, and that word is one edit away
(a letter dropped, added, changed, or two neighbours swapped: ``refunds.isue`` for
``refunds.issue``, ``billing.refnud`` for ``billing.refund``). Short words (under 4 letters:
``orders.eu`` and ``orders.us``) and words that differ only in digits (``refunds.v1``,
``shard-3``) are siblings on purpose, never typos: new topics matching a pattern subscription
(``orders.*``) are created that way. :func:`did_you_mean` is the CLI's looser hint (``difflib``),
shown beside a refusal that stands anyway.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

__all__ = ["did_you_mean", "listed", "near_match"]

_DIGITS = re.compile(r"\d+")
_MIN_WORD = 4


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one insertion, deletion, substitution or adjacent swap."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 1:
            return True
        return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((k for k in range(len(short)) if short[k] != long[k]), len(short))
    return short[i:] == long[i + 1 :]


def _typo_of(name: str, known: str) -> bool:
    words, other = name.split("."), known.split(".")
    if len(words) != len(other):
        return False
    differing = [(w, o) for w, o in zip(words, other, strict=True) if w != o]
    if len(differing) != 1:
        return False
    w, o = differing[0]
    if min(len(w), len(o)) < _MIN_WORD or _DIGITS.sub("", w) == _DIGITS.sub("", o):
        return False
    return _one_edit(w.lower(), o.lower()) or (w.lower() == o.lower())


def near_match(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` is a typo of (see the module docstring), else None."""
    close = [k for k in known if k != name and _typo_of(name, k)]
    return min(close) if close else None


def did_you_mean(name: str, known: Iterable[str], *, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or "" (a hint beside a refusal)."""
    close = difflib.get_close_matches(name, [k for k in known if k != name], n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def listed(names: list[str], limit: int = 20) -> str:
    """``a, b, c and 3 more``, or ``none``."""
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
