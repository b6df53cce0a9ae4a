"""What appends store for the build path: model token counts and tool groups."""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import field_mask_pb2

from conftest import ASSISTANT, TOOL_RESULT, TOOL_USE, USER, InProcessServer
from contextd import core
from contextd.domain.model import ContextKey
from contextd.domain.window import WindowSpec
from contextd.v1 import context_service_pb2 as pb


def test_agent_model_gives_exact_counts(server: InProcessServer) -> None:
    client = server.client
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1", model="gpt-4o")))
    text = "def parse_args(argv):\n    return {'x': 1}  # 🙂 你好"
    receipt = client.append("a1", text).receipts[0]
    assert receipt.token_count == core.count_tokens(text, "o200k_base")
    assert receipt.token_estimate == core.estimate_tokens(text)
    [message] = client.window("a1")
    assert message.token_count == receipt.token_count


def test_claude_counts_carry_the_safety_margin(server: InProcessServer) -> None:
    client = server.client
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1", model="claude-sonnet-4-5-20250929"))
    )
    text = "The quick brown fox jumps over the lazy dog. " * 20
    receipt = client.append("a1", text).receipts[0]
    info = core.model_info("claude-sonnet-4-5")
    assert info.margin > 1.0
    assert receipt.token_count == info.apply_margin(core.count_tokens(text, "o200k_base"))


def test_changing_model_changes_counts_of_new_messages(server: InProcessServer) -> None:
    client = server.client
    client.append("a1", "hello world")  # auto-created: no model, counts are estimates
    [first] = client.window("a1")
    assert first.token_count == first.token_estimate
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", model="gpt-4o"),
            update_mask=field_mask_pb2.FieldMask(paths=["model"]),
        )
    )
    receipt = client.append("a1", "hello world").receipts[0]
    assert receipt.token_count == core.count_tokens("hello world", "o200k_base") == 2


def test_unknown_model_is_invalid_argument(server: InProcessServer) -> None:
    with pytest.raises(grpc.RpcError) as info:
        server.client.stub.CreateAgent(
            pb.CreateAgentRequest(agent=pb.Agent(name="a1", model="no-such-model"))
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not in the model registry" in (info.value.details() or "")


def test_tool_groups_tie_results_to_their_tool_use(server: InProcessServer) -> None:
    client = server.client
    calls = json.dumps(
        [{"id": "c1", "name": "grep", "input": {}}, {"id": "c2", "name": "ls", "input": {}}]
    )
    client.append("a1", "find it")
    use = client.append("a1", "", role=TOOL_USE, tool_calls=calls).receipts[0]
    # Results arrive in a later call, in any order; c2 is after a restart-proof lookup.
    client.append("a1", "ls output", role=TOOL_RESULT, tool_call_id="c2")
    # Forget the embedded engine's cache of call ids: the table must answer.
    getattr(server.running.store, "_calls", {}).clear()
    client.append("a1", "grep output", role=TOOL_RESULT, tool_call_id="c1")
    client.append("a1", "done", role=ASSISTANT)
    client.append("a1", "orphan", role=TOOL_RESULT, tool_call_id="nope")
    store = server.running.store
    ref = store.context_ref(ContextKey("default", "a1", "", "t1"))
    assert ref is not None
    table = store.window_columns(ref, WindowSpec(0, 0))
    assert table.column("group_id").to_pylist() == [-1, use.id, use.id, use.id, -1, -1]
    assert table.column("role").to_pylist() == [
        USER,
        TOOL_USE,
        TOOL_RESULT,
        TOOL_RESULT,
        ASSISTANT,
        TOOL_RESULT,
    ]
    ids = table.column("id").to_pylist()
    kept = store.messages_by_ids(ContextKey("default", "a1", "", "t1"), ids[-2:])
    assert [m.content for m in kept] == ["done", "orphan"]
    # Ids are matched within the full context key only: no other key reaches them.
    client.append("a1", "elsewhere", thread="t2")
    client.append("a1", "other scope", scope="dm:1")
    for other in (
        ContextKey("other-tenant", "a1", "", "t1"),
        ContextKey("default", "a2", "", "t1"),
        ContextKey("default", "a1", "dm:1", "t1"),
        ContextKey("default", "a1", "", "t2"),
    ):
        assert store.messages_by_ids(other, ids) == []


def test_openai_style_tool_calls_are_grouped(server: InProcessServer) -> None:
    client = server.client
    calls = json.dumps(
        [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    )
    use = client.append("a1", "", role=ASSISTANT, tool_calls=calls).receipts[0]
    client.append("a1", "42", role=TOOL_RESULT, tool_call_id="call_9")
    store = server.running.store
    ref = store.context_ref(ContextKey("default", "a1", "", "t1"))
    assert ref is not None
    table = store.window_columns(ref, WindowSpec(0, 0))
    assert table.column("group_id").to_pylist() == [use.id, use.id]


def test_groups_follow_what_builds_call_a_tool_call(server: InProcessServer) -> None:
    """Insert-time groups and builds read tool_calls the same way: the OpenAI message
    wrapper ties its result, a call without a name (which cannot be rendered) ties none."""
    client = server.client
    wrapped = json.dumps(
        {
            "tool_calls": [
                {"id": "w1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]
        }
    )
    use = client.append("a1", "", role=ASSISTANT, tool_calls=wrapped).receipts[0]
    client.append("a1", "42", role=TOOL_RESULT, tool_call_id="w1")
    client.append("a1", "", role=ASSISTANT, tool_calls=json.dumps([{"id": "n1"}]))
    client.append("a1", "7", role=TOOL_RESULT, tool_call_id="n1")
    store = server.running.store
    ref = store.context_ref(ContextKey("default", "a1", "", "t1"))
    assert ref is not None
    table = store.window_columns(ref, WindowSpec(0, 0))
    assert table.column("group_id").to_pylist() == [use.id, use.id, -1, -1]
    built = client.stub.BuildContext(pb.BuildContextRequest(agent="a1", thread="t1"))
    assert [m.tool_call_id for m in built.messages if m.role == TOOL_RESULT] == ["w1"]
