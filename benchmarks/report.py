"""The results of a benchmark run: medians, ratios paired by round, the targets and the table's rows.

:class:`Report` is what :class:`benchmarks.runner.Runner` knows once its trials ran (``trials``,
``errors``, ``extra``): the summary written to JSON and the rows printed.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks import batch_bench, faststream_bench, latency_rows, tracing_bench
from benchmarks.rows import (
    SQL_WORK_MS,
    SQL_WORKERS,
    Row,
    SqlRows,
    _cluster_row,
    _ownership_row,
    _rabbitmq_row,
    _rate,
    _reply_row,
    _saga_row,
    _saga_sql_row,
    _schedule_row,
    _sql_key,
    _workers_row,
    sql_kinds,
    stats,
)

__all__ = ["Report", "Row", "stats"]

_LATENCY = ("p50_ms", "p90_ms", "p99_ms", "max_ms", "achieved_rate", "cpu_us_per_msg", "server_cpu_us_per_msg")

THROUGHPUT_TARGET = 0.25  # of the raw ceiling, one worker process
INBOX_COST_TARGET = 0.30
MEMORY_FLAT_TARGET = 1.10  # peak RSS, big backlog over small backlog
INBOX_BYTES_TARGET = 32  # server bytes per remembered inbox id (issue #15)
OUTBOX_TARGET = 20_000
SPARK_RATIO_TARGET = 0.50  # broker -> Parquet rows/s over the in-memory Python source's


class Report(SqlRows):
    """Summaries and rows of the trials a run kept (mixed into the runner)."""

    trials: dict[str, list[dict[str, Any]]]
    errors: dict[str, str]
    extra: dict[str, Any]
    selected: list[str]
    repeats: int

    # -- summarising --------------------------------------------------------------------------------------

    def _stats(self, key: str, field: str) -> dict[str, Any] | None:
        runs = [t[field] for t in self.trials.get(key, []) if t.get(field) is not None]
        return stats(runs) if runs else None

    def paired(
        self,
        key: str,
        field: str,
        base: str = "raw:xack",
        base_field: str = "drain_msgs_per_s",
    ) -> dict[str, Any] | None:
        """Per-round ratios of ``key``'s ``field`` to ``base``'s, measured back to back in one round
        (a round whose trial lacks the figure is left out)."""
        bases = {
            t["round"]: t[base_field]
            for t in self.trials.get(base, [])
            if t.get("round") is not None and t.get(base_field)
        }
        ratios = [
            t[field] / bases[t["round"]]
            for t in self.trials.get(key, [])
            if t.get("round") in bases and t.get(field) is not None
        ]
        return stats(ratios) if ratios else None

    def summary(self) -> dict[str, dict[str, Any]]:
        """Medians (with min, max and runs) of every figure, by benchmark; ``ratio_to_raw`` is paired by round."""
        out: dict[str, dict[str, Any]] = {}
        fields = {
            "raw:xack": ("drain_msgs_per_s", "fill_msgs_per_s"),
            "raw:xdel": ("drain_msgs_per_s",),
            "commands:on": ("msgs_per_s", "publish_msgs_per_s", "peak_rss_mib", *_PROFILE),
            "commands:off": ("msgs_per_s", "publish_msgs_per_s", "peak_rss_mib", *_PROFILE),
            "events:3": ("events_per_s", "deliveries_per_s", "publish_msgs_per_s"),
            "latency:raw": _LATENCY,
            "latency:framework": _LATENCY,
            "latency:framework-noinbox": _LATENCY,
            "memory:small": ("peak_rss_mib", "msgs_per_s", "server_inbox_mib", "inbox_bytes_per_id"),
            "recovery": (
                "normal_msgs_per_s",
                "restart_msgs_per_s",
                "claim_msgs_per_s",
                "restart_ratio",
                "claim_ratio",
            ),
            "memory:big": (
                "peak_rss_mib",
                "first_half_rss_mib",
                "second_half_rss_mib",
                "msgs_per_s",
                "server_inbox_mib",
                "inbox_bytes_per_id",
            ),
        }
        for work, kind, w in ((t, k, w) for t in SQL_WORK_MS for k in (*sql_kinds(t), "plain") for w in SQL_WORKERS):
            fields[f"{_sql_key(work)}:{kind}:{w}"] = (
                "msgs_per_s",
                "cpu_ms_per_msg",
                "p50_ms",
                "p90_ms",
                "p99_ms",
                "max_ms",
                "achieved_rate",
            )
        for key, names in fields.items():
            figures = {n: st for n in names if (st := self._stats(key, n)) is not None}
            if figures:
                out[key] = figures
        for key, field in (
            ("raw:xdel", "drain_msgs_per_s"),
            ("commands:on", "msgs_per_s"),
            ("commands:off", "msgs_per_s"),
            ("events:3", "deliveries_per_s"),
        ):
            if key in out and (pr := self.paired(key, field)) is not None:
                out[key]["ratio_to_raw"] = pr
        for key in ("latency:framework", "latency:framework-noinbox"):
            if key in out and (pr := self.paired(key, "cpu_us_per_msg", "latency:raw", "cpu_us_per_msg")) is not None:
                out[key]["cpu_ratio_to_raw"] = pr
        for p, w, kind in ((_sql_key(t), w, k) for t in SQL_WORK_MS for w in SQL_WORKERS for k in sql_kinds(t)):
            key, plain = f"{p}:{kind}:{w}", f"{p}:plain:{w}"
            if key in out and (pr := self.paired(key, "msgs_per_s", plain, "msgs_per_s")) is not None:
                out[key]["ratio_to_plain"] = pr
            if key in out and (pr := self.paired(key, "cpu_ms_per_msg", plain, "cpu_ms_per_msg")) is not None:
                out[key]["cpu_ratio_to_plain"] = pr
        on, off = self.trials.get("commands:on", []), {t["round"]: t for t in self.trials.get("commands:off", [])}
        costs = [1 - t["msgs_per_s"] / off[t["round"]]["msgs_per_s"] for t in on if t.get("round") in off]
        if costs:
            out["inbox_cost"] = {"paired": stats(costs)}
        lat_off = {t["round"]: t for t in self.trials.get("latency:framework-noinbox", [])}
        lat_on = self.trials.get("latency:framework", [])
        added = [t["p50_ms"] - lat_off[t["round"]]["p50_ms"] for t in lat_on if t.get("round") in lat_off]
        if added:
            out["latency_inbox_p50_added_ms"] = {"paired": stats(added)}
        out.update(tracing_bench.summary(self.trials))
        out.update(faststream_bench.summary(self.trials))
        out.update(batch_bench.summary(self.trials))
        return out

    def rows(self) -> list[Row]:
        """The table: result, raw ceiling, ratio and target per benchmark."""
        sm = self.summary()
        rows: list[Row] = []
        ceiling = sm.get("raw:xack", {}).get("drain_msgs_per_s")
        ceil_text = f"{ceiling['median']:,.0f} msg/s" if ceiling else "—"

        def ratio(value: float, key: str | None = None) -> tuple[str, float | None]:
            """Paired by round when ``key`` has per-round ratios, else the ratio of the medians."""
            paired = sm.get(key, {}).get("ratio_to_raw") if key else None
            if paired:
                r = paired["median"]
                spread = f"\n[dim]{paired['min']:.0%}-{paired['max']:.0%}[/dim]" if len(paired["runs"]) > 1 else ""
                return f"{r:.0%}{spread}", r
            if not ceiling:
                return "—", None
            r = value / ceiling["median"]
            return f"{r:.0%}", r

        def not_run(name: str, label: str) -> bool:
            if name in self.errors:
                rows.append(Row(label, f"[yellow]{self.errors[name]}[/yellow]"))
                return True
            return name not in self.selected

        if not not_run("raw", "raw redis-py ceiling") and ceiling:
            rows.append(Row("raw redis-py: XREADGROUP 500 + XACK per batch (the ceiling)", _rate(ceiling)))
            if xdel := sm.get("raw:xdel", {}).get("drain_msgs_per_s"):
                rows.append(
                    Row(
                        "raw redis-py: XREADGROUP 500 + XACK + XDEL per batch",
                        _rate(xdel),
                        ceil_text,
                        ratio(xdel["median"], "raw:xdel")[0],
                    )
                )
        if not not_run("commands", "commands, one worker"):
            for key, label in (
                ("commands:on", "commands → one worker, inbox on (default)"),
                ("commands:off", "commands → one worker, inbox off"),
            ):
                if st := sm.get(key, {}).get("msgs_per_s"):
                    text, r = ratio(st["median"], key)
                    rows.append(
                        Row(
                            label,
                            _rate(st),
                            ceil_text,
                            text,
                            f"≥ {THROUGHPUT_TARGET:.0%} of raw",
                            None if r is None else r >= THROUGHPUT_TARGET,
                        )
                    )
            if cost := sm.get("inbox_cost", {}).get("paired"):
                spread = f"\n[dim]{cost['min']:.0%}-{cost['max']:.0%}[/dim]" if len(cost["runs"]) > 1 else ""
                rows.append(
                    Row(
                        "inbox cost: 1 - (inbox on / inbox off), paired by round",
                        f"{cost['median']:.0%} of throughput{spread}",
                        target=f"< {INBOX_COST_TARGET:.0%}",
                        ok=cost["median"] < INBOX_COST_TARGET,
                    )
                )
            rows.extend(_profile_rows(sm))
            if pub := sm.get("commands:on", {}).get("publish_msgs_per_s"):
                fill = sm.get("raw:xack", {}).get("fill_msgs_per_s")
                rows.append(
                    Row(
                        "publish: Client.send_many, 5,000 per call",
                        _rate(pub),
                        f"{fill['median']:,.0f} msg/s\n[dim]pipelined XADD[/dim]" if fill else "—",
                        f"{pub['median'] / fill['median']:.0%}" if fill else "—",
                    )
                )
        if not not_run("events", "events, three groups") and (ev := sm.get("events:3")):
            text, r = ratio(ev["deliveries_per_s"]["median"], "events:3")
            rows.append(
                Row(
                    "events → 3 groups (3 services), one worker",
                    f"{_rate(ev['events_per_s'], 'events/s')}\n= {ev['deliveries_per_s']['median']:,.0f} deliveries/s",
                    ceil_text,
                    text + " [dim](deliveries)[/dim]",
                    f"≥ {THROUGHPUT_TARGET:.0%} of raw",
                    None if r is None else r >= THROUGHPUT_TARGET,
                )
            )
        if not not_run("latency", "latency"):
            rows += latency_rows.rows(sm, self.sizes.latency_rate)
        if "batch" in self.selected:
            rows += [Row(**row) for row in batch_bench.rows(sm, self.errors)]
        if "peer" in self.selected:
            rows += [Row(**row) for row in faststream_bench.rows(sm, self.errors, self.sizes.latency_rate)]
        if "observability" in self.selected:
            rows += [Row(**row) for row in tracing_bench.rows(sm, self.errors, self.sizes.latency_rate)]
        if not not_run("memory", "memory") and (big := sm.get("memory:big")) and (small := sm.get("memory:small")):
            growth = big["peak_rss_mib"]["median"] / small["peak_rss_mib"]["median"]
            rows.append(
                Row(
                    f"worker peak RSS, {self.sizes.memory_backlog:,} vs {self.sizes.memory_small:,} backlog",
                    f"{big['peak_rss_mib']['median']:.1f} MiB vs {small['peak_rss_mib']['median']:.1f} MiB",
                    "—",
                    f"{growth:.2f}x",
                    f"flat (≤ {MEMORY_FLAT_TARGET:.2f}x)",
                    growth <= MEMORY_FLAT_TARGET,
                )
            )
            first, second = big["first_half_rss_mib"]["median"], big["second_half_rss_mib"]["median"]
            rows.append(
                Row(
                    f"worker peak RSS over the {self.sizes.memory_backlog:,} drain, second half vs first half",
                    f"{second:.1f} MiB vs {first:.1f} MiB",
                    "—",
                    f"{second / first:.2f}x" if first else "—",
                    f"flat (≤ {MEMORY_FLAT_TARGET:.2f}x)",
                    bool(first) and second / first <= MEMORY_FLAT_TARGET,
                )
            )
            if "inbox_bytes_per_id" in big:
                per_id = big["inbox_bytes_per_id"]["median"]
                rows.append(
                    Row(
                        f"inbox server memory per remembered id, {self.sizes.memory_backlog:,} ids",
                        f"{per_id:.1f} B ({big['server_inbox_mib']['median']:.1f} MiB)",
                        "—",
                        "—",
                        f"≤ {INBOX_BYTES_TARGET} B",
                        per_id <= INBOX_BYTES_TARGET,
                    )
                )
            text, _ = ratio(big["msgs_per_s"]["median"])
            rows.append(
                Row(
                    f"commands → one worker, {self.sizes.memory_backlog:,} backlog (single run)",
                    _rate(big["msgs_per_s"]),
                    ceil_text,
                    text,
                )
            )
        if not not_run("recovery", "recovery after SIGKILL") and (rc := sm.get("recovery")):
            for which, label in (
                ("restart", "recovery after SIGKILL: restarted worker re-reads its own pending"),
                ("claim", "recovery after SIGKILL: another worker claims the killed one's entries"),
            ):
                rt = rc[f"{which}_ratio"]
                spread = f"\n[dim]{rt['min']:.0%}-{rt['max']:.0%}[/dim]" if len(rt["runs"]) > 1 else ""
                rows.append(
                    Row(
                        label,
                        _rate(rc[f"{which}_msgs_per_s"]),
                        f"{rc['normal_msgs_per_s']['median']:,.0f} msg/s\n[dim]normal drain, same run[/dim]",
                        f"{rt['median']:.0%}{spread}",
                    )
                )
        if not not_run("sql", "SQL effects"):
            rows += self._sql_rows(sm)
        if not not_run("outbox", "outbox relay") and (ob := self.trials.get("outbox")):
            rows.append(self._external_row("outbox relay", ob[0], self._outbox_row))
        if not not_run("spark", "spark bridge") and (sp := self.trials.get("spark")):
            rows.append(self._external_row("spark bridge", sp[0], self._spark_row))
        if not not_run("ownership", "partition ownership") and (ow := self.trials.get("ownership")):
            for w in sorted(int(k) for k in ow[0].get("cost", {})):
                rows.append(self._external_row("partition ownership", ow[0], functools.partial(_ownership_row, w)))
        if not not_run("cluster", "redis cluster") and (cl := self.trials.get("cluster")):
            for w in sorted(int(k) for k in cl[0].get("ratio", {})):
                rows.append(self._external_row("redis cluster", cl[0], functools.partial(_cluster_row, w)))
        if not not_run("schedule", "scheduled messages") and (sc := self.trials.get("schedule")):
            rows.append(self._external_row("scheduled messages", sc[0], _schedule_row))
        if not not_run("saga", "sagas") and (sg := self.trials.get("saga")):
            rows.append(self._external_row("sagas", sg[0], _saga_row))
            if "saga_sql" in sg[0].get("medians", {}):
                rows.append(self._external_row("sagas", sg[0], _saga_sql_row))
        if not not_run("workers", "--workers 2") and (wk := self.trials.get("workers")):
            rows.append(self._external_row("--workers 2", wk[0], _workers_row))
        if not not_run("reply", "request/reply") and (rr := self.trials.get("reply")):
            rows.append(self._external_row("request/reply", rr[0], _reply_row))
        if "rabbitmq" in self.selected:
            if "rabbitmq" in self.errors:
                rows.append(Row("RabbitMQ transport", f"[yellow]{self.errors['rabbitmq']}[/yellow]"))
            elif rb := self.trials.get("rabbitmq"):
                rows.append(_rabbitmq_row(rb[0]["medians"]))
        return rows

    @staticmethod
    def _external_row(label: str, result: dict[str, Any], build: Callable[[dict[str, Any]], Row]) -> Row:
        try:
            return build(result)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            return Row(
                label,
                f"[yellow]ran, but its result has an unexpected shape ({type(exc).__name__}: {exc}); "
                "see --json[/yellow]",
            )

    @staticmethod
    def _outbox_row(o: dict[str, Any]) -> Row:
        st = stats(o["relay_runs"])
        return Row(
            f"outbox relay {o.get('database', 'PostgreSQL')} → broker, one relay",
            _rate(st),
            target=f"≥ {OUTBOX_TARGET:,} msg/s",
            ok=st["median"] >= OUTBOX_TARGET,
        )

    @staticmethod
    def _spark_row(o: dict[str, Any]) -> Row:
        runs = o.get("runs", {})
        st = stats(runs["broker"]) if runs.get("broker") else {"median": o["broker_rows_per_s"], "runs": [1]}
        return Row(
            "spark: broker → Parquet (eventlog source)",
            _rate(st, "rows/s"),
            f"{o['ceiling_rows_per_s']:,.0f} rows/s\n[dim]in-memory Arrow source[/dim]",
            f"{o['ratio']:.0%}",
            target=f"≥ {SPARK_RATIO_TARGET:.0%} of ceiling",
            ok=o["ratio"] >= SPARK_RATIO_TARGET,
        )

    def load_by_benchmark(self) -> dict[str, dict[str, float]]:
        """Per benchmark: median load average and share of CPU other processes used during its trials."""
        out: dict[str, dict[str, float]] = {}
        for key, trials in self.trials.items():
            marks = [t["machine"] for t in trials if "machine" in t]
            if marks:
                out[key] = {
                    "load": statistics.median(m["load_median"] for m in marks),
                    "others_pct": statistics.median(m["cpu_others_pct"] for m in marks),
                    "steal_pct": statistics.median(m["cpu_steal_pct"] for m in marks),
                }
        return out


_PROFILE = ("worker_us_per_msg", "worker_busy", "server_us_per_msg")
"""Where a commands drain's time goes (``framework_bench.commands(profile=True)``)."""


def _profile_rows(sm: dict[str, dict[str, Any]]) -> list[Row]:
    """CPU per message of the worker and the server in the commands drains, and what the inbox adds."""
    rows = []
    got = {k: sm.get(f"commands:{k}", {}) for k in ("on", "off")}
    for k, fig in got.items():
        if "worker_us_per_msg" not in fig:
            continue
        server = fig.get("server_us_per_msg")
        rows.append(
            Row(
                f"where the time goes, inbox {k}: CPU per message, worker + server",
                f"{fig['worker_us_per_msg']['median']:.1f} + "
                + (f"{server['median']:.1f} µs" if server else "— µs (server not on this machine)")
                + f"\n[dim]worker busy {fig['worker_busy']['median']:.0%} of the drain[/dim]",
                target="reported",
            )
        )
    on, off = got["on"], got["off"]
    if "worker_us_per_msg" in on and "worker_us_per_msg" in off:
        worker = on["worker_us_per_msg"]["median"] - off["worker_us_per_msg"]["median"]
        server = (
            f" + {on['server_us_per_msg']['median'] - off['server_us_per_msg']['median']:.1f} µs server"
            if "server_us_per_msg" in on and "server_us_per_msg" in off
            else ""
        )
        rows.append(Row("what the inbox adds per message (medians, on - off)", f"{worker:.1f} µs worker{server}"))
    return rows
