"""Users' type checkers see the package's types: py.typed ships, and the README's service checks clean."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_ships_the_typed_markers(tmp_path: Path) -> None:
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    [wheel] = tmp_path.glob("framework-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"framework/py.typed", "broker/py.typed", "broker/redis/lua/ack.lua"} <= names


def test_a_service_written_from_the_readme_type_checks_in_strict_mode(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    [shop] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if b.startswith("# shop.py")]
    (tmp_path / "shop.py").write_text(shop)
    # As for an installed package: the user's module is checked strictly, the package's own
    # modules are read for their types but not reported on.
    (tmp_path / "mypy.ini").write_text("[mypy]\nstrict = True\n[mypy-framework.*,broker.*]\nfollow_imports = silent\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "shop.py"],
        cwd=tmp_path,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "Success: no issues found in 1 source file" in run.stdout
