"""Declare on first use: the routing every transport shares over its own declare and registry cache."""

from __future__ import annotations

from broker.envelope import Kind
from broker.topology import DestinationSpec, kind_mismatch

__all__ = ["Routing"]


class Routing:
    """Mixin: :meth:`ensure_declared` and :meth:`route` over a transport's ``declare``,
    ``get_destination`` and its per-broker cache ``_specs`` (which the transport fills)."""

    _specs: dict[str, DestinationSpec]

    async def declare(self, spec: DestinationSpec) -> DestinationSpec:
        raise NotImplementedError

    async def get_destination(self, name: str) -> DestinationSpec | None:
        raise NotImplementedError

    async def ensure_declared(self, spec: DestinationSpec) -> DestinationSpec:
        """:meth:`declare` ``spec`` unless this broker already holds exactly it; return the stored spec.

        The one "declare on first use" for producers holding a full spec (a ``Queue``/``Topic``
        object, an outbox row's stored spec): the first call per broker costs a registry round
        trip, later ones with the same spec none. A spec differing from the cached one is declared
        again (so a retention change is written; kind or partition conflicts raise
        ``ConfigurationError``).
        """
        cached = self._specs.get(spec.name)
        if cached == spec:
            return cached
        return await self.declare(spec)

    async def route(self, destination: str, kind: Kind, *, partitions: int = 1) -> DestinationSpec:
        """The spec to publish a ``kind`` message to ``destination`` with, declaring it if needed.

        The one "declare on first use" by name: the declared spec (cached per broker), else a new
        declaration ``DestinationSpec(destination, kind, partitions=partitions)`` with default
        retention (``partitions`` is used only then: an existing destination keeps its own).
        Raises ``ConfigurationError`` when ``destination`` is declared with the other kind, or the
        name is invalid. ``publish`` and effects commits route every envelope this way.
        """
        spec = self._specs.get(destination)
        if spec is not None and spec.kind == kind:
            return spec
        if spec is None:
            spec = await self.get_destination(destination)
            if spec is None:
                return await self.declare(DestinationSpec(name=destination, kind=kind, partitions=partitions))
        if spec.kind != kind:
            raise kind_mismatch(destination, kind)
        return spec
