"""The AppendMessages request path keeps its answers while doing less per call.

The server composes its interceptors once per method (api/server.py `Interceptors`),
keeps checked context keys (domain/limits.py `context_key`) and fingerprints a request
without copying it (api/servicer.py `_fingerprint`); these tests hold each to what it
replaced, including the cases where something kept could go stale.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import InProcessServer
from contextd.api.servicer import _fingerprint
from contextd.domain.errors import InvalidArgument
from contextd.domain.limits import context_key
from contextd.v1 import context_service_pb2 as pb


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


def test_a_method_used_before_the_drain_is_refused_once_it_begins(
    server: InProcessServer,
) -> None:
    """The composed handler of AppendMessages is kept after its first call; once the
    server drains, the same method is answered UNAVAILABLE (SHUTTING_DOWN), not by the
    handler kept from before."""
    client = server.client
    for i in range(3):
        assert len(client.append("a1", f"m{i}").receipts) == 1
    assert server.running.admission.drain(0.0) == 0
    with pytest.raises(grpc.RpcError) as refused:
        client.append("a1", "too late")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _reason(refused.value) == "SHUTTING_DOWN"


def test_bad_input_after_good_calls_still_gets_its_status(server: InProcessServer) -> None:
    """Kept handlers and kept keys do not swallow errors: a bad thread name after many
    good appends is INVALID_ARGUMENT naming the field, and an empty batch is refused."""
    client = server.client
    for i in range(3):
        client.append("a1", f"m{i}", thread="good")
    with pytest.raises(grpc.RpcError) as bad:
        client.append("a1", "x", thread="-bad")
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "thread" in (bad.value.details() or "")
    with pytest.raises(grpc.RpcError) as empty:
        client.stub.AppendMessages(pb.AppendMessagesRequest(agent="a1", thread="good"))
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_kept_context_keys_are_the_keys_asked_for() -> None:
    """Every argument is part of what is kept: a key asked after another differing in
    one name only is that other key, and a bad name raises every time it is asked."""
    first = context_key("t1", "a", "", "x")
    assert context_key("t1", "a", "", "x") == first
    assert context_key("t2", "a", "", "x").tenant == "t2"
    assert context_key("t1", "b", "", "x").agent == "b"
    assert context_key("t1", "a", "s", "x").scope == "s"
    assert context_key("t1", "a", "", "y").thread == "y"
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            context_key("t1", "a", "", "")
        with pytest.raises(InvalidArgument):
            context_key("t1", "bad name", "", "x")


def test_the_fingerprint_is_the_copy_based_one_and_leaves_the_request_as_it_was() -> None:
    """Same bytes as the fingerprint of a copy with the id cleared (records stored by
    earlier versions still match), and the request keeps its id."""
    request = pb.AppendMessagesRequest(
        agent="a1",
        thread="t",
        request_id="req-1",
        messages=[pb.Message(role=pb.ROLE_USER, content="hello", metadata='{"k": 1}')],
    )
    before = request.SerializeToString(deterministic=True)
    copy = pb.AppendMessagesRequest()
    copy.CopyFrom(request)
    copy.request_id = ""
    expected = hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()
    assert _fingerprint(request) == expected
    assert request.request_id == "req-1"
    assert request.SerializeToString(deterministic=True) == before
    other = pb.AppendMessagesRequest()
    other.CopyFrom(request)
    other.request_id = "req-2"
    assert _fingerprint(other) == expected  # the id is not part of it


def test_a_request_id_call_answers_the_response_it_recorded(server: InProcessServer) -> None:
    """With a request id the response is built once, for the record and the answer: the
    first call's answer and a retry's (read from the record) are the same bytes, and a
    second request id gets its own receipts."""
    stub = server.client.stub

    def append(request_id: str, content: str) -> pb.AppendMessagesResponse:
        response: pb.AppendMessagesResponse = stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1",
                thread="t",
                request_id=request_id,
                messages=[pb.Message(role=pb.ROLE_USER, content=content)],
                create_agent_if_missing=True,
            )
        )
        return response

    first = append("req-1", "hello")
    assert len(first.receipts) == 1 and first.receipts[0].id > 0
    assert first.receipts[0].HasField("create_time")
    again = append("req-1", "hello")
    assert again.SerializeToString(deterministic=True) == first.SerializeToString(
        deterministic=True
    )
    other = append("req-2", "hello")
    assert other.receipts[0].id != first.receipts[0].id


def test_a_one_message_append_stores_the_row_a_batch_stores(tmp_path: Path) -> None:
    """A batch of one message outside tool groups takes the writer's one-row path
    (adapters/duckdb/messages.py `_append_one_row`); every column it stores must be what
    the general path stores for the same message in a larger batch: long content,
    client times, metadata, external ids and multi-byte text included."""
    from contextd.adapters.duckdb.schema import SHORT_CONTENT_BYTES
    from contextd.adapters.duckdb.store import Store
    from contextd.app.build.summarizer import ExtractiveSummarizer
    from contextd.app.service import ContextService
    from contextd.domain.clock import wall_clock_us
    from contextd.domain.model import NewMessage, Role

    now = wall_clock_us()
    messages = [
        NewMessage(role=Role.USER, content="plain"),
        NewMessage(role=Role.ASSISTANT, content="é→" * 50, metadata='{"k": 1}'),
        NewMessage(role=Role.USER, content="x" * (SHORT_CONTENT_BYTES + 1), external_id="e1"),
        NewMessage(role=Role.USER, content="ü" * SHORT_CONTENT_BYTES, source_time_us=now - 5),
        NewMessage(role=Role.ASSISTANT, content="", tool_calls='[{"id": "c1"}]'),
    ]
    store = Store.open(tmp_path / "rows.duckdb")
    service = ContextService(store, ExtractiveSummarizer())
    try:
        for m in messages:
            service.append_messages("default", "a1", "", "one", [m], create_agent=True)
        service.append_messages("default", "a1", "", "batch", messages)
        columns = (
            "role, content_short, content_long, tool_calls, tool_call_id, external_id, "
            "metadata, token_estimate, source_time_us, token_count, tokenizer, chars, "
            "group_id = -1, group_start IS NULL, tool_call_ids, is_summary, "
            "first_summarized_id, last_summarized_id, restored_from, sequence"
        )

        def rows(thread: str) -> list[tuple[object, ...]]:
            def read(cur: Any) -> list[tuple[object, ...]]:
                found: list[tuple[object, ...]] = cur.execute(
                    f"SELECT {columns} FROM messages WHERE thread = ? ORDER BY sequence",
                    [thread],
                ).fetchall()
                return found

            return store._write(read)  # on the writer: after the journal is applied

        one, batch = rows("one"), rows("batch")
        assert len(one) == len(messages)
        assert one == batch
        assert any(r[2] is not None for r in one)  # a long content was stored as such
    finally:
        store.close()
