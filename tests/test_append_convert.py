"""The append's one-pass conversions give exactly what the per-message ones give.

`new_messages_of` and `receipts_pb` are the fast paths of AppendMessages (see
api/convert.py); these tests hold them to the plain definitions they replace: the same
NewMessages (and the same errors, naming the same field) and byte-identical responses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from google.protobuf import timestamp_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from contextd import core
from contextd.api import convert
from contextd.api.convert import (
    WIRE_MIN_MESSAGES,
    new_message_of,
    new_messages_of,
    new_messages_of_request,
    receipt_pb,
    receipts_bytes,
    receipts_pb,
)
from contextd.domain.errors import ContextdError, InvalidArgument
from contextd.domain.limits import check_message, check_messages
from contextd.domain.model import MessageReceipt, NewMessage, Role
from contextd.v1 import context_service_pb2 as pb


def _mixed() -> list[pb.Message]:
    return [
        pb.Message(role=pb.ROLE_USER, content="hello"),
        pb.Message(
            role=pb.ROLE_TOOL_USE,
            content="",
            tool_calls='[{"id": "c1", "name": "ls", "arguments": "{}"}]',
            external_id="ext-1",
            metadata='{"k": 1}',
        ),
        pb.Message(role=pb.ROLE_TOOL_RESULT, content="out", tool_call_id="c1"),
        pb.Message(
            role=pb.ROLE_ASSISTANT,
            content="at a time",
            source_time=timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=123_000),
        ),
        pb.Message(
            role=pb.ROLE_TOOL_RESULT, content="", tool_output_id="to_" + "0123456789abcdef0123"
        ),
        pb.Message(role=pb.ROLE_ASSISTANT, content="épée 🌍", metadata="{}"),
    ]


def test_new_messages_of_equals_the_per_message_conversion() -> None:
    messages = _mixed()
    assert new_messages_of(messages) == [new_message_of(m, i) for i, m in enumerate(messages)]


@pytest.mark.parametrize("role", [pb.ROLE_UNSPECIFIED, 99])
def test_new_messages_of_raises_the_same_error_for_a_bad_role(role: int) -> None:
    messages = [*_mixed(), pb.Message(role=role, content="x")]  # type: ignore[arg-type]
    index = len(messages) - 1
    with pytest.raises(InvalidArgument) as expected:
        new_message_of(messages[index], index)
    with pytest.raises(InvalidArgument) as got:
        new_messages_of(messages)
    assert (str(got.value), got.value.field) == (str(expected.value), expected.value.field)
    assert got.value.field == f"messages[{index}].role"


def test_receipts_pb_equals_a_list_of_receipt_pb() -> None:
    receipts = [
        MessageReceipt(7, 1_700_000_000_123_456, 3, 4, 1),
        MessageReceipt(8, 1_700_000_000_123_456, 0, 0, 2),
        MessageReceipt(9, 1_700_000_001_000_000, 12, 11, 1),  # a second thread's commit time
        MessageReceipt(10, 0, 1, 1, 3),  # the epoch: create_time still present
    ]
    plain = pb.AppendMessagesResponse(receipts=[receipt_pb(r) for r in receipts])
    fast = receipts_pb(receipts)
    assert fast == plain
    assert fast.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    assert all(r.HasField("create_time") for r in fast.receipts)
    assert receipts_pb([]) == pb.AppendMessagesResponse()


_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# Times whose Timestamp protobuf can hold (years 1 to 9999), before the epoch included.
_TIME_US = st.integers(min_value=-62_135_596_800_000_000, max_value=253_402_300_799_999_999)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.builds(MessageReceipt, _INT64, _TIME_US, _INT64, _INT64, _INT64),
        max_size=40,
    )
)
def test_receipts_encoded_in_rust_are_the_protobuf_runtimes_bytes(
    receipts: list[MessageReceipt],
) -> None:
    """The Rust encoder (rust_core/src/wire.rs) against the runtime's serialization of the
    plain per-receipt build, over any int64 (negative ones take ten bytes) and any time a
    Timestamp can hold (before the epoch: negative seconds, positive nanos)."""
    plain = pb.AppendMessagesResponse(receipts=[receipt_pb(r) for r in receipts])
    # A batch's goes through the core, a short list is built in place: both are checked.
    assert receipts_pb(receipts * WIRE_MIN_MESSAGES) == pb.AppendMessagesResponse(
        receipts=[receipt_pb(r) for r in receipts * WIRE_MIN_MESSAGES]
    )
    assert receipts_bytes(receipts) == plain.SerializeToString(deterministic=True)
    assert receipts_bytes(receipts) == plain.SerializeToString()
    assert receipts_pb(receipts) == plain


def test_encode_receipts_refuses_columns_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="token_estimates"):
        core.encode_receipts([1, 2], [1, 2], [1], [1, 2], [1, 2])


def _checked(
    messages: list[NewMessage], max_bytes: int
) -> tuple[list[tuple[str, ...]], tuple[type, str, str | None] | None]:
    """Each message's `check_message` result up to the first error, and that error as
    (type, text, field)."""
    out: list[tuple[str, ...]] = []
    for i, m in enumerate(messages):
        try:
            out.append(check_message(m, i, max_bytes, LATEST_US))
        except ContextdError as exc:
            return out, (type(exc), str(exc), exc.field)
    return out, None


LATEST_US = 1_800_000_000_000_000


@pytest.mark.parametrize(
    "odd",
    [
        NewMessage(Role.USER, "nul \x00 inside"),
        NewMessage(Role.USER, "x" * 257),  # over a quarter of 1,024 bytes, under 1,024
        NewMessage(Role.USER, "é" * 600),  # 1,200 UTF-8 bytes: over the limit
        NewMessage(Role.USER, "y" * 2_000),
        NewMessage(Role.TOOL_USE, "", tool_calls='[{"id": "c1", "name": "ls"}]'),
        NewMessage(Role.TOOL_USE, "", tool_calls="not json"),
        NewMessage(Role.USER, "m", metadata="[1]"),
        NewMessage(Role.USER, "e", external_id="e" * 1_000),
        NewMessage(Role.TOOL_RESULT, "r", tool_call_id="c\x00"),
        NewMessage(Role.USER, "late", source_time_us=LATEST_US + 1),
        NewMessage(Role.USER, "in time", source_time_us=LATEST_US),
    ],
)
def test_check_messages_equals_check_message_per_message(odd: NewMessage) -> None:
    """The batch check takes plain messages in one test: every other message gets exactly
    `check_message`'s result or error, at its own index."""
    messages = [NewMessage(Role.USER, "plain"), odd, NewMessage(Role.ASSISTANT, "z" * 256)]
    expected, error = _checked(messages, 1_024)
    if error is not None:
        with pytest.raises(ContextdError) as raised:
            check_messages(messages, 1_024, LATEST_US)
        assert (type(raised.value), str(raised.value), raised.value.field) == error
    else:
        assert check_messages(messages, 1_024, LATEST_US) == expected


# ----------------------------------------------------------------- decoding in the Rust core

_TEXT = st.text(max_size=40) | st.sampled_from(["", "x" * 70_000, "épée 🌍 \u0000 \U0010ffff"])
_TOOL_OUTPUT_IDS = st.sampled_from(["", "", "", "to_" + "0123456789abcdef0123", "not-a-handle"])


@st.composite
def _messages(draw: st.DrawFn) -> pb.Message:
    """Any message a client may send: every role number (unknown and negative ones too),
    any text, tool ids, client times (some out of range), tool output references, and
    fields the append does not read."""
    message = pb.Message(
        role=draw(  # type: ignore[arg-type]
            st.sampled_from([1, 2, 3, 4])
            if draw(st.integers(0, 19))
            else st.integers(-(2**31), 2**31 - 1)
        ),
        content=draw(_TEXT),
        tool_calls=draw(st.sampled_from(["", "[]", '[{"id": "c1", "name": "ls", "input": {}}]'])),
        tool_call_id=draw(st.sampled_from(["", "c1", "call_é"])),
        external_id=draw(_TEXT),
        metadata=draw(st.sampled_from(["", "{}", '{"k": "ü"}'])),
        tool_output_id=draw(_TOOL_OUTPUT_IDS) if draw(st.integers(0, 19)) == 0 else "",
        # Read by other calls, never by the append: skipped by the decoder.
        id=draw(st.integers(-(2**63), 2**63 - 1)),
        agent=draw(_TEXT),
        thread=draw(_TEXT),
        tenant=draw(_TEXT),
        token_estimate=draw(st.integers(0, 2**40)),
        is_summary=draw(st.booleans()),
        restored_from_snapshot=draw(_TEXT),
    )
    if draw(st.integers(0, 9)) == 0:
        message.scope.key = draw(_TEXT)
        message.create_time.seconds = draw(st.integers(0, 2**33))
    if draw(st.integers(0, 19)) == 0:
        message.source_time.seconds = draw(st.integers(-(2**40), 2**40))
        message.source_time.nanos = draw(st.integers(-1, 10**9))
    return message


def _outcome(convert: Callable[[], list[NewMessage]]) -> object:
    """The conversion's NewMessages, or its error as the API reports it."""
    try:
        return convert()
    except ContextdError as exc:
        return (type(exc), str(exc), exc.field)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_messages(), min_size=WIRE_MIN_MESSAGES, max_size=3 * WIRE_MIN_MESSAGES),
    st.sampled_from(["", "req-1", "é" * 30]),
)
def test_the_rust_decoding_equals_the_protobuf_path(
    messages: list[pb.Message], request_id: str
) -> None:
    request = pb.AppendMessagesRequest(
        agent="a1", thread="t1", messages=messages, request_id=request_id
    )
    request.scope.key = "s"
    assert _outcome(lambda: new_messages_of_request(request)) == _outcome(
        lambda: new_messages_of(request.messages)
    )
    # Message by message (a batch with one bad message compares only its error above):
    # the core's NewMessage where the plain path builds one directly, else its index.
    decoded, odd = core.decode_append_messages(
        request.SerializeToString(),
        convert._ROLE_COLUMN,
        NewMessage,
        list(convert._NEW_MESSAGE_FIELDS),
    )
    for index, m in enumerate(request.messages):
        apart = m.role not in (1, 2, 3, 4) or bool(m.tool_output_id) or m.HasField("source_time")
        assert (index in odd) == apart
        if not apart:
            assert decoded[index] == new_message_of(m, index)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=WIRE_MIN_MESSAGES, max_size=64))
def test_regular_batches_take_the_rust_path_and_equal_the_plain_one(roles: list[int]) -> None:
    """Messages of the four roles come out of the core (no index is left to Python) and
    are NewMessages like any other: equal, hashing alike, frozen."""
    request = pb.AppendMessagesRequest(
        messages=[pb.Message(role=r, content=f"m{i} ü") for i, r in enumerate(roles)]  # type: ignore[arg-type]
    )
    messages, odd = core.decode_append_messages(
        request.SerializeToString(),
        [None, *(Role(v) for v in range(1, 5))],
        NewMessage,
        list(_FIELDS),
    )
    assert odd == []
    plain = new_messages_of(request.messages)
    assert messages == plain
    assert [hash(m) for m in messages] == [hash(m) for m in plain]
    assert all(type(m) is NewMessage for m in messages)
    with pytest.raises(dataclasses.FrozenInstanceError):
        messages[0].content = "changed"


def test_a_bad_message_in_a_decoded_batch_gets_the_plain_error() -> None:
    """The first bad message in index order is reported, naming its index, as before."""
    messages = [pb.Message(role=pb.ROLE_USER, content=str(i)) for i in range(40)]
    messages[25] = pb.Message(role=pb.ROLE_UNSPECIFIED, content="no role")
    messages[30] = pb.Message(role=99, content="unknown role")  # type: ignore[arg-type]
    request = pb.AppendMessagesRequest(messages=messages)
    with pytest.raises(InvalidArgument) as got:
        new_messages_of_request(request)
    assert got.value.field == "messages[25].role"
    assert "ROLE_USER" in str(got.value)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    tag = _varint(number << 3 | wire)
    return tag + (_varint(len(payload)) + payload if wire == 2 else payload)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_unknown_fields_and_repeated_fields_decode_as_protobuf_does() -> None:
    """Bytes a newer client may send: unknown fields in the request and in its messages,
    a field given twice (the last wins), a role as a ten-byte varint. The protobuf
    runtime parses them; the core reads the same messages from its re-serialization."""
    message = (
        _field(6, 2, b"first")
        + _field(99, 0, _varint(2**64 - 1))
        + _field(98, 1, bytes(8))
        + _field(97, 5, bytes(4))
        + _field(96, 2, b"\xff\xfe")
        + _field(6, 2, "second ü".encode())
        + _field(5, 0, _varint(2))
    )
    negative = _field(5, 0, _varint(2**64 - 1)) + _field(6, 2, b"minus one")
    body = _field(1, 2, b"a1") + _field(77, 2, b"unknown top-level field")
    body += b"".join(_field(4, 2, message) for _ in range(WIRE_MIN_MESSAGES))
    body += _field(4, 2, negative)
    request = pb.AppendMessagesRequest.FromString(body)
    plain = _outcome(lambda: new_messages_of(request.messages))
    assert _outcome(lambda: new_messages_of_request(request)) == plain
    assert isinstance(plain, tuple)  # role -1 is refused, at the last index
    assert plain[2] == f"messages[{WIRE_MIN_MESSAGES}].role"
    request.messages.pop()
    decoded = new_messages_of_request(request)
    assert decoded[0].content == "second ü"
    assert decoded[0].role == Role.ASSISTANT


@pytest.mark.parametrize(
    "data",
    [
        b"\x22\x05\x32",  # a message shorter than its length
        b"\x22\x03\x32\x01\xff",  # content that is not UTF-8
        b"\x08" + b"\xff" * 10 + b"\x01",  # a varint over ten bytes
        b"\x0b",  # a proto2 group
        b"\x00",  # field number 0
    ],
)
def test_the_core_refuses_malformed_bytes_with_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed AppendMessagesRequest"):
        core.decode_append_messages(
            data, [None, *(Role(v) for v in range(1, 5))], NewMessage, list(_FIELDS)
        )


_FIELDS = (
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "external_id",
    "metadata",
    "source_time_us",
)
