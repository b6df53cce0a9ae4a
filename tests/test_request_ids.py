"""Retries with a request_id write once and return the first call's response."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import USER, Client, InProcessServer, SpawnServer
from contextd.batches import prepare_batch
from contextd.domain import AgentSettings, ContextKey, NewMessage, Role
from contextd.idempotency import RequestRecord
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


@pytest.mark.parametrize("request_id", ["has space", "x" * 129, "é"])
def test_malformed_request_ids_are_invalid_argument(client: Client, request_id: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AppendMessages(_append_request(request_id, "hello"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in (info.value.details() or "")


def test_concurrent_duplicates_write_once(client: Client) -> None:
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        results.append(client.stub.AppendMessages(_append_request("same", "once")))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert client.contents(client.history("a1")) == ["once"]


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
