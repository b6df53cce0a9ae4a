"""Benchmark 6: reading a 1,000-message window, ListMessages over gRPC vs SQLite.

One ListMessages call with page_size 1,000 returns a whole 1,000-message window; the
baseline is the reference design's SQLite query for the same rows in process (no network, no
protobuf), so the ratio shows what the service's layers cost on a read. contextd's own
store read (``Store.list_messages`` in process) is timed too, to separate DuckDB from
gRPC. Both stores also hold other threads' messages, so the query must select; the first
read of each path is checked message by message (role and content) against thread t0.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench import corpus, servers, sqlite_baseline
from bench.model import Bar, Section
from bench.sizes import Sizes
from bench.stats import fmt_ms, fmt_ratio, median_time, progress, ratio

WINDOW = 1_000
NOISE_THREADS = 9
AGENT = "bench-reader"


def _check(path: str, got: list[tuple[int, str]], expected: list[corpus.Message]) -> None:
    """``got`` (role, content) pairs must be ``expected``'s, in order: the right thread."""
    want = [(m.role, m.content) for m in expected]
    if got != want:
        wrong = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
            min(len(got), len(want)),
        )
        raise AssertionError(
            f"{path} read {len(got)} messages, expected {len(want)} of thread t0; "
            f"first difference at message {wrong}"
        )


def run(sz: Sizes) -> Section:
    from bench.load import populated_stub
    from bench.readpath import populate_thread, service_over
    from contextd.adapters.duckdb.store import Store
    from contextd.domain.window import WindowSpec
    from contextd.ports.store import ThreadFilter
    from contextd.v1 import context_service_pb2 as pb

    history = corpus.conversation(WINDOW * (NOISE_THREADS + 1), tools=False)
    threads = [(f"t{k}", history[k * WINDOW : (k + 1) * WINDOW]) for k in range(NOISE_THREADS + 1)]
    expected = threads[0][1]
    calls = sz.window_calls
    with tempfile.TemporaryDirectory(prefix="contextd-bench-reads-") as tmp_name:
        tmp = Path(tmp_name)
        progress(f"window reads: {len(threads)} threads of {WINDOW:,} messages, gRPC")
        server = servers.start_contextd(tmp / "contextd" / "data")
        try:
            with populated_stub(server.address, AGENT, threads, model="") as stub:
                request = pb.ListMessagesRequest(agent=AGENT, thread="t0", page_size=WINDOW)

                def grpc_read() -> Any:
                    response = stub.ListMessages(request)
                    if len(response.messages) != WINDOW:
                        raise AssertionError(f"ListMessages returned {len(response.messages)}")
                    return response

                _check(
                    "ListMessages",
                    [(m.role, m.content) for m in grpc_read().messages],
                    expected,
                )
                t_grpc = median_time(grpc_read, calls, warmup=1)
        finally:
            server.stop()

        progress("window reads: contextd store in process, and SQLite")
        store = Store.open(tmp / "inproc" / "contextd.duckdb")
        try:
            service = service_over(store)
            for thread, messages in threads:
                populate_thread(service, AGENT, thread, messages, model="")
            where = ThreadFilter("default", AGENT, "", "t0")

            def store_read() -> list[Any]:
                rows = store.list_messages(where, WindowSpec(0, 0), None, WINDOW + 1)
                if len(rows) != WINDOW:
                    raise AssertionError(f"Store.list_messages returned {len(rows)}")
                return rows

            _check(
                "Store.list_messages", [(int(m.role), m.content) for m in store_read()], expected
            )
            t_store = median_time(store_read, calls, warmup=1)
        finally:
            store.close()

        con = sqlite_baseline.connect(tmp / "seed.sqlite")
        try:
            for thread, messages in threads:
                sqlite_baseline.insert_batch(con, thread, messages)
            since = time.time_ns() // 1_000 - 86_400 * 1_000_000

            def sqlite_read() -> list[Any]:
                rows = con.execute(
                    sqlite_baseline.SELECT_WINDOW, ("bench", "", "t0", since, WINDOW + 1)
                ).fetchall()
                if len(rows) != WINDOW:
                    raise AssertionError(f"SQLite returned {len(rows)}")
                return rows

            _check("SQLite", [(row[4], row[5]) for row in sqlite_read()], expected)
            t_sqlite = median_time(sqlite_read, calls, warmup=1)
        finally:
            con.close()

    rows = [
        ["SQLite query in process (reference design)", fmt_ms(t_sqlite), "1x"],
        [
            "contextd Store.list_messages in process (DuckDB)",
            fmt_ms(t_store),
            fmt_ratio(ratio(t_store, t_sqlite)),
        ],
        ["contextd ListMessages over gRPC", fmt_ms(t_grpc), fmt_ratio(ratio(t_grpc, t_sqlite))],
    ]
    raw: dict[str, Any] = {"grpc_s": t_grpc, "store_s": t_store, "sqlite_s": t_sqlite}
    return Section(
        key="window_reads",
        title="6. Reading a 1,000-message window",
        method=__doc__ or "",
        headers=["read", "median", "time / SQLite's"],
        rows=rows,
        findings=[
            f"A 1,000-message ListMessages takes {fmt_ms(t_grpc)} over gRPC, "
            f"{fmt_ratio(ratio(t_grpc, t_sqlite))} the time of the in-process SQLite query; "
            f"of that, the DuckDB read and row objects take {fmt_ms(t_store)} and the rest is "
            "the service layer, protobuf and transport.",
        ],
        bars=[Bar("window read gRPC vs SQLite in process", ratio(t_sqlite, t_grpc), None)],
        raw=raw,
    )
