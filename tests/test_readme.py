"""The README's code runs as written: the quick-start service and the testing example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(starting: str) -> str:
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S):
        if block.startswith(starting):
            return block
    raise AssertionError(f"README has no python block starting with {starting!r}")


@pytest.mark.slow
def test_the_quick_start_service_passes_the_readme_testing_example(tmp_path: Path) -> None:
    (tmp_path / "shop.py").write_text(_python_block("# shop.py"))
    (tmp_path / "test_shop.py").write_text(_python_block("import orjson\nimport pytest\n"))
    # No REDIS_URL: the example gets an embedded Valkey of its own, so the key it writes outside
    # its namespace ("revenue") never lands on a server someone else uses.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FRAMEWORK_NAMESPACE")}
    env["FRAMEWORK_HOME"] = str(tmp_path / ".framework")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shop.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout


DOCS = sorted((README.parent / "docs").glob("*.md"))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_python_blocks_parse_and_links_resolve(page: Path) -> None:
    import ast
    import textwrap

    text = page.read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        ast.parse(textwrap.dedent(block))  # a SyntaxError names the block's line
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(), flags=re.S), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert broken == [], f"{page.name}: broken links {broken}"
