"""Pattern subscriptions and message filters: which topics and which messages a handler takes.

A topic pattern (``@svc.event("orders.*")``) uses RabbitMQ's topic-exchange words: names are split
on ``.``; ``*`` matches exactly one word, ``#`` zero or more. A :class:`Filter` (``filter=`` on a
declaration) picks messages by their type and headers, or by a predicate over the same metadata,
before the body is decoded. Both are checked when a handler is declared: a malformed pattern, or
two handlers of one service that could both take one message, fail there with their names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from broker import Envelope

__all__ = ["Filter", "MessageInfo", "Pattern", "filter_of", "is_pattern", "names_overlap"]

_WORD = re.compile(r"[A-Za-z0-9_-]+")


def is_pattern(name: str) -> bool:
    """Whether ``name`` is a topic pattern (has a ``*`` or ``#``) rather than a topic's name."""
    return "*" in name or "#" in name


@functools.lru_cache(maxsize=1024)
def _words(name: str) -> tuple[str, ...]:
    return tuple(name.split("."))


@functools.lru_cache(maxsize=8192)
def _match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """Whether ``pattern`` (words, ``*``, ``#``) matches ``words``; ``*`` or ``#`` in ``words`` are
    themselves wildcards, so this also answers whether two patterns can match one name."""
    if not pattern:
        return not words or all(w == "#" for w in words)
    if not words:
        return all(p == "#" for p in pattern)
    head, rest = pattern[0], pattern[1:]
    if head == "#":  # zero words, or one more word (and keep the #)
        return _match(rest, words) or _match(pattern, words[1:])
    if words[0] == "#":
        return _match(pattern, words[1:]) or _match(rest, words)
    if head == "*" or words[0] == "*" or head == words[0]:
        return _match(rest, words[1:])
    return False


def names_overlap(a: str, b: str) -> bool:
    """Whether some topic name is matched by both ``a`` and ``b`` (each a name or a pattern)."""
    return _match(_words(a), _words(b))


@attrs.frozen
class Pattern:
    """A validated topic pattern; :meth:`matches` tells whether a topic's name falls under it."""

    text: str
    words: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Pattern:
        """Check ``text``; raise ``ValueError`` naming what is wrong and how to write it."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"invalid topic pattern {text!r}: give dot-separated words, '*' or '#'")
        if len(text) > 200:
            raise ValueError(f"invalid topic pattern {text!r}: at most 200 characters")
        words = tuple(text.split("."))
        for word in words:
            if word in ("*", "#"):
                continue
            if not word:
                raise ValueError(f"invalid topic pattern {text!r}: an empty word (two dots, or a dot at an end)")
            if "*" in word or "#" in word:
                raise ValueError(
                    f"invalid topic pattern {text!r}: {word!r} mixes a wildcard into a word; '*' (one word) "
                    "and '#' (zero or more words) stand alone between dots, as in 'orders.*' or 'orders.#'"
                )
            if not _WORD.fullmatch(word):
                raise ValueError(f"invalid topic pattern {text!r}: word {word!r} may hold only letters, digits, _ or -")
        return cls(text, words)

    def matches(self, name: str) -> bool:
        """Whether the topic ``name`` falls under this pattern."""
        return _match(self.words, _words(name))


@attrs.frozen
class MessageInfo:
    """What a filter's predicate sees of a message: its metadata, never its (undecoded) body."""

    type: str
    headers: Mapping[str, str]
    key: str | None
    destination: str
    id: str

    @classmethod
    def of(cls, env: Envelope) -> MessageInfo:
        """The metadata of ``env``."""
        return cls(env.type, env.headers, env.key, env.destination, env.id)


def _type_names(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str | type) else list(value)
    names = set()
    for item in items:
        if isinstance(item, type):  # the name the client records for instances of the class
            tag = getattr(item, "__message_type__", None)
            names.add(tag if isinstance(tag, str) else item.__name__)
        elif isinstance(item, str) and item:
            names.add(item)
        else:
            raise ValueError(f"type= takes type names or classes, not {item!r}")
    if not names:
        raise ValueError("type= is empty: give at least one type name")
    return frozenset(names)


def _header_values(headers: Mapping[str, Any] | None) -> tuple[tuple[str, frozenset[str]], ...]:
    if not headers:
        return ()
    if not isinstance(headers, Mapping):
        raise ValueError(f"headers= takes a dict of header name to value(s), not {headers!r}")
    out = []
    for name, value in headers.items():
        values = [value] if isinstance(value, str) else list(value) if isinstance(value, Iterable) else [value]
        if not isinstance(name, str) or not values or not all(isinstance(v, str) for v in values):
            raise ValueError(f"headers={{{name!r}: {value!r}}}: header values are strings (or a set of strings)")
        out.append((name, frozenset(values)))
    return tuple(sorted(out))


class Filter:
    """Which messages of a topic a handler takes, judged on metadata before the body is decoded.

    ``type``: a type name, a class (its ``__message_type__`` or name, as the client records it) or
    several (any of them); ``headers``: header name -> value (or a set of values) that must all
    be present; ``where``: a predicate over :class:`MessageInfo`. All given conditions must hold.
    """

    __slots__ = ("headers", "types", "where")

    def __init__(
        self,
        type: Any = None,
        headers: Mapping[str, Any] | None = None,
        where: Callable[[MessageInfo], bool] | None = None,
    ) -> None:
        if where is not None and not callable(where):
            raise ValueError(f"where= takes a function of MessageInfo returning a bool, not {where!r}")
        self.types = _type_names(type)
        self.headers = _header_values(headers)
        self.where = where
        if self.types is None and not self.headers and where is None:
            raise ValueError("Filter() with no condition: give type=, headers= or where= (or no filter at all)")

    def matches(self, env: Envelope) -> bool:
        """Whether the message ``env`` passes (its body is not touched)."""
        if self.types is not None and env.type not in self.types:
            return False
        if self.headers:
            got = env.headers
            for name, values in self.headers:
                if got.get(name) not in values:
                    return False
        return self.where is None or bool(self.where(MessageInfo.of(env)))

    def overlaps(self, other: Filter) -> bool:
        """Whether one message could pass both filters: only disjoint types or disjoint values of
        one header tell two filters apart (predicates are opaque, so they never do)."""
        if self.types is not None and other.types is not None and not self.types & other.types:
            return False
        mine = dict(self.headers)
        return all(name not in mine or mine[name] & values for name, values in other.headers)

    def __repr__(self) -> str:
        parts = []
        if self.types is not None:
            parts.append(f"type={sorted(self.types)}")
        if self.headers:
            parts.append(f"headers={ {k: sorted(v) for k, v in self.headers} }")
        if self.where is not None:
            parts.append(f"where={getattr(self.where, '__name__', self.where)!r}")
        return f"Filter({', '.join(parts)})"


def filter_of(value: Any) -> Filter | None:
    """The :class:`Filter` a declaration's ``filter=`` gives: a Filter, a predicate, or None."""
    if value is None or isinstance(value, Filter):
        return value
    if callable(value):
        return Filter(where=value)
    raise ValueError(f"filter= takes a Filter(type=..., headers=...) or a predicate of MessageInfo, not {value!r}")
