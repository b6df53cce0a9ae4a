"""Benchmark: search over message history (SearchMessages), both engines beside bm25s and
rank_bm25 at the same size, in the same run.

Every (engine or library, size) runs in a fresh child process, in turns (contextd on
DuckDB, bm25s, contextd on PostgreSQL, rank_bm25), so load on the machine falls on all
alike. The corpus is the suite's synthetic conversation (chat turns, code, JSON, tool
outputs up to 50 KB), all in one scope of one agent.

- contextd, embedded (DuckDB): the messages are appended through the service layer
  (ContextService, as the gRPC handlers call it) in batches of 10,000 ("load", not
  counted as build); the scope's BM25 index is built lazily by the first search, which
  is timed as "build" with its extra resident memory (peak, and held afterwards). Then
  `search_messages` over the whole history, top 10: each query includes catching up
  (a check for new messages), the Rust search and reading the hits' messages and cutting
  their snippets -- what a call costs without gRPC.
- contextd, PostgreSQL: the same appends through the service layer on a fresh database
  of the run's PostgreSQL server; the tsvector column and its GIN index are kept by
  PostgreSQL while inserting (their cost is inside "load"), and "build" is the first,
  cold search; "memory" is the size on disk of the GIN index and of the tsvector column
  (PostgreSQL's memory is its shared buffers, not this process's).
- bm25s and rank_bm25: their own tokenisation and index over the same texts, then
  top-10 queries (index only: no messages read, no snippets).

Query times are p50 and p99 over the query set (rank_bm25: a few queries, it scores every
document in Python).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import child, corpus
from bench.memory import PeakMemory
from bench.model import Bar, Section, Target
from bench.sizes import Sizes
from bench.stats import fmt_ms, fmt_num, fmt_ratio, progress, ratio

ENGINES = ("contextd (DuckDB)", "bm25s", "contextd (PostgreSQL)", "rank_bm25")
SIZES = {"quick": (5_000,), "full": (1_000_000,)}
QUERIES = {"quick": 20, "full": 200}
RANK_BM25_QUERIES = 5
BATCH = 10_000
TENANT, AGENT = "default", "bench-search"


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timed_queries(search: Any, queries: list[str]) -> dict[str, Any]:
    search(queries[0])  # warm-up
    samples: list[float] = []
    hits = 0
    for q in queries:
        start = time.perf_counter()
        hits += bool(search(q))
        samples.append(time.perf_counter() - start)
    return {"p50_s": _percentile(samples, 0.5), "p99_s": _percentile(samples, 0.99), "hits": hits}


def _load(service: Any, messages: list[corpus.Message]) -> float:
    from contextd.domain.model import NewMessage, Role

    start = time.perf_counter()
    for at in range(0, len(messages), BATCH):
        batch = [
            NewMessage(role=Role(m.role), content=m.content) for m in messages[at : at + BATCH]
        ]
        service.append_messages(TENANT, AGENT, "", f"t{at // 100_000}", batch, create_agent=True)
    return time.perf_counter() - start


def child_contextd(n: int, queries: int, dsn: str = "") -> dict[str, Any]:
    """In a child: load ``n`` messages into a store (DuckDB, or PostgreSQL at ``dsn``),
    build (DuckDB: the first search), then time searches through the service layer."""
    from contextd.app.build.summarizer import ExtractiveSummarizer
    from contextd.app.service import ContextService
    from contextd.domain.model import MessageRange, NewMessage, Role

    messages = corpus.conversation(n)
    qs = corpus.queries(queries)
    out: dict[str, Any] = {"mb": sum(len(m.content) for m in messages) / 1e6}
    with contextlib.ExitStack() as stack:
        if dsn:
            from contextd.adapters.postgres.store import PostgresStore

            store: Any = PostgresStore.open(dsn)
        else:
            from contextd.adapters.duckdb.store import Store

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ctxd-search-")))
            store = Store.open(tmp / "bench.duckdb")
        stack.callback(store.close)
        service = ContextService(store, ExtractiveSummarizer())
        out["load_s"] = _load(service, messages)
        del messages

        def search(q: str) -> list[Any]:
            return service.search_messages(TENANT, AGENT, "", "", MessageRange.ALL, q, 10).hits

        with PeakMemory() as mem:
            start = time.perf_counter()
            search(qs[0])
            out["build_s"] = time.perf_counter() - start
        out["peak_mb"] = mem.peak_extra / 1e6
        out["retained_mb"] = mem.retained_extra / 1e6
        out.update(_timed_queries(search, qs))
        # An append, then a search that must find it: the index catching up (DuckDB).
        fresh: list[float] = []
        for i in range(5):
            word = f"freshword{i}x"
            service.append_messages(
                TENANT, AGENT, "", "t-new", [NewMessage(Role.USER, f"a {word} here")]
            )
            start = time.perf_counter()
            found = search(word)
            fresh.append(time.perf_counter() - start)
            assert len(found) == 1, f"{word} not found right after its append"
        out["append_then_search_s"] = sorted(fresh)[len(fresh) // 2]
        if dsn:
            with store._pool.connection() as conn:
                row = conn.execute(
                    "SELECT pg_relation_size('messages_search'), "
                    "(SELECT sum(pg_column_size(search_tsv)) FROM messages)"
                ).fetchone()
            out["index_mb"] = int(row[0]) / 1e6
            out["tsvector_mb"] = int(row[1] or 0) / 1e6
        else:
            out["index_mb"] = store.search_index_bytes() / 1e6
    return out


def child_library(lib: str, n: int, queries: int) -> dict[str, Any]:
    """In a child: ``lib``'s index over the same texts, then top-10 queries."""
    from bench.bm25 import _words

    texts = corpus.texts(n)
    qs = corpus.queries(queries)
    out: dict[str, Any] = {"mb": sum(len(t) for t in texts) / 1e6, "load_s": 0.0}
    search: Any
    if lib == "bm25s":
        import bm25s  # type: ignore[import-untyped,unused-ignore]
    else:
        import numpy as np
        from rank_bm25 import BM25Okapi  # type: ignore[import-untyped,unused-ignore]
    with PeakMemory() as mem:
        start = time.perf_counter()
        if lib == "bm25s":
            retriever = bm25s.BM25(k1=1.2, b=0.75)
            retriever.index(
                bm25s.tokenize(texts, stopwords=None, show_progress=False), show_progress=False
            )

            def search(q: str) -> list[int]:
                docs, _ = retriever.retrieve([_words(q)], k=10, show_progress=False)
                return [int(d) for d in docs[0]]

        else:
            okapi = BM25Okapi([_words(t) for t in texts], k1=1.2, b=0.75)

            def search(q: str) -> list[int]:
                scores = okapi.get_scores(_words(q))
                top = np.argpartition(-scores, 10)[:10]
                return [int(i) for i in top[np.argsort(-scores[top])]]

        out["build_s"] = time.perf_counter() - start
    out["peak_mb"] = mem.peak_extra / 1e6
    out["retained_mb"] = mem.retained_extra / 1e6
    out["index_mb"] = out["retained_mb"]
    out.update(_timed_queries(search, qs))
    return out


def run(sz: Sizes) -> Section:
    from bench import pg

    raw: dict[str, Any] = {}
    rows: list[list[str]] = []
    queries = QUERIES[sz.mode]
    for n in SIZES[sz.mode]:
        for engine in ENGINES:
            progress(f"search: {engine} over {n:,} messages")
            if engine == "contextd (DuckDB)":
                res = child.run("bench.search:child_contextd", {"n": n, "queries": queries})
            elif engine == "contextd (PostgreSQL)":
                dsn = pg.fresh_database("search")
                res = child.run(
                    "bench.search:child_contextd", {"n": n, "queries": queries, "dsn": dsn}
                )
            else:
                count = queries if engine == "bm25s" else min(queries, RANK_BM25_QUERIES)
                res = child.run(
                    "bench.search:child_library", {"lib": engine, "n": n, "queries": count}
                )
            raw[f"{engine}/{n}"] = res
        ours = raw[f"contextd (DuckDB)/{n}"]
        for engine in ENGINES:
            res = raw[f"{engine}/{n}"]
            memory = (
                f"{fmt_num(res['index_mb'])} on disk (+{fmt_num(res['tsvector_mb'])} tsvector)"
                if "tsvector_mb" in res
                else f"{fmt_num(res['peak_mb'])} / {fmt_num(res['retained_mb'])}"
            )
            rows.append(
                [
                    f"{n:,}",
                    f"{res['mb']:.0f}",
                    engine,
                    f"{res['load_s']:.1f} s" if res["load_s"] else "-",
                    f"{res['build_s']:.2f} s",
                    memory,
                    fmt_ms(res["p50_s"]),
                    fmt_ms(res["p99_s"]),
                    fmt_ratio(ratio(res["p50_s"], ours["p50_s"])),
                    fmt_ms(res["append_then_search_s"]) if "append_then_search_s" in res else "-",
                ]
            )
    big = max(SIZES[sz.mode])
    ours = raw[f"contextd (DuckDB)/{big}"]
    on_pg = raw[f"contextd (PostgreSQL)/{big}"]
    theirs = raw[f"bm25s/{big}"]
    full = big >= 1_000_000
    targets = [
        Target(
            f"SearchMessages top-10, {big:,} messages, embedded",
            "p99 <= 100 ms",
            f"p50 {fmt_ms(ours['p50_s'])}, p99 {fmt_ms(ours['p99_s'])}",
            ours["p99_s"] <= 0.1 if full else None,
        ),
        Target(
            f"SearchMessages top-10, {big:,} messages, PostgreSQL",
            "p99 <= 1 s",
            f"p50 {fmt_ms(on_pg['p50_s'])}, p99 {fmt_ms(on_pg['p99_s'])}",
            on_pg["p99_s"] <= 1.0 if full else None,
            why=f"on PostgreSQL a whole SearchMessages call without gRPC takes p50 "
            f"{fmt_ms(on_pg['p50_s'])}, p99 {fmt_ms(on_pg['p99_s'])} over {big:,} messages "
            "(ts_rank_cd over at most the newest 4,000 matches of a query).",
        ),
        Target(
            "an append is searchable by the next search",
            "found, without a rebuild",
            f"DuckDB {fmt_ms(ours['append_then_search_s'])}, "
            f"PostgreSQL {fmt_ms(on_pg['append_then_search_s'])}",
            True,
        ),
    ]
    findings = [
        f"Over {big:,} messages ({ours['mb']:.0f} MB) the embedded engine builds a scope's "
        f"index in {ours['build_s']:.1f} s on its first search (bm25s: "
        f"{theirs['build_s']:.1f} s for its index alone), holding "
        f"{fmt_num(ours['retained_mb'])} MB afterwards (bm25s {fmt_num(theirs['retained_mb'])} "
        f"MB); a whole SearchMessages call without gRPC takes p50 {fmt_ms(ours['p50_s'])}, "
        f"p99 {fmt_ms(ours['p99_s'])} (bm25s's index alone: p50 {fmt_ms(theirs['p50_s'])}).",
        f"PostgreSQL keeps its tsvector column and GIN index while inserting (load "
        f"{on_pg['load_s']:.0f} s against DuckDB's {ours['load_s']:.0f} s); a search takes "
        f"p50 {fmt_ms(on_pg['p50_s'])}, p99 {fmt_ms(on_pg['p99_s'])}: ts_rank_cd reads the "
        "tsvector of each candidate, so PostgreSQL ranks only the newest 4,000 matches of a "
        "query (docs/api.md, Candidates) where the embedded engine's BM25 ranks every match "
        "from its posting lists.",
    ]
    return Section(
        key="search",
        title="Search over message history (SearchMessages)",
        method=__doc__ or "",
        headers=[
            "messages",
            "MB",
            "engine",
            "load (appends)",
            "build",
            "memory MB (peak / held; PostgreSQL: on disk)",
            "query p50",
            "query p99",
            "p50 / contextd DuckDB's",
            "append, then search",
        ],
        rows=rows,
        targets=targets,
        findings=findings,
        bars=[Bar(f"search p50 vs bm25s ({big:,})", ratio(theirs["p50_s"], ours["p50_s"]))],
        raw=raw,
    )
