"""Compaction: cut points, tool-pair repair, summary reuse, elision; and the summarize
strategy end to end through the real anthropic client against the local fake."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_anthropic import FakeAnthropic
from hypothesis import given, settings
from test_assembly import History, check_pairs, histories

from contextd.app.build import ledger
from contextd.app.build.assembly import assemble
from contextd.app.build.compaction import (
    elide_tool_results,
    make_summary_item,
    plan_compaction,
    repair_tool_pairs,
    split_summary,
    summary_range,
    valid_cuts,
)
from contextd.app.build.summarizer import (
    SPECIFICS_HEADING,
    SUMMARY_SECTIONS,
    AnthropicConfig,
    AnthropicSummarizer,
    SummaryResult,
    parse_specifics,
)
from contextd.domain.context import HistoryItem, StrategyOptions, estimate_counter
from contextd.domain.model import Role


def parallel_turn(start: int, n: int, style: str = "anthropic") -> list[HistoryItem]:
    if style == "anthropic":
        calls = [{"id": f"p{start}_{k}", "name": "read_file", "input": {"k": k}} for k in range(n)]
    else:
        calls = [
            {
                "id": f"p{start}_{k}",
                "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"k": k})},
            }
            for k in range(n)
        ]
    items = [HistoryItem(start, Role.TOOL_USE, "reading", tool_calls=json.dumps(calls))]
    items += [
        HistoryItem(
            start + 1 + k, Role.TOOL_RESULT, f"content {k} " * 300, tool_call_id=f"p{start}_{k}"
        )
        for k in range(n)
    ]
    return items


def test_cuts_never_split_a_parallel_group_nor_start_at_a_result() -> None:
    items = [
        HistoryItem(1, Role.USER, "go"),
        *parallel_turn(2, 3),
        HistoryItem(6, Role.ASSISTANT, "done"),
    ]
    assert valid_cuts(items) == [True, True, False, False, False, True, True]


@settings(max_examples=200, deadline=None)
@given(h=histories())
def test_plan_cuts_at_a_valid_boundary_and_keeps_the_recent_messages(h: History) -> None:
    items, _ = repair_tool_pairs(h.items)
    costs = estimate_counter([it.counted_text for it in items]) if items else []
    plan = plan_compaction(
        items,
        costs,
        previous_summary=None,
        keep_recent_tokens=50,
        keep_recent_messages=3,
        max_recent_tokens=10**9,
    )
    assert valid_cuts(items)[plan.cut_index]
    assert list(plan.to_summarize) + list(plan.kept) == items
    assert len(plan.kept) >= min(3, len(items))
    if plan.to_summarize:
        assert plan.kept[0].role is not Role.TOOL_RESULT
        assert plan.covers == (items[0].id, plan.to_summarize[-1].id)
        check_pairs(list(plan.kept))


def test_plan_respects_the_room_beside_the_summary_but_keeps_the_newest_turn() -> None:
    items = [
        HistoryItem(i, Role.USER if i % 2 else Role.ASSISTANT, "x" * 400) for i in range(1, 21)
    ]
    costs = [100] * 20
    plan = plan_compaction(
        items,
        costs,
        previous_summary=None,
        keep_recent_tokens=10**6,
        keep_recent_messages=10,
        max_recent_tokens=350,
    )
    assert plan.cut_index == 17  # three messages fit in 350
    plan = plan_compaction(
        items,
        costs,
        previous_summary=None,
        keep_recent_tokens=0,
        keep_recent_messages=0,
        max_recent_tokens=50,
    )
    assert plan.cut_index == 19, "the newest turn is never folded away"


def test_repair_makes_orphans_text_and_removes_unanswered_calls() -> None:
    calls = [{"id": "a", "name": "ls", "input": {}}, {"id": "b", "name": "cat", "input": {}}]
    items = [
        HistoryItem(1, Role.TOOL_RESULT, "stray output", tool_call_id="zzz"),
        HistoryItem(2, Role.TOOL_USE, "", tool_calls=json.dumps(calls)),
        HistoryItem(3, Role.TOOL_RESULT, "file list", tool_call_id="a"),
        HistoryItem(4, Role.TOOL_USE, "", tool_calls='[{"id":"c","name":"rm","input":{}}]'),
        HistoryItem(5, Role.USER, "stop"),
    ]
    out, repaired = repair_tool_pairs(items)
    assert repaired == [1, 2, 4]
    assert out[0].role is Role.USER and "stray output" in out[0].content
    assert json.loads(out[1].tool_calls) == [calls[0]]
    assert out[3].role is Role.ASSISTANT and out[3].tool_calls == ""
    assert "rm({})" in out[3].content and "no result" in out[3].content
    check_pairs(out)
    assert repair_tool_pairs(out) == (out, []), "idempotent"


@pytest.mark.parametrize("style", ["anthropic", "openai"])
def test_old_long_tool_results_become_stubs_with_a_handle(style: str) -> None:
    items = [
        HistoryItem(1, Role.USER, "read them"),
        *parallel_turn(2, 2, style),
        HistoryItem(5, Role.USER, "and again"),
        *parallel_turn(6, 1, style),
    ]
    out, elided = elide_tool_results(items, threshold_chars=1000, keep_recent_turns=1)
    assert elided == [3, 4]
    assert "read_file" in out[2].content and "message:3" in out[2].content
    assert out[2].tool_call_id == items[2].tool_call_id
    assert out[6] == items[6], "results in the most recent turn are kept whole"
    assert items[2].content.startswith("content 0"), "the input is untouched"
    _, none = elide_tool_results(items, threshold_chars=10**6, keep_recent_turns=1)
    assert none == []


def test_summary_item_carries_range_flag_and_ledger() -> None:
    result = SummaryResult("## Goal\nship it", "llm", None, ("src/a.py", "`make`"))
    item = make_summary_item(result, (3, 17), estimate_counter)
    assert item.is_summary and item.summary_of == (3, 17) and item.role is Role.USER
    assert item.id == -17
    assert item.content.index("## Goal") < item.content.index(SPECIFICS_HEADING)
    assert parse_specifics(item.content) == ["src/a.py", "`make`"]
    assert json.loads(item.metadata) == {
        "is_summary": True,
        "summary_of": [3, 17],
        "summarizer": "llm",
    }
    assert summary_range(HistoryItem(9, Role.USER, "s", metadata=item.metadata)) == (3, 17)
    assert item.token_count == estimate_counter([item.content])[0]


def test_split_summary_skips_what_the_summary_covers() -> None:
    summary = HistoryItem(-4, Role.USER, "sum", is_summary=True, summary_of=(1, 4))
    window = [HistoryItem(i, Role.USER, str(i)) for i in range(1, 8)]
    found, rest = split_summary([*window, summary])
    assert found == summary and [it.id for it in rest] == [5, 6, 7]
    found, rest = split_summary(window, previous_summary=summary)
    assert found == summary and [it.id for it in rest] == [5, 6, 7]


# ---------------------------------------------------------------- through the real client


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


def checkpoint(goal: str) -> str:
    """A model's checkpoint with every section (the quality gate wants them all)."""
    return "\n\n".join(f"## {s}\n{goal if s == 'Goal' else 'None.'}" for s in SUMMARY_SECTIONS)


def long_conversation(first: int, n: int) -> list[HistoryItem]:
    return [
        HistoryItem(
            i,
            Role.USER if i % 2 else Role.ASSISTANT,
            f"marker-{i} edit src/mod_{i}.py " + "filler " * 60,
        )
        for i in range(first, first + n)
    ]


def test_summarize_strategy_uses_the_llm_and_reuses_its_summary(
    fake: FakeAnthropic, request: pytest.FixtureRequest
) -> None:
    summarizer = AnthropicSummarizer(AnthropicConfig(api_key="k", base_url=fake.base_url))
    request.addfinalizer(summarizer.close)  # its connection, not left to a later test's GC
    opts = StrategyOptions(summarize=True, keep_recent_tokens=400, keep_recent_messages=4)
    fake.reply_text(checkpoint("first checkpoint"))
    first = assemble(
        system_prompt="s",
        history=long_conversation(1, 30),
        budget=1500,
        count_tokens=estimate_counter,
        options=opts,
        summarizer=summarizer,
    )
    assert first.stats.summarizer_path == "llm" and first.summary is not None
    assert "first checkpoint" in first.summary.content
    assert "src/mod_1.py" in parse_specifics(first.summary.content)
    lo, hi = first.stats.summarized_range or (0, 0)
    assert lo == 1
    assert first.stats.total_tokens <= 1500

    # The caller stores the summary; the next build reuses it and folds only newer ones.
    fake.reply_text(checkpoint("updated checkpoint"))
    window = [*long_conversation(1, 200), first.summary]
    second = assemble(
        system_prompt="s",
        history=window,
        budget=1500,
        count_tokens=estimate_counter,
        options=opts,
        summarizer=summarizer,
    )
    assert second.stats.summarizer_path == "llm"
    assert second.stats.summarized_range is not None
    assert second.stats.summarized_range[0] == 1
    prompt = fake.requests[-1].body["messages"][0]["content"]
    assert "<previous-checkpoint>" in prompt and "first checkpoint" in prompt
    assert f"marker-{hi} " not in prompt and f"marker-{hi + 1} " in prompt
    # The ledger carried the first summary's entries; at this budget its share (half:
    # the window is many times the budget) holds only the newest, so the oldest went
    # first, and the build says so.
    kept = parse_specifics(second.history[0].content)
    assert second.stats.ledger_evicted > 0 and "src/mod_1.py" not in kept
    newest_folded = second.stats.summarized_range[1]  # the newest entry is its evidence
    assert second.stats.ledger_entries == len(kept) and kept[-1] == f"src/mod_{newest_folded}.py"
    assert second.stats.ledger_tokens <= 1500 * ledger.MAX_LEDGER_SHARE


def test_summarize_strategy_survives_an_api_failure(
    fake: FakeAnthropic, request: pytest.FixtureRequest
) -> None:
    fake.reply_error(529)
    summarizer = AnthropicSummarizer(AnthropicConfig(api_key="k", base_url=fake.base_url))
    request.addfinalizer(summarizer.close)
    ctx = assemble(
        system_prompt="s",
        history=long_conversation(1, 30),
        budget=1500,
        count_tokens=estimate_counter,
        summarizer=summarizer,
        options=StrategyOptions(summarize=True, keep_recent_tokens=400),
    )
    assert ctx.stats.summarizer_path == "fallback"
    assert ctx.stats.summarizer_error is not None and "529" in ctx.stats.summarizer_error
    assert ctx.history[0].is_summary and "User asked: marker-" in ctx.history[0].content
    assert ctx.stats.total_tokens <= 1500


def test_an_elision_stub_quotes_the_outputs_errors_and_specifics() -> None:
    log = "collected 412 items\n" + "ok line\n" * 500
    log += "FAILED tests/test_lease.py::test_renew - LeaseError: slot 7 leased twice\n"
    log += "see internal/lease/pool.go; 411 passed, 1 failed in 12.5s\n"
    items = [
        HistoryItem(1, Role.USER, "run the tests"),
        HistoryItem(
            2, Role.TOOL_USE, "", tool_calls='[{"id":"c1","name":"bash","input":{"cmd":"go"}}]'
        ),
        HistoryItem(3, Role.TOOL_RESULT, log, tool_call_id="c1"),
        HistoryItem(4, Role.USER, "next"),
    ]
    out, elided = elide_tool_results(items, threshold_chars=1000, keep_recent_turns=1)
    assert elided == [3]
    stub = out[2].content
    assert "FAILED tests/test_lease.py::test_renew - LeaseError: slot 7 leased twice" in stub
    assert "internal/lease/pool.go" in stub and "411 passed" in stub
    assert stub.endswith("Full output: message:3]") and len(stub) < 800
