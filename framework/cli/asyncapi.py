"""``framework asyncapi MODULE:SERVICE ...``: print the services' AsyncAPI 3.0.0 document.

JSON on stdout by default; ``-o FILE`` writes it to a file, ``--yaml`` as YAML (needs PyYAML),
``--html`` as a self-contained HTML page (no external assets). Needs no broker: the document is
built from the services' declarations alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path
from typing import Any

import orjson

from framework.cli.common import UsageError
from framework.cli.run import load_services

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``asyncapi`` to the ``framework`` command."""
    p = sub.add_parser(
        "asyncapi",
        help="print the services' AsyncAPI 3.0 document (channels, operations, message schemas)",
        description="Print the AsyncAPI 3.0.0 document of the services: a channel per queue and topic, a receive "
        "operation per handler, message schemas from the payload types. No broker is contacted.",
    )
    p.add_argument("targets", nargs="+", metavar="MODULE:SERVICE", help="services to describe, e.g. shop:billing")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write to FILE instead of stdout")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--yaml", action="store_true", help="YAML instead of JSON (needs PyYAML)")
    fmt.add_argument("--html", action="store_true", help="a self-contained HTML page of the document")
    p.add_argument("--title", default=None, help="info.title (default: the services' names)")
    p.add_argument("--version", dest="api_version", default="1.0.0", help="info.version (default 1.0.0)")
    p.add_argument("--description", default=None, help="info.description")
    p.add_argument(
        "--lenient",
        action="store_true",
        help="export a payload type it cannot describe as {} with an x-framework-unsupported note instead of failing",
    )
    p.set_defaults(func=export)


def export(args: argparse.Namespace) -> int:
    """Build the document of ``args.targets`` and write it in the asked format."""
    from framework.asyncapi import AsyncAPIError, build_document

    with contextlib.redirect_stdout(sys.stderr):  # a print() at import must not corrupt the document on stdout
        services = load_services(args.targets)
    try:
        document = build_document(
            services, title=args.title, version=args.api_version, description=args.description, lenient=args.lenient
        )
    except AsyncAPIError as exc:
        raise UsageError(str(exc)) from None
    if args.yaml:
        text = _yaml(document)
    elif args.html:
        from framework.asyncapi import render_html

        text = render_html(document)
    else:
        text = orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n"
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    return 0


def _yaml(document: dict[str, Any]) -> str:
    try:
        yaml: Any = importlib.import_module("yaml")  # (optional: PyYAML, without type stubs)
    except ImportError:
        raise UsageError("--yaml needs PyYAML: pip install pyyaml (or leave out --yaml for JSON)") from None
    # keys in document order; anchors off ($ref is how the document shares parts)
    dumper = type("_Dumper", (yaml.SafeDumper,), {"ignore_aliases": lambda self, data: True})
    return str(yaml.dump(document, Dumper=dumper, sort_keys=False, allow_unicode=True))
