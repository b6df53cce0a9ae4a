"""The error contract: every bad input is a clear status with details, never INTERNAL.

Each test reproduces a case that used to end as INTERNAL, a hang, or a status the client
could not read, over a real server on loopback.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import USER, Client, InProcessServer, connect
from contextd.adapters.duckdb.page_token_key import KEY_FILE
from contextd.api.errors import ErrorMappingInterceptor
from contextd.app.paging import PageToken, PageTokens
from contextd.domain.errors import InvalidArgument
from contextd.domain.validation import MAX_JSON_DEPTH
from contextd.v1 import context_service_pb2 as pb

SERVICE = Path(__file__).parent.parent / "service" / "contextd"


def _error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _details(error: grpc.RpcError) -> dict[str, Any]:
    """ErrorInfo reason and BadRequest fields of a status."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "the status carries no google.rpc.Status details"
    out: dict[str, Any] = {"fields": []}
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out["reason"], out["domain"] = info.reason, info.domain
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out["fields"] = [v.field for v in bad.field_violations]
    return out


def _append(client: Client, *messages: pb.Message) -> pb.AppendMessagesResponse:
    response: pb.AppendMessagesResponse = client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent="a1", thread="t1", messages=list(messages), create_agent_if_missing=True
        )
    )
    return response


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ----------------------------------------------------------------- JSON and text


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_is_invalid_argument(client: Client, depth: int) -> None:
    for field, message in (
        ("messages[0].metadata", pb.Message(role=USER, metadata='{"a":' + _nested(depth) + "}")),
        ("messages[0].tool_calls", pb.Message(role=USER, tool_calls=_nested(depth))),
    ):
        error = _error(lambda m=message: _append(client, m))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "levels deep" in (error.details() or "")
        assert _details(error)["fields"] == [field]


def test_json_at_the_depth_limit_is_accepted(client: Client) -> None:
    inner = _nested(MAX_JSON_DEPTH - 1)
    _append(client, pb.Message(role=USER, content="ok", metadata='{"a":' + inner + "}"))
    assert client.contents(client.window("a1")) == ["ok"]


def test_deep_openai_arguments_are_invalid_argument(client: Client) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": _nested(5_000)},
    }
    message = pb.Message(role=pb.ROLE_TOOL_USE, tool_calls=json.dumps([call]))
    error = _error(lambda: _append(client, message))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()


def test_lone_surrogate_in_tool_call_id_is_invalid_argument(client: Client) -> None:
    tool_calls = '[{"id": "call_\\ud800", "name": "grep", "input": {}}]'
    client.append("a1", "first")
    error = _error(
        lambda: _append(client, pb.Message(role=pb.ROLE_TOOL_USE, tool_calls=tool_calls))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unicode" in (error.details() or "")
    assert client.contents(client.history("a1")) == ["first"]


def test_valid_surrogate_pairs_are_accepted(client: Client) -> None:
    tool_calls = '[{"id": "call_\\ud83d\\ude42", "name": "grep", "input": {}}]'
    _append(client, pb.Message(role=pb.ROLE_TOOL_USE, tool_calls=tool_calls))
    assert len(client.history("a1")) == 1


def test_role_hint_uses_the_names_clients_type(client: Client) -> None:
    error = _error(lambda: _append(client, pb.Message(content="no role")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ROLE_USER" in (error.details() or "")
    assert _details(error)["fields"] == ["messages[0].role"]


# ----------------------------------------------------------------- long values


def test_long_values_are_quoted_by_prefix_only(client: Client) -> None:
    client.append("a1", "x")
    long_key = "k" * 8_000
    error = _error(lambda: client.stub.ClearStatus(pb.ClearStatusRequest(agent="a1", key=long_key)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert len(error.details() or "") < 300
    long_model = "m" * 20_000
    error = _error(
        lambda: client.stub.CreateAgent(
            pb.CreateAgentRequest(agent=pb.Agent(name="b1", model=long_model))
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "20,000 characters" in (error.details() or "")
    assert len(error.details() or "") < 2_000
    long_name = "n" * 8_000
    error = _error(lambda: client.stub.GetAgent(pb.GetAgentRequest(name=long_name)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(error.details() or "") < 300


# ----------------------------------------------------------------- undecodable bodies


def test_undecodable_body_is_invalid_argument(client: Client) -> None:
    raw = client.channel.unary_unary(
        "/contextd.v1.ContextService/AppendMessages",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    # Field 1 (agent, a string) declared 100 bytes long, followed by 3: it cannot parse.
    error = _error(lambda: raw(b"\x0a\x64abc"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert _details(error)["reason"] == "MALFORMED_REQUEST"
    # The server is fine afterwards.
    client.append("a1", "still serving")
    assert client.contents(client.window("a1")) == ["still serving"]


def test_a_batch_decoded_by_the_core_reports_its_first_bad_message(client: Client) -> None:
    """A batch long enough for the Rust decoding (api/convert.py) fails as a short one:
    INVALID_ARGUMENT naming the first bad message, and nothing of it is stored."""
    client.append("a1", "first")
    messages = [pb.Message(role=pb.ROLE_USER, content=f"m{i}") for i in range(1_000)]
    messages[700] = pb.Message(content="no role")
    messages[900] = pb.Message(role=pb.ROLE_USER, source_time=timestamp_pb2.Timestamp(nanos=-1))
    error = _error(lambda: _append(client, *messages))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ROLE_USER" in (error.details() or "")
    assert _details(error)["fields"] == ["messages[700].role"]
    assert client.contents(client.history("a1")) == ["first"]


def test_a_batch_with_unknown_fields_is_stored_as_protobuf_reads_it(client: Client) -> None:
    """Raw bytes from a newer client: unknown fields in the request and its messages, a
    field given twice (the last wins). Every message is stored as the runtime parsed it."""
    raw = client.channel.unary_unary(
        "/contextd.v1.ContextService/AppendMessages",
        request_serializer=lambda b: b,
        response_deserializer=pb.AppendMessagesResponse.FromString,
    )
    messages = [
        pb.Message(role=pb.ROLE_ASSISTANT, content="old").SerializeToString()
        + b"\xf8\x06\x07"  # field 111, a varint: unknown
        + pb.Message(content=f"m{i} ü", metadata="{}").SerializeToString()
        for i in range(64)
    ]
    body = (
        pb.AppendMessagesRequest(
            agent="a1", thread="t1", create_agent_if_missing=True
        ).SerializeToString()
        + b"\xfa\x06\x03abc"  # field 111, bytes: unknown
        + b"".join(b"\x22" + bytes([len(m)]) + m for m in messages)
    )
    response = raw(body)
    assert len(response.receipts) == 64
    stored = client.history("a1")
    assert [m.content for m in stored] == [f"m{i} ü" for i in range(64)]
    assert {(m.role, m.metadata) for m in stored} == {(pb.ROLE_ASSISTANT, "{}")}


def test_a_cut_batch_body_is_invalid_argument(client: Client) -> None:
    raw = client.channel.unary_unary(
        "/contextd.v1.ContextService/AppendMessages",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    body = pb.AppendMessagesRequest(
        agent="a1", messages=[pb.Message(role=pb.ROLE_USER, content="x" * 100)] * 1_000
    ).SerializeToString()
    error = _error(lambda: raw(body[:-50]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert _details(error)["reason"] == "MALFORMED_REQUEST"


# ----------------------------------------------------------------- page tokens


def test_page_tokens_are_signed(server: InProcessServer) -> None:
    client = server.client
    for i in range(3):
        client.append("a1", f"m{i}")
    first = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1))
    assert first.next_page_token
    # A token minted with any other key is refused, even when well-formed.
    other = PageTokens(b"\x00" * 32)
    foreign = other.encode(PageToken((0, 0)), ())
    error = _error(
        lambda: client.stub.ListMessages(
            pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1, page_token=foreign)
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(error)["reason"] == "INVALID_PAGE_TOKEN"
    # The key is the store's: a file of the data directory on the embedded engine (tokens
    # survive a restart), a row of the database on PostgreSQL (every replica honours them).
    key = server.running.store.page_token_key()
    assert len(key) == 32 and key == server.running.store.page_token_key()
    if (server.data_dir / KEY_FILE).exists():
        assert (server.data_dir / KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_signed_tokens_out_of_range_are_invalid_argument(server: InProcessServer) -> None:
    """Even a token signed with the server's own key is range-checked before any query."""
    client = server.client
    client.append("a1", "m0", "m1")
    first = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1))
    ours = PageTokens(server.running.store.page_token_key())
    import base64

    raw, _, _ = base64.urlsafe_b64decode(first.next_page_token).rpartition(b".")
    body = json.loads(raw)
    params_fingerprint = body["f"]
    for position in ([1 << 70, 1], [1, -(1 << 64)]):
        forged_body = json.dumps(
            {"p": position, "w": body["w"], "f": params_fingerprint}, separators=(",", ":")
        ).encode()
        forged = base64.urlsafe_b64encode(
            forged_body + b"." + ours._sign(forged_body).encode()
        ).decode()
        error = _error(
            lambda t=forged: client.stub.ListMessages(
                pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1, page_token=t)
            )
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()


def test_pages_stop_at_a_byte_cap(client: Client) -> None:
    big = "x" * 900_000
    for _ in range(6):
        client.append("a1", big)
    first = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1"))
    assert 0 < len(first.messages) < 6 and first.next_page_token
    assert first.ByteSize() < 4 << 20  # what a default gRPC client accepts
    rest = client.stub.ListMessages(
        pb.ListMessagesRequest(agent="a1", thread="t1", page_token=first.next_page_token)
    )
    assert len(first.messages) + len(rest.messages) == 6


# ----------------------------------------------------------------- reasons are API


def test_every_reason_the_code_uses_is_in_the_proto_enum() -> None:
    names = pb.ErrorReason.keys()
    declared = {name.removeprefix("ERROR_REASON_") for name in names}
    declared.discard("UNSPECIFIED")
    used: set[str] = set()
    for path in SERVICE.rglob("*.py"):
        if "_pb2" in path.name:
            continue
        text = path.read_text()
        used.update(re.findall(r'reason="([A-Z_]+)"', text))
        used.update(re.findall(r'default_reason = "([A-Z_]+)"', text))
        used.update(re.findall(r'"(INTERNAL)"\)', text))
    used -= {"FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED"}
    used -= {"UNAVAILABLE", "ABORTED", "UNAUTHENTICATED", "PERMISSION_DENIED"}
    assert used, "found no reasons: the scan is broken"
    assert used <= declared, f"reasons missing from ErrorReason: {sorted(used - declared)}"


# ----------------------------------------------------------------- the interceptor


class _Panic(BaseException):
    """What a Rust panic looks like to Python: pyo3's PanicException is a BaseException."""


def _probe_server() -> tuple[grpc.Server, Client, threading.Event]:
    """A real gRPC server with contextd's interceptor and a probe service whose handlers
    fail on purpose, in every handler shape."""
    released = threading.Event()

    def panics(request: bytes, context: grpc.ServicerContext) -> bytes:
        raise _Panic("index out of bounds")

    def streams_then_fails(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"one"
        raise InvalidArgument("the second item is bad", field="item")

    def takes_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for _ in requests:
            pass
        raise _Panic("after the stream")

    handlers = {
        "Panics": grpc.unary_unary_rpc_method_handler(panics),
        "Streams": grpc.unary_stream_rpc_method_handler(streams_then_fails),
        "TakesStream": grpc.stream_unary_rpc_method_handler(takes_stream),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[ErrorMappingInterceptor()]
    )
    probe = grpc.method_handlers_generic_handler("probe.Probe", handlers)
    server.add_generic_rpc_handlers([probe])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, connect(f"127.0.0.1:{port}"), released


def test_interceptor_turns_a_panic_into_internal_at_once() -> None:
    server, client, _ = _probe_server()
    try:
        call = client.channel.unary_unary("/probe.Probe/Panics", None, None)
        error = _error(lambda: call(b"", timeout=10))
        assert error.code() == grpc.StatusCode.INTERNAL
        assert _details(error)["reason"] == "INTERNAL"
        assert "index out of bounds" not in (error.details() or "")
    finally:
        server.stop(None)


def test_interceptor_covers_streaming_rpcs() -> None:
    server, client, _ = _probe_server()
    try:
        streaming = client.channel.unary_stream("/probe.Probe/Streams", None, None)
        received: list[bytes] = []
        with pytest.raises(grpc.RpcError) as info:
            for item in streaming(b"", timeout=10):
                received.append(item)
        assert received == [b"one"]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _details(info.value)["fields"] == ["item"]
        client_streaming = client.channel.stream_unary("/probe.Probe/TakesStream", None, None)
        error = _error(lambda: client_streaming(iter([b"a", b"b"]), timeout=10))
        assert error.code() == grpc.StatusCode.INTERNAL
    finally:
        server.stop(None)
