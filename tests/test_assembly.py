"""Context assembly: seed 000's order and parts, seed 002's properties, and the budget,
newest-turn and tool-pair invariants on random histories for every strategy."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextd import core
from contextd.app.build.assembly import BudgetTooSmallError, assemble, render_docs
from contextd.app.build.compaction import split_summary
from contextd.app.build.status_text import status_preamble
from contextd.app.build.trimming import cut_text
from contextd.domain.context import (
    AssembledContext,
    Budget,
    HistoryItem,
    StatusEntry,
    StatusKind,
    StrategyOptions,
    ThreadActivity,
    TokenCounter,
    counter_for_encoding,
    counter_for_model,
    estimate_counter,
    parse_tool_calls,
)
from contextd.domain.model import AgentDoc, Role, StoredMessage
from contextd.domain.window import window_spec

S = 1_000_000
NOW = 1_750_000_000 * S
O200K = counter_for_encoding("o200k_base")


def user(i: int, text: str) -> HistoryItem:
    return HistoryItem(i, Role.USER, text)


def assistant(i: int, text: str) -> HistoryItem:
    return HistoryItem(i, Role.ASSISTANT, text)


# ---------------------------------------------------------------- random histories


@dataclass
class History:
    items: list[HistoryItem]


WORDS = st.sampled_from(
    ["alpha", "beta", "src/app.py", "ERROR", "42", "ms", "数据", "the", "`make test`", "\n"]
)


def texts(max_words: int) -> st.SearchStrategy[str]:
    return st.lists(WORDS, max_size=max_words).map(" ".join)


@st.composite
def histories(draw: st.DrawFn, max_turns: int = 14) -> History:
    """Well-formed and messy histories: text turns, tool turns with parallel calls in
    Anthropic or OpenAI style, results in any order, sometimes interleaved with user
    text, sometimes missing, sometimes orphaned; now and then a huge message."""
    items: list[HistoryItem] = []
    next_id = 1

    def add(role: Role, content: str, tool_calls: str = "", tool_call_id: str = "") -> None:
        nonlocal next_id
        items.append(HistoryItem(next_id, role, content, tool_calls, tool_call_id))
        next_id += draw(st.integers(1, 3))

    for _ in range(draw(st.integers(0, max_turns))):
        kind = draw(st.sampled_from(["user", "assistant", "tool", "tool", "orphan", "huge"]))
        if kind == "user":
            add(Role.USER, draw(texts(40)))
        elif kind == "assistant":
            add(Role.ASSISTANT, draw(texts(40)))
        elif kind == "huge":
            add(draw(st.sampled_from([Role.USER, Role.ASSISTANT])), "word " * 3000)
        elif kind == "orphan":
            add(Role.TOOL_RESULT, draw(texts(20)), tool_call_id=f"ghost{next_id}")
        else:
            n = draw(st.integers(1, 3))
            ids = [f"c{next_id}_{k}" for k in range(n)]
            style = draw(st.sampled_from(["anthropic", "openai"]))
            calls: list[dict[str, object]] = []
            for k, cid in enumerate(ids):
                name = f"tool{k}"
                if style == "anthropic":
                    calls.append({"id": cid, "name": name, "input": {"q": cid}})
                else:
                    calls.append(
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps({"q": cid})},
                        }
                    )
            role = draw(st.sampled_from([Role.TOOL_USE, Role.TOOL_USE, Role.ASSISTANT]))
            add(role, draw(texts(10)), tool_calls=json.dumps(calls))
            answered = draw(st.permutations(ids))
            if draw(st.integers(0, 5)) == 0:
                answered = answered[:-1]  # a pending call
            for cid in answered:
                if draw(st.integers(0, 6)) == 0:
                    add(Role.USER, draw(texts(10)))  # the user wrote while tools ran
                size = draw(st.sampled_from([5, 40, 800]))
                add(Role.TOOL_RESULT, draw(texts(size)), tool_call_id=cid)
    return History(items)


STRATEGIES = {
    "truncate": StrategyOptions(),
    "no-truncate": StrategyOptions(truncate=False),
    "summarize": StrategyOptions(summarize=True, keep_recent_tokens=200, keep_recent_messages=4),
    "elide": StrategyOptions(
        elide_tool_results=True, elide_threshold_chars=100, elide_keep_recent_turns=1
    ),
    "all": StrategyOptions(
        summarize=True,
        elide_tool_results=True,
        elide_threshold_chars=50,
        keep_recent_tokens=100,
        keep_recent_messages=2,
        max_chars_per_message=300,
    ),
}


def check_pairs(history: tuple[HistoryItem, ...] | list[HistoryItem]) -> None:
    """No tool_result without its tool_use before it; every call answered exactly once."""
    issued: dict[str, int] = {}
    answered: dict[str, int] = {}
    for item in history:
        if item.role is Role.TOOL_RESULT:
            assert item.tool_call_id in issued, f"orphan result {item.id}"
            answered[item.tool_call_id] = answered.get(item.tool_call_id, 0) + 1
        elif item.tool_calls:
            for call in parse_tool_calls(item.tool_calls):
                assert call.id and call.id not in issued
                issued[call.id] = item.id
    assert answered == dict.fromkeys(issued, 1), "a call without exactly one result"


def check_context(
    ctx: AssembledContext,
    history: list[HistoryItem],
    new_message: str | None,
    budget: int,
    count: TokenCounter,
) -> None:
    stats = ctx.stats
    assert stats.total_tokens <= budget
    # The stats are the real cost of what is returned, part by part.
    assert stats.history_tokens == sum(count([it.counted_text for it in ctx.history]) or [0])
    assert stats.new_message_tokens == count([ctx.new_message or ""])[0]
    assert all(it.token_count == count([it.counted_text])[0] for it in ctx.history)
    check_pairs([it for it in ctx.history if not it.is_summary])
    if new_message and not new_message.strip():
        assert ctx.new_message is None  # whitespace only: no new message
    elif new_message:
        assert ctx.new_message is not None
        if stats.new_message_truncated:
            assert new_message.startswith(ctx.new_message.split("\n[…")[0])
        else:
            assert ctx.new_message == new_message
    # Every input message is kept, dropped or summarized, and said so: nothing vanishes.
    kept = [it.id for it in ctx.history if not it.is_summary]
    assert kept == sorted(kept)
    dropped = set(stats.dropped_ids)
    lo, hi = stats.summarized_range or (1, 0)
    for item in history:
        placed = (item.id in kept) + (item.id in dropped) + (lo <= item.id <= hi)
        assert placed == 1, f"message {item.id} kept/dropped/summarized {placed} times"
    # The ranges name exactly the dropped messages, as runs of the window's order.
    _, rest = split_summary(history)
    order = [it.id for it in rest]
    in_ranges: list[int] = []
    for first, last in stats.dropped_ranges:
        run = order[order.index(first) : order.index(last) + 1]
        assert run and all(i in dropped for i in run)
        in_ranges.extend(run)
    assert sorted(in_ranges) == sorted(dropped) and len(in_ranges) == len(set(in_ranges))
    if history and not (new_message and new_message.strip()):
        newest = history[-1].id
        assert newest in kept or stats.newest_turn_dropped, "newest turn dropped silently"
    for item in ctx.history:
        original = next((h for h in history if h.id == item.id), None)
        if original is not None and item.content != original.content:
            assert (
                item.id in stats.truncated_ids
                or item.id in stats.elided_ids
                or item.id in stats.repaired_ids
            )


# ---------------------------------------------------------------- property tests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=histories(),
    budget=st.integers(40, 4000),
    new_message=st.none() | texts(60),
    strategy=st.sampled_from(sorted(STRATEGIES)),
    exact=st.booleans(),
)
def test_random_histories_keep_every_invariant(
    h: History, budget: int, new_message: str | None, strategy: str, exact: bool
) -> None:
    count = O200K if exact else estimate_counter
    ctx = assemble(
        system_prompt="You are a careful agent.",
        docs=[AgentDoc("notes.md", "Be brief.")],
        status="Status: nothing else running.",
        history=h.items,
        new_message=new_message,
        budget=Budget.tokens(budget),
        count_tokens=count,
        options=STRATEGIES[strategy],
    )
    check_context(ctx, h.items, new_message, budget, count)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=histories(), chat=st.booleans(), with_request=st.booleans())
def test_the_newest_turn_of_chat_turns_costs_what_its_cuts_find(
    h: History, chat: bool, with_request: bool
) -> None:
    """A prepared window of chat turns alone finds its newest turn (and the request
    before it) without its tool groups (`PreparedHistory.chat`: every cut is valid), as a
    window extended after an append does; what that costs equals what the cuts find
    (`valid_cuts`), and only chat windows take that path."""
    from dataclasses import replace

    from contextd.app.build.compaction import chat_only
    from contextd.app.build.compressor import prepare_history
    from contextd.app.build.render import Framing

    items = [it for it in h.items if chat_only([it])] if chat else h.items
    prepared = prepare_history(items, StrategyOptions(), Framing(O200K, ()).items, None)
    assert prepared.chat == chat_only(prepared.work.items)
    by_cuts = replace(prepared, chat=False, protected={})
    assert prepared.protected_cost(with_request=with_request) == by_cuts.protected_cost(
        with_request=with_request
    )


@settings(max_examples=60, deadline=None)
@given(h=histories(max_turns=8), budget=st.integers(1, 60))
def test_tiny_budgets_still_keep_the_newest_turn_or_say_so(h: History, budget: int) -> None:
    ctx = assemble(
        system_prompt="",
        history=h.items,
        budget=budget,
        count_tokens=estimate_counter,
        options=StrategyOptions(summarize=True, keep_recent_messages=1, keep_recent_tokens=1),
    )
    check_context(ctx, h.items, None, budget, estimate_counter)


# ---------------------------------------------------------------- seed 000: assembly


def test_context_includes_system_prompt_docs_status_and_window_in_order() -> None:
    docs = [AgentDoc("style.md", "Use short sentences."), AgentDoc("api.md", "GET /v1/x")]
    status = status_preamble(
        [StatusEntry("build-7", StatusKind.PROCESS, "running", "compiling", NOW - 60 * S)],
        [ThreadActivity("t1", NOW - 5 * S, 2), ThreadActivity("t2", NOW - 3600 * S, 4)],
        NOW,
        "t1",
    )
    history = [user(1, "hello"), assistant(2, "hi there")]
    ctx = assemble(
        system_prompt="You are Chorus.",
        docs=docs,
        status=status,
        history=history,
        new_message="what next?",
        budget=Budget.for_model("gpt-4o"),
        count_tokens=counter_for_model("gpt-4o"),
    )
    assert ctx.system_prompt == "You are Chorus."
    assert ctx.docs == tuple(docs)
    assert "build-7" in ctx.status and "t2: 4 messages" in ctx.status
    assert [it.content for it in ctx.history] == ["hello", "hi there"]
    assert ctx.new_message == "what next?"
    s = ctx.stats
    assert s.system_tokens == core.count_tokens("You are Chorus.", "o200k_base")
    assert s.docs_tokens == core.count_tokens(render_docs(docs), "o200k_base")
    assert s.status_tokens == core.count_tokens(status, "o200k_base") > 0
    assert s.total_tokens == sum(
        core.count_tokens(t, "o200k_base")
        for t in ["You are Chorus.", render_docs(docs), status, "hello", "hi there", "what next?"]
    )
    assert s.budget == int((128_000 - 16_384) * 0.8)
    assert s.messages_before == s.messages_after == 2 and not s.dropped_ids


def test_window_is_bounded_by_clear_time_or_rolling_window() -> None:
    def stored(i: int, t_us: int) -> StoredMessage:
        return StoredMessage(
            i, "default", "a", "", "t1", Role.USER, f"m{i}", "", "", "", "", 1, t_us
        )

    messages = [stored(i, NOW - (10 - i) * 3600 * S) for i in range(10)]
    for clear, expected in [(NOW - 100 * 3600 * S, 5), (NOW - 2 * 3600 * S, 1)]:
        spec = window_spec(NOW, 5 * 3600 * S + 1, clear)
        window = [
            HistoryItem.from_stored(m)
            for m in messages
            if spec.holds(m.create_time_us, m.source_time_us)
        ]
        ctx = assemble(
            system_prompt="p", history=window, budget=10_000, count_tokens=estimate_counter
        )
        assert len(ctx.history) == expected
        assert all(int(it.content[1:]) >= 10 - expected for it in ctx.history)


def test_status_preamble_drops_expired_entries_and_shows_other_threads() -> None:
    entries = [
        StatusEntry(
            "deploy", StatusKind.THREAD, "running", "rolling out v2", NOW - 120 * S, NOW + 600 * S
        ),
        StatusEntry("old-job", StatusKind.PROCESS, "running", "stale", NOW - 9000 * S, NOW - 1),
        StatusEntry("tests", StatusKind.PROCESS, "done", "120 passed\nall green", NOW - 30 * S),
    ]
    activity = [
        ThreadActivity("main", NOW - 10 * S, 7),
        ThreadActivity("deploy", NOW - 120 * S, 3),
        ThreadActivity("idle", NOW - 99 * S, 0),
    ]
    text = status_preamble(entries, activity, NOW, "main")
    assert "old-job" not in text and "stale" not in text
    assert "[thread] deploy — running: rolling out v2 (updated 2m ago, expires in 10m)" in text
    assert "[process] tests — done: 120 passed all green" in text
    assert "- main (this thread): 7 messages, last 10s ago" in text
    assert "- deploy: 3 messages, last 2m ago" in text
    assert "idle" not in text
    assert text.index("tests") < text.index("[thread] deploy"), "newest update first"
    # A lone thread with nothing running pays nothing.
    assert status_preamble([entries[1]], [activity[0]], NOW, "main") == ""


# ---------------------------------------------------------------- seed 002 properties


def conversation(n: int, words: int = 20) -> list[HistoryItem]:
    return [
        (user if i % 2 else assistant)(i, f"message {i} " + "lorem ipsum " * words)
        for i in range(1, n + 1)
    ]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_context_grows_by_exactly_the_appended_messages(strategy: str) -> None:
    history = conversation(6)
    opts = STRATEGIES[strategy]
    kw = {
        "system_prompt": "sys",
        "budget": 100_000,
        "count_tokens": estimate_counter,
        "options": opts,
    }
    before = assemble(history=history, **kw)  # type: ignore[arg-type]
    grown = [*history, user(7, "next question"), assistant(8, "next answer")]
    after = assemble(history=grown, **kw)  # type: ignore[arg-type]
    assert after.stats.messages_after == before.stats.messages_after + 2
    assert after.history[:-2] == before.history
    assert [it.content for it in after.history[-2:]] == ["next question", "next answer"]


def test_summarization_stays_under_limit_and_keeps_10_recent_unchanged() -> None:
    history = conversation(60, words=80)
    total = sum(estimate_counter([it.content for it in history]))
    budget = total // 3
    ctx = assemble(
        system_prompt="sys",
        history=history,
        budget=Budget.tokens(budget),
        count_tokens=estimate_counter,
        options=StrategyOptions(summarize=True),
    )
    assert ctx.stats.total_tokens <= budget
    assert ctx.history[0].is_summary and ctx.summary == ctx.history[0]
    assert not ctx.history[0].content.endswith("[… truncated]")
    recent = [it for it in ctx.history if not it.is_summary]
    assert len(recent) >= 10
    assert [(it.id, it.role, it.content) for it in recent[-10:]] == [
        (it.id, it.role, it.content) for it in history[-10:]
    ]
    assert ctx.stats.summarizer_path == "fallback"  # no LLM given: the extractive summary
    lo, hi = ctx.stats.summarized_range or (0, 0)
    assert lo == 1 and hi == recent[0].id - 1
    assert f"message {hi} lorem" in ctx.history[0].content  # the newest folded one
    assert "earlier requests omitted)" in ctx.history[0].content  # 20 of them listed


def test_seed_002_budget_is_window_minus_reserve_minus_20_percent() -> None:
    assert Budget(200_000).prompt_budget == 160_000
    assert Budget(200_000, 16_384, 0.1).prompt_budget == int((200_000 - 16_384) * 0.9)
    assert Budget.tokens(1234).prompt_budget == 1234
    b = Budget.for_model("claude-sonnet-4-5-20250929")
    assert (b.context_window, b.output_reserve) == (200_000, 16_384)
    with pytest.raises(core.UnknownModelError):
        Budget.for_model("no-such-model")
    with pytest.raises(ValueError):
        Budget(100, safety_margin=1.5)


# ---------------------------------------------------------------- budget edges


def test_newest_message_alone_over_budget_is_truncated_and_recorded() -> None:
    history = [user(1, "old"), assistant(2, "x " * 20_000)]
    ctx = assemble(
        system_prompt="",
        history=history,
        budget=500,
        count_tokens=O200K,
        options=StrategyOptions(truncate=False),
    )
    assert [it.id for it in ctx.history] == [2]
    assert ctx.stats.truncated_ids == (2,) and ctx.stats.dropped_ids == (1,)
    assert ctx.stats.total_tokens <= 500
    assert "message:2" in ctx.history[0].content


def test_parallel_tool_group_over_budget_is_shrunk_not_split() -> None:
    calls = [{"id": f"c{k}", "name": "grep", "input": {"q": k}} for k in range(3)]
    history = [
        user(1, "search"),
        HistoryItem(2, Role.TOOL_USE, "", tool_calls=json.dumps(calls)),
        *[
            HistoryItem(3 + k, Role.TOOL_RESULT, "hit " * 900, tool_call_id=f"c{k}")
            for k in range(3)
        ],
    ]
    ctx = assemble(system_prompt="", history=history, budget=600, count_tokens=O200K)
    assert [it.id for it in ctx.history] == [2, 3, 4, 5]
    assert set(ctx.stats.truncated_ids) == {3, 4, 5}
    assert ctx.stats.total_tokens <= 600
    check_pairs(ctx.history)


def test_long_messages_keep_head_and_tail_within_max_chars_with_a_handle() -> None:
    # A "4,000-character" cut yields at most 4,000 characters, marker included, and keeps
    # the tail (where the error usually is) as well as the head.
    text = "START of output\n" + "line of log output\n" * 600 + "Error: the end is here"
    history = [user(1, text), assistant(2, "ok")]
    ctx = assemble(system_prompt="", history=history, budget=100_000, count_tokens=estimate_counter)
    first = ctx.history[0]
    assert 3_990 <= len(first.content) <= 4_000
    assert first.content.startswith("START of output\nline of log output")
    assert first.content.endswith("Error: the end is here")
    match = re.search(r"\n\[… (\d+) more chars truncated; full text: message:1\]\n", first.content)
    assert match is not None
    assert int(match.group(1)) == len(text) - (len(first.content) - len(match.group(0)))
    assert ctx.stats.truncated_ids == (1,)


@pytest.mark.parametrize("limit", [1, 40, 80, 100, 999, 4_000])
def test_a_cut_never_exceeds_its_limit_once_the_marker_fits(limit: int) -> None:
    text = "x" * 5_000
    cut = cut_text(text, limit, "message:12345")
    marker_only = "\n[… 5000 more chars truncated; full text: message:12345]\n"
    assert len(cut) <= max(limit, len(marker_only))
    assert "full text: message:12345" in cut
    assert cut_text("short", 10, "message:1") == "short"


def test_new_message_is_truncated_when_it_alone_exceeds_and_status_goes_first() -> None:
    ctx = assemble(
        system_prompt="sys",
        status="status " * 50,
        history=[user(1, "old")],
        new_message="word " * 5000,
        budget=300,
        count_tokens=O200K,
    )
    assert ctx.stats.status_dropped and ctx.status == ""
    assert ctx.stats.new_message_truncated
    assert ctx.new_message is not None and ctx.new_message.startswith("word word")
    assert ctx.stats.total_tokens <= 300
    assert ctx.history == () and ctx.stats.dropped_ids == (1,)


def test_budget_smaller_than_the_system_prompt_is_an_error() -> None:
    with pytest.raises(BudgetTooSmallError):
        assemble(system_prompt="long prompt " * 100, budget=50, count_tokens=estimate_counter)


def test_stored_summary_in_the_window_is_reused_and_covered_messages_skipped() -> None:
    meta = json.dumps({"is_summary": True, "summary_of": [1, 4]})
    summary = StoredMessage(
        9,
        "default",
        "a",
        "",
        "t1",
        Role.USER,
        "[checkpoint] earlier",
        "",
        "",
        "",
        meta,
        5,
        NOW,
        is_summary=True,
        summarized_ids=(1, 4),
    )
    window = [*conversation(6), HistoryItem.from_stored(summary)]
    ctx = assemble(system_prompt="", history=window, budget=10_000, count_tokens=estimate_counter)
    assert ctx.history[0].content == "[checkpoint] earlier"
    assert [it.id for it in ctx.history[1:]] == [5, 6]
    assert ctx.stats.summarizer_path == "reused"
