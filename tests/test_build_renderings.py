"""Renderings are entries keyed by format; a client asks for as few as it needs."""

from __future__ import annotations

import json

import grpc
import pytest

from conftest import Client, rendering
from contextd import core
from contextd.app.build.window_loading import MAX_SUMMARY_SOURCE_CHARS
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb


def _build(client: Client, **fields: object) -> pb.BuildContextResponse:
    response: pb.BuildContextResponse = client.stub.BuildContext(
        pb.BuildContextRequest(agent="a1", thread="t1", user_message="next?", **fields)  # type: ignore[arg-type]
    )
    return response


def test_one_format_returns_one_rendering(client: Client) -> None:
    client.append("a1", "hello", "world")
    response = _build(client, formats=[pb.CONTEXT_FORMAT_OPENAI])
    assert [r.format for r in response.renderings] == [pb.CONTEXT_FORMAT_OPENAI]
    messages = json.loads(rendering(response, pb.CONTEXT_FORMAT_OPENAI))
    assert messages[-1] == {"role": "user", "content": "next?"}


def test_renderings_come_in_the_order_asked(client: Client) -> None:
    client.append("a1", "hello")
    asked = [pb.CONTEXT_FORMAT_TEXT, pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI]
    response = _build(client, formats=asked)
    assert [r.format for r in response.renderings] == asked


def test_no_formats_means_no_renderings(client: Client) -> None:
    client.append("a1", "hello")
    response = _build(client)
    assert list(response.renderings) == []
    assert [m.content for m in response.messages][-1] == "next?"


def test_renderings_view_leaves_out_the_structured_context(client: Client) -> None:
    client.append("a1", "x" * 5_000, "y" * 5_000)
    full = _build(client, formats=[pb.CONTEXT_FORMAT_ANTHROPIC])
    lean = _build(client, formats=[pb.CONTEXT_FORMAT_ANTHROPIC], view=pb.CONTEXT_VIEW_RENDERINGS)
    assert list(lean.messages) == [] and lean.system_prompt == "" and list(lean.docs) == []
    assert rendering(lean, pb.CONTEXT_FORMAT_ANTHROPIC) == rendering(
        full, pb.CONTEXT_FORMAT_ANTHROPIC
    )
    assert lean.stats.total_tokens == full.stats.total_tokens
    assert lean.ByteSize() < full.ByteSize() * 0.6


@pytest.mark.parametrize(
    ("formats", "field"),
    [
        ([pb.CONTEXT_FORMAT_TEXT, pb.CONTEXT_FORMAT_TEXT], "formats[1]"),
        ([pb.CONTEXT_FORMAT_UNSPECIFIED], "formats[0]"),
        ([42], "formats[0]"),
    ],
)
def test_bad_formats_are_invalid_argument(client: Client, formats: list[int], field: str) -> None:
    client.append("a1", "hello")
    with pytest.raises(grpc.RpcError) as info:
        _build(client, formats=formats)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")


def test_unknown_view_is_invalid_argument(client: Client) -> None:
    client.append("a1", "hello")
    with pytest.raises(grpc.RpcError) as info:
        _build(client, view=7)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_dropped_ids_are_capped_and_counted(client: Client) -> None:
    """A build that drops most of a long window lists the newest 10,000 ids only."""
    for start in range(0, 12_000, 2_000):
        batch = [
            pb.Message(role=pb.ROLE_USER, content=f"m{i}") for i in range(start, start + 2_000)
        ]
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1", thread="t1", messages=batch, create_agent_if_missing=True
            )
        )
    stats = _build(client, options=pb.BuildOptions(budget_tokens=300)).stats
    assert stats.messages_before == 12_000
    assert stats.dropped_count == 12_000 - stats.messages_after
    assert len(stats.dropped_ids) == 10_000
    ids = [m.id for m in client.history("a1")]
    kept_from = ids.index(stats.dropped_ids[-1]) + 1
    assert stats.dropped_ids[-1] == ids[kept_from - 1]  # the newest dropped is listed
    assert list(stats.dropped_ids) == ids[kept_from - 10_000 : kept_from]


def test_a_huge_budget_is_clamped_to_the_models_window(client: Client) -> None:
    """A budget of 2**31 - 1 used to load a whole long window into Python."""
    for start in range(0, 20_000, 5_000):
        batch = [
            pb.Message(role=pb.ROLE_USER, content=f"m{i} " + "w " * 40)
            for i in range(start, start + 5_000)
        ]
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1", thread="t1", messages=batch, create_agent_if_missing=True
            )
        )
    stats = _build(client, options=pb.BuildOptions(budget_tokens=2**31 - 1)).stats
    window = core.model_info("default").context_window
    assert stats.budget_tokens == window
    assert stats.total_tokens <= window
    assert stats.messages_loaded < 20_000
    assert stats.dropped_count == 20_000 - stats.messages_after


def test_summarize_reads_a_bounded_source(client: Client) -> None:
    """A summarizing build used to load up to 5,000 whole messages, whatever their size:
    its source is bounded in characters (here 5 MB of window, more than the bound)."""
    text = "z" * 1_990
    for start in range(0, 2_500, 250):
        batch = [
            pb.Message(role=pb.ROLE_USER, content=f"{i:05d}{text}")
            for i in range(start, start + 250)
        ]
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1", thread="t1", messages=batch, create_agent_if_missing=True
            )
        )
    budget = 4_000
    stats = _build(
        client, options=pb.BuildOptions(summarize=True, budget_tokens=budget, truncate=False)
    ).stats
    assert stats.summarizer_path in ("llm", "fallback")
    source_chars = stats.messages_loaded * 1_995
    assert source_chars <= MAX_SUMMARY_SOURCE_CHARS + 8 * budget + 1_995
    assert stats.messages_loaded < 2_500  # not the whole window
    # Nothing is lost from the accounting: what was not read is dropped.
    summarized = stats.last_summarized_id >= stats.first_summarized_id > 0
    assert summarized and stats.dropped_count > 0


def test_prefix_is_byte_stable_between_builds(client: Client, clock: ManualClock) -> None:
    """The status preamble ("as of <time>") used to sit in the system prompt, so every
    build had a new prefix and prompt caches never hit."""
    client.stub.CreateAgent(
        pb.CreateAgentRequest(
            agent=pb.Agent(
                name="a1",
                system_prompt="You are terse.",
                docs=[pb.AgentDoc(name="d.md", content="doc")],
            )
        )
    )
    client.append("a1", "hello", "hi", thread="t1")
    client.append("a1", "elsewhere", thread="t2")
    entry = pb.StatusEntry(key="job", kind=pb.STATUS_KIND_PROCESS, state="running", summary="x")
    client.stub.SetStatus(pb.SetStatusRequest(agent="a1", entry=entry))
    formats = [pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI, pb.CONTEXT_FORMAT_TEXT]
    first = _build(client, formats=formats)
    clock.advance(5 * 1_000_000)
    second = _build(client, formats=formats)
    assert first.status and first.status != second.status  # "as of" moved
    anthropic = [json.loads(rendering(r, pb.CONTEXT_FORMAT_ANTHROPIC)) for r in (first, second)]
    assert (
        anthropic[0]["system"]
        == anthropic[1]["system"]
        == "You are terse.\n\n" + ('<document name="d.md">\ndoc\n</document>')
    )
    assert anthropic[0]["messages"][:-1] == anthropic[1]["messages"][:-1]
    last = anthropic[0]["messages"][-1]["content"]
    assert [b["text"] for b in last[-2:]] == [first.status, "next?"]
    openai = [json.loads(rendering(r, pb.CONTEXT_FORMAT_OPENAI)) for r in (first, second)]
    assert openai[0][:-2] == openai[1][:-2]
    assert openai[0][-2] == {"role": "user", "content": first.status}
    text = [rendering(r, pb.CONTEXT_FORMAT_TEXT) for r in (first, second)]
    prefix = text[0].split(first.status)[0]
    assert prefix and text[1].startswith(prefix)
