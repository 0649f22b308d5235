"""The package structure holds: every module imports alone (no cycles), and imports run one way.

`example_services -> framework -> broker` and `spark_bridge -> broker`: the broker knows nothing
of services, and the Spark bridge never pulls in the runtime.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "framework", "example_services", "spark_bridge")
ALLOWED = {
    "broker": {"broker"},
    "framework": {"framework", "broker"},
    "example_services": {"example_services", "framework", "broker", "spark_bridge"},  # the shop's analytics use Spark
    "spark_bridge": {"spark_bridge", "broker"},
}


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(_imported_packages(path) - ALLOWED[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in wrong.items() if v} == {}


def test_every_module_imports_on_its_own_in_a_fresh_interpreter() -> None:
    # One interpreter per module would take minutes; a fresh interpreter that imports each module
    # after clearing the project's modules from sys.modules finds the same cycles. Two of them, each
    # with every other module, use both cores of a 2-core machine.
    names = _modules()
    probes = [_probe(names[i::2]) for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", p], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in probes
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "OK", out


def _probe(names: list[str]) -> str:
    """A script that imports each of ``names`` with none of the project's modules loaded before it."""
    return (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        f"packages = {PACKAGES!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in packages]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        if 'partially initialized' in str(exc) or (exc.name or '').split('.')[0] in packages:\n"
        "            failed.append(f'{name}: {exc}')\n"
        "    except Exception:\n"
        "        pass  # optional extras missing (pyspark without Java, ...): not an import-order problem\n"
        "print('\\n'.join(failed) or 'OK')\n"
    )
