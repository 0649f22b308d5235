"""compose.yaml parses, names the right images, and its commands are real framework commands.

No Docker engine runs here, so the file is checked as data: images, commands (parsed by the real
CLI parser), start order (tables migrated before the relay), ports bound to 127.0.0.1 only, and
passwords taken from the environment (documented in .env.example), never written in the file.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from framework.cli import build_parser
from framework.cli.run import load_services

ROOT = Path(__file__).resolve().parent.parent
_REQUIRED_VAR = re.compile(r"\$\{(\w+):\?[^}]*\}")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_file_names_the_right_images_and_commands() -> None:
    services = _compose()["services"]
    assert services["valkey"]["image"].startswith("valkey/valkey:")
    assert "--appendonly" in services["valkey"]["command"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["jaeger"]["image"].startswith("jaegertracing/")
    parser = build_parser()
    for name in ("orders", "billing", "outbox-relay", "migrate"):
        svc = services[name]
        assert svc["build"] == "." and svc["environment"]["REDIS_URL"].startswith("redis://")
        command = svc["command"]
        assert command[0] == "framework"
        args = parser.parse_args(command[1:])  # a real sub-command with valid options
        if command[1] == "run":
            assert [s.name for s in load_services(args.targets)] in (["orders"], ["billing"])
    assert services["migrate"]["command"][1:3] == ["outbox", "migrate"]
    assert (ROOT / "Dockerfile").exists()
    assert "framework" in shlex.split((ROOT / "Dockerfile").read_text().splitlines()[-1].split("CMD", 1)[1])[0]


def test_the_relay_starts_only_after_the_tables_are_migrated() -> None:
    services = _compose()["services"]
    relay_deps = services["outbox-relay"]["depends_on"]
    assert relay_deps["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["restart"] == "no"  # one-shot, not a crash loop
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_ports_are_published_on_loopback_only() -> None:
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_passwords_come_from_the_environment_and_env_example_lists_them() -> None:
    text = (ROOT / "compose.yaml").read_text()
    services = _compose()["services"]
    assert "postgres:postgres@" not in text and "POSTGRES_PASSWORD: postgres" not in text
    assert _REQUIRED_VAR.fullmatch(services["postgres"]["environment"]["POSTGRES_PASSWORD"])
    valkey_cmd = services["valkey"]["command"]
    assert _REQUIRED_VAR.fullmatch(valkey_cmd[valkey_cmd.index("--requirepass") + 1])
    for name in ("orders", "billing", "outbox-relay", "migrate"):
        env = services[name]["environment"]
        assert _REQUIRED_VAR.search(env["REDIS_URL"]) and _REQUIRED_VAR.search(env["DATABASE_URL"])
        assert "--database-url" not in services[name]["command"]  # a password on a command line shows in ps
    needed = set(_REQUIRED_VAR.findall(text))
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert needed == {"VALKEY_PASSWORD", "POSTGRES_PASSWORD"} and needed <= set(example)
