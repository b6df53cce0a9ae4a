"""Stateless replicas over one PostgreSQL, with real processes: several `contextd serve`
processes on one database serve the same contexts, a replica killed with kill -9 loses no
acknowledged write, a retry through another replica is answered from the request record,
clears, page tokens and builds agree across replicas, and replicas starting together
migrate once."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import USER, Client, ServerProcess, SpawnServer, connect, scope_pb
from contextd.adapters.postgres.schema import MIGRATION_LOCK, MIGRATIONS
from contextd.api.server import create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock, wall_clock_us
from contextd.v1 import context_service_pb2 as pb
from waiting import wait_until

# What a client may retry, with the same request id, through another replica: the call
# may or may not have been written, and the request record makes the retry safe.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}
CALL_TIMEOUT_S = 15.0
ALL_FORMATS = [pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI, pb.CONTEXT_FORMAT_TEXT]


@dataclass
class Replica:
    name: str
    proc: ServerProcess
    client: Client


def _start(spawn_server: SpawnServer, tmp_path: Path, dsn: str, name: str) -> Replica:
    """A replica: its own process and data directory, the shared database."""
    proc = spawn_server(tmp_path / name, extra_env={"CONTEXTD_STORE": dsn})
    return Replica(name, proc, proc.start())


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


def _history(clients: list[Client], agent: str, scope: str, thread: str) -> list[pb.Message]:
    """Every message of a thread (range ALL), page by page, each page asked of the next
    replica in turn: a page token from one replica must be honoured by the others."""
    out: list[pb.Message] = []
    token = ""
    page = 0
    while True:
        response = clients[page % len(clients)].stub.ListMessages(
            pb.ListMessagesRequest(
                agent=agent,
                scope=scope_pb(scope),
                thread=thread,
                range=pb.MESSAGE_RANGE_ALL,
                page_size=37,
                page_token=token,
            ),
            timeout=CALL_TIMEOUT_S,
        )
        out.extend(response.messages)
        token = response.next_page_token
        page += 1
        if not token:
            return out


def _build(client: Client, agent: str, scope: str, thread: str) -> pb.BuildContextResponse:
    """A truncate-only build (no summarizer) with every rendering."""
    response: pb.BuildContextResponse = client.stub.BuildContext(
        pb.BuildContextRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            options=pb.BuildOptions(truncate=True, summarize=False, elide_tool_results=False),
            formats=ALL_FORMATS,
        ),
        timeout=CALL_TIMEOUT_S,
    )
    return response


# ------------------------------------------------------------------ kill -9 under load

# Six threads of two agents. Each thread has a scope of its own, so that no build carries
# a status preamble: that block reads "now" ("last 3s ago"), which differs between any
# two builds, on one replica as on two, and would hide what the comparison is about.
CONTEXTS = [(f"agent-{k % 2}", f"scope-{k}", f"thread-{k}") for k in range(6)]
CLIENTS = 16
MAX_PER_CLIENT = 400  # a cap, so that a stalled main thread cannot make the run unbounded
MAX_ATTEMPTS = 25
ACKS_BEFORE_KILL = 150
ACKS_THROUGH_REPLACEMENT = 100


@dataclass(frozen=True)
class Ack:
    client: int
    index: int
    content: str
    receipt: pb.MessageReceipt
    replica: str
    attempts: int


def test_replicas_survive_kill9_and_retries_write_once(
    postgres_dsn: str, spawn_server: SpawnServer, tmp_path: Path
) -> None:
    slots = [_start(spawn_server, tmp_path, postgres_dsn, name) for name in ("a", "b")]
    lock = threading.Lock()
    acks: list[Ack] = []
    failures: Counter[grpc.StatusCode] = Counter()
    unexpected: list[str] = []
    gave_up: list[str] = []
    stop = threading.Event()

    def client_loop(c: int) -> None:
        agent, scope, thread = CONTEXTS[c % len(CONTEXTS)]
        pick = random.Random(c)
        for i in range(MAX_PER_CLIENT):
            if stop.is_set():
                return
            content = f"c{c:02d}-m{i:04d}"
            request = pb.AppendMessagesRequest(
                agent=agent,
                scope=scope_pb(scope),
                thread=thread,
                request_id=f"req-{content}",
                create_agent_if_missing=True,
                messages=[pb.Message(role=USER, content=content)],
            )
            first = pick.randrange(2)
            for attempt in range(MAX_ATTEMPTS):
                with lock:
                    replica = slots[(first + attempt) % 2]  # a retry goes to the other one
                try:
                    response = replica.client.stub.AppendMessages(request, timeout=CALL_TIMEOUT_S)
                except grpc.RpcError as exc:
                    with lock:
                        failures[exc.code()] += 1
                    if exc.code() not in RETRYABLE:
                        with lock:
                            unexpected.append(f"{content}: {exc.code()} {exc.details()}")
                        return
                    time.sleep(min(0.2, 0.005 * 2**attempt))  # back off; not an assertion
                    continue
                [receipt] = response.receipts
                with lock:
                    acks.append(Ack(c, i, content, receipt, replica.name, attempt + 1))
                break
            else:
                with lock:
                    gave_up.append(content)
                return

    def acked(through: str | None = None) -> int:
        with lock:
            return sum(1 for a in acks if through is None or a.replica == through)

    workers = [threading.Thread(target=client_loop, args=(c,)) for c in range(CLIENTS)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: acked() >= ACKS_BEFORE_KILL, "the first appends are acknowledged")
        slots[0].proc.kill9()  # calls in flight on it fail; their retries go to "b"
        replacement = _start(spawn_server, tmp_path, postgres_dsn, "a2")
        with lock:
            killed, slots[0] = slots[0], replacement
        wait_until(
            lambda: acked("a2") >= ACKS_THROUGH_REPLACEMENT,
            "the replacement replica acknowledges appends",
        )
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not any(w.is_alive() for w in workers), "a client is stuck"
    killed.client.channel.close()

    assert not unexpected, unexpected[:5]
    assert not gave_up, f"{len(gave_up)} requests never acknowledged, e.g. {gave_up[:5]}"
    retried = [a for a in acks if a.attempts > 1]
    assert retried, "no call failed over to the other replica: the kill proved nothing"
    assert failures[grpc.StatusCode.UNAVAILABLE] > 0
    by_content = {a.content: a for a in acks}
    assert len(by_content) == len(acks)

    clients = [slots[0].client, slots[1].client]
    stored_total = 0
    for k, (agent, scope, thread) in enumerate(CONTEXTS):
        through_a2 = _history([clients[0], clients[1]], agent, scope, thread)
        through_b = _history([clients[1], clients[0]], agent, scope, thread)
        assert through_a2 == through_b, f"the replicas list {thread} differently"
        contents = [m.content for m in through_a2]
        # Nothing stored twice, retried or not; nothing stored that no client sent here.
        duplicated = [c for c, n in Counter(contents).items() if n > 1]
        assert not duplicated, f"stored twice in {thread}: {duplicated[:5]}"
        assert all(int(c[1:3]) % len(CONTEXTS) == k for c in contents), contents[:5]
        # Numbered 1..N with no gap, times never going back.
        assert [m.sequence for m in through_a2] == list(range(1, len(through_a2) + 1))
        times = [m.create_time.ToMicroseconds() for m in through_a2]
        assert times == sorted(times)
        # Every acknowledged message is there, as its receipt said.
        expected = {a.content for a in acks if a.client % len(CONTEXTS) == k}
        stored = {m.content: m for m in through_a2}
        missing = expected - stored.keys()
        assert not missing, f"acknowledged but lost in {thread}: {sorted(missing)[:5]}"
        for content in expected:
            receipt, message = by_content[content].receipt, stored[content]
            assert (receipt.id, receipt.sequence) == (message.id, message.sequence), content
            assert receipt.create_time == message.create_time, content
        # Each client's messages are in its own append order.
        per_client: dict[str, list[int]] = defaultdict(list)
        for m in through_a2:
            per_client[m.content[:3]].append(int(m.content[5:]))
        for client_name, indexes in per_client.items():
            assert indexes == list(range(len(indexes))), f"{client_name} out of order"
        stored_total += len(through_a2)
        # The thread's counters agree with its rows, on both replicas.
        for client in clients:
            [row] = client.stub.ListThreads(
                pb.ListThreadsRequest(agent=agent, scope=scope_pb(scope))
            ).threads
            assert (row.message_count, row.last_sequence) == (len(contents), len(contents))
        # Both replicas build the same context.
        build_a2 = _build(clients[0], agent, scope, thread)
        build_b = _build(clients[1], agent, scope, thread)
        assert build_a2.status == ""  # nothing time-dependent in the comparison
        assert [m.id for m in build_a2.messages] == [m.id for m in through_a2]
        assert [m.id for m in build_b.messages] == [m.id for m in build_a2.messages]
        assert list(build_b.renderings) == list(build_a2.renderings)
        assert build_b == build_a2
    # Every request sent was acknowledged (none gave up), so the rows are exactly the acks.
    assert stored_total == len(acks)


# ------------------------------------------------------------------ focused cases


def _append(agent: str, thread: str, request_id: str, *texts: str) -> pb.AppendMessagesRequest:
    return pb.AppendMessagesRequest(
        agent=agent,
        thread=thread,
        request_id=request_id,
        create_agent_if_missing=True,
        messages=[pb.Message(role=USER, content=t) for t in texts],
    )


def test_a_retry_through_another_replica_is_answered_from_the_record(
    postgres_dsn: str, spawn_server: SpawnServer, tmp_path: Path
) -> None:
    a, b = (_start(spawn_server, tmp_path, postgres_dsn, name).client for name in ("a", "b"))
    first = a.stub.AppendMessages(_append("a1", "t1", "R", "hello", "world"))
    assert b.stub.AppendMessages(_append("a1", "t1", "R", "hello", "world")) == first
    for client in (a, b):
        history = client.history("a1")
        assert client.contents(history) == ["hello", "world"]
        assert [m.id for m in history] == [r.id for r in first.receipts]
    with pytest.raises(grpc.RpcError) as info:
        b.stub.AppendMessages(_append("a1", "t1", "R", "something else"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _reason(info.value) == "REQUEST_ID_REUSED"
    assert b.contents(b.history("a1")) == ["hello", "world"]

    # The same request sent through both replicas at once is written once.
    results: list[pb.AppendMessagesResponse | grpc.StatusCode] = []
    barrier = threading.Barrier(8)

    def send(client: Client) -> None:
        barrier.wait()
        try:
            results.append(client.stub.AppendMessages(_append("a1", "t2", "R2", "once")))
        except grpc.RpcError as exc:
            results.append(exc.code())

    senders = [threading.Thread(target=send, args=([a, b][n % 2],)) for n in range(8)]
    for s in senders:
        s.start()
    for s in senders:
        s.join(30)
    assert len(results) == 8 and all(r == results[0] for r in results), results
    assert a.contents(a.history("a1", thread="t2")) == ["once"]


def test_clears_and_page_tokens_hold_across_replicas(
    postgres_dsn: str, spawn_server: SpawnServer, tmp_path: Path
) -> None:
    a, b = (_start(spawn_server, tmp_path, postgres_dsn, name).client for name in ("a", "b"))
    a.append("a1", "old-1", "old-2", thread="t1")
    cleared = a.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    receipt = b.append("a1", "new-1", thread="t1").receipts[0]
    assert receipt.create_time.ToMicroseconds() > cleared.ToMicroseconds()
    for client in (a, b):
        assert client.contents(client.window("a1")) == ["new-1"]
        assert client.contents(client.history("a1")) == ["old-1", "old-2", "new-1"]

    b.append("a1", *(f"more-{i}" for i in range(7)), thread="t1")
    for range_ in (pb.MESSAGE_RANGE_ALL, pb.MESSAGE_RANGE_WINDOW):
        whole = a.list_messages("a1", thread="t1", range=range_)
        # Pages of 2, asked of a, b, a, b...: every token one replica issued, the other
        # honours (the signing key is in the database, not in a data directory).
        pages: list[pb.Message] = []
        token = ""
        for n in range(len(whole)):
            response = (a, b)[n % 2].stub.ListMessages(
                pb.ListMessagesRequest(
                    agent="a1", thread="t1", range=range_, page_size=2, page_token=token
                )
            )
            pages.extend(response.messages)
            token = response.next_page_token
            if not token:
                break
        assert pages == whole
        assert len(whole) == (10 if range_ == pb.MESSAGE_RANGE_ALL else 8)


def test_replicas_starting_together_migrate_once(
    postgres_dsn: str, spawn_server: SpawnServer, tmp_path: Path
) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        # Hold the migration lock, so both replicas reach it before either may migrate.
        conn.execute("SELECT pg_advisory_lock(%s)", [MIGRATION_LOCK])
        procs = [
            spawn_server(tmp_path / name, extra_env={"CONTEXTD_STORE": postgres_dsn})
            for name in ("a", "b")
        ]
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(p.start) for p in procs]

            def waiting() -> int:
                row = conn.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND database = (SELECT oid FROM pg_database WHERE datname = "
                    "current_database())"
                ).fetchone()
                return int(row[0]) if row else 0

            wait_until(lambda: waiting() == 2, "both replicas wait for the migration lock")
            assert not any(f.done() for f in starting)  # neither serves before migrating
            conn.execute("SELECT pg_advisory_unlock(%s)", [MIGRATION_LOCK])
            a, b = (f.result(timeout=60) for f in starting)
        versions = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
    assert versions == [(version,) for version, _ in MIGRATIONS]  # each applied once
    assert sum("migrated schema" in p.log() for p in procs) == 1
    a.append("a1", "through a")
    b.append("a1", "through b")
    for client in (a, b):
        assert client.contents(client.history("a1")) == ["through a", "through b"]


def test_clear_markers_never_go_back_when_replica_clocks_disagree(
    tmp_path: Path, postgres_dsn: str
) -> None:
    """Replicas' clocks differ (by seconds, across machines): a clear through the one
    behind must still land after every marker already set, as from one clock."""
    start = wall_clock_us()
    ahead, behind = ManualClock(start + 10_000_000), ManualClock(start)
    servers = [
        create_server(
            Settings(addr="127.0.0.1:0", data_dir=tmp_path / name, store=postgres_dsn),
            clock=clock,
        )
        for name, clock in (("ahead", ahead), ("behind", behind))
    ]
    a, b = (connect(f"127.0.0.1:{s.port}") for s in servers)
    try:
        a.append("a1", "m1", thread="t1")
        ahead.advance(5_000_000)
        markers = [a.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))]
        markers.append(b.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1")))
        ahead.advance(5_000_000)
        markers.append(a.stub.ClearContext(pb.ClearContextRequest(agent="a1", all_scopes=True)))
        markers.append(b.stub.ClearContext(pb.ClearContextRequest(agent="a1")))
        ahead.advance(5_000_000)
        markers.append(a.stub.ClearContext(pb.ClearContextRequest(agent="a1", all_scopes=True)))
        markers.append(b.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1")))
        times = [m.clear_time.ToMicroseconds() for m in markers]
        assert times == sorted(set(times)), "a clear marker went back"
        [thread] = b.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
        assert thread.last_clear_time == markers[-1].clear_time
        receipt = b.append("a1", "after", thread="t1").receipts[0]
        assert receipt.create_time.ToMicroseconds() > times[-1]
        assert b.contents(b.window("a1", thread="t1")) == ["after"]
    finally:
        for client in (a, b):
            client.channel.close()
        for server in servers:
            server.stop(grace=1)
