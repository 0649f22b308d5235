"""A payload class's fast structuring path: the common case checked inline, cattrs for the rest.

cattrs' generated structuring of an attrs class or dataclass (with detailed validation, which
names the failing field) calls a hook per field, builds a dict of the values and calls the
class with keywords: about 2.7 µs for a three-field class on a 2-core VM, the largest single
piece of a worker's own work per message. :func:`fast_structure` compiles, once per class, a
function that checks the fields of JSON scalar types (``str``, ``int``, ``float``, ``bool``, those
or ``None``, nested classes of the same kind) inline, calls the converter's own hook for any
other field type, and calls the class positionally. It promises the same value as the
converter for every body it accepts (the strict rules of :mod:`framework._payloads`: no bool for
an int, an int for a float becomes a float, nothing coerced, an absent field left to the class's
default); for anything it does not take as is (a missing field, a wrong type: :class:`Slow`; a
field's hook or the class's own validator raising: that error) it raises, and the caller runs
the converter, which gives the detailed error naming the field or, for a value only the
converter's rules accept, the same value (the class's ``__init__`` then runs twice).

Only for classes whose fields are all set through ``__init__`` under their own names; a class
with a custom structure hook on the converter, generic parameters, or fields cattrs would rename
keeps the converter's path alone (:func:`fast_structure` returns None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import attrs
import cattrs

__all__ = ["Slow", "fast_structure"]

_SCALARS = (str, int, float, bool)
_FACTORY: Any = type(attrs.Factory(list))  # attrs' Factory class (its stub types it as a function)


class Slow(Exception):
    """The fast path does not take this value as is: structure it with the converter."""


_REQUIRED = object()  # a field without a default


def _fields(cls: type) -> list[tuple[str, Any, Any, bool]] | None:
    """(name, type, default, keyword-only) per field, or None when the fast path cannot apply.

    The default is the value itself, ``_REQUIRED``, or an ``attrs.Factory`` (or a dataclass's
    ``default_factory`` wrapped as one)."""
    if getattr(cls, "__parameters__", ()):
        return None
    try:
        if attrs.has(cls):
            attrs.resolve_types(cls)
            out = []
            for a in attrs.fields(cls):
                if not a.init or a.alias != a.name or a.type is None:
                    return None
                default: Any = _REQUIRED if a.default is attrs.NOTHING else a.default
                if isinstance(default, _FACTORY) and default.takes_self:
                    return None
                out.append((a.name, a.type, default, a.kw_only))
            return out
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            out = []
            for f in dataclasses.fields(cls):
                if not f.init:
                    return None
                if f.default is not dataclasses.MISSING:
                    default = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    default = attrs.Factory(f.default_factory)
                else:
                    default = _REQUIRED
                out.append((f.name, hints[f.name], default, bool(getattr(f, "kw_only", False))))
            return out
    except Exception:  # unresolvable annotations and the like: the converter reports them
        return None
    return None


def _optional_of(tp: Any) -> Any:
    """``T`` for ``T | None`` / ``Optional[T]``, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if len(args) == 2 and type(None) in args:
            return args[0] if args[1] is type(None) else args[1]
    return None


def fast_structure(cls: type, converter: cattrs.Converter, strict: dict[type, Any]) -> Callable[[Any], Any] | None:
    """A function ``o -> cls`` for the common case (raising :class:`Slow` otherwise), or None.

    ``strict`` maps each scalar type to the framework's strict hook for it: a scalar whose hook
    on the converter is another one (registered by the user) goes through that hook instead.
    Any exception from the function means: run the converter (it may be the class's own
    validator failing, which the converter reports with the field).
    """
    return _compile(cls, converter, strict, set())


def _compile(
    cls: type, converter: cattrs.Converter, strict: dict[type, Any], seen: set[type]
) -> Callable[[Any], Any] | None:
    if cls in seen:  # a recursive class: the converter handles it
        return None
    fields = _fields(cls)
    if fields is None or not _is_generated(cls, converter):
        return None
    scope: dict[str, Any] = {"Slow": Slow, "cls": cls, "_float": float, "_dict": dict}
    lines = ["def structure(o):", "    if type(o) is not _dict:", "        raise Slow"]
    args: list[str] = []
    keywords: list[str] = []
    for i, (name, tp, default, kw_only) in enumerate(fields):
        v = f"v{i}"
        check = _check(v, tp, i, scope, converter, strict, seen | {cls})
        if default is _REQUIRED:
            lines += ["    try:", f"        {v} = o[{name!r}]", "    except KeyError:", "        raise Slow from None"]
            lines += [f"    {c}" for c in check]
        else:  # absent: the class's default, as the converter leaves it (not checked, not converted)
            lines += [f"    if {name!r} in o:", f"        {v} = o[{name!r}]"]
            lines += [f"        {c}" for c in check]
            if isinstance(default, _FACTORY):
                scope[f"f{i}"] = default.factory
                lines += ["    else:", f"        {v} = f{i}()"]
            else:
                scope[f"d{i}"] = default
                lines += ["    else:", f"        {v} = d{i}"]
        if kw_only:
            keywords.append(f"{name}={v}")
        else:
            args.append(v)
    lines.append(f"    return cls({', '.join(args + keywords)})")
    code = "\n".join(lines)
    exec(compile(code, f"<fast structure {cls.__module__}.{cls.__qualname__}>", "exec"), scope)
    fn: Callable[[Any], Any] = scope["structure"]
    return fn


def _is_generated(cls: type, converter: cattrs.Converter) -> bool:
    """Whether the converter structures ``cls`` with its own generated function (no user hook)."""
    try:
        hook = converter.get_structure_hook(cls)
    except Exception:
        return False
    return getattr(hook, "__name__", "") == f"structure_{cls.__name__}"


def _check(
    v: str,
    tp: Any,
    i: int,
    scope: dict[str, Any],
    converter: cattrs.Converter,
    strict: dict[type, Any],
    seen: set[type],
) -> list[str]:
    """Statements checking (and, where the rules convert, converting) variable ``v`` of type ``tp``."""
    inner = _optional_of(tp)
    base = inner if inner is not None else tp
    none_ok = inner is not None
    if base in _SCALARS and converter.get_structure_hook(base) is strict.get(base):
        cond = _scalar_condition(v, base)
        if none_ok:
            cond = f"{v} is not None and {cond}"
        out = [f"if {cond}:", "    raise Slow"]
        if base is float:
            out += [f"if type({v}) is not _float and {v} is not None:", f"    {v} = _float({v})"]
        return out
    if isinstance(base, type) and (attrs.has(base) or dataclasses.is_dataclass(base)):
        nested = _compile(base, converter, strict, seen)
        if nested is not None:
            scope[f"n{i}"] = nested
            call = f"{v} = n{i}({v})"
            return [f"if {v} is not None:", f"    {call}"] if none_ok else [call]
    # Any other type: the converter's own hook for it (its failure falls back to the whole class).
    scope[f"h{i}"] = converter.get_structure_hook(tp)
    scope[f"t{i}"] = tp
    return ["try:", f"    {v} = h{i}({v}, t{i})", "except Exception:", "    raise Slow from None"]


def _scalar_condition(v: str, tp: type) -> str:
    """The condition under which ``v`` is NOT taken as is for scalar type ``tp``."""
    if tp is float:
        return f"type({v}) is not _float and type({v}) is not int"
    return f"type({v}) is not {tp.__name__}"
