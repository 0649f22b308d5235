"""Near matches for a mistyped name: the one "did you mean" of the client and every CLI command.

A near match is a known name similar enough to be a typo of the given one (``difflib`` ratio of at
least :data:`CUTOFF`: a transposed, dropped or doubled letter in a dotted name, not a sibling such as
``orders.paid`` for ``orders.placed``). Names that differ only in their digits (``refunds.v1`` and
``refunds.v2``, ``shard-3`` and ``shard-4``) are siblings on purpose, never near matches.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

__all__ = ["CUTOFF", "did_you_mean", "listed", "near_match"]

CUTOFF = 0.85
_DIGITS = re.compile(r"\d+")


def near_match(name: str, known: Iterable[str], *, cutoff: float = CUTOFF, numbered: bool = False) -> str | None:
    """The known name closest to ``name`` when it is close enough to be a typo of it, else None
    (``numbered``: names differing only in digits count too)."""
    letters = _DIGITS.sub("", name)
    names = [k for k in known if k != name and (numbered or _DIGITS.sub("", k) != letters)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str], *, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or "" (the looser CLI cutoff: a hint only)."""
    close = near_match(name, known, cutoff=cutoff, numbered=True)
    return f" (did you mean {close!r}?)" if close else ""


def listed(names: list[str], limit: int = 20) -> str:
    """``a, b, c and 3 more``, or ``none``."""
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
