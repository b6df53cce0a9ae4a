"""Benchmark 5: durable appends over gRPC, against the echo ceiling and SQLite.

Single-message AppendMessages from 32 concurrent callers is the agent-fleet pattern: many
small writes, each acknowledged only after it is durable. Python's gRPC stack has a
ceiling of its own, so the same load is first run against ``bench.echo_server`` (same
process model and pool size, stores nothing) and contextd is reported as a share of it.
Batched appends (100 and 1,000 messages per call, 4 concurrent callers) measure the
store's own throughput. The baseline is the reference design, SQLite with WAL and
synchronous=FULL, in process with one caller (see ``bench.sqlite_baseline``): it shows
the scale of a durable commit and of a bulk insert on this disk, not the same load, so the
single-message row has no contextd / SQLite ratio.

The load runs in a separate asyncio process (``bench.load``); server and client CPU use
are reported because on two cores they compete for the same CPUs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench import append_probe, child, servers, sqlite_baseline
from bench.model import Bar, Section, Target
from bench.sizes import Sizes
from bench.stats import fmt_num, fmt_ratio, median, progress, ratio

CALLERS = 32
BATCH_CALLERS = 4
BATCHES = (100, 1_000)


def _phase(
    server: servers.ServerProcess, callers: int, batch: int, seconds: float
) -> dict[str, Any]:
    res: dict[str, Any] = child.run(
        "bench.load:child_load",
        {
            "address": server.address,
            "server_pid": server.proc.pid,
            "concurrency": callers,
            "batch": batch,
            "seconds": seconds,
        },
    )
    res["calls"] = median(res["calls_per_s"])
    res["messages"] = res["calls"] * batch
    return res


def run(sz: Sizes) -> Section:
    raw: dict[str, Any] = {}
    phases = [(CALLERS, 1), *((BATCH_CALLERS, b) for b in BATCHES)]
    with tempfile.TemporaryDirectory(prefix="contextd-bench-appends-") as tmp_name:
        tmp = Path(tmp_name)
        for name in ("echo", "contextd"):
            server = (
                servers.start_echo(tmp / "echo")
                if name == "echo"
                else servers.start_contextd(tmp / "contextd" / "data")
            )
            try:
                for callers, batch in phases:
                    progress(f"appends: {name}, {callers} callers x {batch} message(s) per call")
                    raw[f"{name}/{batch}"] = _phase(server, callers, batch, sz.append_seconds)
            finally:
                server.stop()
        progress("appends: SQLite baseline (WAL, synchronous=FULL), in process")
        raw["sqlite"] = sqlite_baseline.append_rates(
            tmp, sz.sqlite_single, BATCHES, batched_messages=sz.sqlite_batched
        )
    probe_s = 1.5 if sz.mode == "quick" else 4.0
    for shared in (False, True):
        progress(
            f"appends: group-commit probe in process ({'one shared' if shared else 'own'} thread)"
        )
        raw[f"probe/{'shared' if shared else 'own'}"] = child.run(
            "bench.append_probe:child_probe", {"shared": shared, "seconds": probe_s}
        )

    def cpu(res: dict[str, Any]) -> str:
        return f"{res['server_cpu']:.0%} / {res['client_cpu']:.0%}"

    rows: list[list[str]] = []
    echo1, ours1 = raw["echo/1"], raw["contextd/1"]
    ours1000 = raw["contextd/1000"]["messages"]
    share = ratio(ours1["calls"], echo1["calls"])
    rows.append(
        [
            f"1 message per call, {CALLERS} callers",
            "calls/s",
            fmt_num(echo1["calls"]),
            fmt_num(ours1["calls"]),
            f"{share:.0%}",
            fmt_num(raw["sqlite"]["single"]),
            cpu(echo1),
            cpu(ours1),
        ]
    )
    for batch in BATCHES:
        e, o = raw[f"echo/{batch}"], raw[f"contextd/{batch}"]
        rows.append(
            [
                f"{batch:,} messages per call, {BATCH_CALLERS} callers",
                "messages/s",
                fmt_num(e["messages"]),
                fmt_num(o["messages"]),
                f"{ratio(o['messages'], e['messages']):.0%}",
                fmt_num(raw["sqlite"][f"batch{batch}"]),
                cpu(e),
                cpu(o),
            ]
        )
    best_batched = max(raw[f"contextd/{b}"]["messages"] for b in BATCHES)
    vs_sqlite_batch = ratio(ours1000, raw["sqlite"]["batch1000"])
    targets = [
        Target(
            f"Single-message appends, {CALLERS} callers",
            ">= 70% of the echo ceiling",
            f"{share:.0%} ({fmt_num(ours1['calls'])} of {fmt_num(echo1['calls'])} calls/s)",
            share >= 0.7,
            why="the echo server does the same gRPC work on the same one core (GIL) several "
            "times faster, so the gap is contextd's own Python per call (validation, counting, "
            "the hand-off to the writer thread) and its single writer's commit cost; see the "
            "group-commit probe below.",
        ),
        Target(
            "Batched appends, durable",
            ">= 50,000 messages/s",
            f"{fmt_num(best_batched)} messages/s",
            best_batched >= 50_000,
            why="with 1,000 messages per call the server is CPU-bound near one core: "
            "protobuf to domain objects, per-message validation and token estimates, "
            "per-message Python building the Arrow columns, all under the GIL, before "
            "DuckDB's own insert. SQLite's executemany in process (one caller, no network, "
            "a narrower row: no context_id, token_count, tokenizer, chars, group_id or "
            "tool_call_ids column, and no per-thread bookkeeping) inserts the same messages "
            f"{fmt_ratio(ratio(raw['sqlite']['batch1000'], ours1000))} faster.",
        ),
    ]
    findings = [
        f"Single-message appends reach {share:.0%} of what a do-nothing Python gRPC server "
        "serves under the same load. For scale only (not the same load, so no ratio): "
        f"SQLite in process, one caller committing each message, does "
        f"{fmt_num(raw['sqlite']['single'])} commits/s, each caller waiting for its own "
        f"fsync; contextd serves {CALLERS} callers over gRPC and group-commits the calls "
        "that arrive together.",
        f"With 1,000 messages per call contextd stores {fmt_num(ours1000)} messages/s "
        f"durably over gRPC, {fmt_ratio(vs_sqlite_batch)} the rate of SQLite's executemany "
        "in process with one caller.",
        "CPU columns are server / client CPU use (100% = one core): on two cores the client "
        "takes CPU the server would otherwise use, for the echo server and contextd alike. "
        "contextd's server sits near 100% of one core (the GIL) while the echo server "
        "serves several times more calls with the same CPU, so the time goes to contextd's "
        "own Python per call and per commit, not to gRPC.",
    ]
    own, shared = raw["probe/own"], raw["probe/shared"]
    if "skipped" not in own and "skipped" not in shared:
        per_thread = (own["group_ms"] - shared["group_ms"]) / max(1.0, own["mean_group"] - 1)
        findings.append(
            f"Group-commit probe (in process, no gRPC, {append_probe.CALLERS} threads, one "
            f"message per call): with each caller on its own conversation thread the store "
            f"does {fmt_num(own['calls_per_s'])} calls/s; its writer thread is busy "
            f"{own['writer_busy']:.0%} of the time, committing groups of "
            f"{own['mean_group']:.1f} calls in {own['group_ms']:.1f} ms each. With all "
            f"callers on one shared thread: {fmt_num(shared['calls_per_s'])} calls/s, writer "
            f"busy {shared['writer_busy']:.0%}, groups of {shared['mean_group']:.1f} in "
            f"{shared['group_ms']:.1f} ms. Measured extra cost per distinct conversation "
            "thread in a group, (own-thread group time - shared-thread group time) / "
            f"(own-thread group size - 1): {per_thread:+.2f} ms (a few hundredths of a "
            "millisecond either way is within run-to-run noise)."
        )
    return Section(
        key="appends",
        title="5. Durable appends over gRPC",
        method=__doc__ or "",
        headers=[
            "load",
            "unit",
            "echo server (ceiling)",
            "contextd",
            "contextd / echo",
            "SQLite in process, 1 caller",
            "echo CPU srv/cli",
            "contextd CPU srv/cli",
        ],
        rows=rows,
        targets=targets,
        findings=findings,
        bars=[
            Bar("appends 1 msg vs echo ceiling", share, 0.7),
            Bar("appends x1000 vs SQLite executemany (1 caller)", vs_sqlite_batch, None),
        ],
        raw=raw,
    )
