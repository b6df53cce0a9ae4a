"""Retries with a request_id write once and return the first call's response."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import grpc
import pytest
from fake_anthropic import FakeAnthropic, full_checkpoint
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import ASSISTANT, USER, Client, InProcessServer, SpawnServer, connect
from contextd.adapters.duckdb import base as duckdb_base
from contextd.adapters.duckdb import schema as duckdb_schema
from contextd.adapters.duckdb import store as storage
from contextd.adapters.duckdb import writer as duckdb_writer
from contextd.adapters.postgres import store as postgres_store
from contextd.api.server import create_server
from contextd.config import Settings
from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock
from contextd.domain.idempotency import (
    CLEANUP_BACKLOG_EVERY_US,
    CLEANUP_EVERY_US,
    RETENTION_US,
    Remembered,
    RequestRecord,
    record_key,
)
from contextd.domain.model import DEFAULT_TENANT, AgentSettings, ContextKey, NewMessage, Role
from contextd.v1 import context_service_pb2 as pb


def _append_request(request_id: str, *texts: str) -> pb.AppendMessagesRequest:
    return pb.AppendMessagesRequest(
        agent="a1",
        thread="t1",
        request_id=request_id,
        create_agent_if_missing=True,
        messages=[pb.Message(role=USER, content=t) for t in texts],
    )


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


def test_a_retried_append_stores_once_and_returns_the_same_receipts(client: Client) -> None:
    first = client.stub.AppendMessages(_append_request("r-1", "hello", "world"))
    again = client.stub.AppendMessages(_append_request("r-1", "hello", "world"))
    assert again == first
    assert client.contents(client.history("a1")) == ["hello", "world"]
    # Without a request id, every call appends.
    client.stub.AppendMessages(_append_request("", "x"))
    client.stub.AppendMessages(_append_request("", "x"))
    assert client.contents(client.history("a1")) == ["hello", "world", "x", "x"]


def test_a_request_id_reused_for_another_request_is_invalid_argument(client: Client) -> None:
    client.stub.AppendMessages(_append_request("r-1", "hello"))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AppendMessages(_append_request("r-1", "something else"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _reason(info.value) == "REQUEST_ID_REUSED"
    with pytest.raises(grpc.RpcError) as info:  # another method, same id
        client.stub.ClearContext(pb.ClearContextRequest(agent="a1", request_id="r-1"))
    assert _reason(info.value) == "REQUEST_ID_REUSED"
    assert client.contents(client.history("a1")) == ["hello"]


@pytest.mark.parametrize("request_id", ["x" * 129, "é", "tab\there", "new\nline", "nul\0"])
def test_malformed_request_ids_are_invalid_argument(client: Client, request_id: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AppendMessages(_append_request(request_id, "hello"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in (info.value.details() or "")
    assert client.stub.ListAgents(pb.ListAgentsRequest()).agents == []


@pytest.mark.parametrize(
    "request_id", ["x" * 128, "a", "has space", " ~!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}"]
)
def test_request_ids_are_any_printable_ascii(client: Client, request_id: str) -> None:
    """The contract says 1 to 128 printable ASCII characters; a space is one of them."""
    first = client.stub.AppendMessages(_append_request(request_id, "hello"))
    assert client.stub.AppendMessages(_append_request(request_id, "hello")) == first
    assert client.contents(client.history("a1")) == ["hello"]


def test_the_reuse_error_names_the_first_method(client: Client) -> None:
    client.stub.AppendMessages(_append_request("r-1", "hello"))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ClearContext(pb.ClearContextRequest(agent="a1", request_id="r-1"))
    assert "different AppendMessages request" in (info.value.details() or "")


def _eight_at_once(client: Client, request: pb.AppendMessagesRequest) -> list[Any]:
    """The responses of eight attempts of `request` sent at one moment."""
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        results.append(client.stub.AppendMessages(request))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_concurrent_duplicates_write_once(client: Client) -> None:
    results = _eight_at_once(client, _append_request("same", "once"))
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert client.contents(client.history("a1")) == ["once"]


def test_concurrent_duplicates_on_an_existing_thread_write_once(client: Client) -> None:
    """As above, on a thread that exists (on PostgreSQL each attempt is then the
    one-statement append: the losers conflict on the record and replay it)."""
    client.stub.AppendMessages(_append_request("", "first"))
    results = _eight_at_once(client, _append_request("same", "once"))
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert [r.sequence for r in results[0].receipts] == [2]
    assert client.contents(client.history("a1")) == ["first", "once"]


def test_a_retried_append_after_its_agent_was_deleted_returns_the_first_receipts(
    client: Client,
) -> None:
    """A retry gets the first response though the agent is gone since (on PostgreSQL
    the append's own statement reads the record before it looks at the agent); a new
    request is NOT_FOUND."""
    client.stub.AppendMessages(_append_request("", "first"))
    request = _append_request("r-1", "hello")
    request.create_agent_if_missing = False
    first = client.stub.AppendMessages(request)
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    assert client.stub.AppendMessages(request) == first
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1", thread="t1", request_id="r-2", messages=request.messages
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_retry_after_a_restart_is_deduplicated(spawn_server: SpawnServer) -> None:
    server = spawn_server()
    client = server.start()
    first = client.stub.AppendMessages(_append_request("r-restart", "durable"))
    client.channel.close()
    server.kill9()  # acknowledged, then the process dies: the record must be durable
    client = spawn_server().start()
    again = client.stub.AppendMessages(_append_request("r-restart", "durable"))
    assert again == first
    assert client.contents(client.history("a1")) == ["durable"]


def test_every_write_returns_its_first_response(client: Client) -> None:
    create = pb.CreateAgentRequest(agent=pb.Agent(name="a1"), request_id="c")
    assert client.stub.CreateAgent(create) == client.stub.CreateAgent(create)
    client.append("a1", "m")
    update = pb.UpdateAgentRequest(agent=pb.Agent(name="a1", system_prompt="p"), request_id="u")
    assert client.stub.UpdateAgent(update) == client.stub.UpdateAgent(update)
    clear = pb.ClearContextRequest(agent="a1", request_id="cl")
    first_clear = client.stub.ClearContext(clear)
    client.append("a1", "after the clear")
    assert client.stub.ClearContext(clear) == first_clear  # the marker did not move
    assert client.contents(client.window("a1")) == ["after the clear"]
    entry = pb.StatusEntry(key="k", kind=pb.STATUS_KIND_THREAD, state="s", summary="x")
    status = pb.SetStatusRequest(agent="a1", entry=entry, request_id="s")
    assert client.stub.SetStatus(status) == client.stub.SetStatus(status)
    clear_status = pb.ClearStatusRequest(agent="a1", key="k", request_id="cs")
    assert client.stub.ClearStatus(clear_status).removed_count == 1
    assert client.stub.ClearStatus(clear_status).removed_count == 1  # not NOT_FOUND
    delete = pb.DeleteAgentRequest(name="a1", request_id="d")
    first_delete = client.stub.DeleteAgent(delete)
    assert first_delete.deleted_message_count == 2
    assert client.stub.DeleteAgent(delete) == first_delete  # not NOT_FOUND


def test_a_retried_compaction_stores_one_summary(client: Client) -> None:
    for i in range(30):
        client.append("a1", f"turn {i} " + "w " * 100)
    request = pb.CompactContextRequest(
        agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=1), request_id="k"
    )
    first = client.stub.CompactContext(request)
    again = client.stub.CompactContext(request)
    assert again.summary == first.summary and first.summary.is_summary
    summaries = [m for m in client.history("a1") if m.is_summary]
    assert [m.id for m in summaries] == [first.summary.id]


def test_records_are_kept_per_tenant(server: InProcessServer) -> None:
    """The same request id in two tenants is two requests: both write."""
    store = server.running.store

    def record(tenant: str) -> RequestRecord:
        return RequestRecord(tenant, "shared-id", "m", "f", lambda r: str(r[0].id).encode())

    for tenant in ("t-one", "t-two"):
        batch = prepare_batch([NewMessage(role=Role.USER, content=tenant)], "", [()])
        store.append(ContextKey(tenant, "a1", "", "t1"), batch, AgentSettings(), record(tenant))
    for tenant in ("t-one", "t-two"):
        found = store.remembered(tenant, "shared-id")
        assert found is not None
        [message] = store.messages_by_ids(ContextKey(tenant, "a1", "", "t1"), [int(found.payload)])
        assert message.content == tenant


def test_the_record_key_includes_the_tenant() -> None:
    assert record_key("t-one", "r") != record_key("t-two", "r")
    # A request id never holds a tab, so no (tenant, id) pair can pose as another.
    assert record_key("b", "a") != record_key("", "a\tb")
    assert RequestRecord("t-one", "r", "m", "f", bytes).key == record_key("t-one", "r")


def test_a_failed_call_records_nothing_and_its_retry_runs_again(client: Client) -> None:
    request = _append_request("r-missing", "hello")
    request.create_agent_if_missing = False
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AppendMessages(request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    first = client.stub.AppendMessages(request)
    assert client.stub.AppendMessages(request) == first
    assert client.contents(client.history("a1")) == ["hello"]


def test_a_retried_update_does_not_undo_a_later_update(client: Client) -> None:
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    first_update = pb.UpdateAgentRequest(
        agent=pb.Agent(name="a1", system_prompt="first"), request_id="u-1"
    )
    first = client.stub.UpdateAgent(first_update)
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(agent=pb.Agent(name="a1", system_prompt="second"), request_id="u-2")
    )
    assert client.stub.UpdateAgent(first_update) == first
    assert first.agent.system_prompt == "first"
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent
    assert agent.system_prompt == "second"


def test_a_retried_delete_spares_an_agent_created_since(client: Client) -> None:
    client.append("a1", "old")
    delete = pb.DeleteAgentRequest(name="a1", request_id="d-1")
    first = client.stub.DeleteAgent(delete)
    assert first.deleted_message_count == 1
    client.append("a1", "new")  # creates the agent again
    assert client.stub.DeleteAgent(delete) == first
    assert client.contents(client.history("a1")) == ["new"]


def test_a_retried_create_after_a_delete_returns_the_first_agent(client: Client) -> None:
    create = pb.CreateAgentRequest(agent=pb.Agent(name="a1"), request_id="c-1")
    first = client.stub.CreateAgent(create)
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    assert client.stub.CreateAgent(create) == first
    with pytest.raises(grpc.RpcError) as info:
        client.stub.GetAgent(pb.GetAgentRequest(name="a1"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------- compaction


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def llm_client(
    tmp_path: Path,
    fake: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    clock: ManualClock,
    store_url: str,
) -> Iterator[Client]:
    """A server whose summaries come from the fake Anthropic API, which counts them."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    settings = Settings(
        addr="127.0.0.1:0",
        data_dir=tmp_path / "data",
        store=store_url,
        anthropic_base_url=fake.base_url,
        summary_timeout_seconds=30.0,
    )
    running = create_server(settings, clock=clock)
    client = connect(f"127.0.0.1:{running.port}")
    yield client
    client.channel.close()
    running.stop(grace=1)


def _compact_request(request_id: str) -> pb.CompactContextRequest:
    return pb.CompactContextRequest(
        agent="a1",
        thread="t1",
        options=pb.BuildOptions(keep_recent_tokens=1),
        request_id=request_id,
    )


def _long_thread(client: Client) -> None:
    for i in range(30):
        client.append("a1", f"turn {i} " + "w " * 100, role=USER if i % 2 == 0 else ASSISTANT)


def test_a_retried_compaction_does_not_ask_the_summarizer_again(
    llm_client: Client, fake: FakeAnthropic
) -> None:
    _long_thread(llm_client)
    fake.reply_text(full_checkpoint("## Goal\nthe first summary"))
    first = llm_client.stub.CompactContext(_compact_request("k-1"))
    assert first.summarizer_path == "llm" and len(fake.requests) == 1
    fake.reply_text(full_checkpoint("## Goal\na second summary"))
    again = llm_client.stub.CompactContext(_compact_request("k-1"))
    assert again == first
    assert len(fake.requests) == 1
    summaries = [m for m in llm_client.history("a1") if m.is_summary]
    assert [m.id for m in summaries] == [first.summary.id]


def test_concurrent_compactions_with_one_request_id_store_one_summary(
    llm_client: Client, fake: FakeAnthropic
) -> None:
    """Both calls pass the check before the summarizer (neither is recorded yet) and both
    summarize; the check in the summary's transaction lets only one store it."""
    _long_thread(llm_client)
    fake.reply_text(full_checkpoint("## Goal\nthe summary"))
    fake.hold()
    results: list[pb.CompactContextResponse] = []

    def compact() -> None:
        results.append(llm_client.stub.CompactContext(_compact_request("k-2"), timeout=60))

    callers = [threading.Thread(target=compact) for _ in range(2)]
    for caller in callers:
        assert not fake.arrived.is_set()
        caller.start()
        assert fake.arrived.wait(30), "the compaction never asked for a summary"
        fake.arrived.clear()
    assert len(fake.requests) == 2  # both are at the summarizer now
    fake.release()
    for caller in callers:
        caller.join(60)
    assert len(results) == 2 and results[0] == results[1]
    summaries = [m for m in llm_client.history("a1") if m.is_summary]
    assert [m.id for m in summaries] == [results[0].summary.id]


# ---------------------------------------------------------------------- retention


SECOND = 1_000_000


def _remembered_ids(server: InProcessServer, ids: list[str]) -> list[str]:
    return [i for i in ids if server.running.store.remembered(DEFAULT_TENANT, i) is not None]


def test_records_are_kept_24_hours_then_removed(
    server: InProcessServer, clock: ManualClock
) -> None:
    client = server.client
    first = client.stub.AppendMessages(_append_request("r-old", "first"))
    clock.advance(RETENTION_US - 1_000_000)  # a second short of a day: still kept
    assert client.stub.AppendMessages(_append_request("r-old", "first")) == first
    assert _remembered_ids(server, ["r-old"]) == ["r-old"]
    clock.advance(CLEANUP_EVERY_US + 1_000_000)  # past a day, and a cleanup pass is due
    client.append("a1", "a write runs the due pass first")
    assert _remembered_ids(server, ["r-old"]) == []
    # Forgotten: the same request is a new write now.
    client.stub.AppendMessages(_append_request("r-old", "first"))
    assert client.contents(client.history("a1")) == [
        "first",
        "a write runs the due pass first",
        "first",
    ]


def test_a_cleanup_pass_removes_a_bounded_chunk_and_a_backlog_drains_sooner(
    server: InProcessServer, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(duckdb_writer, "CLEANUP_CHUNK", 3)
    monkeypatch.setattr(postgres_store, "CLEANUP_CHUNK", 3)
    client = server.client
    early = [f"r-{i}" for i in range(7)]
    for request_id in early:  # the first write ran a pass: the next is due in a minute
        client.stub.AppendMessages(_append_request(request_id, request_id))
    clock.advance(30 * SECOND)
    client.stub.AppendMessages(_append_request("r-late", "late"))
    clock.advance(RETENTION_US - 29 * SECOND)  # the early ones are a day and a second old
    left = []
    for _ in range(3):
        client.append("a1", "any write")  # runs a due pass before its own write
        left.append(len(_remembered_ids(server, early)))
        clock.advance(CLEANUP_BACKLOG_EVERY_US)  # a full chunk brings the next pass closer
    assert left == [4, 1, 0]
    # The last pass removed less than a chunk: the next one waits the full interval, so
    # r-late, past its day now, stays until then.
    clock.advance(30 * SECOND)
    client.append("a1", "any write")
    assert _remembered_ids(server, ["r-late"]) == ["r-late"]
    clock.advance(CLEANUP_EVERY_US)
    client.append("a1", "any write")
    assert _remembered_ids(server, ["r-late"]) == []


def test_records_of_schema_v6_survive_the_move_to_one_column_keys(tmp_path: Path) -> None:
    """A file at schema v6 kept records under (tenant, request_id); after the migration
    the same ids are found, so retries across the upgrade still deduplicate."""
    path = tmp_path / "db.duckdb"
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
        "applied_time_us BIGINT NOT NULL)"
    )
    for version, statements in duckdb_schema.MIGRATIONS[:6]:
        for statement in statements:
            con.execute(statement)
        con.execute("INSERT INTO schema_migrations VALUES (?, 0)", [version])
    con.execute("INSERT INTO request_log VALUES ('default', 'r 1', 'm', 'f', 'p'::BLOB, 5)")
    con.execute("INSERT INTO request_log VALUES ('other', 'r 1', 'm', 'g', 'q'::BLOB, 5)")
    con.close()
    store = storage.Store.open(path)
    try:
        assert store.schema_version() == duckdb_schema.MIGRATIONS[-1][0]
        assert store.remembered("default", "r 1") == Remembered("m", "f", b"p")
        assert store.remembered("other", "r 1") == Remembered("m", "g", b"q")
        assert store.remembered("default", "r 2") is None
    finally:
        store.close()


def test_a_record_is_found_through_the_index(tmp_path: Path) -> None:
    """Every write with a request id looks its id up, the appends on the one writer. By
    (tenant, request_id) DuckDB scanned the whole table (no index scan on a two-column
    key): milliseconds per write once a day of records piled up. By the one-column key
    the lookup reads only the rows it asks for."""
    store = storage.Store.open(tmp_path / "db.duckdb")
    try:
        loader = store._con.cursor()
        loader.execute(
            "INSERT INTO request_records SELECT 'r-' || i || chr(9) || 'default', 'default', "
            "'r-' || i, 'm', 'f', 'p'::BLOB, i FROM range(20000) t(i)"
        )
        profiled = store._con.cursor()
        profile = tmp_path / "profile.json"
        profiled.execute("SET enable_profiling = 'json'")
        profiled.execute(f"SET profiling_output = '{profile}'")
        keys = [record_key(DEFAULT_TENANT, f"r-{i}") for i in (5, 12_345, 19_999)]
        assert len(duckdb_base._remembered_keys(profiled, keys)) == 3
        scans = _table_scans(json.loads(profile.read_text()))
        assert [(s["extra_info"]["Type"], s["rows_scanned"]) for s in scans] == [("Index Scan", 3)]
    finally:
        store.close()


def _table_scans(node: dict[str, Any]) -> list[dict[str, Any]]:
    children = node.get("operator", []) + node.get("children", [])
    found = [c for c in children if c.get("type") == "TABLE_SCAN"]
    return found + [s for c in children for s in _table_scans(c)]


# ---------------------------------------------------------------------- shutdown


def test_writes_in_flight_at_shutdown_happen_once_when_retried(
    spawn_server: SpawnServer,
) -> None:
    """Writers append until SIGTERM stops the server: each call either was acknowledged
    or failed without its client knowing whether it committed. After a restart, retrying
    every one of them (same request_id) leaves each message stored exactly once, and an
    acknowledged call's retry returns its first receipts."""
    process = spawn_server()
    client = process.start()
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    acknowledged: dict[str, pb.AppendMessagesResponse] = {}
    attempted: list[str] = []
    lock = threading.Lock()
    enough = threading.Event()

    def write(worker: int) -> None:
        for i in range(100_000):
            request_id = f"w{worker}-{i}"
            with lock:
                attempted.append(request_id)
            try:
                response = client.stub.AppendMessages(
                    _append_request(request_id, request_id), timeout=30
                )
            except grpc.RpcError:
                return  # the server is stopping: this call's outcome is unknown
            with lock:
                acknowledged[request_id] = response
                if len(acknowledged) >= 40:
                    enough.set()

    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for writer in writers:
        writer.start()
    assert enough.wait(60), "the writers never got going"
    assert process.signal(signal.SIGTERM) == 0
    for writer in writers:
        writer.join(60)
    client.channel.close()
    assert 40 <= len(acknowledged) < len(attempted)

    client = spawn_server().start()
    for request_id in attempted:
        response = client.stub.AppendMessages(_append_request(request_id, request_id))
        if request_id in acknowledged:
            assert response == acknowledged[request_id]
    assert sorted(client.contents(client.history("a1"))) == sorted(attempted)
