"""The README's Quick start, run exactly as printed, from a fresh shell in a directory that has
`.venv` (as after `make demo`) and the quick start's `shop.py`: every command must work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _quick_start() -> tuple[str, str]:
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, flags=re.S)
    shell = re.search(r"```sh\n(.*?)```", section, flags=re.S)
    assert python and shell, "the Quick start has a python block and a sh block"
    return python.group(1), shell.group(1)


@pytest.mark.slow
def test_the_quick_start_runs_as_printed_in_a_fresh_shell(tmp_path: Path) -> None:
    code, commands = _quick_start()
    assert commands.splitlines()[0].startswith("source .venv/bin/activate"), "the first command activates .venv"
    (tmp_path / "shop.py").write_text(code)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the venv `make demo` made, where the user stands
    # a fresh shell: no framework variables, no PATH entry for the venv; an embedded Valkey of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAMEWORK_", "REDIS_", "BROKER_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))
    env["FRAMEWORK_HOME"] = str(tmp_path / ".framework")
    script = (
        "set -e\n"
        + commands
        + "\nfor i in $(seq 100); do framework status --json | grep -q '\"lag\": 0' && break; sleep 0.2; done\n"
        + "framework status\nkill %1 && wait %1 || true\nframework server stop\n"
    )
    run = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "orders.placed" in run.stdout and "payments.captured" in run.stdout  # the worker processed the order
