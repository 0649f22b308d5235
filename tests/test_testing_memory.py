"""docs/testing.md's unit-test example runs as written on ``memory://``, in a user's own project."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def test_the_memory_example_of_the_testing_guide_passes_without_any_server(tmp_path: Path) -> None:
    [block] = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "memory://" in b]
    (tmp_path / "test_billing_memory.py").write_text(block)
    # No server can be reached: a transport that quietly fell back to Redis would fail to connect.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BROKER_URL", "FRAMEWORK_NAMESPACE")}
    env["FRAMEWORK_HOME"] = str(tmp_path / "no-home")
    env["REDIS_URL"] = "redis://127.0.0.1:1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_billing_memory.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    assert not (tmp_path / "no-home").exists()  # no embedded server was started
