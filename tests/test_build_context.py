"""BuildContext, CompactContext, status entries and events over gRPC, end to end:
a real server, a real DuckDB file, the real Rust core, and the real anthropic client
talking to a local fake of the Messages API (never the network)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_anthropic import FakeAnthropic, full_checkpoint
from google.protobuf import duration_pb2, field_mask_pb2

from conftest import (
    ASSISTANT,
    TOOL_RESULT,
    TOOL_USE,
    USER,
    Client,
    connect,
    db_rows,
    rendering,
    summary_in_flight,
    ts,
)
from contextd import core
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def running(
    tmp_path: Path,
    fake: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    clock: ManualClock,
    store_url: str,
) -> Iterator[tuple[RunningServer, Client]]:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    settings = Settings(
        addr="127.0.0.1:0",
        data_dir=tmp_path / "data",
        store=store_url,
        anthropic_base_url=fake.base_url,
        summary_timeout_seconds=2.0,
    )
    server = create_server(settings, clock=clock)
    client = connect(f"127.0.0.1:{server.port}")
    yield server, client
    client.channel.close()
    server.stop(grace=1)


def _build(client: Client, agent: str = "a1", **kwargs: Any) -> pb.BuildContextResponse:
    response: pb.BuildContextResponse = client.stub.BuildContext(
        pb.BuildContextRequest(agent=agent, thread="t1", **kwargs)
    )
    return response


def _agent(client: Client, **fields: Any) -> None:
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1", **fields)))


# ----------------------------------------------------------------- seed 000: assembly


def test_context_includes_system_prompt(running: tuple[RunningServer, Client]) -> None:
    _, client = running
    _agent(client, system_prompt="You are terse.")
    ctx = _build(client)
    assert ctx.system_prompt == "You are terse."
    assert ctx.stats.system_tokens > 0


def test_context_includes_agent_docs(running: tuple[RunningServer, Client]) -> None:
    _, client = running
    _agent(client, docs=[pb.AgentDoc(name="style.md", content="Use metric units.")])
    ctx = _build(client, formats=[pb.CONTEXT_FORMAT_ANTHROPIC])
    assert [(d.name, d.content) for d in ctx.docs] == [("style.md", "Use metric units.")]
    assert "Use metric units." in json.loads(rendering(ctx, pb.CONTEXT_FORMAT_ANTHROPIC))["system"]


def test_context_includes_thread_status(
    running: tuple[RunningServer, Client], clock: ManualClock
) -> None:
    _, client = running
    client.append("a1", "working on the parser", thread="t1")
    client.append("a1", "deploying", thread="t2")
    client.stub.SetStatus(
        pb.SetStatusRequest(
            agent="a1",
            entry=pb.StatusEntry(
                key="build-42",
                kind=pb.STATUS_KIND_PROCESS,
                state="running",
                summary="cargo build --release",
            ),
        )
    )
    client.stub.SetStatus(
        pb.SetStatusRequest(
            agent="a1",
            entry=pb.StatusEntry(
                key="old", kind=pb.STATUS_KIND_THREAD, state="done", summary="expired entry"
            ),
            ttl=duration_pb2.Duration(seconds=60),
        )
    )
    clock.advance(60 * 1_000_000)  # the entry's expiry
    ctx = _build(client)
    assert "build-42" in ctx.status and "cargo build --release" in ctx.status
    assert "t2" in ctx.status  # the other thread active in the window
    assert "expired entry" not in ctx.status
    assert ctx.stats.status_tokens > 0


def test_context_includes_rolling_window_messages(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    client.append("a1", "question", thread="t1")
    client.append("a1", "answer", thread="t1", role=ASSISTANT)
    client.append("a1", "other thread", thread="t9")
    ctx = _build(client, user_message="follow-up")
    assert [m.content for m in ctx.messages] == ["question", "answer", "follow-up"]
    assert [m.role for m in ctx.messages] == [USER, ASSISTANT, USER]
    assert ctx.messages[-1].id == 0  # the new message is not stored
    assert len(client.history("a1")) == 2


def test_context_window_bounded_by_clear_time_or_rolling_window(
    running: tuple[RunningServer, Client], clock: ManualClock
) -> None:
    _, client = running
    client.append("a1", "before clear")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    client.append("a1", "after clear")
    assert [m.content for m in _build(client).messages] == ["after clear"]
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", rolling_window=duration_pb2.Duration(seconds=60)),
            update_mask=field_mask_pb2.FieldMask(paths=["rolling_window"]),
        )
    )
    assert [m.content for m in _build(client).messages] == ["after clear"]
    clock.advance(60 * 1_000_000)  # "after clear" is now exactly a window old
    assert list(_build(client).messages) == []


# ----------------------------------------------------------------- budget and strategies


def test_budget_is_never_exceeded_and_newest_turn_kept(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    for i in range(300):
        client.append("a1", f"message {i} " + "lorem ipsum dolor " * 20)
    ctx = _build(client, options=pb.BuildOptions(budget_tokens=2_000), user_message="now?")
    assert ctx.stats.total_tokens <= 2_000
    assert ctx.messages[-2].content.startswith("message 299 ")
    assert ctx.stats.messages_before == 300
    assert ctx.stats.messages_after == len(ctx.messages) - 1 < 300
    assert ctx.stats.strategy == "truncate"
    # A build that only trims is a pure read: it records no event.
    assert client.stub.ListEvents(pb.ListEventsRequest(agent="a1")).events == []


@pytest.mark.parametrize("build_model", ["gpt-4o", "gpt-4", "claude-sonnet-4-5"])
def test_history_tokens_are_exact_under_the_builds_model(
    running: tuple[RunningServer, Client], build_model: str
) -> None:
    """The build reuses the counts stored at insert only when they were made with its
    own tokenizer; under any other model it counts again, so the figure is always exact."""
    _, client = running
    _agent(client, model="gpt-4o")  # stored counts: o200k_base
    texts = [
        f"message {i}: " + "naïve café 東京 " * (i % 7) + "\n```py\nx = 1\n```" for i in range(40)
    ]
    client.append("a1", *texts)
    ctx = _build(client, model=build_model)
    assert len(ctx.messages) == 40
    # Each message costs what it costs in the request its model is sent: for OpenAI
    # models the chat accounting (3 per message, the role, the content), for Claude the
    # count of its JSON in the Messages request (o200k_base times the margin).
    if build_model.startswith("claude"):
        framed = [
            json.dumps(
                {"role": "user", "content": [{"type": "text", "text": m.content}]},
                ensure_ascii=False,
            )
            + ", "
            for m in ctx.messages
        ]
        expected = core.count_tokens_for_model_batch(framed, build_model)
    else:
        bare = core.count_tokens_for_model_batch([m.content for m in ctx.messages], build_model)
        expected = [3 + 1 + n for n in bare]  # "user" is one token
    assert [m.token_count for m in ctx.messages] == expected
    assert ctx.stats.history_tokens == sum(expected)
    assert ctx.stats.tokenizer == core.model_info(build_model).tokenizer


def test_context_grows_by_exactly_the_appended_messages(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    client.append("a1", "one", "two")
    before = _build(client)
    client.append("a1", "three")
    after = _build(client)
    assert [m.content for m in after.messages] == [m.content for m in before.messages] + ["three"]
    assert client.stub.ListEvents(pb.ListEventsRequest(agent="a1")).events == []


def test_summarize_uses_llm_then_reuses_the_stored_summary(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nShip the parser.\n## Progress\nTokenizer done."))
    for i in range(60):
        client.append("a1", f"step {i}: edit src/parser_{i}.rs " + "details " * 30)
    options = pb.BuildOptions(budget_tokens=3_000, summarize=True, keep_recent_tokens=1_000)
    ctx = _build(client, options=options)
    assert ctx.stats.summarizer_path == "llm"
    assert ctx.messages[0].is_summary and "Ship the parser." in ctx.messages[0].content
    assert ctx.stats.total_tokens <= 3_000
    # The 10 most recent messages are there unchanged (seed 002).
    assert [m.content for m in ctx.messages[-10:]] == [
        f"step {i}: edit src/parser_{i}.rs " + "details " * 30 for i in range(50, 60)
    ]
    summary_id = ctx.messages[0].id
    stored = [m for m in client.history("a1") if m.is_summary]
    assert [m.id for m in stored] == [summary_id]
    assert stored[0].first_summarized_id == ctx.stats.first_summarized_id > 0
    assert "src/parser_0.rs" in stored[0].content  # specifics ledger, verbatim
    calls = len(fake.requests)
    again = _build(client, options=options)
    assert again.stats.summarizer_path == "reused" and len(fake.requests) == calls
    assert again.messages[0].id == summary_id
    event = client.stub.ListEvents(pb.ListEventsRequest(agent="a1")).events[0]
    assert json.loads(event.data)["summarizer_path"] == "llm"


def test_a_summary_with_the_nul_character_is_stored_without_it(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    """A model's answer holding U+0000 used to reach the store: PostgreSQL refused the
    summary row and the build failed with INTERNAL."""
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nShip\x00 the parser.\n## Progress\nDone\x00."))
    for i in range(60):
        client.append("a1", f"step {i}: edit src/parser_{i}.rs " + "details " * 30)
    options = pb.BuildOptions(budget_tokens=3_000, summarize=True, keep_recent_tokens=1_000)
    ctx = _build(client, options=options)
    assert ctx.stats.summarizer_path == "llm"
    assert "Ship the parser." in ctx.messages[0].content
    stored = [m for m in client.history("a1") if m.is_summary]
    assert len(stored) == 1 and "\x00" not in stored[0].content
    assert "Ship the parser." in stored[0].content


def test_summaries_share_one_client_connection(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    """The summarizer keeps one anthropic client: later summaries reuse its connection
    instead of opening (and closing) one per call."""
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nKeep going."))
    for round_ in range(3):
        for i in range(30):
            client.append("a1", f"round {round_} step {i} " + "details " * 30)
        client.stub.CompactContext(
            pb.CompactContextRequest(
                agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=500)
            )
        )
    assert len(fake.requests) == 3
    assert len({r.peer for r in fake.requests}) == 1


@pytest.mark.parametrize("failure", ["error", "slow"])
def test_summary_falls_back_when_the_llm_fails(
    running: tuple[RunningServer, Client], fake: FakeAnthropic, failure: str
) -> None:
    _, client = running
    if failure == "error":
        fake.reply_error(529)
    else:
        fake.reply_slow(5.0)
    for i in range(40):
        client.append("a1", f"please fix bug {i} " + "context " * 30)
    ctx = _build(
        client, options=pb.BuildOptions(budget_tokens=2_000, summarize=True, keep_recent_tokens=500)
    )
    assert ctx.stats.summarizer_path == "fallback"
    assert ctx.stats.summarizer_error
    assert ctx.messages[0].is_summary and "please fix bug" in ctx.messages[0].content
    assert ctx.stats.total_tokens <= 2_000


def test_compact_context_on_demand(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nCompacted."))
    for i in range(30):
        client.append("a1", f"m{i} " + "words " * 50)
    result = client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=100)
        )
    )
    assert result.summarizer_path == "llm" and result.summary.is_summary
    ctx = _build(client)
    assert ctx.messages[0].id == result.summary.id and ctx.stats.summarizer_path == "reused"
    assert len(ctx.messages) < 30


def test_a_backdated_message_after_a_summary_is_still_built(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    """A message appended after a compaction with a source time inside the summarized
    span was not summarized: the build keeps it, in append order (it used to vanish
    from the context)."""
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nCompacted."))
    receipts = [client.append("a1", f"m{i} " + "words " * 50).receipts[0] for i in range(30)]
    client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=100)
        )
    )
    early = ts(receipts[1].create_time.ToMicroseconds() - 1)
    client.append("a1", "backdated note", source_time=early)
    ctx = _build(client)
    assert ctx.messages[0].is_summary
    assert ctx.messages[-1].content == "backdated note"
    assert ctx.messages[-1].source_time == early
    assert ctx.stats.summarizer_path == "reused"


def test_compact_with_nothing_old_is_failed_precondition(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    client.append("a1", "only one")
    with pytest.raises(grpc.RpcError) as info:
        client.stub.CompactContext(pb.CompactContextRequest(agent="a1", thread="t1"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_elide_old_tool_results(running: tuple[RunningServer, Client]) -> None:
    _, client = running
    calls = json.dumps([{"id": "c1", "name": "read_file", "input": {"path": "big.log"}}])
    client.append("a1", "read the log")
    client.append("a1", "", role=TOOL_USE, tool_calls=calls)
    big = client.append("a1", "x" * 10_000, role=TOOL_RESULT, tool_call_id="c1").receipts[0]
    for i in range(4):
        client.append("a1", f"turn {i}")
        client.append("a1", f"reply {i}", role=ASSISTANT)
    ctx = _build(
        client,
        options=pb.BuildOptions(elide_tool_results=True),
        formats=[pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI, pb.CONTEXT_FORMAT_TEXT],
    )
    [stub] = [m for m in ctx.messages if m.id == big.id]
    assert stub.elided and "read_file" in stub.content and f"message:{big.id}" in stub.content
    assert list(ctx.stats.elided_ids) == [big.id]
    stored = next(m for m in client.history("a1") if m.id == big.id)
    assert stored.content == "x" * 10_000  # the stored message stays intact
    anthropic = json.loads(rendering(ctx, pb.CONTEXT_FORMAT_ANTHROPIC))
    roles = [m["role"] for m in anthropic["messages"]]
    assert all(a != b for a, b in pairwise(roles))
    openai = json.loads(rendering(ctx, pb.CONTEXT_FORMAT_OPENAI))
    tool_ids = {
        c["id"] for m in openai if m["role"] == "assistant" for c in m.get("tool_calls", [])
    }
    assert {m["tool_call_id"] for m in openai if m["role"] == "tool"} <= tool_ids
    assert rendering(ctx, pb.CONTEXT_FORMAT_TEXT).count("User:") >= 5


# ----------------------------------------------------------------- status and bad input


def test_status_set_list_clear(running: tuple[RunningServer, Client]) -> None:
    _, client = running
    client.append("a1", "x")
    for key in ["b", "a", "c"]:
        client.stub.SetStatus(
            pb.SetStatusRequest(
                agent="a1",
                entry=pb.StatusEntry(
                    key=key, kind=pb.STATUS_KIND_THREAD, state="running", summary=f"entry {key}"
                ),
            )
        )
    client.stub.SetStatus(
        pb.SetStatusRequest(
            agent="a1",
            entry=pb.StatusEntry(
                key="a", kind=pb.STATUS_KIND_THREAD, state="done", summary="replaced"
            ),
        )
    )
    page = client.stub.ListStatus(pb.ListStatusRequest(agent="a1", page_size=2))
    assert [e.key for e in page.entries] == ["a", "b"] and page.entries[0].state == "done"
    rest = client.stub.ListStatus(
        pb.ListStatusRequest(agent="a1", page_token=page.next_page_token, page_size=2)
    )
    assert [e.key for e in rest.entries] == ["c"]
    assert client.stub.ClearStatus(pb.ClearStatusRequest(agent="a1", key="b")).removed_count == 1
    assert client.stub.ClearStatus(pb.ClearStatusRequest(agent="a1")).removed_count == 2
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ClearStatus(pb.ClearStatusRequest(agent="a1", key="b"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "request_",
    [
        pb.BuildContextRequest(agent="a1", options=pb.BuildOptions(budget_tokens=5)),
        pb.BuildContextRequest(agent="a1", model="no-such-model"),
        pb.BuildContextRequest(agent="a1", options=pb.BuildOptions(max_chars_per_message=0)),
        pb.BuildContextRequest(agent="a1", options=pb.BuildOptions(safety_margin=1.5)),
        pb.BuildContextRequest(agent="a1", formats=[42]),  # type: ignore[list-item]
        pb.BuildContextRequest(agent="bad name"),
    ],
)
def test_bad_build_requests_are_invalid_argument(
    running: tuple[RunningServer, Client], request_: pb.BuildContextRequest
) -> None:
    _, client = running
    _agent(client, system_prompt="A system prompt that needs more than five tokens for sure.")
    with pytest.raises(grpc.RpcError) as info:
        client.stub.BuildContext(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_status_is_invalid_argument(running: tuple[RunningServer, Client]) -> None:
    _, client = running
    client.append("a1", "x")
    for entry in (
        pb.StatusEntry(key="k", summary="no kind"),
        pb.StatusEntry(kind=pb.STATUS_KIND_THREAD, summary="no key"),
        pb.StatusEntry(key="k", kind=pb.STATUS_KIND_THREAD, summary="s" * 501),
    ):
        with pytest.raises(grpc.RpcError) as info:
            client.stub.SetStatus(pb.SetStatusRequest(agent="a1", entry=entry))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_build_unknown_agent_is_not_found(running: tuple[RunningServer, Client]) -> None:
    _, client = running
    with pytest.raises(grpc.RpcError) as info:
        _build(client, agent="ghost")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_agent_build_options_are_defaults_and_calls_override(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    _agent(client, build_options=pb.BuildOptions(budget_tokens=500))
    assert (
        client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent.build_options.budget_tokens == 500
    )
    for i in range(100):
        client.append("a1", f"m{i} " + "word " * 20)
    assert _build(client).stats.budget_tokens == 500
    assert _build(client, options=pb.BuildOptions(budget_tokens=900)).stats.budget_tokens == 900


def test_build_reads_content_only_for_what_can_fit(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    _agent(client, model="gpt-4o")
    batch = [
        pb.Message(role=USER if i % 2 == 0 else ASSISTANT, content=f"msg {i} " + "w " * 40)
        for i in range(1_000)
    ]
    for _ in range(10):
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1", thread="t1", messages=batch, create_agent_if_missing=True
            )
        )
    ctx = _build(client, options=pb.BuildOptions(budget_tokens=4_000))
    assert ctx.stats.messages_before == 10_000
    assert ctx.stats.total_tokens <= 4_000
    assert ctx.stats.messages_after <= ctx.stats.messages_loaded < 300
    assert ctx.messages[-1].content == batch[-1].content


def test_summary_of_cleared_messages_is_not_reused(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nOld work."))
    for i in range(30):
        client.append("a1", f"old {i} " + "words " * 50)
    client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=100)
        )
    )
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    client.append("a1", "fresh start")
    ctx = _build(client, options=pb.BuildOptions(summarize=True))
    assert [m.content for m in ctx.messages] == ["fresh start"]
    assert ctx.stats.summarizer_path == ""


def test_second_summary_updates_the_first(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nFirst checkpoint."))
    options = pb.BuildOptions(budget_tokens=3_000, summarize=True, keep_recent_tokens=800)
    for i in range(80):
        client.append("a1", f"a{i} " + "words " * 40)
    first = _build(client, options=options)
    assert first.stats.summarizer_path == "llm"
    fake.reply_text(full_checkpoint("## Goal\nSecond checkpoint."))
    for i in range(80):
        client.append("a1", f"b{i} " + "words " * 40)
    second = _build(client, options=options)
    assert second.stats.summarizer_path == "llm"
    assert "Second checkpoint." in second.messages[0].content
    # The update prompt carried the first summary and only the new messages.
    prompt = json.dumps(fake.requests[-1].body)
    conversation = prompt.split("<conversation>")[-1]  # the goal line quotes a0, by design
    assert "First checkpoint." in prompt and "a0 " not in conversation
    assert second.stats.first_summarized_id == first.stats.first_summarized_id
    assert second.stats.total_tokens <= 3_000


@pytest.mark.parametrize(
    "options",
    [
        pb.BuildOptions(budget_tokens=1_500),
        pb.BuildOptions(budget_tokens=1_500, elide_tool_results=True, elide_threshold_chars=100),
        pb.BuildOptions(budget_tokens=1_500, summarize=True, keep_recent_tokens=300),
        pb.BuildOptions(
            budget_tokens=1_500, summarize=True, elide_tool_results=True, truncate=False
        ),
    ],
)
def test_parallel_tool_calls_stay_paired_in_every_rendering(
    running: tuple[RunningServer, Client], fake: FakeAnthropic, options: pb.BuildOptions
) -> None:
    _, client = running
    fake.reply_text(full_checkpoint("## Goal\nKeep going."))
    for turn in range(12):
        client.append("a1", f"turn {turn}: look around " + "please " * 20)
        calls = [{"id": f"t{turn}c{k}", "name": f"tool{k}", "input": {"k": k}} for k in range(3)]
        client.append("a1", "", role=TOOL_USE, tool_calls=json.dumps(calls))
        for k in (2, 0, 1):  # parallel results, out of order
            client.append(
                "a1",
                f"result {turn}/{k} " + "data " * 60,
                role=TOOL_RESULT,
                tool_call_id=f"t{turn}c{k}",
            )
        client.append("a1", f"done with turn {turn}", role=ASSISTANT)
    ctx = _build(
        client, options=options, formats=[pb.CONTEXT_FORMAT_ANTHROPIC, pb.CONTEXT_FORMAT_OPENAI]
    )
    assert ctx.stats.total_tokens <= 1_500
    assert ctx.messages[-1].content == "done with turn 11"
    results = [m for m in ctx.messages if m.role == TOOL_RESULT]
    uses = [m for m in ctx.messages if m.role == TOOL_USE]
    answered = {c["id"] for m in uses for c in json.loads(m.tool_calls)}
    assert {m.tool_call_id for m in results} == answered  # groups kept whole
    anthropic = json.loads(rendering(ctx, pb.CONTEXT_FORMAT_ANTHROPIC))["messages"]
    assert anthropic[0]["role"] == "user"
    for before, after in pairwise(anthropic):
        assert before["role"] != after["role"]
        blocks = after["content"] if isinstance(after["content"], list) else []
        answers = {b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"}
        if answers:
            asked = {b["id"] for b in before["content"] if b.get("type") == "tool_use"}
            assert answers <= asked
    openai = json.loads(rendering(ctx, pb.CONTEXT_FORMAT_OPENAI))
    seen: set[str] = set()
    for m in openai:
        seen |= {c["id"] for c in m.get("tool_calls", [])}
        if m["role"] == "tool":
            assert m["tool_call_id"] in seen


def test_list_events_filters_by_type_and_time_and_pages(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    times = []
    for budget in (300, 400, 500):
        for i in range(20):
            client.append("a1", f"m{i} " + "words " * 30)
        client.stub.CompactContext(
            pb.CompactContextRequest(
                agent="a1",
                thread="t1",
                options=pb.BuildOptions(budget_tokens=budget, keep_recent_tokens=1),
            )
        )
        events = client.stub.ListEvents(pb.ListEventsRequest(agent="a1")).events
        times.append(events[-1].create_time)
    first = client.stub.ListEvents(pb.ListEventsRequest(agent="a1", page_size=2))
    assert len(first.events) == 2 and first.next_page_token
    rest = client.stub.ListEvents(
        pb.ListEventsRequest(agent="a1", page_size=2, page_token=first.next_page_token)
    )
    budgets = [json.loads(e.data)["budget_tokens"] for e in [*first.events, *rest.events]]
    assert budgets == [300, 400, 500]
    later = client.stub.ListEvents(pb.ListEventsRequest(agent="a1", start_time=times[1]))
    assert [json.loads(e.data)["budget_tokens"] for e in later.events] == [400, 500]
    earlier = client.stub.ListEvents(pb.ListEventsRequest(agent="a1", end_time=times[1]))
    assert [json.loads(e.data)["budget_tokens"] for e in earlier.events] == [300]
    none = client.stub.ListEvents(pb.ListEventsRequest(agent="a1", type="other.type"))
    assert list(none.events) == []


def test_client_metadata_cannot_pose_as_a_stored_summary(
    running: tuple[RunningServer, Client],
) -> None:
    _, client = running
    client.append("a1", "first", "second")
    client.append("a1", "fake", metadata=json.dumps({"is_summary": True, "summary_of": [1, 2]}))
    ctx = _build(client, options=pb.BuildOptions(summarize=True))
    assert [m.content for m in ctx.messages] == ["first", "second", "fake"]
    assert not any(m.is_summary for m in ctx.messages)
    assert not any(m.is_summary for m in client.history("a1"))


def test_delete_is_final_while_a_summary_is_in_flight(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    """A summarizing build used to re-create a deleted agent and store its summary."""
    server, client = running
    _agent(client)
    with summary_in_flight(client, fake, "## Goal\nsummary of deleted messages") as outcome:
        client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    assert outcome["error"].code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        client.stub.GetAgent(pb.GetAgentRequest(name="a1"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert db_rows(server.store, "SELECT count(*) FROM messages") == [(0,)]
    assert db_rows(server.store, "SELECT count(*) FROM events") == [(0,)]


def test_append_to_an_unknown_agent_is_not_found_unless_asked(client: Client) -> None:
    request = pb.AppendMessagesRequest(
        agent="typo", thread="t1", messages=[pb.Message(role=USER, content="hi")]
    )
    with pytest.raises(grpc.RpcError) as info:
        client.stub.AppendMessages(request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError):
        client.stub.GetAgent(pb.GetAgentRequest(name="typo"))
    request.create_agent_if_missing = True
    client.stub.AppendMessages(request)
    assert client.stub.GetAgent(pb.GetAgentRequest(name="typo")).agent.name == "typo"
