"""Payload types -> JSON Schema (the AsyncAPI Schema dialect, a superset of JSON Schema draft 07).

:class:`SchemaBuilder` describes the types a handler can declare as its payload, as they travel in
a message body (JSON through the framework's cattrs converter): attrs classes, dataclasses,
TypedDicts and Pydantic models become named schemas in ``components/schemas`` referenced with
``$ref``; enums too; ``datetime``, ``date``, ``time``, ``UUID`` and ``Decimal`` are strings with a
``format``; ``Optional``/``Union`` are ``anyOf``; lists, tuples, sets and dicts are arrays and
objects. A class may describe itself with a ``__json_schema__`` dict (or a method returning
one). Anything else raises :class:`UnsupportedType` naming the type and where it was met.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import sys
import types
import typing
import uuid
from collections import abc
from typing import Any

import attrs

__all__ = ["SchemaBuilder", "UnsupportedType", "describe_type"]

_REF = "#/components/schemas/"
_NO = object()  # a field without a default (or with a factory)

_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    dt.datetime: {"type": "string", "format": "date-time"},
    dt.date: {"type": "string", "format": "date"},
    dt.time: {"type": "string", "format": "time"},
    uuid.UUID: {"type": "string", "format": "uuid"},
    decimal.Decimal: {"type": "string", "format": "decimal"},
    # inside a JSON body the converter writes bytes as base85 text (a bytes *payload* is raw: see the document)
    bytes: {"type": "string", "contentEncoding": "base85"},
}

# what typing.get_origin() gives for list[X], Sequence[X], set[X], dict[K, V] and their kin
_ARRAYS = (list, abc.Sequence, abc.MutableSequence)
_SETS = (set, frozenset, abc.Set, abc.MutableSet)
_MAPPINGS = (dict, abc.Mapping, abc.MutableMapping)


class UnsupportedType(TypeError):
    """A type the builder cannot describe; ``where`` names the field path that holds it."""

    def __init__(self, tp: Any, where: str = "") -> None:
        self.type = tp
        self.where = where
        at = f" (at {where})" if where else ""
        super().__init__(f"cannot describe type {describe_type(tp)}{at}")


def describe_type(tp: Any) -> str:
    """A readable name of ``tp`` for errors: ``module.Name`` for classes, the repr otherwise."""
    if isinstance(tp, type):
        module = getattr(tp, "__module__", "")
        name = getattr(tp, "__qualname__", tp.__name__)
        return name if module in ("builtins", "") else f"{module}.{name}"
    return repr(tp).replace("typing.", "")


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__required_keys__")


def _pydantic_model(tp: Any) -> bool:
    """True for a Pydantic v2 model class; Pydantic is never imported here (if the user's code did
    not import it, no payload type can be one of its models)."""
    pydantic = sys.modules.get("pydantic")
    base = getattr(pydantic, "BaseModel", None) if pydantic is not None else None
    return isinstance(tp, type) and base is not None and issubclass(tp, base) and hasattr(tp, "model_json_schema")


class SchemaBuilder:
    """Builds JSON Schemas of payload types, collecting named ones in :attr:`components`.

    One builder serves one document: a class met twice is described once and referenced twice,
    and two classes with one name get distinct component names (module-qualified).
    """

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Any]] = {}
        self._names: dict[Any, str] = {}  # class -> its component name

    def schema(self, tp: Any, where: str = "") -> dict[str, Any]:
        """The JSON Schema of values of ``tp`` (a ``$ref`` for named classes); raises
        :class:`UnsupportedType` for a type it cannot describe."""
        if tp is Any or tp is object:
            return {}
        custom = getattr(tp, "__json_schema__", None) if isinstance(tp, type) else None
        if custom is not None:
            return self._named(tp, lambda: self._custom(tp, custom, where))
        if tp in _SCALARS:
            return dict(_SCALARS[tp])
        if isinstance(tp, typing.NewType):
            return self.schema(tp.__supertype__, where)
        if isinstance(tp, typing.TypeVar | typing.ForwardRef | str):
            raise UnsupportedType(tp, where)
        origin = typing.get_origin(tp)
        if origin is not None:
            return self._generic(tp, origin, where)
        if isinstance(tp, type):
            return self._class(tp, where)
        raise UnsupportedType(tp, where)

    # -- generic aliases: Optional/Union, Literal, Annotated, containers ---------------------------

    def _generic(self, tp: Any, origin: Any, where: str) -> dict[str, Any]:
        args = typing.get_args(tp)
        if origin is typing.Annotated:
            return self.schema(args[0], where)
        if origin is typing.Union or origin is types.UnionType:
            return self._union(args, where)
        if origin is typing.Literal:
            choices = list(args)
            if not all(v is None or isinstance(v, str | int | float | bool) for v in choices):
                raise UnsupportedType(tp, where)
            return {"enum": choices}
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return {"type": "array", "items": self.schema(args[0], f"{where}[]")}
            if args == ((),):  # tuple[()]
                return {"type": "array", "maxItems": 0}
            each = [self.schema(a, f"{where}[{i}]") for i, a in enumerate(args)]
            return {"type": "array", "items": each, "minItems": len(each), "maxItems": len(each)}
        if origin in _ARRAYS:
            items = self.schema(args[0], f"{where}[]") if args else {}
            return {"type": "array", "items": items} if items else {"type": "array"}
        if origin in _SETS:
            item = self.schema(args[0], f"{where}[]") if args else {}
            return (
                {"type": "array", "items": item, "uniqueItems": True}
                if item
                else {"type": "array", "uniqueItems": True}
            )
        if origin in _MAPPINGS:
            if not args:
                return {"type": "object"}
            key, value_type = args
            if key not in (str, Any) and not (isinstance(key, type) and issubclass(key, str | int | enum.Enum)):
                raise UnsupportedType(tp, where)
            values = self.schema(value_type, f"{where}{{}}")
            return {"type": "object", "additionalProperties": values} if values else {"type": "object"}
        if isinstance(origin, type) and (attrs.has(origin) or dataclasses.is_dataclass(origin)):
            raise UnsupportedType(tp, where)  # generic classes: their fields' types are parameters
        raise UnsupportedType(tp, where)

    def _union(self, args: tuple[Any, ...], where: str) -> dict[str, Any]:
        options = [self.schema(a, where) for a in args]
        simple = [o.get("type") for o in options if set(o) == {"type"} and isinstance(o.get("type"), str)]
        if len(simple) == len(options):  # int | None -> {"type": ["integer", "null"]}
            return {"type": list(dict.fromkeys(simple))}
        return {"anyOf": options}

    # -- classes ----------------------------------------------------------------------------------

    def _class(self, tp: type, where: str) -> dict[str, Any]:
        if tp in (list, tuple):
            return {"type": "array"}
        if tp in (set, frozenset):
            return {"type": "array", "uniqueItems": True}
        if tp is dict:
            return {"type": "object"}
        if issubclass(tp, enum.Enum):
            return self._named(tp, lambda: self._enum(tp, where))
        if _pydantic_model(tp):
            return self._pydantic(tp)
        if attrs.has(tp) or dataclasses.is_dataclass(tp) or _is_typeddict(tp):
            return self._named(tp, lambda: self._record(tp, where))
        raise UnsupportedType(tp, where)

    def _named(self, tp: type, build: Any) -> dict[str, Any]:
        """A ``$ref`` to ``tp``'s component, built on first use (recursive classes end in a ``$ref``)."""
        name = self._names.get(tp)
        if name is None:
            name = self._component_name(tp)
            self._names[tp] = name
            self.components[name] = {}  # reserved: a field of tp's own type refers to it
            try:
                self.components[name] = build()
            except BaseException:
                del self.components[name], self._names[tp]
                raise
        return {"$ref": _REF + name}

    def _component_name(self, tp: type) -> str:
        name = getattr(tp, "__message_type__", None)
        if not isinstance(name, str) or not name:
            name = tp.__name__
        if name in self.components:
            name = f"{tp.__module__}.{tp.__qualname__}"
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        base, n = name, 2
        while name in self.components:
            name, n = f"{base}_{n}", n + 1
        return name

    def _custom(self, tp: type, custom: Any, where: str) -> dict[str, Any]:
        value = custom() if callable(custom) else custom
        if not isinstance(value, dict):
            raise UnsupportedType(tp, where)
        return dict(value)

    def _enum(self, tp: type[enum.Enum], where: str) -> dict[str, Any]:
        values = [m.value for m in tp]
        if not all(isinstance(v, str | int | float | bool) for v in values):
            raise UnsupportedType(tp, where)
        schema: dict[str, Any] = {"title": tp.__name__, "enum": values}
        kinds = {"string" if isinstance(v, str) else "boolean" if isinstance(v, bool) else "number" for v in values}
        if kinds == {"number"} and all(isinstance(v, int) for v in values):
            kinds = {"integer"}
        if len(kinds) == 1:
            schema["type"] = kinds.pop()
        return schema

    def _record(self, tp: type, where: str) -> dict[str, Any]:
        """An object schema of an attrs class, a dataclass or a TypedDict."""
        try:
            hints = typing.get_type_hints(tp, include_extras=True)
        except Exception as exc:
            raise UnsupportedType(tp, f"{where or tp.__name__}: its type hints do not resolve ({exc})") from None
        fields: list[tuple[str, Any, bool, Any]] = []  # name, type, required, default
        if attrs.has(tp):
            for f in attrs.fields(tp):
                if not f.init:
                    continue
                default = f.default
                has_default = default is not attrs.NOTHING
                plain = has_default and not isinstance(default, attrs.Factory)  # type: ignore[arg-type]
                fields.append((f.name, hints.get(f.name, f.type or Any), not has_default, default if plain else _NO))
        elif dataclasses.is_dataclass(tp):
            for f in dataclasses.fields(tp):
                if not f.init:
                    continue
                has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
                given = f.default if f.default is not dataclasses.MISSING else _NO
                fields.append((f.name, hints.get(f.name, Any), not has_default, given))
        else:
            total = getattr(tp, "__total__", True)
            for name, hint in hints.items():  # (not __required_keys__: wrong for string annotations on 3.11)
                marker = getattr(typing.get_origin(hint), "_name", None)
                fields.append((name, hint, marker == "Required" or (total and marker != "NotRequired"), _NO))
        properties: dict[str, Any] = {}
        for name, hint, _, default in fields:
            prop = self.schema(_unwrap_typeddict_marker(hint), f"{where or tp.__name__}.{name}")
            if (default is None or type(default) in (str, int, float, bool)) and "$ref" not in prop:
                prop = {**prop, "default": default}  # (a plain JSON default; factories and objects are left out)
            properties[name] = prop
        schema: dict[str, Any] = {"title": tp.__name__, "type": "object", "properties": properties}
        doc = _docstring(tp)
        if doc:
            schema["description"] = doc
        required = [name for name, _, req, _ in fields if req]
        if required:
            schema["required"] = required
        return schema

    def _pydantic(self, tp: type) -> dict[str, Any]:
        """The model's own ``model_json_schema()``, its ``$defs`` moved into ``components/schemas``."""
        name = self._names.get(tp)
        if name is not None:
            return {"$ref": _REF + name}
        name = self._component_name(tp)
        self._names[tp] = name
        schema = tp.model_json_schema(ref_template=_REF + "{model}")  # type: ignore[attr-defined]
        definitions: dict[str, Any] = schema.pop("$defs", {})
        renamed: dict[str, str] = {}  # a nested model whose name another schema has -> its new name
        for def_name, definition in definitions.items():
            target, n = def_name, 2
            while target in self.components and self.components[target] != definition:
                target, n = f"{def_name}_{n}", n + 1
            renamed[def_name] = target
        for def_name, definition in definitions.items():
            self.components[renamed[def_name]] = _rename_refs(definition, renamed)
        self.components[name] = _rename_refs(schema, renamed)
        return {"$ref": _REF + name}


def _rename_refs(node: Any, renamed: dict[str, str]) -> Any:
    """``node`` with its ``$ref``s to ``components/schemas`` following ``renamed``."""
    if isinstance(node, dict):
        out = {k: _rename_refs(v, renamed) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith(_REF) and ref[len(_REF) :] in renamed:
            out["$ref"] = _REF + renamed[ref[len(_REF) :]]
        return out
    if isinstance(node, list):
        return [_rename_refs(v, renamed) for v in node]
    return node


def _unwrap_typeddict_marker(hint: Any) -> Any:
    """``Required[X]`` / ``NotRequired[X]`` (TypedDict markers) -> ``X``."""
    origin = typing.get_origin(hint)
    if origin is not None and getattr(origin, "_name", None) in ("Required", "NotRequired", "ReadOnly"):
        return typing.get_args(hint)[0]
    return hint


def _docstring(tp: type) -> str:
    """The first paragraph of a class's own docstring (not the one attrs/dataclasses generate)."""
    doc = tp.__dict__.get("__doc__") or ""
    if not doc or (dataclasses.is_dataclass(tp) and doc.startswith(f"{tp.__name__}(")):
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())
