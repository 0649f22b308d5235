"""The conformance kit: checks any transport against the Broker contract, through the contract alone.

A transport's author gives a factory making connected brokers (all on one server and namespace)
and the :class:`Features` the transport claims; each check is a plain
``async def check_...(make, features)`` that talks only through :mod:`broker.protocol` and
:mod:`broker.capabilities` and raises AssertionError saying what broke the contract. Checks are
registered in :data:`CHECKS` with the features they need; one needing a feature that is off is
skipped, with the reason (:meth:`Check.skip_reason`). No pytest needed: :func:`run_all` runs
them in turn::

    from broker.conformance import Features, run_all

    outcomes = await run_all(lambda: my_connect("mytransport://test"))  # features: its capabilities

With pytest, parametrize over the registry (``tests/test_broker_conformance.py`` does this for
every transport of this repository)::

    import pytest
    from broker.conformance import CHECKS, Check, Features

    FEATURES = Features.of(MyBroker.capabilities, store_raw=my_raw_writer)

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", list(CHECKS.values()), ids=str)
    async def test_conformance(check: Check) -> None:
        if (reason := check.skip_reason(FEATURES)) is not None:
            pytest.skip(reason)
        await check(lambda: my_connect("mytransport://test"), FEATURES)

Checks name their destinations uniquely (a random suffix), so one namespace may serve every check;
each check closes the brokers it made. The checks of a capability the transport does not declare
are skipped; its documented degraded behaviour (narrowing to it raises TypeError naming the
transport and the capability) is asserted by ``capabilities_are_declared_honestly``.

Modules, by role: ``features`` (:class:`Features`), ``registry`` (:data:`CHECKS`, :func:`run_all`),
``support`` (helpers), ``publishing``, ``destinations``, ``reading`` (read/ack, pending, claims),
``settlement`` (dead letter, retries, attempts), ``dead_letters`` (administration), ``inbox``,
``introspection``, ``ownership``, ``scheduling``, ``state`` (the state store: guarded commits with the ack),
``retention``, ``degraded`` (what a transport lacking a feature does instead) and ``members``
(the protocols' members, capabilities).
"""

import importlib

from broker.conformance.features import CAPABILITY_FEATURES, BrokerFactory, Features, RawWriter
from broker.conformance.registry import CHECKS, Check, CheckFn, Outcome, check, run_all, run_check

ROLES = (
    "members",
    "destinations",
    "publishing",
    "reading",
    "settlement",
    "dead_letters",
    "inbox",
    "introspection",
    "ownership",
    "scheduling",
    "state",
    "replies",
    "retention",
    "degraded",
)
"""The modules holding checks, in the order :data:`CHECKS` lists them (each registers its own on import)."""

for _role in ROLES:
    importlib.import_module(f"{__name__}.{_role}")

__all__ = [
    "CAPABILITY_FEATURES",
    "CHECKS",
    "BrokerFactory",
    "Check",
    "CheckFn",
    "Features",
    "Outcome",
    "ROLES",
    "RawWriter",
    "check",
    "run_all",
    "run_check",
]
