"""Every metric the Grafana dashboard queries is one a real worker or relay serves, with those labels.

The dashboard (deploy/observability/grafana/dashboards/framework.json) is read as data: each PromQL
query is split into its selectors (metric name and the labels it matches on) and the labels it
aggregates by. A real ``framework run --metrics-port`` worker (tests/apps/obsapp.py: a handler that
succeeds, one that retries, one that dead-letters, one downstream) and a real ``framework outbox
relay --metrics-port`` are scraped, their exposition parsed with ``prometheus_client``'s parser, and
every name and label the dashboard uses must be among what they serve. A renamed instrument, a
label spelled differently, or an exporter version that changes a suffix fails here, not on a blank
panel in production.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework import SyncClient
from tests.workers import Workers, wait_for

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "observability" / "grafana" / "dashboards" / "framework.json"

# -- PromQL, as much of it as a dashboard uses ------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
      | (?P<range>\[[^\]]*\])
      | (?P<var>\$\{?\w+(?::\w+)?\}?)
      | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
      | (?P<ident>[A-Za-z_:][\w:]*)
      | (?P<op>\S)
    )""",
    re.X,
)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
_AGGREGATIONS |= {"quantile", "limitk", "limit_ratio"}  # `sum by (x) (...)`: an operator, not a metric
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", *_GROUPING, *_AGGREGATIONS}


def parse_promql(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """(selectors as (metric name, labels matched on), labels grouped by) of a PromQL expression."""
    tokens = [(m.lastgroup, m.group(m.lastgroup)) for m in _TOKEN.finditer(expr) if m.lastgroup]
    selectors: list[tuple[str, set[str]]] = []
    grouped: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "op" and text == "{":
            raise AssertionError(f"a selector without a metric name is not supported: {expr}")
        if kind != "ident":
            i += 1
            continue
        if following == "(":
            if text in _GROUPING:  # by (a, b): the labels up to the closing parenthesis
                j = i + 2
                while tokens[j][1] != ")":
                    if tokens[j][0] == "ident":
                        grouped.add(tokens[j][1])
                    j += 1
                i = j
            i += 1  # a function name
            continue
        if text in _KEYWORDS:
            i += 1
            continue
        labels: set[str] = set()
        if following == "{":
            j = i + 2
            while tokens[j][1] != "}":
                if tokens[j][0] == "ident":
                    labels.add(tokens[j][1])
                j += 1
            i = j
        selectors.append((text, labels))
        i += 1
    return selectors, grouped


def _label_values(query: str) -> tuple[str, str]:
    """(selector expression, label) of a Grafana ``label_values(selector, label)`` variable query."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query, re.S)
    assert m, f"unsupported variable query {query!r}"
    return m.group(1), m.group(2)


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def dashboard_queries(dashboard: dict) -> list[tuple[str, list[tuple[str, set[str]]], set[str]]]:
    """(expression, selectors, grouping labels) of every Prometheus query: panels and variables."""
    found = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            source = target.get("datasource") or panel.get("datasource") or {}
            if source.get("type") == "prometheus":
                found.append((target["expr"], *parse_promql(target["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query" and variable["datasource"]["type"] == "prometheus":
            query = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
            selector, label = _label_values(query)
            selectors, grouped = parse_promql(selector)
            found.append((query, selectors, grouped | {label}))
    return found


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_promql_reader_finds_metrics_and_labels() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, framework_handler) (rate(messaging_process_duration_seconds_bucket"
        '{framework_service=~"$service", framework_handler=~"a,b}"}[$__rate_interval]))) '
        "/ on (framework_handler) group_left max(framework_dlq_size) > bool 0"
    )
    selectors, grouped = parse_promql(expr)
    assert selectors == [
        ("messaging_process_duration_seconds_bucket", {"framework_service", "framework_handler"}),
        ("framework_dlq_size", set()),
    ]
    assert grouped == {"le", "framework_handler"}
    assert parse_promql("sum(rate(x_total[5m])) by (a) + y") == ([("x_total", set()), ("y", set())], {"a"})


def test_the_dashboard_shows_what_operators_need() -> None:
    dashboard = _dashboard()
    queries = dashboard_queries(dashboard)
    names = {name for _, selectors, _ in queries for name, _ in selectors}
    assert {
        "framework_messages_processed_total",
        "framework_messages_failed_total",
        "framework_messages_retried_total",
        "framework_messages_dead_lettered_total",
        "framework_messages_duplicates_total",
        "framework_dlq_size",
        "framework_consumer_lag",
        "framework_consumer_pending",
        "messaging_process_duration_seconds_bucket",
        "framework_message_latency_seconds_bucket",
        "framework_outbox_backlog",
        "framework_outbox_oldest_age_seconds",
    } <= names
    # latency percentiles over the histogram buckets, p50/p95/p99 of both histograms
    for histogram in ("messaging_process_duration_seconds_bucket", "framework_message_latency_seconds_bucket"):
        quantiles = {
            float(m.group(1))
            for expr, selectors, grouped in queries
            if any(name == histogram for name, _ in selectors) and "le" in grouped
            for m in [re.match(r"histogram_quantile\(([\d.]+),", expr)]
            if m
        }
        assert quantiles == {0.5, 0.95, 0.99}, histogram
    # lag and pending per partition
    for expr, selectors, grouped in queries:
        if any(name in ("framework_consumer_lag", "framework_consumer_pending") for name, _ in selectors):
            assert "messaging_destination_partition_id" in grouped, expr
    # every per-handler query follows the service and handler variables
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"service", "handler"} <= variables
    for expr, selectors, _ in queries:
        for name, labels in selectors:
            if name.startswith(("framework_messages_", "framework_consumer_", "framework_dlq", "messaging_process")):
                assert {"framework_service", "framework_handler"} <= labels, expr
                assert '"$service"' in expr and '"$handler"' in expr, expr
    # traces are one click away
    assert any(link["url"].startswith("http://127.0.0.1:16686") for link in dashboard["links"])
    assert any(p.get("datasource", {}).get("type") == "jaeger" for p in _panels(dashboard))


# -- what a real run serves -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> tuple[str, str]:
    """(content type, body) of ``http://127.0.0.1:port/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


def _served(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it is served with (the exposition must parse)."""
    served: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            served.setdefault(sample.name, []).append(dict(sample.labels))
    return served


def _scraped(port: int) -> dict[str, list[dict[str, str]]]:
    try:
        return _served(_scrape(port)[1])
    except OSError:
        return {}


def _value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` with ``labels`` in an exposition."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _assert_served(queries: list, served: dict[str, list[dict[str, str]]], which: str) -> int:
    """Every selector of ``queries`` is served, with the labels it matches on and groups by."""
    checked = 0
    for expr, selectors, grouped in queries:
        labels_in_expr: set[str] = set()
        for name, matched in selectors:
            assert name in served, f"the dashboard queries {name}, which {which} does not serve ({expr})"
            have = set().union(*map(set, served[name]))
            assert matched <= have, f"{name} is served without labels {matched - have} ({expr})"
            labels_in_expr |= have
            checked += 1
        assert grouped <= labels_in_expr, f"{expr} groups by {grouped - labels_in_expr}, which no metric has"
    return checked


@pytest.fixture
def clean_worker_env(worker_env: dict[str, str]) -> dict[str, str]:
    """The workers' environment with only the Prometheus endpoint on (no OTLP export attempts)."""
    env = {k: v for k, v in worker_env.items() if not k.startswith(("OTEL_", "FRAMEWORK_METRICS_"))}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    return env


@pytest.mark.slow
def test_every_consumer_metric_the_dashboard_queries_is_served_by_a_worker(
    clean_worker_env: dict[str, str], tmp_path: Path, redis_url: str, namespace: str
) -> None:
    port = _free_port()
    workers = Workers(clean_worker_env, tmp_path)
    try:
        workers.start("obsapp:observed", "obs-1", "--metrics-port", str(port))
        workers.start("obsapp:notifier", "obs-2", "--metrics-port", str(_free_port()))
        handlers = {"work", "flaky", "reject"}

        def tracked() -> bool:
            served = _scraped(port).get("messaging_client_consumed_messages_total", [])
            return {labels.get("framework_handler") for labels in served} >= handlers

        wait_for(tracked, 30, "the worker's metrics endpoint to list its handlers")
        with SyncClient(redis_url, namespace=namespace) as client:
            for n in range(5):
                client.send("obs.work", {"n": n})
            client.send("obs.flaky", {"n": "f"})
            client.send("obs.rejected", {"n": "r"})

        def settled() -> bool:
            text = _scrape(port)[1]
            return (
                _value(text, "framework_messages_processed_total", framework_handler="work") >= 5
                and _value(text, "framework_messages_retried_total", framework_handler="flaky") >= 1
                and _value(text, "framework_messages_processed_total", framework_handler="flaky") >= 1
                and _value(text, "framework_messages_dead_lettered_total", framework_handler="reject") >= 1
                and _value(text, "framework_dlq_size", framework_handler="reject") >= 1  # refreshed every 5 s
                and _value(text, "messaging_client_sent_messages_total", messaging_destination_name="obs.done") >= 5
                and _value(text, "framework_message_latency_seconds_count", framework_handler="work") >= 5
                and all(
                    _value(text, "messaging_process_duration_seconds_count", framework_outcome=outcome) >= 1
                    for outcome in ("success", "retry", "dead_letter")
                )
            )

        wait_for(settled, 40, "the worker to process, retry and dead-letter, and the metrics to show it")
        content_type, text = _scrape(port)
    finally:
        workers.stop_all()
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    served = _served(text)
    assert served["framework_consumer_lag"] and served["framework_consumer_pending"]
    outbox = [q for q in dashboard_queries(_dashboard()) if any(n.startswith("framework_outbox_") for n, _ in q[1])]
    consumer = [q for q in dashboard_queries(_dashboard()) if q not in outbox]
    assert _assert_served(consumer, served, "a `framework run --metrics-port` worker") >= 20
    # what the dashboard's panels will show is really recorded: histograms by outcome, sent messages
    outcomes = {labels.get("framework_outcome") for labels in served["messaging_process_duration_seconds_count"]}
    assert {"success", "retry", "dead_letter"} <= outcomes


@pytest.mark.slow
def test_every_outbox_metric_the_dashboard_queries_is_served_by_the_relay(
    clean_worker_env: dict[str, str], tmp_path: Path
) -> None:
    database = f"sqlite:///{tmp_path / 'outbox.db'}"
    cli = [sys.executable, "-m", "framework", "outbox"]
    migrated = subprocess.run(
        [*cli, "migrate", "--database-url", database], env=clean_worker_env, capture_output=True, text=True, timeout=60
    )
    assert migrated.returncode == 0, migrated.stderr
    port = _free_port()
    log = open(tmp_path / "relay.log", "wb")  # noqa: SIM115 - closed below
    relay = subprocess.Popen(
        [*cli, "relay", "--database-url", database, "--metrics-port", str(port)],
        env=clean_worker_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: "framework_outbox_backlog" in _scraped(port), 30, "the relay's metrics endpoint")
        content_type, text = _scrape(port)
    finally:
        relay.kill()
        relay.wait()
        log.close()
    assert content_type.startswith("text/plain")
    outbox = [q for q in dashboard_queries(_dashboard()) if any(n.startswith("framework_outbox_") for n, _ in q[1])]
    assert _assert_served(outbox, _served(text), "`framework outbox relay --metrics-port`") >= 2
