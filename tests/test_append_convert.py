"""The append's one-pass conversions give exactly what the per-message ones give.

`new_messages_of` and `receipts_pb` are the fast paths of AppendMessages (see
api/convert.py); these tests hold them to the plain definitions they replace: the same
NewMessages (and the same errors, naming the same field) and byte-identical responses.
"""

from __future__ import annotations

import pytest
from google.protobuf import timestamp_pb2

from contextd.api.convert import new_message_of, new_messages_of, receipt_pb, receipts_pb
from contextd.domain.errors import InvalidArgument
from contextd.domain.model import MessageReceipt
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
