"""Snapshots end to end: SaveSnapshot, ListSnapshots, GetSnapshot, DeleteSnapshot and
RestoreSnapshot over gRPC on a real server, on both engines (the embedded DuckDB file with
its documents under the data directory, and PostgreSQL), with summaries written by the
real anthropic client against the local fake of the Messages API (never the network).

Each sentence of docs/api.md's *Snapshots* section names the test here that checks it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_anthropic import FakeAnthropic
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import (
    ASSISTANT,
    TOOL_RESULT,
    TOOL_USE,
    USER,
    Client,
    connect,
    db_rows,
    rendering,
    scope_pb,
    ts,
)
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb

FAILED = "(summary generation failed)"
SECOND = 1_000_000


@dataclass
class Service:
    running: RunningServer
    client: Client
    data_dir: Path
    stopped: bool = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.client.channel.close()
            self.running.stop(grace=1)


Start = Callable[..., Service]


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def start(
    tmp_path: Path,
    fake: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    clock: ManualClock,
    store_url: str,
) -> Iterator[Start]:
    """Starts servers on one data directory (or database) and one clock, their summaries
    written through the fake Anthropic API; stopped at the end."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    started: list[Service] = []

    def make(**overrides: Any) -> Service:
        values: dict[str, Any] = {
            "addr": "127.0.0.1:0",
            "data_dir": tmp_path / "data",
            "store": store_url,
            "anthropic_base_url": fake.base_url,
            "summary_timeout_seconds": 10.0,
            **overrides,
        }
        settings = Settings(**values)
        running = create_server(settings, clock=clock)
        service = Service(running, connect(f"127.0.0.1:{running.port}"), settings.data_dir)
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop()


@pytest.fixture
def svc(start: Start) -> Service:
    return start()


# ----------------------------------------------------------------- helpers


def _save(client: Client, agent: str = "a1", scope: str = "", **fields: Any) -> pb.Snapshot:
    response: pb.SaveSnapshotResponse = client.stub.SaveSnapshot(
        pb.SaveSnapshotRequest(agent=agent, scope=scope_pb(scope), **fields)
    )
    return response.snapshot


def _get(
    client: Client, snapshot_id: str, agent: str = "a1", scope: str = "", full: bool = True
) -> pb.GetSnapshotResponse:
    view = pb.SNAPSHOT_VIEW_FULL if full else pb.SNAPSHOT_VIEW_UNSPECIFIED
    response: pb.GetSnapshotResponse = client.stub.GetSnapshot(
        pb.GetSnapshotRequest(agent=agent, scope=scope_pb(scope), id=snapshot_id, view=view)
    )
    return response


def _list(client: Client, agent: str = "a1", scope: str = "", **fields: Any) -> Any:
    return client.stub.ListSnapshots(
        pb.ListSnapshotsRequest(agent=agent, scope=scope_pb(scope), **fields)
    )


def _restore(
    client: Client, snapshot_id: str, agent: str = "a1", scope: str = "", **fields: Any
) -> pb.RestoreSnapshotResponse:
    response: pb.RestoreSnapshotResponse = client.stub.RestoreSnapshot(
        pb.RestoreSnapshotRequest(agent=agent, scope=scope_pb(scope), id=snapshot_id, **fields)
    )
    return response


def _delete(
    client: Client, snapshot_id: str, agent: str = "a1", scope: str = "", **fields: Any
) -> pb.DeleteSnapshotResponse:
    response: pb.DeleteSnapshotResponse = client.stub.DeleteSnapshot(
        pb.DeleteSnapshotRequest(agent=agent, scope=scope_pb(scope), id=snapshot_id, **fields)
    )
    return response


def _clear(client: Client, thread: str = "t1", agent: str = "a1") -> None:
    client.stub.ClearContext(pb.ClearContextRequest(agent=agent, thread=thread))


def _failure(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, str, str]:
    """(code, reason, field, message) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    reason = field = ""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            found = error_details_pb2.ErrorInfo()
            detail.Unpack(found)
            reason, field = found.reason, found.metadata.get("field", "")
    return error.code(), reason, field, error.details() or ""


def _tool_turn(client: Client, thread: str = "t1", call_id: str = "call_1") -> None:
    calls = json.dumps([{"id": call_id, "name": "grep", "input": {"q": "x"}}])
    client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent="a1",
            thread=thread,
            create_agent_if_missing=True,
            messages=[
                pb.Message(role=USER, content="find x"),
                pb.Message(role=TOOL_USE, tool_calls=calls),
                pb.Message(role=TOOL_RESULT, tool_call_id=call_id, content="x is in y.py"),
                pb.Message(role=ASSISTANT, content="x is in y.py"),
            ],
        )
    )


def _execute(svc: Service, sql: str, params: list[Any]) -> None:
    """A write behind the server's back (to damage what it stored), on either engine."""
    store: Any = svc.running.store
    if hasattr(store, "_pool"):
        with store._pool.connection() as conn:
            conn.execute(sql.replace("?", "%s"), params)
        return
    store._cursor()  # the read barrier: journaled appends reach the tables first
    cur = store._con.cursor()
    try:
        cur.execute(sql, params)
    finally:
        cur.close()


def _replace_document(svc: Service, snapshot_id: str, data: bytes) -> None:
    """Make `data` the stored document of a snapshot, as if the disk (or the database)
    held those bytes; on DuckDB the recorded checksum follows, so only the content is
    wrong."""
    if hasattr(svc.running.store, "_pool"):
        _execute(svc, "UPDATE snapshots SET document = ? WHERE id = ?", [data, snapshot_id])
        return
    [(path,)] = db_rows(svc.running.store, f"SELECT path FROM snapshots WHERE id = '{snapshot_id}'")
    (svc.data_dir / path).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    _execute(svc, "UPDATE snapshots SET sha256 = ? WHERE id = ?", [digest, snapshot_id])


def _document_files(data_dir: Path) -> list[str]:
    root = data_dir / "snapshots"
    return sorted(p.relative_to(data_dir).as_posix() for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------- save


def test_a_snapshot_holds_the_window_of_every_thread_and_saving_clears_nothing(
    svc: Service, clock: ManualClock
) -> None:
    c = svc.client
    c.append("a1", "before the clear", thread="t1")
    _clear(c, "t1")
    c.append("a1", "q1", thread="t1", source_time=ts(clock.now_us() - 5 * SECOND))
    _tool_turn(c, "t1")
    c.append("a1", "other thread", thread="t2")
    c.append("a1", "other scope", thread="t1", scope="k1")
    windows = {t: c.window("a1", t) for t in ("t1", "t2")}
    snap = _save(c, description="before the refactor")
    assert snap.message_count == 6 and list(snap.threads) == ["t1", "t2"]
    assert snap.description == "before the refactor" and snap.thread == ""
    assert re.fullmatch(r"[0-9a-f]{16}", snap.id)
    full = _get(c, snap.id)
    saved = [*windows["t1"], *windows["t2"]]
    assert [(m.id, m.thread, m.role, m.content) for m in full.messages] == [
        (m.id, m.thread, m.role, m.content) for m in saved
    ]
    assert [(m.tool_calls, m.tool_call_id, m.create_time, m.sequence) for m in full.messages] == [
        (m.tool_calls, m.tool_call_id, m.create_time, m.sequence) for m in saved
    ]
    assert full.messages[0].source_time == windows["t1"][0].source_time
    assert snap.window_start_time.ToMicroseconds() == min(
        m.create_time.ToMicroseconds() for m in saved
    )
    assert snap.window_end_time.ToMicroseconds() == max(
        m.create_time.ToMicroseconds() for m in saved
    )
    assert snap.size_bytes == sum(len(m.content) + len(m.tool_calls) for m in saved)
    # Saving changes nothing in the window.
    assert {t: c.window("a1", t) for t in ("t1", "t2")} == windows


def test_a_snapshot_of_one_thread(svc: Service) -> None:
    c = svc.client
    c.append("a1", "one", thread="t1")
    c.append("a1", "two", thread="t2")
    snap = _save(c, thread="t2")
    assert snap.thread == "t2" and list(snap.threads) == ["t2"]
    assert [m.content for m in _get(c, snap.id).messages] == ["two"]
    code, reason, _, _ = _failure(lambda: _save(c, thread="t9"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "THREAD_NOT_FOUND")


def test_a_snapshot_keeps_the_agents_settings_and_the_specifics_ledger(svc: Service) -> None:
    c = svc.client
    c.stub.CreateAgent(
        pb.CreateAgentRequest(
            agent=pb.Agent(
                name="a1",
                system_prompt="Be terse.",
                model="gpt-4o",
                docs=[pb.AgentDoc(name="style.md", content="Use metric units.")],
                rolling_window=duration_pb2.Duration(seconds=7200),
            )
        )
    )
    c.append("a1", "deploy failed: see /var/log/app.log and run `make deploy`")
    snap = _save(c)
    c.stub.UpdateAgent(pb.UpdateAgentRequest(agent=pb.Agent(name="a1", system_prompt="Changed.")))
    full = _get(c, snap.id)
    assert full.agent.name == "a1" and full.agent.system_prompt == "Be terse."
    assert full.agent.model == "gpt-4o" and full.agent.rolling_window.seconds == 7200
    assert [(d.name, d.content) for d in full.agent.docs] == [("style.md", "Use metric units.")]
    assert "/var/log/app.log" in full.specifics and "make deploy" in full.specifics


def test_a_snapshot_keeps_the_ledger_entries_a_build_held_out(
    svc: Service, clock: ManualClock
) -> None:
    """A summary whose ledger could not show every entry keeps the rest in its metadata;
    once the summarized messages have left the rolling window, the snapshot's specifics
    still list every one of them."""
    c = svc.client
    c.stub.CreateAgent(
        pb.CreateAgentRequest(
            agent=pb.Agent(name="a1", rolling_window=duration_pb2.Duration(seconds=3600))
        )
    )
    paths = [f"src/sched/lease_{i:03d}.py" for i in range(80)]  # a snapshot lists 80
    for i, path in enumerate(paths):
        c.append("a1", f"step {i}: edited {path}", role=USER if i % 2 == 0 else ASSISTANT)
    clock.advance(1_800 * SECOND)
    c.stub.BuildContext(
        pb.BuildContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(summarize=True, budget_tokens=700)
        )
    )
    [summary] = [m for m in c.window("a1") if m.is_summary]
    shown = [p for p in paths if p in summary.content]
    assert 0 < len(shown) < len(paths) and "ledger_held" in summary.metadata
    clock.advance(1_800 * SECOND + 1)  # the appended messages leave the window, not it
    assert [m.is_summary for m in c.window("a1")] == [True]
    full = _get(c, _save(c).id)
    summarized = paths[summary.first_summarized_id - 1 : summary.last_summarized_id]
    assert len(summarized) > len(shown)
    assert not full.messages and set(summarized) <= set(full.specifics)


def test_stored_summaries_are_not_captured(svc: Service) -> None:
    c = svc.client
    for i in range(30):
        c.append("a1", f"turn {i} " + "w " * 100, role=USER if i % 2 == 0 else ASSISTANT)
    c.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=1)
        )
    )
    assert any(m.is_summary for m in c.window("a1"))
    full = _get(c, _save(c).id)
    assert len(full.messages) == 30 and not any(m.is_summary for m in full.messages)


def test_the_basic_view_has_no_contents(svc: Service) -> None:
    c = svc.client
    c.append("a1", "hello")
    snap = _save(c)
    basic = _get(c, snap.id, full=False)
    assert basic.snapshot == snap
    assert not basic.messages and not basic.HasField("agent") and not basic.specifics


# ----------------------------------------------------------------- the summary


def test_the_summary_comes_from_the_summary_model(svc: Service, fake: FakeAnthropic) -> None:
    c = svc.client
    c.append("a1", "please write the parser")
    c.append("a1", "done, using PEG", role=ASSISTANT)
    fake.reply_text("We wrote the parser. We chose PEG.\nTests are still missing.")
    snap = _save(c)
    assert snap.summary == "We wrote the parser. We chose PEG. Tests are still missing."
    [request] = fake.requests
    assert "2 to 4" in request.body["system"]
    prompt = request.body["messages"][0]["content"]
    assert "please write the parser" in prompt and "done, using PEG" in prompt
    assert _list(c).snapshots[0].summary == snap.summary


def test_a_failed_summary_still_saves_the_snapshot(svc: Service, fake: FakeAnthropic) -> None:
    c = svc.client
    c.append("a1", "hello")
    fake.reply_error(500)
    snap = _save(c)
    assert snap.summary == FAILED and snap.message_count == 1
    assert [s.id for s in _list(c).snapshots] == [snap.id]
    fake.reply_raw(b"not json at all", status=200, content_type="application/json")
    assert _save(c).summary == FAILED


def test_a_summary_that_times_out_still_saves_the_snapshot(
    start: Start, fake: FakeAnthropic
) -> None:
    c = start(summary_timeout_seconds=0.3).client
    c.append("a1", "hello")
    fake.reply_slow(5.0)
    snap = _save(c)
    assert snap.summary == FAILED and len(fake.requests) == 1
    assert [m.content for m in _get(c, snap.id).messages] == ["hello"]


def test_without_an_api_key_the_summary_fails_and_nothing_is_asked(
    svc: Service, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    svc.client.append("a1", "hello")
    assert _save(svc.client).summary == FAILED
    assert fake.requests == []


def test_a_snapshot_of_an_empty_window_asks_for_no_summary(
    svc: Service, fake: FakeAnthropic
) -> None:
    c = svc.client
    c.append("a1", "soon cleared")
    _clear(c)
    snap = _save(c)
    assert snap.message_count == 0 and snap.summary == "" and not snap.threads
    assert not snap.HasField("window_start_time") and not snap.HasField("window_end_time")
    assert fake.requests == []


# ----------------------------------------------------------------- list, get, delete


def test_snapshots_are_listed_newest_first_and_paged(svc: Service, clock: ManualClock) -> None:
    c = svc.client
    c.append("a1", "hello")
    ids = []
    for i in range(5):
        ids.append(_save(c, description=f"s{i}").id)
        clock.advance(SECOND)
    first = _list(c, page_size=2)
    second = _list(c, page_size=2, page_token=first.next_page_token)
    third = _list(c, page_size=2, page_token=second.next_page_token)
    pages = [first, second, third]
    assert [[s.id for s in p.snapshots] for p in pages] == [ids[4:2:-1], ids[2:0:-1], ids[:1]]
    assert third.next_page_token == ""
    assert [s.description for s in first.snapshots] == ["s4", "s3"]
    times = [s.create_time.ToMicroseconds() for p in pages for s in p.snapshots]
    assert times == sorted(times, reverse=True)
    code, reason, _, _ = _failure(
        lambda: _list(c, scope="k1", page_size=2, page_token=first.next_page_token)
    )
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_TOKEN")
    code, reason, _, _ = _failure(lambda: _list(c, page_token=first.next_page_token[:-4] + "AAAA"))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_TOKEN")


def test_a_deleted_snapshot_is_gone_and_a_retried_delete_answers_the_same(svc: Service) -> None:
    c = svc.client
    c.append("a1", "hello")
    keep, gone = _save(c), _save(c)
    first = _delete(c, gone.id, request_id="d-1")
    assert first.snapshot == gone
    assert _delete(c, gone.id, request_id="d-1") == first
    for call in (
        lambda: _get(c, gone.id),
        lambda: _delete(c, gone.id),
        lambda: _restore(c, gone.id),
    ):
        code, reason, _, _ = _failure(call)
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "SNAPSHOT_NOT_FOUND")
    assert [s.id for s in _list(c).snapshots] == [keep.id]
    # The messages stay.
    assert c.contents(c.window("a1")) == ["hello"]


def test_a_retried_save_saves_once(svc: Service, fake: FakeAnthropic) -> None:
    c = svc.client
    c.append("a1", "hello")
    first = _save(c, description="d", request_id="s-1")
    assert _save(c, description="d", request_id="s-1") == first
    assert [s.id for s in _list(c).snapshots] == [first.id] and len(fake.requests) == 1
    code, reason, _, _ = _failure(lambda: _save(c, description="other", request_id="s-1"))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")


def test_bad_snapshot_requests(svc: Service) -> None:
    c = svc.client
    c.append("a1", "hello")
    snap = _save(c)
    cases: list[tuple[Callable[[], Any], grpc.StatusCode, str, str]] = [
        (lambda: _save(c, agent=""), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "agent"),
        (
            lambda: _save(c, description="x" * 1001),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "description",
        ),
        (lambda: _get(c, "not an id!"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "id"),
        (lambda: _get(c, ""), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "id"),
        (
            lambda: c.stub.GetSnapshot(pb.GetSnapshotRequest(agent="a1", id=snap.id, view=7)),  # type: ignore[arg-type]
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "view",
        ),
        (
            lambda: _restore(c, snap.id, branch_thread="bad name!"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "branch_thread",
        ),
        (lambda: _save(c, agent="nobody"), grpc.StatusCode.NOT_FOUND, "AGENT_NOT_FOUND", ""),
        (lambda: _list(c, agent="nobody"), grpc.StatusCode.NOT_FOUND, "AGENT_NOT_FOUND", ""),
        (
            lambda: _get(c, snap.id, agent="nobody"),
            grpc.StatusCode.NOT_FOUND,
            "AGENT_NOT_FOUND",
            "",
        ),
        (lambda: _get(c, "0123456789abcdef"), grpc.StatusCode.NOT_FOUND, "SNAPSHOT_NOT_FOUND", ""),
        (
            lambda: _restore(c, "0123456789abcdef"),
            grpc.StatusCode.NOT_FOUND,
            "SNAPSHOT_NOT_FOUND",
            "",
        ),
    ]
    for call, code, reason, field in cases:
        assert _failure(call)[:3] == (code, reason, field)


# ----------------------------------------------------------------- restore


def test_a_restore_brings_the_messages_back_into_the_window(
    svc: Service, clock: ManualClock
) -> None:
    c = svc.client
    c.append("a1", "q1", source_time=ts(clock.now_us() - 3_600 * SECOND))
    c.append("a1", "answer", role=ASSISTANT)
    originals = c.window("a1")
    snap = _save(c)
    _clear(c)
    clock.advance(SECOND)
    now = clock.now_us()
    agent = c.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent
    response = _restore(c, snap.id)
    assert c.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent == agent
    window = c.window("a1")
    assert response.restored_count == 2 and list(response.threads) == ["t1"]
    assert [r.id for r in response.receipts] == [m.id for m in window]
    assert [(m.role, m.content) for m in window] == [(m.role, m.content) for m in originals]
    assert all(m.restored_from_snapshot == snap.id for m in window)
    assert {m.create_time.ToMicroseconds() for m in window} == {
        response.receipts[0].create_time.ToMicroseconds()
    }
    assert response.receipts[0].create_time.ToMicroseconds() > now
    assert not any(m.HasField("source_time") for m in window)
    assert [m.sequence for m in window] == [3, 4]
    assert not {m.id for m in window} & {m.id for m in originals}
    # The originals stay in the history, unmarked.
    history = c.history("a1")
    assert [m.restored_from_snapshot for m in history] == ["", "", snap.id, snap.id]


def test_a_restore_of_several_threads_goes_back_to_each(svc: Service) -> None:
    c = svc.client
    c.append("a1", "one", "two", thread="t1")
    c.append("a1", "three", thread="t2")
    snap = _save(c)
    c.stub.ClearContext(pb.ClearContextRequest(agent="a1", all_scopes=True))
    response = _restore(c, snap.id)
    assert list(response.threads) == ["t1", "t2"] and response.restored_count == 3
    assert c.contents(c.window("a1", "t1")) == ["one", "two"]
    assert c.contents(c.window("a1", "t2")) == ["three"]


def test_a_restore_keeps_tool_pairs_whole(svc: Service) -> None:
    c = svc.client
    _tool_turn(c)
    snap = _save(c)
    # Restored next to the originals: the restored result ties to the restored call.
    _restore(c, snap.id)
    rows = db_rows(
        svc.running.store,
        "SELECT id, role, group_id FROM messages WHERE restored_from <> '' ORDER BY id",
    )
    call_row = next(r for r in rows if r[1] == TOOL_USE)
    result_row = next(r for r in rows if r[1] == TOOL_RESULT)
    assert call_row[2] == call_row[0] and result_row[2] == call_row[0]
    # Restored after a clear, the pair is whole in a built context: nothing orphaned.
    _clear(c)
    _restore(c, snap.id)
    built = c.stub.BuildContext(
        pb.BuildContextRequest(agent="a1", thread="t1", formats=[pb.CONTEXT_FORMAT_ANTHROPIC])
    )
    assert [m.role for m in built.messages] == [USER, TOOL_USE, TOOL_RESULT, ASSISTANT]
    assert not built.stats.orphaned_ids and not built.stats.dropped_ids
    turns = json.loads(rendering(built, pb.CONTEXT_FORMAT_ANTHROPIC))["messages"]
    blocks = [b for t in turns if isinstance(t["content"], list) for b in t["content"]]
    assert {b["type"] for b in blocks} >= {"tool_use", "tool_result"}


def test_a_retried_restore_restores_once(svc: Service) -> None:
    c = svc.client
    c.append("a1", "one", "two")
    snap = _save(c)
    first = _restore(c, snap.id, request_id="r-1")
    assert _restore(c, snap.id, request_id="r-1") == first
    with ThreadPoolExecutor(4) as pool:
        racing = list(pool.map(lambda _: _restore(c, snap.id, request_id="r-2"), range(4)))
    assert all(r == racing[0] for r in racing)
    assert c.contents(c.window("a1")) == ["one", "two"] * 3
    code, reason, field, _ = _failure(
        lambda: _restore(c, snap.id, branch_thread="b1", request_id="r-1")
    )
    assert (code, reason, field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        "request_id",
    )


def test_a_restore_into_a_new_thread_leaves_the_saved_thread_untouched(svc: Service) -> None:
    c = svc.client
    c.append("a1", "one", "two")
    snap = _save(c)
    c.append("a1", "three")
    before = c.window("a1")
    response = _restore(c, snap.id, branch_thread="t1-branch")
    assert list(response.threads) == ["t1-branch"]
    assert c.window("a1") == before
    branch = c.window("a1", "t1-branch")
    assert c.contents(branch) == ["one", "two"]
    assert [m.sequence for m in branch] == [1, 2]
    assert all(m.restored_from_snapshot == snap.id for m in branch)
    code, reason, field, _ = _failure(lambda: _restore(c, snap.id, branch_thread="t1-branch"))
    assert (code, reason, field) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "THREAD_EXISTS",
        "branch_thread",
    )
    c.append("a1", "elsewhere", thread="t2")
    both = _save(c)
    code, reason, field, _ = _failure(lambda: _restore(c, both.id, branch_thread="new"))
    assert (code, reason, field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "branch_thread",
    )


def test_a_later_snapshot_tells_restored_messages_apart(svc: Service) -> None:
    c = svc.client
    c.append("a1", "old")
    first = _save(c)
    c.append("a1", "new")
    _restore(c, first.id)
    full = _get(c, _save(c).id)
    assert [(m.content, m.restored_from_snapshot) for m in full.messages] == [
        ("old", ""),
        ("new", ""),
        ("old", first.id),
    ]


# ----------------------------------------------------------------- scopes


def test_a_snapshot_of_one_scope_is_invisible_from_another(svc: Service) -> None:
    c = svc.client
    c.append("a1", "in k1", scope="k1")
    c.append("a1", "in the default scope")
    c.append("a2", "another agent", scope="k1")
    snap = _save(c, scope="k1")
    assert snap.scope == pb.Scope(key="k1")
    assert [m.content for m in _get(c, snap.id, scope="k1").messages] == ["in k1"]
    for scope in ("", "dm:k1", "guild:g/channel:k1/user:u"):
        assert not _list(c, scope=scope).snapshots
        for call in (
            lambda scope=scope: _get(c, snap.id, scope=scope),
            lambda scope=scope: _delete(c, snap.id, scope=scope),
            lambda scope=scope: _restore(c, snap.id, scope=scope),
        ):
            code, reason, _, _ = _failure(call)
            assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "SNAPSHOT_NOT_FOUND")
    code, reason, _, _ = _failure(lambda: _get(c, snap.id, agent="a2", scope="k1"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "SNAPSHOT_NOT_FOUND")
    assert not _list(c, agent="a2", scope="k1").snapshots
    # Restored into its own scope only.
    _restore(c, snap.id, scope="k1")
    assert c.contents(c.window("a1", scope="k1")) == ["in k1", "in k1"]
    assert c.contents(c.window("a1")) == ["in the default scope"]


# ----------------------------------------------------------------- limits


def test_saves_over_the_limits_are_resource_exhausted(svc: Service, start: Start) -> None:
    svc.stop()
    limited = start(snapshot_max_messages=3, snapshot_max_bytes=1_000)
    c = limited.client
    c.append("a1", "m1", "m2", "m3", thread="t1")
    c.append("a1", "m4", thread="t2")
    code, reason, _, message = _failure(lambda: _save(c))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "SNAPSHOT_TOO_LARGE")
    assert "3" in message and "snapshot_max_messages" in message
    assert _save(c, thread="t1").message_count == 3
    c.append("a1", "y" * 1_001, thread="t3")
    code, reason, _, message = _failure(lambda: _save(c, thread="t3"))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "SNAPSHOT_TOO_LARGE")
    assert "1,000" in message and "snapshot_max_bytes" in message
    assert len(_list(c).snapshots) == 1


# ----------------------------------------------------------------- consistency


def test_a_save_under_concurrent_appends_holds_a_prefix_of_each_thread(svc: Service) -> None:
    """Writers append batches of 3 to three threads while snapshots are saved: each
    snapshot holds, of every thread, messages 1..k with k a multiple of 3 (whole
    batches, no gaps), and they are the thread's own first k messages."""
    c = svc.client
    c.append("a1", "start", thread="t0")
    threads = ("t1", "t2", "t3")
    stop = threading.Event()
    progress = {t: threading.Semaphore(0) for t in threads}

    def write(thread: str) -> None:
        for i in range(200):
            if stop.is_set():
                return
            c.stub.AppendMessages(
                pb.AppendMessagesRequest(
                    agent="a1",
                    thread=thread,
                    messages=[pb.Message(role=USER, content=f"{thread}-{i}-{k}") for k in range(3)],
                )
            )
            progress[thread].release()

    writers = [threading.Thread(target=write, args=(t,)) for t in threads]
    for w in writers:
        w.start()
    snapshots = []
    try:
        for _ in range(5):
            for t in threads:  # every writer moved on since the last save
                assert progress[t].acquire(timeout=30)
            snapshots.append(_get(c, _save(c).id))
    finally:
        stop.set()
        for w in writers:
            w.join()
    for full in snapshots:
        for t in threads:
            mine = [m for m in full.messages if m.thread == t]
            assert len(mine) % 3 == 0
            assert [m.sequence for m in mine] == list(range(1, len(mine) + 1))
            history = c.history("a1", thread=t)[: len(mine)]
            assert [m.id for m in mine] == [m.id for m in history]
    counts = [sum(1 for m in s.messages if m.thread != "t0") for s in snapshots]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_snapshots_outlive_a_restart(svc: Service, start: Start) -> None:
    c = svc.client
    _tool_turn(c)
    kept, deleted = _save(c), _save(c)
    _delete(c, deleted.id)
    before = _get(c, kept.id)
    svc.stop()
    again = start().client
    assert [s.id for s in _list(again).snapshots] == [kept.id]
    assert _get(again, kept.id) == before
    _restore(again, kept.id)
    assert len(again.window("a1")) == 8


@pytest.mark.duckdb_only
def test_documents_are_files_that_agree_with_the_database(svc: Service, start: Start) -> None:
    c = svc.client
    c.append("team/bot", "see /srv/app.py")
    first, second = _save(c, agent="team/bot"), _save(c, agent="team/bot")
    paths = [r[0] for r in db_rows(svc.running.store, "SELECT path FROM snapshots ORDER BY path")]
    assert _document_files(svc.data_dir) == paths
    pattern = r"snapshots/team%2Fbot/\d{8}T\d{6}\.\d{6}Z_([0-9a-f]{16})\.json"
    assert sorted(re.fullmatch(pattern, p).group(1) for p in paths) == sorted(  # type: ignore[union-attr]
        [first.id, second.id]
    )
    document = json.loads((svc.data_dir / paths[0]).read_text())
    saved = first if first.id in paths[0] else second
    assert document["id"] == saved.id and document["summary"] == saved.summary
    assert document["message_count"] == 1 and document["messages"][0]["role"] == "user"
    assert document["messages"][0]["content"] == "see /srv/app.py"
    assert "/srv/app.py" in document["specifics"]
    assert document["agent_settings"]["name"] == "team/bot"
    _delete(c, first.id, agent="team/bot")
    assert _document_files(svc.data_dir) == [
        r[0] for r in db_rows(svc.running.store, "SELECT path FROM snapshots")
    ]
    assert len(_document_files(svc.data_dir)) == 1
    svc.stop()
    # What a crash between the two steps of a save or delete leaves is removed at start.
    stray = svc.data_dir / "snapshots" / "team%2Fbot"
    (stray / "20250101T000000.000000Z_00000000deadbeef.json").write_text("{}")
    (stray / ".20250101T000000.000000Z_00000000cafebabe.json.tmp").write_text("{")
    restarted = start()
    assert _document_files(restarted.data_dir) == [
        r[0] for r in db_rows(restarted.running.store, "SELECT path FROM snapshots")
    ]
    assert [s.id for s in _list(restarted.client, agent="team/bot").snapshots] == [second.id]


@pytest.mark.duckdb_only
def test_a_missing_document_is_data_loss(svc: Service, start: Start) -> None:
    c = svc.client
    c.append("a1", "hello")
    snap = _save(c)
    [(path,)] = db_rows(svc.running.store, "SELECT path FROM snapshots")
    (svc.data_dir / path).unlink()
    for call in (lambda: _get(c, snap.id), lambda: _restore(c, snap.id)):
        code, reason, _, message = _failure(call)
        assert (code, reason) == (grpc.StatusCode.DATA_LOSS, "SNAPSHOT_UNREADABLE")
        assert snap.id in message and "missing" in message
    assert _get(c, snap.id, full=False).snapshot == snap
    svc.stop()
    again = start().client  # starts all the same
    assert _failure(lambda: _get(again, snap.id))[0] == grpc.StatusCode.DATA_LOSS
    assert c.contents(again.window("a1")) == ["hello"]


@pytest.mark.duckdb_only
def test_a_document_changed_on_disk_is_data_loss(svc: Service) -> None:
    c = svc.client
    c.append("a1", "hello")
    snap = _save(c)
    [(path,)] = db_rows(svc.running.store, "SELECT path FROM snapshots")
    file = svc.data_dir / path
    file.write_bytes(file.read_bytes().replace(b"hello", b"HELLO"))
    code, reason, _, message = _failure(lambda: _get(c, snap.id))
    assert (code, reason) == (grpc.StatusCode.DATA_LOSS, "SNAPSHOT_UNREADABLE")
    assert "checksum" in message


def test_a_corrupt_document_is_data_loss_and_restores_nothing(svc: Service) -> None:
    c = svc.client
    c.append("a1", "hello")
    snap, other = _save(c), _save(c)
    for damage, words in (
        (b'{"format": "contextd.snapshot/1", "id": ', "corrupt"),
        (b"\xff\xfe not utf-8", "corrupt"),
        (b'{"format": "something else"}', "corrupt"),
    ):
        _replace_document(svc, snap.id, damage)
        for call in (lambda: _get(c, snap.id), lambda: _restore(c, snap.id)):
            code, reason, _, message = _failure(call)
            assert (code, reason) == (grpc.StatusCode.DATA_LOSS, "SNAPSHOT_UNREADABLE")
            assert snap.id in message and words in message
    # A well-formed document holding a value its field cannot carry is corrupt too.
    edited = _document_of(svc, other.id)
    edited["id"] = snap.id
    edited["agent_settings"]["build_options"] = {"truncate": "yes"}
    _replace_document(svc, snap.id, json.dumps(edited).encode())
    code, reason, _, message = _failure(lambda: _get(c, snap.id))
    assert (code, reason) == (grpc.StatusCode.DATA_LOSS, "SNAPSHOT_UNREADABLE")
    assert "corrupt" in message
    edited["agent_settings"]["build_options"] = {}
    edited["messages"][0]["id"] = 1 << 64
    _replace_document(svc, snap.id, json.dumps(edited).encode())
    assert _failure(lambda: _get(c, snap.id))[:2] == (
        grpc.StatusCode.DATA_LOSS,
        "SNAPSHOT_UNREADABLE",
    )
    # Another snapshot's (valid) document in its place is caught too.
    _replace_document(svc, snap.id, json.dumps(_document_of(svc, other.id)).encode())
    code, _, _, message = _failure(lambda: _get(c, snap.id))
    assert code == grpc.StatusCode.DATA_LOSS and "another snapshot" in message
    assert _get(c, snap.id, full=False).snapshot == snap
    assert c.contents(c.history("a1")) == ["hello"]


def _document_of(svc: Service, snapshot_id: str) -> Any:
    if hasattr(svc.running.store, "_pool"):
        [(raw,)] = db_rows(
            svc.running.store, f"SELECT document FROM snapshots WHERE id = '{snapshot_id}'"
        )
        return json.loads(bytes(raw))
    [(path,)] = db_rows(svc.running.store, f"SELECT path FROM snapshots WHERE id = '{snapshot_id}'")
    return json.loads((svc.data_dir / path).read_bytes())


def test_a_save_racing_the_agents_deletion_stores_nothing(
    svc: Service, fake: FakeAnthropic
) -> None:
    """The agent is deleted while the save waits for its summary: the save ends
    NOT_FOUND and leaves no snapshot (nor a document) behind."""
    c = svc.client
    c.append("a1", "hello")
    fake.hold()
    with ThreadPoolExecutor(1) as pool:
        saving = pool.submit(_failure, lambda: _save(c))
        assert fake.arrived.wait(30)
        c.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
        fake.release()
        code, reason, _, _ = saving.result(timeout=30)
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "AGENT_NOT_FOUND")
    assert not db_rows(svc.running.store, "SELECT id FROM snapshots")
    if not hasattr(svc.running.store, "_pool"):
        assert _document_files(svc.data_dir) == []
    c.append("a1", "a new agent of the same name")
    assert not _list(c).snapshots


def test_deleting_the_agent_deletes_its_snapshots(svc: Service) -> None:
    c = svc.client
    c.append("a1", "hello")
    snap = _save(c)
    c.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    assert not db_rows(svc.running.store, "SELECT id FROM snapshots")
    if not hasattr(svc.running.store, "_pool"):
        assert _document_files(svc.data_dir) == []
    c.append("a1", "a new agent of the same name")
    assert not _list(c).snapshots
    code, reason, _, _ = _failure(lambda: _get(c, snap.id))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "SNAPSHOT_NOT_FOUND")
