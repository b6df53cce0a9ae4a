"""Benchmark: BuildContext against history length beside a SQLite peer; the footprint.

Threads of 1,000 to 1,000,000 messages (one agent each; quick: 1,000 and 10,000) and a
thread of 10,000 messages whose appends were interleaved with those of 100 other threads
of the same agent are stored in one DuckDB file, one PostgreSQL database and one SQLite
file. Each is built with an 8,000-token budget, the thread hot (a first build of each is
discarded), then every path is called once per round, in turns, so a slow spell of the
shared machine falls on all; the paths of one thread stay together and the threads take
turns going first (each round starts one thread later), so what an append leaves to the
next reader does not always fall on the same thread; the peer's load-then-trim reads (a
whole thread made Python objects) come last in each round, so that no build always
follows one (what such a read leaves, cold caches and a heap to reuse, doubled the time
of the call after it); the table gives each path's median and minimum. Every round
(the discarded one too) begins, untimed, with one message appended to a further thread
of 10,000 messages in every store (its own agent): that thread's row is an agent's
pattern, where each build follows an append, and no build of any thread can be answered
from an earlier round's. The gRPC rounds likewise begin with one message appended to
another agent on each engine's server.

- contextd in process: ``ContextService.build_context`` over the engine's store (offline
  extractive summarizer, no truncation), what a BuildContext call costs the server
  besides gRPC.
- the SQLite peer (``bench.sqlite_reads``): the reference design's table and index on
  (agent, scope, thread, time) in WAL mode, with the per-message token counts contextd
  stored; newest-first (walking the index backwards and stopping at the first message
  that does not fit: the peer's fastest path), and load-then-trim (the whole thread read,
  then trimmed; a few rounds only at 100,000 messages and more). All paths must keep the
  same messages (checked; a difference fails the suite).
- end to end: the BuildContext RPC against ``contextd serve`` on each engine (the same
  stores), beside an echo server's round trip of a reply of the same size (as many
  messages and dropped ids, the same bytes) that does no work.

The DuckDB store is written over gRPC (``AppendMessages``), the largest thread first in
batches of 1,000 while the server's resident memory is sampled every 10 ms (its peak is
the import's memory row), the rest in batches of 10,000; the token counts the server
returns are what the SQLite peer stores. The PostgreSQL database is written in process
through ``ContextService.append_messages`` in batches of 10,000; its 1,000,000-message
thread is left out when the smaller threads' rate projects its fill over four minutes.
The SQLite file is filled with ``synchronous=OFF`` (only its reads are timed).

Footprint: the first 100,000 messages of the same corpus (quick: 5,000) appended into a
fresh store of each kind, then its size on disk: the DuckDB file after a checkpoint
(closing the store), PostgreSQL's ``pg_total_relation_size`` of every table (heap, TOAST
and indexes: the messages with their search column and GIN index, and the rows of the
one agent and thread), the SQLite file with its index after a WAL checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import corpus
from bench.model import Bar, Section, Target
from bench.sizes import Sizes
from bench.sqlite_reads import SqlitePeer
from bench.stats import fmt_ms, fmt_ratio, progress, ratio

SIZES = {"quick": (1_000, 10_000), "full": (1_000, 10_000, 100_000, 1_000_000)}
MIXED_MAIN = 10_000  # messages of the interleaved thread
OTHER_THREADS = 100
OTHER_EACH = {"quick": 20, "full": 100}  # messages of each other thread
# The interleaved thread's appends alternate with the others' this many times.
MIXED_ROUNDS = {"quick": 2, "full": 10}
FOOTPRINT_N = {"quick": 5_000, "full": 100_000}
IMPORT_BATCH = 1_000
FILL_BATCH = 10_000
ROUNDS = {"quick": 5, "full": 25}
HEAVY_ROUNDS = 3  # load-then-trim at 100,000 messages and more
HEAVY_FROM = 100_000
RPC_ROUNDS = {"quick": 5, "full": 20}
PG_FILL_LIMIT_S = 240.0
MAX_STATUS_MESSAGES = 5  # fewer messages the status block may leave room for (interleaved)
FLAT = 2.0  # "flat": the largest p50 within this factor of the smallest
P50_GOAL_S = 0.002
PEER_FACTOR = 5.0
RSS_GOAL_MB = 500.0
TENANT = "default"
MODEL = "gpt-4o"
THREAD = "main"
MIXED = "mixed"
LIVE = "live"  # a 10,000-message thread that gets one message before each timed round
ENGINES = ("duckdb", "postgresql")
ENGINE_NAMES = {"duckdb": "DuckDB", "postgresql": "PostgreSQL"}


@dataclass(frozen=True, slots=True)
class Case:
    key: str  # the thread's length, MIXED or LIVE
    agent: str
    length: int  # messages in the built thread
    label: str


@dataclass(frozen=True, slots=True)
class Append:
    agent: str
    thread: str
    lo: int  # a slice of the corpus
    hi: int


def _plan(mode: str) -> tuple[list[Case], list[Append], int]:
    """The cases, the appends that store them (the largest thread first, then the others,
    then the interleaved rounds) and the corpus length they need."""
    sizes = SIZES[mode]
    each = OTHER_EACH[mode]
    cases = [Case(str(n), f"hist-{n}", n, f"{n:,}") for n in sizes]
    cases.append(
        Case(
            MIXED,
            "hist-mixed",
            MIXED_MAIN,
            f"{MIXED_MAIN:,}, interleaved ({OTHER_THREADS} other threads, "
            f"{OTHER_THREADS * each:,} messages)",
        )
    )
    cases.append(
        Case(LIVE, "hist-live", MIXED_MAIN, f"{MIXED_MAIN:,}, one message appended per round")
    )
    appends = [Append(f"hist-{n}", THREAD, 0, n) for n in sorted(sizes, reverse=True)]
    appends.append(Append("hist-live", THREAD, 0, MIXED_MAIN))
    rounds = MIXED_ROUNDS[mode]
    step_main, step_other = MIXED_MAIN // rounds, each // rounds
    for r in range(rounds):
        appends.append(Append("hist-mixed", THREAD, r * step_main, (r + 1) * step_main))
        for k in range(OTHER_THREADS):
            lo = MIXED_MAIN + k * each + r * step_other
            appends.append(Append("hist-mixed", f"other-{k:02d}", lo, lo + step_other))
    # The live thread's later messages are the corpus's from MIXED_MAIN on (the other
    # threads' messages: stored, so their counts are known).
    return cases, appends, max(max(sizes), MIXED_MAIN + OTHER_THREADS * each)


class RssPeak:
    """Peak resident memory of another process, sampled every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        import psutil  # type: ignore[import-untyped,unused-ignore]

        self._proc = psutil.Process(pid)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.base = 0
        self.peak = 0
        self.end = 0

    def _rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssPeak:
        self.base = self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end = self._rss()
        self.peak = max(self.peak, self.end)


def _import_rpc(
    address: str,
    server_pid: int,
    history: list[corpus.Message],
    appends: list[Append],
    counts: list[int],
) -> dict[str, float]:
    """Store ``appends`` through the server's AppendMessages, the first (largest) in
    batches of IMPORT_BATCH under an RSS sampler; fills ``counts`` from the receipts."""
    import grpc

    from bench.load import CHANNEL_OPTIONS, messages_pb
    from contextd.v1 import context_service_pb2 as pb
    from contextd.v1 import context_service_pb2_grpc as pb_grpc

    out: dict[str, float] = {}
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        for agent in dict.fromkeys(a.agent for a in appends):
            stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name=agent, model=MODEL)))

        def send(a: Append, batch: int) -> None:
            for lo in range(a.lo, a.hi, batch):
                hi = min(lo + batch, a.hi)
                response = stub.AppendMessages(
                    pb.AppendMessagesRequest(
                        agent=a.agent, thread=a.thread, messages=messages_pb(pb, history[lo:hi])
                    )
                )
                for i, receipt in enumerate(response.receipts):
                    counts[lo + i] = receipt.token_count

        first, rest = appends[0], appends[1:]
        progress(
            f"build scale: importing {first.hi - first.lo:,} messages over gRPC in batches of "
            f"{IMPORT_BATCH:,} (server RSS sampled)"
        )
        with RssPeak(server_pid) as rss:
            start = time.perf_counter()
            send(first, IMPORT_BATCH)
            out["import_s"] = time.perf_counter() - start
        out["import_n"] = first.hi - first.lo
        out["rss_base_mb"] = rss.base / 1e6
        out["rss_peak_mb"] = rss.peak / 1e6
        out["rss_end_mb"] = rss.end / 1e6
        progress("build scale: the other threads over gRPC (DuckDB)")
        start = time.perf_counter()
        for a in rest:
            send(a, FILL_BATCH)
        out["rest_s"] = time.perf_counter() - start
    return out


def _fill_service(
    service: Any, history: list[corpus.Message], appends: list[Append], agents: set[str]
) -> None:
    from contextd.domain.errors import AlreadyExists
    from contextd.domain.model import AgentSettings, NewMessage, Role

    for agent in agents:
        with contextlib.suppress(AlreadyExists):
            service.create_agent(TENANT, agent, AgentSettings(model=MODEL))
    for a in appends:
        if a.agent not in agents:
            continue
        for lo in range(a.lo, a.hi, FILL_BATCH):
            batch = [
                NewMessage(role=Role(m.role), content=m.content)
                for m in history[lo : min(lo + FILL_BATCH, a.hi)]
            ]
            service.append_messages(TENANT, a.agent, "", a.thread, batch)


def _fill_postgres(
    service: Any, history: list[corpus.Message], cases: list[Case], appends: list[Append]
) -> dict[str, Any]:
    """Every case but the largest, then the largest unless the rate so far projects it
    over PG_FILL_LIMIT_S. Returns the fill seconds and what was left out."""
    largest = max((c for c in cases if c.key not in (MIXED, LIVE)), key=lambda c: c.length)
    sized = {c.agent for c in cases if c is not largest and c.key != MIXED}
    progress("build scale: writing the smaller threads into PostgreSQL (in process)")
    start = time.perf_counter()
    _fill_service(service, history, appends, sized)
    small_s = time.perf_counter() - start
    small_n = sum(a.hi - a.lo for a in appends if a.agent in sized)
    # The rate of the bulk appends (not of the interleaved thread's small ones) projects
    # the largest thread's fill.
    projected = small_s / small_n * largest.length
    start = time.perf_counter()
    _fill_service(service, history, appends, {c.agent for c in cases if c.key == MIXED})
    mixed_s = time.perf_counter() - start
    out: dict[str, Any] = {
        "small_s": small_s,
        "small_n": small_n,
        "mixed_s": mixed_s,
        "projected_s": projected,
    }
    if largest.length > 100_000 and projected > PG_FILL_LIMIT_S:
        progress(f"build scale: PostgreSQL {largest.length:,} left out (fill ~{projected:.0f} s)")
        out["skipped"] = largest.key
        return out
    progress(f"build scale: writing {largest.length:,} messages into PostgreSQL (in process)")
    start = time.perf_counter()
    _fill_service(service, history, appends, {largest.agent})
    out["largest_s"] = time.perf_counter() - start
    return out


def _fill_sqlite(
    peer: SqlitePeer, history: list[corpus.Message], appends: list[Append], counts: list[int]
) -> None:
    """The appends, each in one transaction; without waiting for the disk (what is
    measured is reading)."""
    with peer.unsynced():
        _insert_sqlite(peer, history, appends, counts)


def _insert_sqlite(
    peer: SqlitePeer, history: list[corpus.Message], appends: list[Append], counts: list[int]
) -> None:
    for a in appends:
        peer.insert(
            a.agent,
            a.thread,
            ((history[i].role, history[i].content, counts[i]) for i in range(a.lo, a.hi)),
        )


def _rounds(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    limits: dict[str, int],
    before_round: Callable[[], object] | None = None,
    last: tuple[str, ...] = (),
) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` over ``rounds`` rounds calling each once in turn, after
    one discarded round (the hot-thread warm-up); a name in ``limits`` is called only in
    that many rounds; ``before_round``, untimed, starts every round (the warm-up's too).

    The names are "path/case": the paths of one case stay together, and the cases take
    turns going first (round r starts with the r-th case), so whatever an append leaves
    to its next reader (a journal to apply, a collection) does not always land on the
    same case. The paths named in ``last`` (heavy reads: a whole thread made Python
    objects) are called after every other call of the round, in the same order: what
    one leaves to the next call (cold CPU caches, a heap to reuse, a collection) cost
    the build that follows it about twice its time, and the order of the groups never
    changes who follows whom, so with them among the groups the same two lengths paid
    it in every round (the 1,000 and 100,000-message threads, after the load-then-trim
    of a 10,000-message thread)."""
    if before_round is not None:
        before_round()
    for fn in fns.values():
        fn()
    groups: dict[str, list[str]] = {}
    for name in fns:
        groups.setdefault(name.split("/", 1)[-1], []).append(name)
    order = list(groups.values())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        if before_round is not None:
            before_round()
        shift = r % len(order)
        turn = [name for group in order[shift:] + order[:shift] for name in group]
        heavy = [name for name in turn if name.split("/", 1)[0] in last]
        for name in [name for name in turn if name not in heavy] + heavy:
            if r >= limits.get(name, rounds):
                continue
            fn = fns[name]
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def _rpc_phase(
    addresses: dict[str, str], cases: list[Case], on_pg: set[str], rounds: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """The BuildContext RPC per (engine, case; PostgreSQL: the keys in ``on_pg``) and the
    echo of a same-size reply, in turns; ``addresses`` by "duckdb", "postgresql", "echo"."""
    import grpc

    from bench import servers
    from bench.load import CHANNEL_OPTIONS
    from contextd.v1 import context_service_pb2 as pb
    from contextd.v1 import context_service_pb2_grpc as pb_grpc

    fns: dict[str, Callable[[], object]] = {}
    shapes: dict[str, dict[str, int]] = {}
    with contextlib.ExitStack() as stack:
        stubs: dict[str, Any] = {}
        for engine, address in addresses.items():
            channel = stack.enter_context(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
            stubs[engine] = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        for case in cases:
            request = pb.BuildContextRequest(
                agent=case.agent,
                thread=THREAD,
                options=pb.BuildOptions(budget_tokens=8_000, summarize=False),
            )
            duck = stubs["duckdb"].BuildContext(request)
            shape = {
                "messages": len(duck.messages),
                "ids": len(duck.stats.dropped_ids),
                "bytes": duck.ByteSize(),
            }
            shapes[case.key] = shape
            metadata = tuple((f"x-reply-{k}", str(v)) for k, v in shape.items())
            fns[f"duckdb/{case.key}"] = functools.partial(stubs["duckdb"].BuildContext, request)
            if case.key in on_pg:
                pg_reply = stubs["postgresql"].BuildContext(request)
                if [m.content for m in pg_reply.messages] != [m.content for m in duck.messages]:
                    raise AssertionError(
                        f"BuildContext RPC differs by engine on {case.label}: DuckDB kept "
                        f"{len(duck.messages)}, PostgreSQL {len(pg_reply.messages)}"
                    )
                fns[f"postgresql/{case.key}"] = functools.partial(
                    stubs["postgresql"].BuildContext, request
                )
            fns[f"echo/{case.key}"] = functools.partial(
                stubs["echo"].BuildContext, request, metadata=metadata
            )
        echoed = stubs["echo"].BuildContext(request, metadata=metadata)
        if abs(echoed.ByteSize() - shape["bytes"]) > 16:
            raise AssertionError(f"echo reply {echoed.ByteSize()} B for {shape['bytes']} B")
        # Every round follows a commit on each engine (another agent's message), as the
        # in-process rounds do: no build is answered from a result the server remembered.
        engines = [stubs[e] for e in addresses if e != "echo"]
        append_elsewhere = servers.append_elsewhere(engines, THREAD, MODEL)

        samples = _rounds(fns, rounds, {}, append_elsewhere)
    return samples, shapes


def _footprint(
    n: int, history: list[corpus.Message], counts: list[int], tmp: Path
) -> dict[str, float]:
    """Bytes on disk of ``n`` messages in a fresh store of each kind."""
    import psycopg

    from bench import pg
    from bench.readpath import service_over
    from contextd.adapters.duckdb.store import Store
    from contextd.adapters.postgres.store import PostgresStore

    append = [Append("footprint", THREAD, 0, n)]
    content = sum(len(m.content.encode()) for m in history[:n])
    out: dict[str, float] = {"n": n, "content_bytes": content}
    progress(f"footprint: {n:,} messages into DuckDB, PostgreSQL and SQLite")
    path = tmp / "footprint.duckdb"
    store = Store.open(path)
    try:
        _fill_service(service_over(store), history, append, {"footprint"})
    finally:
        store.close()
    wal = path.with_name(path.name + ".wal")
    out["duckdb"] = path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    dsn = pg.fresh_database("footprint")
    pg_store = PostgresStore.open(dsn)
    try:
        _fill_service(service_over(pg_store), history, append, {"footprint"})
    finally:
        pg_store.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace s ON s.oid = c.relnamespace "
            "WHERE c.relkind = 'r' AND s.nspname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()
        out["postgresql"] = int(row[0]) if row else 0
        row = conn.execute(
            "SELECT pg_relation_size('messages_search'), "
            "(SELECT coalesce(sum(pg_column_size(search_tsv)), 0) FROM messages)"
        ).fetchone()
        out["pg_gin"], out["pg_tsvector"] = (int(row[0]), int(row[1])) if row else (0, 0)
    peer = SqlitePeer(tmp / "footprint.sqlite")
    try:
        _fill_sqlite(peer, history, append, counts)
        out["sqlite"] = peer.disk_bytes()
    finally:
        peer.close()
    return out


def _cell(samples: list[float]) -> str:
    if not samples:
        return "-"
    return f"{fmt_ms(statistics.median(samples))} (min {fmt_ms(min(samples))})"


def _p50(samples: dict[str, list[float]], name: str) -> float:
    values = samples.get(name, [])
    return statistics.median(values) if values else float("nan")


def run(sz: Sizes) -> list[Section]:
    from bench import pg, servers
    from bench.readpath import service_over
    from contextd.adapters.duckdb.store import Store
    from contextd.adapters.postgres.store import PostgresStore
    from contextd.app.build.build_types import BuildRequest
    from contextd.config import DATABASE_FILE
    from contextd.domain.model import BuildOverrides

    mode = sz.mode
    budget = sz.budget
    cases, appends, needed = _plan(mode)
    progress(f"build scale: generating {needed:,} messages")
    history = corpus.conversation(needed, tools=False)
    # The corpus stays alive for the whole section: out of the collector's sight, so that
    # garbage collections during the in-process builds do not traverse it.
    gc.collect()
    gc.freeze()
    counts = [0] * needed
    raw: dict[str, Any] = {"cases": {c.key: {"label": c.label, "length": c.length} for c in cases}}
    with contextlib.ExitStack() as stack:
        stack.callback(gc.unfreeze)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="contextd-bench-scale-")))
        duck_dir = tmp / "duckdb" / "data"
        duck = servers.start_contextd(duck_dir)
        stack.callback(duck.stop)
        raw["import"] = _import_rpc(duck.address, duck.proc.pid, history, appends, counts)
        if not all(counts):
            from contextd import core

            missing = [i for i, c in enumerate(counts) if not c]
            found = core.count_tokens_batch([history[i].content for i in missing], "o200k_base")
            for i, c in zip(missing, found, strict=True):
                counts[i] = c

        dsn = pg.fresh_database("buildscale")
        pg_store = PostgresStore.open(dsn)
        stack.callback(pg_store.close)
        pg_service = service_over(pg_store)
        raw["pg_fill"] = _fill_postgres(pg_service, history, cases, appends)
        pg_cases = [c for c in cases if c.key != raw["pg_fill"].get("skipped")]

        progress("build scale: writing the same threads into SQLite")
        peer = SqlitePeer(tmp / "peer.sqlite")
        stack.callback(peer.close)
        start = time.perf_counter()
        _fill_sqlite(peer, history, appends, counts)
        raw["sqlite_fill_s"] = time.perf_counter() - start
        raw["sqlite_plan"] = peer.plan()

        progress("build scale: BuildContext RPCs on both engines and the echo, in turns")
        pg_server = servers.start_contextd(tmp / "postgresql" / "data", store=dsn)
        stack.callback(pg_server.stop)
        echo = servers.start_echo(tmp / "echo")
        stack.callback(echo.stop)
        rpc, shapes = _rpc_phase(
            {"duckdb": duck.address, "postgresql": pg_server.address, "echo": echo.address},
            [c for c in cases if c.key != LIVE],  # gRPC rounds append nothing
            {c.key for c in pg_cases},
            RPC_ROUNDS[mode],
        )
        raw["shapes"] = shapes
        pg_server.stop()
        echo.stop()
        duck.stop()

        store = Store.open(duck_dir / DATABASE_FILE)
        stack.callback(store.close)
        services = {"duckdb": service_over(store), "postgresql": pg_service}
        fns: dict[str, Callable[[], object]] = {}
        limits: dict[str, int] = {}
        progress("build scale: checking every path keeps the same messages")

        def build_request(agent: str) -> BuildRequest:
            """The in-process request every path of a case is timed with."""
            return BuildRequest(
                TENANT,
                agent,
                "",
                THREAD,
                overrides=BuildOverrides(budget_tokens=budget, truncate=False),
            )

        for case in cases:
            request = build_request(case.agent)
            kept: dict[str, list[str]] = {}
            for engine, service in services.items():
                if engine == "postgresql" and case not in pg_cases:
                    continue

                def build(s: Any = service, q: Any = request) -> list[Any]:
                    return list(s.build_context(q).context.history)

                fns[f"{engine}/{case.key}"] = build
                result = service.build_context(request)
                raw["cases"][case.key][f"loaded_{engine}"] = result.messages_loaded
                kept[engine] = [m.content for m in result.context.history]

            def nf(a: str = case.agent) -> list[tuple[int, str]]:
                return peer.newest_first(a, THREAD, budget)

            def lt(a: str = case.agent) -> list[tuple[int, str]]:
                return peer.load_then_trim(a, THREAD, budget)

            fns[f"sqlite_nf/{case.key}"] = nf
            fns[f"sqlite_lt/{case.key}"] = lt
            if case.length >= HEAVY_FROM:
                limits[f"sqlite_lt/{case.key}"] = HEAVY_ROUNDS
            kept["sqlite newest-first"] = [c for _, c in nf()]
            kept["sqlite load-then-trim"] = [c for _, c in lt()]
            reference = kept["duckdb"]
            for path, contents in kept.items():
                # On the interleaved thread contextd's context also carries the status
                # block naming the agent's other threads, which takes part of the budget:
                # its messages must then be the newest of the peer's.
                extra = len(contents) - len(reference)
                if (
                    case.key == MIXED
                    and path.startswith("sqlite")
                    and 0 < extra <= MAX_STATUS_MESSAGES
                    and contents[extra:] == reference
                ):
                    raw["cases"][case.key]["peer_extra"] = extra
                    continue
                if contents != reference:
                    raise AssertionError(
                        f"build paths disagree on {case.label}: DuckDB kept {len(reference)} "
                        f"messages, {path} {len(contents)} (or other ones)"
                    )
            raw["cases"][case.key]["kept"] = len(reference)
        progress("build scale: timing in-process builds and the SQLite peer, in turns")
        live = next(c for c in cases if c.key == LIVE)
        live_engines = [e for e in services if e == "duckdb" or live in pg_cases]
        next_live = [MIXED_MAIN]

        def append_live() -> None:
            """One message more on the live thread of every store: an agent's pattern,
            where each build follows an append (no build answers from a previous one)."""
            from contextd.domain.model import NewMessage, Role

            i = next_live[0]
            next_live[0] += 1
            m = history[i]
            for engine in live_engines:
                services[engine].append_messages(
                    TENANT,
                    live.agent,
                    "",
                    THREAD,
                    [NewMessage(role=Role(m.role), content=m.content)],
                )
            _insert_sqlite(peer, history, [Append(live.agent, THREAD, i, i + 1)], counts)

        local = _rounds(fns, ROUNDS[mode], limits, append_live, last=("sqlite_lt",))
        live_request = build_request(live.agent)
        live_kept = {
            engine: [
                m.content for m in services[engine].build_context(live_request).context.history
            ]
            for engine in live_engines
        }
        live_kept["sqlite newest-first"] = [
            c for _, c in peer.newest_first(live.agent, THREAD, budget)
        ]
        if any(kept != live_kept["duckdb"] for kept in live_kept.values()):
            raise AssertionError(
                "build paths disagree on the live thread after its appends: "
                + ", ".join(f"{k} kept {len(v)}" for k, v in live_kept.items())
            )
        raw["cases"][LIVE]["appended"] = next_live[0] - MIXED_MAIN
        raw["footprint"] = _footprint(FOOTPRINT_N[mode], history, counts, tmp)
    samples = {**local, **{f"rpc_{k}": v for k, v in rpc.items()}}
    raw["samples"] = samples
    return [_scale_section(sz, cases, raw), _footprint_section(sz, raw)]


def _flat_why(
    s: dict[str, list[float]],
    raw: dict[str, Any],
    engine: str,
    measured: list[Case],
    p50: dict[str, float],
) -> str:
    """What the measurements say about a missed p50/flatness target."""
    sized = sorted((c for c in measured if c.key not in (MIXED, LIVE)), key=lambda c: c.length)
    low, high = sized[0], sized[-1]
    peer = [_p50(s, f"sqlite_nf/{c.key}") for c in sized]
    loaded = raw["cases"][high.key].get(f"loaded_{engine}", 0)
    return (
        f"the in-process build's p50 goes from {fmt_ms(p50[low.key])} at {low.length:,} "
        f"messages to {fmt_ms(p50[high.key])} at {high.length:,}, though it read the content "
        f"of only {loaded:,} messages there; the SQLite peer's newest-first read stays "
        f"within {fmt_ms(min(peer))}-{fmt_ms(max(peer))}."
    )


def _short(case: Case) -> str:
    """A case's name in a target's listing."""
    if case.key == MIXED:
        return "interleaved"
    if case.key == LIVE:
        return "after an append"
    return f"{case.length:,}"


def _scale_section(sz: Sizes, cases: list[Case], raw: dict[str, Any]) -> Section:
    full = sz.mode == "full"
    s = raw["samples"]
    rows: list[list[str]] = []
    for case in cases:
        k = case.key
        nf = _p50(s, f"sqlite_nf/{k}")
        rows.append(
            [
                case.label,
                _cell(s.get(f"duckdb/{k}", [])),
                _cell(s.get(f"postgresql/{k}", [])) if f"postgresql/{k}" in s else "not stored",
                _cell(s[f"sqlite_nf/{k}"]),
                _cell(s[f"sqlite_lt/{k}"]),
                fmt_ratio(ratio(_p50(s, f"duckdb/{k}"), nf)),
                fmt_ratio(ratio(_p50(s, f"postgresql/{k}"), nf)),
                _cell(s.get(f"rpc_duckdb/{k}", [])),
                _cell(s.get(f"rpc_postgresql/{k}", [])),
                _cell(s.get(f"rpc_echo/{k}", [])),
                f"{raw['shapes'][k]['bytes'] / 1e3:,.0f}" if k in raw["shapes"] else "-",
            ]
        )
    sized = [c for c in cases if c.key not in (MIXED, LIVE)]
    targets: list[Target] = []
    bars: list[Bar] = []
    findings: list[str] = []
    chart: dict[str, list[list[float]]] = {}
    for engine in ENGINES:
        name = ENGINE_NAMES[engine]
        measured = [c for c in cases if f"{engine}/{c.key}" in s]
        p50 = {c.key: _p50(s, f"{engine}/{c.key}") for c in measured}
        # Flat is about history length: the lengths and the interleaved thread are built
        # in the same pattern (after a commit to another thread); the thread that takes
        # each round's append is one length, in another pattern, held to the p50 alone.
        alike = [p50[c.key] for c in measured if c.key != LIVE]
        spread = ratio(max(alike), min(alike))
        worst = max(p50.values())
        listing = "; ".join(f"{_short(c)}: {fmt_ms(p50[c.key])}" for c in measured)
        left_out = [c.label for c in cases if c not in measured]
        note = (
            f" ({', '.join(left_out)} not stored on this engine: its fill was projected at "
            f"{raw['pg_fill']['projected_s']:.0f} s)"
            if left_out
            else ""
        )
        targets.append(
            Target(
                f"BuildContext, 8k budget, hot thread, {name}",
                f"server-side p50 <= 2 ms, flat from 1,000 to 1,000,000 messages (and "
                f"interleaved); flat: largest p50 of those within {FLAT:.0f}x of the "
                f"smallest (the thread appended to each round: p50 only)",
                f"{listing}; largest / smallest of those {fmt_ratio(spread)}{note}",
                (worst <= P50_GOAL_S and spread <= FLAT) if full else None,
                why=_flat_why(s, raw, engine, measured, p50),
            )
        )
        peer_ratio = {c.key: ratio(p50[c.key], _p50(s, f"sqlite_nf/{c.key}")) for c in measured}
        worst_case = max(measured, key=lambda c: peer_ratio[c.key])
        targets.append(
            Target(
                f"BuildContext vs the SQLite peer's newest-first read, {name}",
                f"within {PEER_FACTOR:.0f}x of SQLite newest-first (the peer's fastest path) "
                "at every length",
                f"worst {fmt_ratio(peer_ratio[worst_case.key])} at {worst_case.label}",
                (peer_ratio[worst_case.key] <= PEER_FACTOR) if full else None,
                why=(
                    f"at {worst_case.label} contextd's in-process build took "
                    f"{fmt_ms(p50[worst_case.key])} against SQLite newest-first's "
                    f"{fmt_ms(_p50(s, f'sqlite_nf/{worst_case.key}'))} for the same "
                    f"{raw['cases'][worst_case.key]['kept']:,} kept messages."
                ),
            )
        )
        biggest = max((c for c in sized if c in measured), key=lambda c: c.length)
        bars.append(
            Bar(
                f"build vs SQLite newest-first, {biggest.length:,} ({name})",
                1 / peer_ratio[biggest.key],
                1 / PEER_FACTOR,
            )
        )
        chart[f"contextd {name}, in process"] = [
            [c.length, p50[c.key] * 1e3] for c in sized if c in measured
        ]
        chart[f"contextd {name}, gRPC"] = [
            [c.length, _p50(s, f"rpc_{engine}/{c.key}") * 1e3]
            for c in sized
            if f"rpc_{engine}/{c.key}" in s
        ]
    peers = (("sqlite_nf", "SQLite newest-first"), ("sqlite_lt", "SQLite load-then-trim"))
    for key, label in peers:
        chart[label] = [[c.length, _p50(s, f"{key}/{c.key}") * 1e3] for c in sized]
    chart["echo of a same-size reply, gRPC"] = [
        [c.length, _p50(s, f"rpc_echo/{c.key}") * 1e3] for c in sized
    ]
    mixed = {
        label: _p50(s, f"{key}/{MIXED}") * 1e3
        for key, label in (
            ("duckdb", "contextd DuckDB, in process"),
            ("postgresql", "contextd PostgreSQL, in process"),
            ("sqlite_nf", "SQLite newest-first"),
        )
        if f"{key}/{MIXED}" in s
    }
    big = max(sized, key=lambda c: c.length)
    imp, fill = raw["import"], raw["pg_fill"]
    findings += [
        f"At {big.label} messages a hot in-process build takes "
        f"{fmt_ms(_p50(s, f'duckdb/{big.key}'))} on DuckDB and "
        + (
            f"{fmt_ms(_p50(s, f'postgresql/{big.key}'))} on PostgreSQL"
            if f"postgresql/{big.key}" in s
            else "was not measured on PostgreSQL"
        )
        + f" (1,000 messages: {fmt_ms(_p50(s, 'duckdb/1000'))} and "
        f"{fmt_ms(_p50(s, 'postgresql/1000'))}); the SQLite peer's newest-first read takes "
        f"{fmt_ms(_p50(s, f'sqlite_nf/{big.key}'))} and its load-then-trim "
        f"{fmt_ms(_p50(s, f'sqlite_lt/{big.key}'))}. Every path kept the same "
        f"{raw['cases'][big.key]['kept']:,} messages.",
        f"Over gRPC the build of the {big.label}-message thread takes "
        f"{fmt_ms(_p50(s, f'rpc_duckdb/{big.key}'))} on DuckDB; an echo of a reply of the same "
        f"size ({raw['shapes'][big.key]['bytes'] / 1e3:,.0f} kB, "
        f"{raw['shapes'][big.key]['messages']} messages and "
        f"{raw['shapes'][big.key]['ids']:,} dropped ids) takes "
        f"{fmt_ms(_p50(s, f'rpc_echo/{big.key}'))}: the rest is the build.",
        f"SQLite's plan for the newest-first read: {raw['sqlite_plan']}.",
        f"On the interleaved thread the build takes {fmt_ms(_p50(s, f'duckdb/{MIXED}'))} on "
        f"DuckDB and {fmt_ms(_p50(s, f'postgresql/{MIXED}'))} on PostgreSQL (a thread alone "
        f"of the same length: {fmt_ms(_p50(s, 'duckdb/10000'))} and "
        f"{fmt_ms(_p50(s, 'postgresql/10000'))}); its context also carries the status block "
        "naming the agent's other threads, which takes part of the budget, so it kept "
        f"{raw['cases'][MIXED].get('peer_extra', 0)} message(s) fewer than the SQLite peer "
        "(the newest ones of the peer's, checked).",
        f"With one message appended before each round (an agent's pattern: no build can "
        f"answer from an earlier one) the {MIXED_MAIN:,}-message thread builds in "
        f"{fmt_ms(_p50(s, f'duckdb/{LIVE}'))} on DuckDB and "
        f"{fmt_ms(_p50(s, f'postgresql/{LIVE}'))} on PostgreSQL, against "
        f"{fmt_ms(_p50(s, f'sqlite_nf/{LIVE}'))} for the SQLite peer's newest-first read; "
        f"after the {raw['cases'][LIVE].get('appended', 0)} appends every path kept the same "
        "messages (checked).",
        f"(Writing: {imp['import_n']:,} messages over gRPC into DuckDB in batches of "
        f"{IMPORT_BATCH:,} took {imp['import_s']:.1f} s, the other threads "
        f"{imp['rest_s']:.1f} s; PostgreSQL in process took {fill['small_s']:.1f} s for "
        f"the {fill['small_n']:,} messages of the smaller threads, {fill['mixed_s']:.1f} s for "
        "the interleaved ones"
        + (
            f" and {fill['largest_s']:.1f} s for the {big.label}-message thread"
            if "largest_s" in fill
            else f"; the {big.label}-message thread was left out, its fill projected at "
            f"{fill['projected_s']:.0f} s"
        )
        + f"; SQLite {raw['sqlite_fill_s']:.1f} s.)",
    ]
    raw["chart"] = {
        "title": f"BuildContext, {sz.budget:,}-token budget, hot thread (median)",
        "xlabel": "messages in the thread (log scale)",
        "ylabel": "ms (log scale)",
        "series": chart,
        "points": {k: [[MIXED_MAIN, v]] for k, v in mixed.items()},
        "points_label": "interleaved",
        "hlines": {f"target: p50 <= {P50_GOAL_S * 1e3:.0f} ms": P50_GOAL_S * 1e3},
    }
    return Section(
        key="buildscale",
        title=f"BuildContext against history length ({sz.budget:,}-token budget, hot thread)",
        method=__doc__ or "",
        headers=[
            "thread (messages)",
            "DuckDB, in process",
            "PostgreSQL, in process",
            "SQLite newest-first",
            "SQLite load-then-trim",
            "DuckDB / SQLite newest-first",
            "PostgreSQL / SQLite newest-first",
            "DuckDB RPC",
            "PostgreSQL RPC",
            "echo of a same-size reply",
            "reply kB",
        ],
        rows=rows,
        targets=targets,
        findings=findings,
        bars=bars,
        raw=raw,
    )


def _footprint_section(sz: Sizes, raw: dict[str, Any]) -> Section:
    full = sz.mode == "full"
    fp = raw["footprint"]
    n = int(fp["n"])
    per = {k: fp[k] / n for k in ("duckdb", "postgresql", "sqlite")}
    imp = raw["import"]
    rows = [
        [
            label,
            f"{fp[k] / 1e6:,.1f} MB",
            f"{per[k]:,.0f}",
            fmt_ratio(ratio(per[k], per["sqlite"])),
        ]
        for k, label in (
            ("duckdb", "contextd, DuckDB (file after a checkpoint)"),
            ("postgresql", "contextd, PostgreSQL (every table with TOAST and indexes)"),
            ("sqlite", "SQLite peer (file with its index, WAL checkpointed)"),
        )
    ]
    content = fp["content_bytes"] / n
    targets = [
        Target(
            f"Bytes per message on disk, {ENGINE_NAMES[k]} ({n:,} messages)",
            "<= the SQLite peer's (table + index)",
            f"{per[k]:,.0f} B vs SQLite {per['sqlite']:,.0f} B",
            (per[k] <= per["sqlite"]) if full else None,
            why=(
                f"{ENGINE_NAMES[k]} stores {per[k]:,.0f} B per message against SQLite's "
                f"{per['sqlite']:,.0f} B; the contents average {content:,.0f} B"
                + (
                    f"; the search column (tsvector) takes {fp['pg_tsvector'] / n:,.0f} B "
                    f"and its GIN index {fp['pg_gin'] / n:,.0f} B per message."
                    if k == "postgresql"
                    else "."
                )
            ),
        )
        for k in ENGINES
    ]
    targets.append(
        Target(
            f"Peak server RSS importing {imp['import_n']:,.0f} messages over gRPC "
            f"(batches of {IMPORT_BATCH:,}), DuckDB",
            f"< {RSS_GOAL_MB:.0f} MB",
            f"{imp['rss_peak_mb']:,.0f} MB (before: {imp['rss_base_mb']:,.0f} MB)",
            (imp["rss_peak_mb"] < RSS_GOAL_MB) if imp["import_n"] >= 1_000_000 else None,
            why=(
                f"the server's resident set rose from {imp['rss_base_mb']:,.0f} MB to "
                f"{imp['rss_peak_mb']:,.0f} MB while importing and was "
                f"{imp.get('rss_end_mb', float('nan')):,.0f} MB when the import ended."
            ),
        )
    )
    return Section(
        key="footprint",
        title=f"Footprint: bytes per message on disk ({n:,} messages), memory while importing",
        method=(
            "Footprint\n\nThe first messages of the BuildContext scale corpus, appended through "
            "`ContextService.append_messages` (batches of 10,000) into a fresh store of each "
            "engine and through `executemany` into the SQLite peer's table (the reference "
            "design's schema and index, `bench/sqlite_baseline.py`); sizes as described in "
            "the section above. Memory: the resident set of `contextd serve` (DuckDB) sampled "
            f"every 10 ms while one client imports {imp['import_n']:,.0f} messages over gRPC "
            f"in AppendMessages calls of {IMPORT_BATCH:,}, one after another."
        ),
        headers=["store", "on disk", "bytes / message", "/ SQLite's"],
        rows=[
            *rows,
            [
                f"contextd serve (DuckDB), peak RSS importing {imp['import_n']:,.0f} messages",
                f"{imp['rss_peak_mb']:,.0f} MB",
                f"({imp['import_n'] / imp['import_s']:,.0f} messages/s)",
                "-",
            ],
        ],
        targets=targets,
        findings=[
            f"Per message: DuckDB {per['duckdb']:,.0f} B, PostgreSQL {per['postgresql']:,.0f} B, "
            f"SQLite {per['sqlite']:,.0f} B; the contents alone average {content:,.0f} B "
            "(UTF-8).",
            f"The server's resident set went from {imp['rss_base_mb']:,.0f} MB to a peak of "
            f"{imp['rss_peak_mb']:,.0f} MB while importing {imp['import_n']:,.0f} messages "
            f"({imp['import_s']:.1f} s) and was {imp.get('rss_end_mb', float('nan')):,.0f} MB "
            "when it ended.",
        ],
        bars=[Bar("bytes/message vs SQLite (DuckDB)", ratio(per["sqlite"], per["duckdb"]), 1.0)],
        raw={"footprint": fp, "import": imp},
    )
