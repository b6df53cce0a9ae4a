"""The append's one-pass conversions give exactly what the per-message ones give.

`new_messages_of` and `receipts_pb` are the fast paths of AppendMessages (see
api/convert.py); these tests hold them to the plain definitions they replace: the same
NewMessages (and the same errors, naming the same field) and byte-identical responses.
"""

from __future__ import annotations

import pytest
from google.protobuf import timestamp_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from contextd import core
from contextd.api.convert import (
    new_message_of,
    new_messages_of,
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
