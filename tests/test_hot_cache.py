"""The DuckDB engine's hot cache (adapters/duckdb/hot.py): a build served from memory is
the build served by SQL.

- A differential test: the same random operations (appends with tool calls and client
  times, builds that truncate and summarize, clears of a thread, a scope and the agent,
  status set and clear, agent updates of the window and retention, retention sweeps,
  compactions, snapshot save and restore, agent deletes, clock advances) go to three real
  servers over the same injected time: the hot cache on, off, and on with a bound so small
  that it evicts all the time. Every BuildContext and GetContextStats answer (or error)
  must be identical.
- One test per kind of write: the next build sees it.
- The bound: bytes are accounted, eviction keeps them under it, and a thread loaded again
  after eviction builds the same.

The cache exists on the DuckDB engine only, so these tests are `duckdb_only`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from contract import support
from google.protobuf import field_mask_pb2
from google.protobuf.json_format import MessageToDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    ASSISTANT,
    TOOL_RESULT,
    TOOL_USE,
    USER,
    ServerProcess,
    connect,
    scope_pb,
    span,
    ts,
)
from contextd.adapters.duckdb.store import Store
from contextd.api.server import create_server
from contextd.app.build.build_types import BuildRequest
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.config import Settings
from contextd.domain.clock import ManualClock, wall_clock_us
from contextd.domain.errors import NotFound
from contextd.domain.model import AgentSettings, BuildOverrides, ContextKey, NewMessage, Role
from contextd.domain.window import WindowSpec
from contextd.ports.store import SnapshotMoved, read_consistently
from contextd.v1 import context_service_pb2 as pb

pytestmark = pytest.mark.duckdb_only

MINUTE = 60 * 1_000_000
HOUR = 60 * MINUTE
DAY = 24 * HOUR
THREADS = ("t1", "t2", "t3")
SCOPES = ("", "s1")


class Node:
    """One in-process server over its own DuckDB file and its own manual clock."""

    def __init__(self, tmp: Path, name: str, start_us: int, hot_bytes: int) -> None:
        self.clock = ManualClock(start_us)
        settings = Settings(
            addr="127.0.0.1:0",
            data_dir=tmp / name,
            sweep_interval_seconds=0,
            hot_cache_bytes=hot_bytes,
        )
        self.running = create_server(settings, clock=self.clock)
        self.client = connect(f"127.0.0.1:{self.running.port}")
        self.snapshots: list[str] = []

    @property
    def service(self) -> ContextService:
        assert self.running.service is not None
        return self.running.service

    @property
    def store(self) -> Store:
        store = self.service._store
        assert isinstance(store, Store)
        return store

    def stop(self) -> None:
        self.client.channel.close()
        self.running.stop(grace=1)


@contextlib.contextmanager
def _nodes() -> Iterator[list[Node]]:
    """Fresh servers for one example: the cache on, off, and on with a tiny bound."""
    start = wall_clock_us()
    with tempfile.TemporaryDirectory(prefix="contextd-hot-") as tmp:
        made: list[Node] = []
        try:
            for name, hot_bytes in (("hot", 256 << 20), ("cold", 0), ("tiny", 24 << 10)):
                made.append(Node(Path(tmp), name, start, hot_bytes))
            yield made
        finally:
            for node in made:
                node.stop()


def _calls(*ids: str) -> str:
    return json.dumps([{"id": i, "name": "grep", "input": {"q": i}} for i in ids])


def _outcome(call: Any) -> Any:
    """The answer of a call as comparable data: the message, or the error's code and text."""
    try:
        return MessageToDict(call())
    except grpc.RpcError as exc:
        return ("error", exc.code(), exc.details())


def _without_snapshot_ids(value: Any, ids: list[str]) -> Any:
    """Snapshot ids are random per server: replaced by their order of creation."""
    text = json.dumps(value, sort_keys=True, default=str)
    for i, snapshot_id in enumerate(ids):
        text = text.replace(snapshot_id, f"snapshot-{i}")
    return json.loads(text)


def _apply(node: Node, op: tuple[Any, ...]) -> Any:
    """Apply one operation; return what must be the same on every server (or None)."""
    kind, *args = op
    stub = node.client.stub
    agent = "a1"
    if kind == "advance":
        node.clock.advance(args[0])
        return None
    if kind == "append":
        thread, scope, shape, n, old = args
        messages: list[pb.Message] = []
        for i in range(n):
            role = USER if i % 2 == 0 else ASSISTANT
            messages.append(pb.Message(role=role, content=f"{shape} {i} " + "word " * (5 + 7 * i)))
        if shape == "tool":
            call = f"c{len(node.snapshots)}-{n}-{thread}"
            messages.append(pb.Message(role=TOOL_USE, tool_calls=_calls(call)))
            messages.append(
                pb.Message(role=TOOL_RESULT, tool_call_id=call, content="result " * (3 + 40 * n))
            )
        if old:
            for m in messages:
                m.source_time.CopyFrom(ts(node.clock.now_us() - old))
        return _outcome(
            lambda: stub.AppendMessages(
                pb.AppendMessagesRequest(
                    agent=agent,
                    scope=scope_pb(scope),
                    thread=thread,
                    messages=messages,
                    create_agent_if_missing=True,
                )
            )
        )
    if kind == "build":
        thread, scope, budget, summarize, truncate = args
        return _outcome(
            lambda: stub.BuildContext(
                pb.BuildContextRequest(
                    agent=agent,
                    scope=scope_pb(scope),
                    thread=thread,
                    user_message="next?",
                    options=pb.BuildOptions(
                        budget_tokens=budget, summarize=summarize, truncate=truncate
                    ),
                    formats=[pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI],
                )
            )
        )
    if kind == "stats":
        thread, scope = args
        return _outcome(
            lambda: stub.GetContextStats(
                pb.GetContextStatsRequest(agent=agent, thread=thread, scope=scope_pb(scope))
            )
        )
    if kind == "clear":
        thread, scope, which = args
        request = pb.ClearContextRequest(agent=agent)
        if which == "thread":
            request = pb.ClearContextRequest(agent=agent, scope=scope_pb(scope), thread=thread)
        elif which == "scope":
            request = pb.ClearContextRequest(agent=agent, scope=scope_pb(scope))
        elif which == "all":
            request = pb.ClearContextRequest(agent=agent, all_scopes=True)
        return _outcome(lambda: stub.ClearContext(request))
    if kind == "status":
        scope, key, ttl = args
        entry = pb.StatusEntry(key=key, kind=pb.STATUS_KIND_PROCESS, state="running", summary=key)
        return _outcome(
            lambda: stub.SetStatus(
                pb.SetStatusRequest(
                    agent=agent,
                    scope=scope_pb(scope),
                    entry=entry,
                    ttl=span(ttl) if ttl else None,
                )
            )
        )
    if kind == "unstatus":
        scope, key = args
        return _outcome(
            lambda: stub.ClearStatus(
                pb.ClearStatusRequest(agent=agent, scope=scope_pb(scope), key=key)
            )
        )
    if kind == "window":
        return _outcome(
            lambda: stub.UpdateAgent(
                pb.UpdateAgentRequest(
                    agent=pb.Agent(name=agent, rolling_window=span(args[0])),
                    update_mask=field_mask_pb2.FieldMask(paths=["rolling_window"]),
                )
            )
        )
    if kind == "retention":
        max_messages, ttl, overflow = args
        policy = pb.RetentionPolicy(
            max_messages=max_messages, ttl=span(ttl) if ttl else None, delete_overflow=overflow
        )
        return _outcome(
            lambda: stub.UpdateAgent(
                pb.UpdateAgentRequest(
                    agent=pb.Agent(name=agent, retention=policy),
                    update_mask=field_mask_pb2.FieldMask(paths=["retention"]),
                )
            )
        )
    if kind == "sweep":
        return node.service.sweep_retention(chunk_rows=args[0])
    if kind == "compact":
        thread, scope = args
        return _outcome(
            lambda: stub.CompactContext(
                pb.CompactContextRequest(
                    agent=agent,
                    scope=scope_pb(scope),
                    thread=thread,
                    options=pb.BuildOptions(budget_tokens=300),
                )
            )
        )
    if kind == "save":
        scope = args[0]
        try:
            saved = stub.SaveSnapshot(pb.SaveSnapshotRequest(agent=agent, scope=scope_pb(scope)))
        except grpc.RpcError as exc:
            return ("error", exc.code())
        node.snapshots.append(saved.snapshot.id)
        return None
    if kind == "restore":
        scope, branch = args
        if not node.snapshots:
            return None
        return _outcome(
            lambda: stub.RestoreSnapshot(
                pb.RestoreSnapshotRequest(
                    agent=agent, scope=scope_pb(scope), id=node.snapshots[-1], branch_thread=branch
                )
            )
        )
    if kind == "delete":
        return _outcome(lambda: stub.DeleteAgent(pb.DeleteAgentRequest(name=agent)))
    raise AssertionError(kind)


def _random_ops(seed: int, count: int) -> list[tuple[Any, ...]]:
    rnd = random.Random(seed)
    ops: list[tuple[Any, ...]] = []

    def thread() -> str:
        return rnd.choice(THREADS)

    def scope() -> str:
        return rnd.choice(SCOPES)

    weights = {
        "append": 30,
        "build": 25,
        "stats": 5,
        "advance": 8,
        "clear": 8,
        "status": 4,
        "unstatus": 2,
        "window": 2,
        "retention": 3,
        "sweep": 3,
        "compact": 3,
        "save": 2,
        "restore": 2,
        "delete": 1,
    }
    kinds = list(weights)
    for _ in range(count):
        kind = rnd.choices(kinds, [weights[k] for k in kinds])[0]
        if kind == "append":
            old = rnd.choice([0, 0, 0, 2 * HOUR, 3 * DAY])
            op: tuple[Any, ...] = (
                kind,
                thread(),
                scope(),
                rnd.choice(["text", "text", "tool"]),
                rnd.randint(1, 4),
                old,
            )
        elif kind == "build":
            op = (
                kind,
                thread(),
                scope(),
                rnd.choice([0, 120, 400, 2000]),
                rnd.random() < 0.25,
                rnd.random() < 0.8,
            )
        elif kind == "stats":
            op = (kind, thread(), scope())
        elif kind == "advance":
            op = (kind, rnd.choice([1, MINUTE, HOUR, DAY, 2 * DAY]))
        elif kind == "clear":
            op = (kind, thread(), scope(), rnd.choice(["thread", "scope", "agent", "all"]))
        elif kind == "status":
            op = (kind, scope(), rnd.choice(["k1", "k2", "k3"]), rnd.choice([0, HOUR]))
        elif kind == "unstatus":
            op = (kind, scope(), rnd.choice(["k1", "k2"]))
        elif kind == "window":
            op = (kind, rnd.choice([HOUR, DAY, 7 * DAY]))
        elif kind == "retention":
            op = (
                kind,
                rnd.choice([0, 3, 8]),
                rnd.choice([0, DAY, 3 * DAY]),
                rnd.random() < 0.5,
            )
        elif kind == "sweep":
            op = (kind, rnd.choice([2, 100]))
        elif kind == "compact":
            op = (kind, thread(), scope())
        elif kind == "save":
            op = (kind, scope())
        elif kind == "restore":
            op = (kind, scope(), rnd.choice(["", "branch"]))
        else:
            op = (kind,)
        ops.append(op)
        if kind != "build" and rnd.random() < 0.6:
            # A build right after a write, often of the thread it wrote: what must see it.
            near = rnd.random() < 0.7 and len(op) > 2 and op[1] in THREADS
            where = (op[1], op[2]) if near else (thread(), scope())
            ops.append(("build", *where, rnd.choice([0, 400, 2000]), False, True))
    return ops


@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_hot_cache_builds_what_sql_builds(seed: int) -> None:
    """Every answer of the servers with the cache on, off and tiny is the same, step by
    step, for the same operations at the same times."""
    with _nodes() as nodes:
        _run_differential(nodes, seed)


def _run_differential(nodes: list[Node], seed: int) -> None:
    steps = _random_ops(seed, 60)
    built = 0
    for step, op in enumerate(steps):
        answers = [_without_snapshot_ids(_apply(node, op), node.snapshots) for node in nodes]
        if op[0] == "build" and isinstance(answers[0], dict):
            built += 1
        assert answers[1] == answers[0], f"step {step} {op}: hot cache differs from SQL"
        assert answers[2] == answers[0], f"step {step} {op}: tiny cache differs from SQL"
    assert built > 0 or not any(op[0] == "build" for op in steps)
    hot = nodes[0].store
    assert hot.hot_stats.hits > 0  # the cache did serve
    tiny = nodes[2].store
    assert tiny._hot.bytes <= tiny._hot.max_bytes


# ----------------------------------------------------------------- one test per write kind


@pytest.fixture
def hot(tmp_path: Path) -> Iterator[Node]:
    node = Node(tmp_path, "hot", wall_clock_us(), 256 << 20)
    yield node
    node.stop()


def _built(node: Node, thread: str = "t1", scope: str = "") -> pb.BuildContextResponse:
    built: pb.BuildContextResponse = node.client.stub.BuildContext(
        pb.BuildContextRequest(agent="a1", scope=scope_pb(scope), thread=thread)
    )
    return built


def _kept(node: Node, thread: str = "t1", scope: str = "") -> list[str]:
    return [m.content for m in _built(node, thread, scope).messages]


def _warm(node: Node, *contents: str, thread: str = "t1", scope: str = "") -> None:
    node.client.append("a1", *contents, thread=thread, scope=scope)
    _kept(node, thread, scope)
    _kept(node, thread, scope)
    assert node.store.hot_stats.hits > 0


def test_an_append_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    hot.client.append("a1", "two")
    assert _kept(hot) == ["one", "two"]


def test_a_thread_clear_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    hot.client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    assert _kept(hot) == []


def test_a_scope_clear_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one", scope="s1")
    hot.client.stub.ClearContext(pb.ClearContextRequest(agent="a1", scope=scope_pb("s1")))
    assert _kept(hot, scope="s1") == []


def test_an_agent_clear_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    hot.client.stub.ClearContext(pb.ClearContextRequest(agent="a1", all_scopes=True))
    assert _kept(hot) == []


def test_a_status_write_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    entry = pb.StatusEntry(key="deploy", kind=pb.STATUS_KIND_PROCESS, state="running", summary="x")
    hot.client.stub.SetStatus(pb.SetStatusRequest(agent="a1", entry=entry))
    assert "deploy" in _built(hot).status
    hot.client.stub.ClearStatus(pb.ClearStatusRequest(agent="a1", key="deploy"))
    assert "deploy" not in _built(hot).status


def test_another_threads_append_is_in_the_next_builds_activity(hot: Node) -> None:
    _warm(hot, "one")
    hot.client.append("a1", "elsewhere", thread="t2")
    assert "t2" in _built(hot).status


def test_an_agent_update_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    hot.client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", system_prompt="be brief"),
            update_mask=field_mask_pb2.FieldMask(paths=["system_prompt"]),
        )
    )
    assert _built(hot).system_prompt == "be brief"


def test_a_window_update_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    hot.clock.advance(2 * HOUR)
    hot.client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", rolling_window=span(HOUR)),
            update_mask=field_mask_pb2.FieldMask(paths=["rolling_window"]),
        )
    )
    assert _kept(hot) == []


def test_retention_and_its_sweep_are_in_the_next_build(hot: Node) -> None:
    _warm(hot, "m1", "m2", "m3", "m4")
    hot.client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(
                name="a1", retention=pb.RetentionPolicy(max_messages=2, delete_overflow=True)
            ),
            update_mask=field_mask_pb2.FieldMask(paths=["retention"]),
        )
    )
    assert _kept(hot) == ["m3", "m4"]
    hot.service.sweep_retention()
    assert _kept(hot) == ["m3", "m4"]
    hot.client.append("a1", "m5")
    assert _kept(hot) == ["m4", "m5"]


def test_an_append_to_an_expired_thread_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, "old")
    _warm(hot, "elsewhere", thread="t2")
    hot.client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", retention=pb.RetentionPolicy(ttl=span(DAY))),
            update_mask=field_mask_pb2.FieldMask(paths=["retention"]),
        )
    )
    hot.clock.advance(2 * DAY)
    hot.client.append("a1", "new")  # finds t1 expired: its clear marker moves
    assert _kept(hot) == ["new"]
    assert "t2" not in _built(hot).status  # t2 expired too: no activity


def test_a_stored_summary_is_in_the_next_build(hot: Node) -> None:
    _warm(hot, *[f"message {i} " + "word " * 40 for i in range(12)])
    summary = hot.client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(budget_tokens=300)
        )
    ).summary
    built = _built(hot)
    assert built.messages[0].id == summary.id
    assert built.stats.last_summarized_id > 0


def test_a_restore_and_a_delete_are_in_the_next_build(hot: Node) -> None:
    _warm(hot, "one")
    saved = hot.client.stub.SaveSnapshot(pb.SaveSnapshotRequest(agent="a1")).snapshot
    hot.client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    assert _kept(hot) == []
    hot.client.stub.RestoreSnapshot(pb.RestoreSnapshotRequest(agent="a1", id=saved.id))
    assert _kept(hot) == ["one"]
    hot.client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    hot.client.append("a1", "new life")
    assert _kept(hot) == ["new life"]


# ----------------------------------------------------------------- the bound


def test_the_bound_holds_and_a_reloaded_thread_builds_the_same(tmp_path: Path) -> None:
    node = Node(tmp_path, "small", wall_clock_us(), 64 << 10)
    try:
        for t in range(6):
            node.client.append("a1", *[f"{t}-{i} " + "x" * 900 for i in range(20)], thread=f"t{t}")
        first = {f"t{t}": _kept(node, f"t{t}") for t in range(6)}
        cache = node.store._hot
        assert 0 < cache.bytes <= cache.max_bytes
        assert cache.evictions > 0
        assert sum(e.size() for e in cache.entries.values()) == cache.bytes
        loads = node.store.hot_stats.loads
        again = {f"t{t}": _kept(node, f"t{t}") for t in range(6)}
        assert again == first
        assert node.store.hot_stats.loads > loads  # evicted threads were loaded again
        assert cache.bytes <= cache.max_bytes
    finally:
        node.stop()


# ----------------------------------------------------------------- the flag


def test_serve_with_the_cache_off_builds_the_same(tmp_path: Path) -> None:
    """`contextd serve --hot-cache-bytes 0` (here by its environment variable) serves
    builds by SQL; a negative size is refused before anything opens."""
    proc = ServerProcess(tmp_path / "off", extra_env={"CONTEXTD_HOT_CACHE_BYTES": "0"})
    client = proc.start()
    try:
        client.append("a1", "one", "two")
        built = client.stub.BuildContext(pb.BuildContextRequest(agent="a1", thread="t1"))
        assert [m.content for m in built.messages] == ["one", "two"]
    finally:
        client.channel.close()
        proc.stop()
    refused = subprocess.run(
        [sys.executable, "-m", "contextd", "serve", "--hot-cache-bytes", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CONTEXTD_DATA_DIR": str(tmp_path / "never")},
    )
    assert refused.returncode == 2
    assert "hot-cache-bytes" in refused.stderr and "Traceback" not in refused.stderr


# ----------------------------------------------------------------- one committed point


def test_a_snapshot_that_moved_under_cached_reads_is_read_again_by_sql(tmp_path: Path) -> None:
    """A commit between a snapshot's cached reads and one it must make by SQL would mix
    two states: the read raises SnapshotMoved, and `read_consistently` runs the block
    again, by SQL alone, which then sees the later state throughout."""
    store = Store.open(tmp_path / "s.duckdb")
    try:
        k = ContextKey("default", "a1", "", "t1")
        store.append(k, support.batch("one"), AgentSettings())
        store.context_ref(k)  # warm: read once by SQL, then from memory
        calls: list[int] = []

        def block() -> list[str]:
            calls.append(1)
            assert store.context_ref(k) is not None  # cached: fixes the snapshot's state
            if len(calls) == 1:
                store.append(k, support.batch("two"), None)  # a commit meanwhile
            return support.history(store, k)  # by SQL

        assert read_consistently(store, block) == ["one", "two"]
        assert len(calls) == 2 and store.hot_stats.moved == 1
        # A snapshot whose first read went to SQL pins that state; cached reads after
        # it are of the same state, so a later commit is simply not seen.
        with store.snapshot():
            assert support.history(store, k) == ["one", "two"]
            store.append(k, support.batch("later"), None)
            assert store.context_ref(k) is not None
            assert support.history(store, k) == ["one", "two"]
        with pytest.raises(SnapshotMoved), store.snapshot():
            store.context_ref(k)
            store.append(k, support.batch("three"), None)
            store.list_messages(support.where(k), None, None, 100)
    finally:
        store.close()


# ----------------------------------------------------------------- racing writes


def test_builds_racing_appends_each_see_one_committed_prefix(tmp_path: Path) -> None:
    """Builds on several threads while appends land (to the thread and beside it): each
    build's window is one committed prefix of the thread, never a mix of two states."""
    store = Store.open(tmp_path / "race.duckdb")
    service = ContextService(store, ExtractiveSummarizer())
    total = 240
    failures: list[str] = []

    def append() -> None:
        i = 0
        while i < total:
            n = 1 + i % 3
            batch = [NewMessage(role=Role.USER, content=f"m{j}") for j in range(i, i + n)]
            service.append_messages("default", "a1", "", "t1", batch, create_agent=True)
            service.append_messages(
                "default", "a1", "", "t2", [NewMessage(role=Role.USER, content="x")]
            )
            i += n

    def build() -> None:
        request = BuildRequest(
            "default", "a1", "", "t1", overrides=BuildOverrides(budget_tokens=100_000)
        )
        for _ in range(60):
            try:
                kept = [it.content for it in service.build_context(request).context.history]
            except NotFound:
                continue  # before the first append
            if kept != [f"m{j}" for j in range(len(kept))]:
                failures.append(f"not a prefix: {kept[:5]}...{kept[-5:]}")

    service.append_messages(
        "default", "a1", "", "t0", [NewMessage(role=Role.USER, content="first")], create_agent=True
    )
    try:
        workers = [threading.Thread(target=append)] + [
            threading.Thread(target=build) for _ in range(3)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert not failures, failures[:3]
        final = service.build_context(
            BuildRequest("default", "a1", "", "t1", overrides=BuildOverrides(budget_tokens=100_000))
        )
        assert [it.content for it in final.context.history] == [f"m{j}" for j in range(total)]
    finally:
        store.close()


def test_a_build_reaching_older_than_the_cached_content_reads_it_by_sql(tmp_path: Path) -> None:
    """The cache keeps the newest 4,096 messages' content of a thread; a budget that keeps
    more reads the older part by SQL, and the build is the same as without the cache."""
    start = wall_clock_us()
    nodes = [Node(tmp_path, "hot", start, 256 << 20), Node(tmp_path, "cold", start, 0)]
    try:
        for node in nodes:
            node.client.append("a1", *[f"m{i}" for i in range(4_500)])
        request = pb.BuildContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(budget_tokens=200_000)
        )
        for round_ in range(2):
            built = [MessageToDict(n.client.stub.BuildContext(request)) for n in nodes]
            assert built[0] == built[1]
            assert len(built[0]["messages"]) == 4_500 + round_
            for node in nodes:
                node.client.append("a1", "one more")
        assert nodes[0].store.hot_stats.hits > 0
    finally:
        for node in nodes:
            node.stop()


def test_builds_share_a_window_table_until_an_append_and_see_the_append(tmp_path: Path) -> None:
    """The cache keeps one view per thread state and one window table per view: reads
    between two commits share them, and the first read after an append makes new ones
    that hold it (the older table is unchanged: a build holding it reads one state)."""
    store = Store.open(tmp_path / "s.duckdb")
    try:
        k = ContextKey("default", "a1", "", "t1")
        store.append(k, support.batch("one", "two"), AgentSettings())
        window = WindowSpec(0, 0)
        ref = store.context_ref(k)
        assert ref is not None
        first = store.window_columns(ref, window)
        assert store.window_columns(ref, window) is first
        store.append(k, support.batch("three"), None)
        ref = store.context_ref(k)
        assert ref is not None
        after = store.window_columns(ref, window)
        assert after is not first
        assert len(first) == 2 and len(after) == 3
        assert after.column("id").to_pylist()[:2] == first.column("id").to_pylist()
        assert store.window_columns(ref, window) is after
    finally:
        store.close()


def test_appends_grouped_together_reach_each_cached_thread(tmp_path: Path) -> None:
    """Callers on many threads at once: the writer commits their appends in groups
    whose rows interleave threads, and the hot cache splits each group by thread (hot.py,
    `_appended`). Every cached thread, and its scope's activity, must take exactly its
    own rows; threads nothing cached must be read right when first built."""
    store = Store.open(tmp_path / "groups.duckdb")
    service = ContextService(store, ExtractiveSummarizer())
    threads = [f"t{k}" for k in range(8)]
    each = 30
    cached = threads[::2]  # half the threads are cached before the appends, half are not
    for thread in threads:
        service.append_messages(
            "default",
            "a1",
            "",
            thread,
            [NewMessage(role=Role.USER, content=f"{thread}-start")],
            create_agent=True,
        )
    window = WindowSpec(clear_after_us=0, age_after_us=0)

    def build(thread: str) -> list[str]:
        request = BuildRequest(
            "default", "a1", "", thread, overrides=BuildOverrides(budget_tokens=100_000)
        )
        return [it.content for it in service.build_context(request).context.history]

    def activity() -> dict[str, int]:
        found = store.thread_activity("default", "a1", "", window, 100)
        return {a.thread: a.window_message_count for a in found}

    try:
        for thread in cached:
            build(thread)
            build(thread)
        assert activity() == dict.fromkeys(threads, 1)  # the scope's rows are cached too
        hits = store.hot_stats.hits
        assert hits > 0

        def append(thread: str) -> None:
            for i in range(each):
                service.append_messages(
                    "default",
                    "a1",
                    "",
                    thread,
                    [NewMessage(role=Role.USER, content=f"{thread}-{i}")],
                )

        workers = [threading.Thread(target=append, args=(t,)) for t in threads]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        expected = {t: [f"{t}-start", *(f"{t}-{i}" for i in range(each))] for t in threads}
        for thread in threads:
            assert build(thread) == expected[thread], thread
        assert store.hot_stats.hits > hits  # the cached threads were served from memory
        assert activity() == dict.fromkeys(threads, 1 + each)
    finally:
        store.close()
