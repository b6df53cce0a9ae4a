"""Orphaned tool calls and results never make a build lose history silently.

A tool_result whose tool_use is outside the history being built (before the window, before
a clear, or folded into a summary) and a tool_use none of whose results arrived are
orphans. A build keeps them as plain text naming the call (so the context stays valid
for both APIs) and keeps everything older that fits; every window message is kept,
listed in dropped_ids, or inside the summarized range. Over a real server and DuckDB.
"""

from __future__ import annotations

import json
import time

from google.protobuf import timestamp_pb2

from conftest import ASSISTANT, TOOL_RESULT, TOOL_USE, USER, Client, rendering
from contextd.v1 import context_service_pb2 as pb

BIG = pb.BuildOptions(budget_tokens=100_000, truncate=False)


def _calls(*ids: str, name: str = "grep") -> str:
    return json.dumps([{"id": i, "name": name, "input": {"q": i}} for i in ids])


def _build(client: Client, **kwargs: object) -> pb.BuildContextResponse:
    response: pb.BuildContextResponse = client.stub.BuildContext(
        pb.BuildContextRequest(
            agent="a1",
            thread="t1",
            formats=[pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI],
            **kwargs,  # type: ignore[arg-type]
        )
    )
    return response


def _accounted(client: Client, ctx: pb.BuildContextResponse) -> None:
    """Every window message is kept, dropped or summarized, exactly once."""
    window = [m.id for m in client.window("a1") if not m.is_summary]
    kept = [m.id for m in ctx.messages if m.id > 0 and not m.is_summary]
    dropped = list(ctx.stats.dropped_ids)
    first, last = ctx.stats.first_summarized_id, ctx.stats.last_summarized_id
    summarized = [i for i in window if first and first <= i <= last]
    assert sorted(kept + dropped + summarized) == sorted(window)


def _assert_valid_renderings(ctx: pb.BuildContextResponse) -> None:
    """Every tool_result answers a tool_use of the message just before it (Anthropic),
    every tool message answers a call of an earlier assistant message (OpenAI)."""
    anthropic = json.loads(rendering(ctx, pb.CONTEXT_FORMAT_ANTHROPIC))["messages"]
    assert not anthropic or anthropic[0]["role"] == "user"
    for i, message in enumerate(anthropic):
        for block in message["content"]:
            if block["type"] == "tool_result":
                prev = anthropic[i - 1]["content"]
                assert block["tool_use_id"] in {b.get("id") for b in prev}
    issued: set[str] = set()
    for message in json.loads(rendering(ctx, pb.CONTEXT_FORMAT_OPENAI)):
        issued.update(c["id"] for c in message.get("tool_calls", []))
        if message["role"] == "tool":
            assert message["tool_call_id"] in issued


def test_result_whose_call_is_before_a_clear_keeps_older_history(client: Client) -> None:
    client.append("a1", "start")
    client.append("a1", "", role=TOOL_USE, tool_calls=_calls("c1"))
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    client.append("a1", "q1")
    client.append("a1", "a1 answer", role=ASSISTANT)
    orphan = client.append("a1", "late grep output", role=TOOL_RESULT, tool_call_id="c1")
    client.append("a1", "u2")
    ctx = _build(client, options=BIG)
    assert ctx.stats.messages_before == 4
    assert [m.content for m in ctx.messages][:2] == ["q1", "a1 answer"]
    assert len(ctx.messages) == 4
    kept_orphan = ctx.messages[2]
    assert kept_orphan.id == orphan.receipts[0].id
    assert kept_orphan.role == USER
    assert "c1" in kept_orphan.content and "late grep output" in kept_orphan.content
    assert list(ctx.stats.orphaned_ids) == [kept_orphan.id]
    assert list(ctx.stats.dropped_ids) == []
    _assert_valid_renderings(ctx)
    _accounted(client, ctx)


def test_result_whose_call_is_before_the_window_start(client: Client) -> None:
    two_days_ago = timestamp_pb2.Timestamp(seconds=int(time.time()) - 2 * 86_400)
    client.append("a1", "", role=TOOL_USE, tool_calls=_calls("c1"), source_time=two_days_ago)
    client.append("a1", "q1", "q2")
    client.append("a1", "output", role=TOOL_RESULT, tool_call_id="c1")
    client.append("a1", "u3")
    ctx = _build(client, options=BIG)
    assert [m.content for m in ctx.messages][:2] == ["q1", "q2"]
    assert len(ctx.messages) == 4 and ctx.stats.messages_before == 4
    assert len(ctx.stats.orphaned_ids) == 1
    _assert_valid_renderings(ctx)
    _accounted(client, ctx)


def test_result_whose_call_was_folded_into_a_summary(client: Client) -> None:
    for i in range(8):
        client.append("a1", f"old {i} " + "words " * 40)
    use = client.append("a1", "", role=TOOL_USE, tool_calls=_calls("c1", "c2")).receipts[0]
    for i in range(10):  # compaction keeps at least the 10 newest messages
        client.append("a1", f"meanwhile {i}")
    compacted = client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1",
            thread="t1",
            options=pb.BuildOptions(keep_recent_tokens=1, summarize=True),
        )
    )
    assert compacted.summary.last_summarized_id >= use.id
    # The calls' results arrive after the compaction folded their call away.
    client.append("a1", "out 1", role=TOOL_RESULT, tool_call_id="c1")
    client.append("a1", "out 2", role=TOOL_RESULT, tool_call_id="c2")
    client.append("a1", "newest")
    ctx = _build(client, options=BIG)
    assert ctx.messages[0].is_summary
    contents = [m.content for m in ctx.messages[1:]]
    assert contents[-1] == "newest"
    out1 = next(c for c in contents if "out 1" in c)
    assert out1.startswith('[output of tool call c1 to grep({"q":"c1"})')
    assert any("out 2" in c for c in contents)
    assert len(ctx.stats.orphaned_ids) == 2 and not ctx.stats.dropped_ids
    _assert_valid_renderings(ctx)
    _accounted(client, ctx)


def test_small_budget_lists_everything_left_out(client: Client) -> None:
    client.append("a1", "", role=TOOL_USE, tool_calls=_calls("c1"))
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    for i in range(40):
        client.append("a1", f"m{i} " + "filler " * 30)
    client.append("a1", "orphan output", role=TOOL_RESULT, tool_call_id="c1")
    client.append("a1", "", role=TOOL_USE, tool_calls=_calls("c9", name="ls"))
    client.append("a1", "the newest")
    ctx = _build(client, options=pb.BuildOptions(budget_tokens=400))
    assert ctx.stats.total_tokens <= 400
    assert ctx.messages[-1].content == "the newest"
    assert ctx.stats.dropped_ids  # older messages did not fit: said so, by id
    # The call nobody answered and the result of a cleared call are both orphans.
    assert len(ctx.stats.orphaned_ids) == 2
    _assert_valid_renderings(ctx)
    _accounted(client, ctx)
