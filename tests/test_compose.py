"""compose.yaml parses, names the right images, and its commands are real framework commands."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from framework.cli import build_parser, load_services

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_names_the_right_images_and_commands() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert services["valkey"]["image"].startswith("valkey/valkey:")
    assert "--appendonly" in services["valkey"]["command"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["jaeger"]["image"].startswith("jaegertracing/")
    parser = build_parser()
    for name in ("orders", "billing", "outbox-relay"):
        svc = services[name]
        assert svc["build"] == "." and svc["environment"]["REDIS_URL"] == "redis://valkey:6379/0"
        command = svc["command"]
        assert command[0] == "framework"
        args = parser.parse_args(command[1:])  # a real sub-command with valid options
        if command[1] == "run":
            assert [s.name for s in load_services(args.targets)] in (["orders"], ["billing"])
    assert (ROOT / "Dockerfile").exists()
    assert "framework" in shlex.split((ROOT / "Dockerfile").read_text().splitlines()[-1].split("CMD", 1)[1])[0]
