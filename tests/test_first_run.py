"""A fresh clone's first commands work on the core install: nothing outside tests/ needs the dev extras.

`make demo` installs the framework without the `dev` extra (no pytest, no ruff, no PyYAML), so every
module the demo, the CLI, the benchmarks or a user's service imports must import without them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEV_ONLY = ("pytest", "_pytest", "pytest_timeout", "yaml", "ruff")

# Imports every module of the shipped packages in a fresh interpreter where the dev extras cannot be
# imported (a meta path finder refuses them, as on a core install).
_PROBE = """
import importlib, pkgutil, sys

BLOCKED = {blocked!r}

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (dev extra, blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
failed = []
for package in ("broker", "framework", "example_services"):
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        if info.name == "framework.pytest_plugin" or info.name.endswith("__main__"):
            continue  # loaded by pytest only; entry points that would run
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in BLOCKED:
                failed.append(f"{{info.name}}: {{exc}}")
        except Exception:
            pass  # optional extras (sql, spark) are not this test's concern
print("\\n".join(failed) if failed else "OK")
"""


def test_shipped_modules_import_without_the_dev_extras() -> None:
    probe = _PROBE.format(blocked=DEV_ONLY)
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK", f"modules that need a dev extra:\n{result.stdout}"


def test_testing_helpers_import_without_pytest_and_the_plugin_is_registered() -> None:
    probe = (
        "import sys; sys.modules['pytest'] = None\n"
        "from framework.testing import ServiceHarness, delete_namespace, embedded_server\n"
        "import importlib.metadata as m\n"
        "eps = [e.value for e in m.entry_points(group='pytest11') if e.name == 'framework']\n"
        "print(eps)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['framework.pytest_plugin']"


def test_ci_runs_the_readme_demo_command_before_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands[:2] == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    demo_at, test_at = ci.find("make demo"), ci.find("make test")
    assert 0 <= demo_at < test_at, ".ci/run must run `make demo` and then `make test`"
