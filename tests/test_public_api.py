"""The public surface is deliberate: ``framework`` exports exactly the listed names, each documented.

Users import the names below from ``framework`` and the feature packages (``framework.testing``,
``framework.outbox``, ``framework.dead_letters``, ``framework.scheduling``, ``framework.sql``, the
``framework`` command). A name added to or dropped from a surface fails here, so it is a decision,
not an accident.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import framework

ROOT = Path(__file__).resolve().parent.parent

PUBLIC = {
    "framework": {
        "Service",
        "Queue",
        "Topic",
        "UnknownDestination",
        "NewDestinationWarning",
        "Context",
        "HandlerError",
        "Filter",
        "MessageInfo",
        "Resource",
        "StartupError",
        "BatchPolicy",
        "BatchFailed",
        "BatchAborted",
        "BatchContext",
        "Saga",
        "SagaContext",
        "RetryPolicy",
        "RetryAfter",
        "HandlerTimeout",
        "Client",
        "SyncClient",
        "Batch",
        "RequestError",
        "RequestTimeout",
        "RequestFailed",
        "ReplyDecodeError",
        "Runtime",
        "RuntimeSettings",
        "converter",
        "PayloadError",
        "Envelope",
        "BrokerUnavailable",
        "ConfigurationError",
        "MessageTooLarge",
        "Middleware",
        "CallNext",
        "InboundMessage",
        "Outcome",
        "enable_tracing",
        "enable_metrics",
    },
    "framework.observability": {
        "configure_from_env",
        "disable_metrics",
        "disable_tracing",
        "enable_metrics",
        "enable_tracing",
        "metrics_enabled",
        "shutdown",
        "tracing_enabled",
    },
    "framework.testing": {
        "TEST_SETTINGS",
        "Chaos",
        "ExactlyOnce",
        "Recovery",
        "ServiceHarness",
        "WorkerPool",
        "exactly_once",
        "delete_namespace",
        "embedded_postgres",
        "embedded_server",
        "temporary_database",
        "unique_namespace",
        "wait_for",
    },
    "framework.dead_letters": {"DeadLetter", "DeadLetters", "body_view"},
    "framework.scheduling": {"Job", "ScheduleError", "Tick", "cancel", "due_ms", "scheduled"},
    "framework.saga": {"MAX_CONFLICTS", "SAGA_INPUT", "Saga", "SagaContext", "SagaError", "SagaRetryPolicy"},
    "framework.outbox": {
        "NOTIFY_CHANNEL",
        "SHARDS",
        "DatabaseUnavailable",
        "OutboxRelay",
        "add",
        "add_command",
        "add_event",
        "check_tables",
        "claim_inbox",
        "create_engine",
        "create_tables",
        "ddl",
        "inbox_table",
        "metadata",
        "outbox_table",
        "sent_table",
        "shard_of",
        "shards_table",
        "stage",
    },
    "framework.asyncapi": {
        "ASYNCAPI_VERSION",
        "AsyncAPIError",
        "SchemaBuilder",
        "UnsupportedType",
        "build_document",
        "render_html",
    },
    "framework.sql": {
        "DatabaseUnavailable",
        "create_engine",
        "default_sqlite_path",
        "libpq_url",
        "ping",
        "redact_url",
        "resolve_url",
    },
    "framework.cli": {"build_parser", "main"},
}


def _attribute_docstring(module: types.ModuleType, name: str) -> str | None:
    """The string literal right after ``name = ...`` in ``module``'s source (how constants are documented)."""
    body = ast.parse(Path(inspect.getfile(module)).read_text()).body
    for node, after in itertools.pairwise(body):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        named = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            return str(after.value.value)
    return None


def _documentation(value: Any, home: types.ModuleType, name: str) -> str | None:
    """A class's or function's own docstring; for any other value, its attribute docstring at home."""
    if inspect.isclass(value):
        return vars(value).get("__doc__")
    if inspect.isroutine(value):
        return inspect.unwrap(value).__doc__
    return _attribute_docstring(home, name)


def _home(package: types.ModuleType, name: str) -> types.ModuleType:
    """The module that defines ``name`` as ``package`` re-exports it (for attribute docstrings)."""
    for module in [package, *(m for m in list(sys.modules.values()) if m is not None)]:
        path = getattr(module, "__file__", None)
        if path is None or not str(path).startswith(str(ROOT)):
            continue
        if vars(module).get(name) is vars(package)[name] and _attribute_docstring(module, name) is not None:
            return module
    return package


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_surface_is_exactly_the_listed_names(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC[package]
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice in __all__"
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name} is in __all__ but does not import"


def test_nothing_else_is_public_by_accident_in_framework() -> None:
    # Submodules are attributes of the package once imported; everything else must be listed.
    public = {
        name
        for name, value in vars(framework).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(framework.__all__)


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_public_name_says_what_it_promises(package: str) -> None:
    module = importlib.import_module(package)
    undocumented = [
        name
        for name in module.__all__
        if not (_documentation(getattr(module, name), _home(module, name), name) or "").strip()
    ]
    assert undocumented == []


def test_public_classes_and_functions_carry_type_hints() -> None:
    missing = []
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            routines = [value] if inspect.isfunction(value) else []
            if inspect.isclass(value):
                routines = [
                    f
                    for attr, f in vars(value).items()
                    if inspect.isfunction(f) and (not attr.startswith("_") or attr == "__init__")
                ]
            for fn in routines:
                fn = inspect.unwrap(fn)
                params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
                if any(p.annotation is inspect.Parameter.empty for p in params) or (
                    fn.__name__ != "__init__" and inspect.signature(fn).return_annotation is inspect.Signature.empty
                ):
                    missing.append(f"{package}.{name}: {fn.__qualname__}")
    assert missing == []


def test_the_surface_imports_alone_without_pytest_or_the_sql_extra() -> None:
    # The core install: no pytest (dev extra), no SQLAlchemy (sql extra). framework.testing too.
    probe = (
        "import sys\n"
        "for blocked in ('pytest', 'sqlalchemy', 'psycopg', 'aiosqlite'):\n"
        "    sys.modules[blocked] = None\n"
        "import framework, framework.testing, framework.dead_letters, framework.cli\n"
        "print(sorted(framework.__all__) == sorted(set(framework.__all__)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
