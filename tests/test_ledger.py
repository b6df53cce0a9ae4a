"""The specifics ledger (provenance, merging, eviction), the goal carried through
compactions, chunked summaries and the quality gate; the LLM path through the real
anthropic client against the local fake answering like a lossy model."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_anthropic import FakeAnthropic
from test_build_context import _build, running
from test_compaction import checkpoint

from conftest import Client
from contextd import core
from contextd.api.server import RunningServer
from contextd.app.build import ledger
from contextd.app.build.assembly import assemble
from contextd.app.build.ledger import Entry
from contextd.app.build.summarizer import (
    AnthropicConfig,
    AnthropicSummarizer,
    ExtractiveSummarizer,
    Summarizer,
    parse_specifics,
    quality_problem,
    thread_goal,
)
from contextd.domain.context import (
    HistoryItem,
    StrategyOptions,
    estimate_counter,
)
from contextd.domain.model import Role
from contextd.v1 import context_service_pb2 as pb

__all__ = ["running"]  # a fixture, used by name

GOAL = "Stop the double-leasing of job slots in the scheduler"


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


_MADE: list[AnthropicSummarizer] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Each test's summarizers close their HTTP clients (no socket left to the GC)."""
    yield
    while _MADE:
        _MADE.pop().close()


def llm(fake: FakeAnthropic, **kw: int) -> AnthropicSummarizer:
    made = AnthropicSummarizer(
        AnthropicConfig(api_key="k", base_url=fake.base_url, timeout_s=5.0, **kw)  # type: ignore[arg-type]
    )
    _MADE.append(made)
    return made


def session(first: int, n: int) -> list[HistoryItem]:
    """A coding session: a request, then tool calls with results full of specifics."""
    items: list[HistoryItem] = []
    for i in range(first, first + n, 3):
        calls = json.dumps(
            [{"id": f"toolu_0{i}AbC", "name": "bash", "input": {"command": "pytest -q"}}]
        )
        failure = f"FAILED tests/test_lease_{i}.py - LeaseError: slot {i}\n" if i % 9 == 2 else ""
        items += [
            HistoryItem(i, Role.USER, f"Now check lease {i} please " + "context " * 30),
            HistoryItem(i + 1, Role.TOOL_USE, "", tool_calls=calls),
            HistoryItem(
                i + 2,
                Role.TOOL_RESULT,
                failure + "log " * 40,
                tool_call_id=f"toolu_0{i}AbC",
            ),
        ]
    return items


def test_entries_keep_provenance_and_references() -> None:
    items = [
        HistoryItem(7, Role.USER, "edit src/a.py and run `make test`"),
        HistoryItem(9, Role.ASSISTANT, "src/a.py done; ORD-12-X is next"),
        HistoryItem(11, Role.TOOL_RESULT, "see src/a.py, parse_args", tool_call_id="c"),
    ]
    found = ledger.extract(items)
    assert found == [
        Entry("src/a.py", 7, 3),
        Entry("make test", 7, 1),
        Entry("ORD-12-X", 9, 1),
    ], "identifiers in tool output are noise"
    text = ledger.render(found)
    assert text.splitlines() == [
        "## Specifics",
        ledger.LEGEND,
        "7 src/a.py (x3) · make test",
        "9 ORD-12-X",
    ], "one line per source, its provenance once"
    assert ledger.parse("## Goal\ng\n\n" + text) == found


def test_a_sources_id_then_a_space_costs_a_token_less_a_line_and_the_colon_form_reads() -> None:
    """A line is its source's id, a space and its entries: the colon the earlier form put
    after the id is a token of its own on every line (a tenth of a ledger of one-entry
    lines). Ledgers stored with the colon still read; an entry may start with a digit."""
    entries = [Entry(f"ORD-{i}-QX", 100 + 3 * i) for i in range(80)] + [Entry("12 ms", 400)]
    text = ledger.render(entries)
    colon = "\n".join(
        line if line[:1] not in "0123456789" else line.replace(" ", ": ", 1)
        for line in text.splitlines()
    )
    assert "400 12 ms" in text and "400: 12 ms" in colon
    (new_t, colon_t) = core.count_tokens_batch([text, colon], "o200k_base")
    assert new_t <= colon_t - 80, (new_t, colon_t)
    assert ledger.parse(text) == entries
    assert ledger.parse(colon) == entries


def test_the_one_line_form_costs_fewer_tokens_and_both_forms_read_back() -> None:
    """A line per source message: its id once and a separator per entry, in place of a
    [message:<id>] line and a dash line per entry. Ledgers stored in the older form still
    read; an entry holding the separator keeps a line of its own."""
    # one or two new entries per message, as transcripts bring them
    entries = [Entry(f"src/sched/lease_{i}.py", 10 + 2 * i // 3, 1 + i % 2) for i in range(60)]
    text = ledger.render(entries)
    old_form = ["## Specifics"]
    for source in sorted({e.source for e in entries}):
        old_form.append(f"[message:{source}]")
        old_form += [
            f"- {e.text}" + (f" (x{e.refs})" if e.refs > 1 else "")
            for e in entries
            if e.source == source
        ]
    (new_t, old_t) = core.count_tokens_batch([text, "\n".join(old_form)], "o200k_base")
    assert new_t <= 0.85 * old_t, (new_t, old_t)
    assert ledger.parse(text) == entries
    assert ledger.parse("\n".join(old_form)) == entries
    odd = [Entry("echo a · b", 4), Entry("src/x.py", 4), Entry("v1.2.3", 5, 2)]
    assert ledger.render(odd).splitlines() == [
        "## Specifics",
        ledger.LEGEND,
        "[message:4]",
        "- echo a · b",
        "- src/x.py",
        "5 v1.2.3 (x2)",
    ]
    assert ledger.parse(ledger.render(odd)) == odd


def test_merge_keeps_old_entries_once_and_counts_repeats() -> None:
    old = [Entry("a/b.py", 1), Entry("v1.2.3", 2)]
    new = [Entry("v1.2.3", 5), Entry("#42", 6)]
    merged, evicted = ledger.merge(old, new)
    assert merged == [Entry("a/b.py", 1), Entry("v1.2.3", 2, 2), Entry("#42", 6)]
    assert evicted == 0
    many = [Entry(f"x/{i}.py", i) for i in range(ledger.MAX_LEDGER_ENTRIES + 5)]
    merged, evicted = ledger.merge(many[:10], many[10:])
    assert evicted == 5 and len(merged) == ledger.MAX_LEDGER_ENTRIES
    assert merged[0] == many[5], "the oldest of the least referenced go first"


def test_fit_evicts_least_referenced_oldest_first() -> None:
    entries = [Entry(f"src/mod_{i}.py", i, 2 if i == 0 else 1) for i in range(50)]
    kept, evicted = ledger.fit(entries, 100, estimate_counter)
    assert evicted == 50 - len(kept) and 0 < len(kept) < 50
    assert kept[0] == entries[0], "more references outrank age"
    assert kept[1:] == entries[50 - len(kept) + 1 :], "then the newest are kept"
    assert estimate_counter([ledger.render(kept)])[0] <= 100


def test_a_builds_ledger_keeps_its_reference_counts_in_the_metadata() -> None:
    """In a build the ledger shows no "(xN)" (about a fifth of its tokens); the counts are
    in the summary's metadata, and the next build's restore puts them back."""
    entries = [Entry("src/a.py", 3, 7), Entry("v1.2.3", 3), Entry("ORD-9-QX", 4, 2)]
    text = ledger.with_ledger("[Context checkpoint: summary]\n\n## Goal\ng", entries)
    item = HistoryItem(-4, Role.USER, text, is_summary=True, summary_of=(1, 4))
    fitted, stats = ledger.fit_item(
        item, max_item_tokens=500, max_ledger_tokens=200, count=estimate_counter
    )
    assert stats.entries == 3 and stats.evicted == 0
    assert "(x" not in fitted.content and "3 src/a.py · v1.2.3" in fitted.content
    assert json.loads(fitted.metadata)[ledger.REFS_KEY] == {"src/a.py": 7, "ORD-9-QX": 2}
    assert ledger.parse(ledger.restore(fitted).content) == entries
    assert ledger.restore(ledger.restore(fitted)) == ledger.restore(fitted)


def test_fit_keeps_the_most_mentions_per_token() -> None:
    """Equal references: the longer entry (more tokens for the same mentions) goes first,
    whatever its age; then the fewest references per token."""
    long_url = "https://grafana.example.com/d/8f3a9c1e/scheduler-leases?from=now-6h&var=slot"
    entries = [Entry("v1.2.3", 1), Entry(long_url, 2), Entry("#42", 3), Entry("ORD-7-QX", 4)]
    full = estimate_counter([ledger.render(entries)])[0]
    kept, evicted = ledger.fit(entries, full - 5, estimate_counter)
    assert evicted == 1 and long_url not in [e.text for e in kept]
    assert [e.text for e in kept] == ["v1.2.3", "#42", "ORD-7-QX"]


def test_an_error_lines_mention_outweighs_its_length() -> None:
    """An error line's references count 2.5 times against its tokens: an error line of
    up to 2.5 times a path's tokens outlasts the path, mentioned as often; a longer one
    still goes first."""
    error = "KeyError: 'lease_slot_4512'"
    paths = [Entry(f"src/sched/{w}.py", 10 + i) for i, w in enumerate(("a", "b", "c"))]
    entries = [Entry(error, 1), *paths]
    # the largest room that cannot hold them all: one entry must go
    room = max(r for r in range(1, 200) if ledger.fit(entries, r, estimate_counter)[1])
    kept, evicted = ledger.fit(entries, room, estimate_counter)
    assert evicted == 1 and error in [e.text for e in kept]
    assert [e.text for e in kept] == [error, "src/sched/b.py", "src/sched/c.py"]
    huge = "ValueError: " + " ".join(f"word{i}" for i in range(60))
    kept, evicted = ledger.fit([Entry(huge, 1), *paths], 60, estimate_counter)
    assert huge not in [e.text for e in kept] and len(kept) == 3


def test_error_entries_are_told_by_the_extractors_markers() -> None:
    errors = [
        "panic: runtime error: index out of range [4] with length 3",
        "KeyError: 'core_43'",
        "java.lang.IllegalStateException: merge not ready (5)",
        "error[E0382]: borrow of moved value: `x`",
        "Error: ENOENT: no such file or directory, open 'a.json'",
        "FAILED tests/test_api.py::test_get - AssertionError: 1 != 2",
        "fatal: not a git repository",
        "ValueError",
    ]
    others = ["errors/handler.py", "error_rate", "ErrorBoundary.tsx", "FAILED", "v1.2.3"]
    assert all(ledger.is_error(e) for e in errors)
    assert not any(ledger.is_error(e) for e in others)
    found = core.extract_specifics_batch(errors)
    assert all(kind == "error" for pairs in found for kind, _ in pairs[:1])


def test_fit_fills_its_room_when_the_counter_frames_each_text() -> None:
    """The build's counter prices a text as a whole message (its framing included); the
    framing is paid once by the ledger, not by each entry, so the ledger fills its room."""

    def framed(texts: list[str]) -> list[int]:
        return [n + 7 for n in core.count_tokens_batch(texts, "o200k_base")]

    entries = [Entry(f"src/sched/lease_{i}.py", 10 + i, 1) for i in range(400)]
    kept, evicted = ledger.fit(entries, 1_000, framed)
    used = framed([ledger.render(kept)])[0]
    assert evicted > 0 and 0.9 * 1_000 <= used <= 1_000 + 40, used


def test_evicted_entries_are_held_and_come_back_with_their_references() -> None:
    """An entry a build's room cannot show is held in the summary's metadata with its
    provenance and references, not forgotten: the next build puts it back, and one with
    room shows it (its mentions still counted)."""
    entries = [Entry(f"src/sched/lease_{i}.py", 10 + i, 1 + i % 3) for i in range(60)]
    text = ledger.with_ledger("[Context checkpoint: summary]\n\n## Goal\ng", entries)
    item = HistoryItem(-70, Role.USER, text, is_summary=True, summary_of=(1, 70))
    small, stats = ledger.fit_item(
        item, max_item_tokens=300, max_ledger_tokens=200, count=estimate_counter
    )
    assert stats.evicted > 0 and stats.entries + stats.evicted == 60
    held = json.loads(small.metadata)[ledger.HELD_KEY]
    assert len(held) == stats.evicted
    assert all([e.text, e.source, e.refs] in held for e in entries if e.text not in small.content)
    back = ledger.restore(small)
    assert sorted(ledger.parse(back.content), key=lambda e: e.source) == entries
    roomy, again = ledger.fit_item(
        back, max_item_tokens=5_000, max_ledger_tokens=5_000, count=estimate_counter
    )
    assert again.evicted == 0 and again.entries == 60
    assert all(e.text in roomy.content for e in entries)


def test_fit_item_fills_its_room_when_the_counter_frames_each_text() -> None:
    """The whole ledger is measured, not the sum of its entries' estimates: with a
    counter that prices each text as a framed message, an empty one higher (as a build's
    does: an empty message renders a placeholder), the estimate runs low, and still the
    ledger fills its room (within a few entries) and never passes it."""

    def framed(texts: list[str]) -> list[int]:
        counted = core.count_tokens_batch(texts, "o200k_base")
        return [n + (4 if text else 6) for n, text in zip(counted, texts, strict=True)]

    entries = [Entry(f"src/sched/lease_{i}.py", 10 + i, 1) for i in range(1_500)]
    text = ledger.with_ledger("[Context checkpoint: summary]\n\n## Goal\ng", entries)
    item = HistoryItem(-2_000, Role.USER, text, is_summary=True, summary_of=(1, 2_000))
    _, stats = ledger.fit_item(item, max_item_tokens=4_200, max_ledger_tokens=4_000, count=framed)
    assert stats.evicted > 0 and 4_000 - 40 <= stats.tokens <= 4_000, stats


def test_a_blob_stubs_sizes_are_not_entries() -> None:
    """A blob's stub is the build's text: its sizes and handle are not the conversation's
    evidence, so they are not ledger entries; the message's own specifics are."""
    from contextd.app.build.blobs import stub

    text = f"see ORD-4411-QX, {stub('base64 (image/png)', 1_234, 925, 'message:12')} thanks"
    found = [e.text for e in ledger.extract([HistoryItem(12, Role.USER, text)])]
    assert found == ["ORD-4411-QX"]


def test_the_ledger_takes_the_room_the_recent_part_leaves(fake: FakeAnthropic) -> None:
    """When the newest messages are too large to fill the room beside the summary's
    reserve, the ledger takes what they leave rather than stopping at its share: room
    left unused holds no evidence. The budget still holds."""
    fake.reply_lossy()
    history = specifics_session(300)
    n = len(history)

    def big(words: int) -> str:
        return " ".join(f"word{i}" for i in range(words))

    history += [
        HistoryItem(n + 1, Role.USER, "first big note " + big(750)),
        HistoryItem(n + 2, Role.USER, "the newest turn " + big(1_000)),
    ]
    built = assemble(
        system_prompt="s",
        history=history,
        budget=4_000,
        count_tokens=estimate_counter,
        options=StrategyOptions(summarize=True, truncate=False),  # whole or not at all
        summarizer=llm(fake),
    )
    stats = built.stats
    assert built.summary is not None and stats.summarizer_path == "llm"
    assert stats.total_tokens <= 4_000
    share = ledger.ledger_share(sum(it.token_count for it in history), 4_000)
    assert stats.ledger_evicted > 0 and stats.ledger_tokens > 4_000 * share, stats
    assert stats.total_tokens >= 4_000 - 200, "little of the budget is left unused"


def test_the_ledger_share_grows_with_the_windows_length() -> None:
    assert ledger.ledger_share(40_000, 10_000) == ledger.LEDGER_SHARE
    # 0.6 more each tenfold past 4 times the budget: 0.55 at 4 * sqrt(10) times
    assert abs(ledger.ledger_share(int(40_000 * 10**0.5), 10_000) - 0.55) < 1e-4
    assert ledger.ledger_share(400_000, 10_000) == ledger.MAX_LEDGER_SHARE == 0.85
    assert ledger.ledger_share(10_000_000, 10_000) == ledger.MAX_LEDGER_SHARE
    middle = ledger.ledger_share(80_000, 10_000)
    assert ledger.LEDGER_SHARE < middle < ledger.MAX_LEDGER_SHARE


def specifics_session(n: int) -> list[HistoryItem]:
    """A request, then messages that each name a new file and a new order id, and one
    file and one command every message repeats."""
    items = [HistoryItem(1, Role.USER, GOAL)]
    for i in range(2, n + 2):
        role = Role.USER if i % 2 else Role.ASSISTANT
        text = (
            f"Looked at src/sched/slot_{i}.py for ORD-{i}-QX; src/core/lease.py again, "
            f"ran `make test-lease` " + "and the rest of the notes " * 6
        )
        items.append(HistoryItem(i, role, text))
    return items


def test_entries_the_kept_messages_hold_are_left_out_and_come_back(fake: FakeAnthropic) -> None:
    """An entry a message kept whole holds verbatim costs nothing in the ledger: it is
    left out (counted in ledger_in_context) and held in the summary's metadata with its
    provenance and references; the next build puts it back before merging, so it is not
    lost nor restarted when those messages are folded in turn."""
    fake.reply_lossy()
    history = specifics_session(400)
    opts = StrategyOptions(summarize=True)
    first = assemble(
        system_prompt="s",
        history=history[:200],
        budget=3_000,
        count_tokens=estimate_counter,
        options=opts,
        summarizer=llm(fake),
    )
    assert first.summary is not None and first.stats.summarizer_path == "llm"
    shown = [e.text for e in ledger.parse(first.summary.content)]
    recent = "\n".join(it.content for it in first.history if not it.is_summary)
    assert "src/core/lease.py" in recent and "src/core/lease.py" not in shown
    assert "make test-lease" not in shown and first.stats.ledger_in_context >= 2
    assert first.stats.ledger_added == (
        first.stats.ledger_entries + first.stats.ledger_evicted + first.stats.ledger_in_context
    )
    held = {e.text: e for e in ledger.parse(ledger.restore(first.summary).content)}
    assert held["src/core/lease.py"].source == 2, "provenance: the first message naming it"
    assert held["src/core/lease.py"].refs > 100, "references: every message naming it"
    missing = [i for i in range(2, 200) if f"ORD-{i}-QX" not in [*shown, recent]]
    missing = [i for i in missing if f"ORD-{i}-QX" not in recent]
    assert len(missing) <= first.stats.ledger_evicted, "none lost unless evicted, and said so"
    # The caller stores the summary; a later build folds the messages that held them.
    stored = HistoryItem(
        9_000,
        Role.USER,
        first.summary.content,
        is_summary=True,
        metadata=first.summary.metadata,
        summary_of=first.summary.summary_of,
    )
    second = assemble(
        system_prompt="s",
        history=[*history, stored],
        budget=3_000,
        count_tokens=estimate_counter,
        options=opts,
        summarizer=llm(fake),
    )
    assert second.summary is not None and second.stats.summarizer_path == "llm"
    again = {e.text: e for e in ledger.parse(ledger.restore(second.summary).content)}
    assert again["src/core/lease.py"].source == 2
    assert again["src/core/lease.py"].refs > held["src/core/lease.py"].refs


def test_a_window_many_times_the_budget_gives_the_ledger_more_room(fake: FakeAnthropic) -> None:
    """A window many times the budget: the ledger may take up to 85% of the
    history budget (a quarter otherwise), as much as its entries need; the recent part
    keeps what truncation keeps under the budget less the summary as built."""
    fake.reply_lossy()
    history = specifics_session(1_500)
    common = {"system_prompt": "s", "history": history, "count_tokens": estimate_counter}
    built = assemble(
        **common,  # type: ignore[arg-type]
        budget=4_000,
        options=StrategyOptions(summarize=True),
        summarizer=llm(fake),
    )
    stats = built.stats
    assert built.summary is not None and stats.summarizer_path == "llm"
    assert 4_000 * ledger.LEDGER_SHARE < stats.ledger_tokens <= 4_000 * ledger.MAX_LEDGER_SHARE
    assert stats.total_tokens <= 4_000
    truncated = assemble(**common, budget=4_000 - built.summary.token_count)  # type: ignore[arg-type]
    verbatim = [it for it in built.history if not it.is_summary]
    assert len(verbatim) >= len(truncated.history)


def test_the_ledgers_larger_share_leaves_the_request_and_newest_turn_whole(
    fake: FakeAnthropic,
) -> None:
    """A window 40 times the budget lets the ledger take up to 85% of it, but never the
    room of the current request (the latest user message) and the newest turn: they stay
    whole beside it when they fit the budget."""
    fake.reply_lossy()
    history = specifics_session(3_000)
    n = len(history)
    calls = json.dumps([{"id": "toolu_01", "name": "bash", "input": {"command": "make"}}])
    history += [
        HistoryItem(n + 1, Role.USER, "Now run the build and tell me what fails. " * 12),
        HistoryItem(n + 2, Role.TOOL_USE, "Running it.", tool_calls=calls),
        HistoryItem(n + 3, Role.TOOL_RESULT, "build ok " * 420, tool_call_id="toolu_01"),
    ]
    built = assemble(
        system_prompt="s",
        history=history,
        budget=4_000,
        count_tokens=estimate_counter,
        options=StrategyOptions(summarize=True),
        summarizer=llm(fake),
    )
    newest = {it.id: it.content for it in history[-3:]}
    kept = {it.id: it.content for it in built.history if not it.is_summary}
    assert built.summary is not None and built.stats.summarizer_path == "llm"
    assert sum(estimate_counter([t])[0] for t in newest.values()) > 4_000 * 0.25
    assert all(kept.get(i) == text for i, text in newest.items()), sorted(kept)
    assert built.stats.total_tokens <= 4_000
    assert built.stats.ledger_tokens > 4_000 * ledger.LEDGER_SHARE


def test_goal_is_the_first_request_and_explicit_changes() -> None:
    items = [
        HistoryItem(1, Role.USER, GOAL),
        HistoryItem(2, Role.ASSISTANT, "ok"),
        HistoryItem(3, Role.USER, "also fix the typo"),
        HistoryItem(4, Role.USER, "New goal: ship the v2 API first"),
    ]
    goal = thread_goal(items, None)
    assert goal == [
        f"- Original request (message:1): {GOAL}",
        "- Goal change (message:4): New goal: ship the v2 API first",
    ]
    later = [HistoryItem(9, Role.USER, "and now rename the module")]
    assert thread_goal(later, "## Goal\n" + "\n".join(goal)) == goal, "carried, not replaced"


@pytest.mark.parametrize("kind", ["extractive", "lossy-llm"])
def test_goal_and_evidence_survive_ten_rolling_compactions(fake: FakeAnthropic, kind: str) -> None:
    fake.reply_lossy()
    summarizer: Summarizer = ExtractiveSummarizer() if kind == "extractive" else llm(fake)
    opts = StrategyOptions(summarize=True, keep_recent_tokens=300, keep_recent_messages=3)
    history = [HistoryItem(1, Role.USER, GOAL), *session(2, 600)]
    summary: HistoryItem | None = None
    compactions = evicted = 0
    for end in range(40, 602, 20):  # the thread grows; each build may compact
        window = [*history[:end], *([summary] if summary else [])]
        ctx = assemble(
            system_prompt="s",
            history=window,
            budget=2_500,
            count_tokens=estimate_counter,
            options=opts,
            summarizer=summarizer,
        )
        assert ctx.stats.total_tokens <= 2_500
        if ctx.stats.summarizer_path in ("llm", "fallback"):
            compactions += 1
            evicted += ctx.stats.ledger_evicted
            assert ctx.summary is not None
            summary = HistoryItem(
                10_000 + end,
                Role.USER,
                ctx.summary.content,
                is_summary=True,
                metadata=ctx.summary.metadata,
                summary_of=ctx.summary.summary_of,
            )
        assert ctx.stats.summarizer_path != "fallback" or kind == "extractive", (
            ctx.stats.summarizer_error
        )
        text = "\n".join(it.content for it in ctx.history)
        assert GOAL in text, f"goal lost after {compactions} compactions"
    assert compactions >= 10
    assert summary is not None
    # What the summary carries: its ledger and the entries it held out while the recent
    # messages held them (`pytest -q` is in every call).
    kept = parse_specifics(ledger.restore(summary).content)
    # The failure lines of the folded part are in the ledger, verbatim, unless the build
    # that left them out said so; the newest are always there.
    lo, hi = summary.summary_of or (0, 0)
    failures = [
        it.content.splitlines()[0]
        for it in history
        if it.role is Role.TOOL_RESULT and lo <= it.id <= hi and it.content.startswith("FAILED")
    ]
    missing = [f for f in failures if f not in kept]
    assert len(missing) <= evicted and failures[-1] in kept
    assert "pytest -q" in kept
    assert ledger.parse(summary.content)[0].source > 0, "entries name their message"


def test_a_long_span_is_summarized_in_chunks_with_every_message(fake: FakeAnthropic) -> None:
    fake.reply_lossy()
    items = [HistoryItem(1, Role.USER, GOAL), *session(2, 900)]
    summarizer = llm(fake, chunk_chars=40_000, max_transcript_chars=150_000)
    chunks = summarizer.chunks(items)
    assert 3 <= len(chunks) <= 150_000 // 40_000 + 1
    result = summarizer.summarize(items, None)
    assert result.path == "llm", result.error
    prompts = [r.body["messages"][0]["content"] for r in fake.requests]
    assert len(prompts) == len(chunks) == result.attempts
    assert GOAL in prompts[0] and all("<previous-checkpoint>" in p for p in prompts[1:])
    assert all(GOAL in p for p in prompts), "the goal rides along in each checkpoint"
    assert all(len(p) < 40_000 + 2_000 for p in prompts)
    sent = "\n".join(prompts)
    assert all(f"lease {i} please" in sent for i in range(2, 902, 3)), "no message left out"
    assert f"- Original request (message:1): {GOAL}" in result.text


def test_quality_gate_retries_once_then_falls_back(fake: FakeAnthropic) -> None:
    items = session(2, 30)
    fake.then_text("## Goal\nonly a goal", checkpoint("fine"))
    result = llm(fake).summarize(items, None)
    assert result.path == "llm" and result.attempts == 2 and len(fake.requests) == 2
    fake.requests.clear()
    fake.then_text("   \n", "## Goal\nstill partial")
    result = llm(fake).summarize(items, None)
    assert result.path == "fallback" and result.attempts == 2
    assert result.error is not None and "misses sections" in result.error
    assert "## Progress" in result.text and "LeaseError" in " ".join(result.specifics)
    fake.then_text("", "")
    result = llm(fake).summarize(items, None)
    assert result.path == "fallback" and result.attempts == 2
    assert result.error is not None and "empty" in result.error
    assert quality_problem("") == "the summary is empty"
    assert quality_problem(checkpoint("g")) is None


def notes(first: int, n: int) -> list[HistoryItem]:
    return [
        HistoryItem(
            i,
            Role.USER if i % 2 else Role.ASSISTANT,
            f"edit src/mod_{i}.py for ORD-{i}-X " + "filler " * 40,
        )
        for i in range(first, first + n)
    ]


def test_a_small_fold_is_not_summarized_again(fake: FakeAnthropic) -> None:
    """A thread at its budget, built after every new turn, with each new summary stored
    as the builder stores it: a fold under a quarter of the budget joins the stored
    summary's ledger (no model call, nothing stored), so the model is asked about once
    every few builds, not on every one; nothing of the folded messages is lost."""
    fake.reply_text(checkpoint("the checkpoint " + "and more prose " * 200))
    opts = StrategyOptions(summarize=True, keep_recent_messages=3)
    history = [HistoryItem(1, Role.USER, GOAL), *notes(2, 120)]
    budget = 1_200
    stored: HistoryItem | None = None
    deferred = []
    builds = 20
    for turns in range(builds):
        window = [*history, *notes(500, turns), *([stored] if stored else [])]
        ctx = assemble(
            system_prompt="s",
            history=window,
            budget=budget,
            count_tokens=estimate_counter,
            options=opts,
            summarizer=llm(fake),
        )
        assert ctx.stats.total_tokens <= budget
        assert ctx.summary is not None
        if ctx.stats.summarizer_path == "llm":
            stored = HistoryItem(
                900 + turns,
                Role.USER,
                ctx.summary.content,
                is_summary=True,
                metadata=ctx.summary.metadata,
                summary_of=ctx.summary.summary_of,
            )
        if ctx.stats.compaction_deferred:
            assert ctx.stats.summarizer_path == "reused" and ctx.stats.ledger_added > 0
            _, hi = ctx.stats.summarized_range or (0, 0)
            # The fold's evidence: shown, or held for a build with more room.
            shown_or_held = ctx.summary.content + ctx.summary.metadata
            assert f"src/mod_{hi}.py" in shown_or_held
            deferred.append(turns)
    assert deferred, "some folds joined the ledger without a model call"
    assert len(fake.requests) <= 1 + builds // 3, len(fake.requests)


# ---------------------------------------------------------------- through the service


def test_a_build_reports_its_ledger_and_names_each_source(
    running: tuple[RunningServer, Client], fake: FakeAnthropic
) -> None:
    """Through gRPC, on both engines: the lossy model's prose carries no specifics, the
    ledger does, each under the id of the stored message it came from; BuildStats counts
    the ledger; the goal is the first request."""
    _, client = running
    fake.reply_lossy()
    client.append("a1", f"Please {GOAL}.")
    for i in range(120):
        client.append("a1", f"order ORD-{1000 + i}-QX costs €{i}.50, see docs/o_{i}.md " * 3)
    options = pb.BuildOptions(budget_tokens=3_000, summarize=True, keep_recent_tokens=600)
    built = _build(client, options=options)
    stats = built.stats
    assert stats.summarizer_path == "llm" and stats.summary_attempts == 1, stats
    assert stats.ledger_entries > 0 and stats.ledger_tokens > 0 and stats.ledger_added > 0
    assert stats.ledger_added == (
        stats.ledger_entries + stats.ledger_evicted + stats.ledger_in_context
    )
    summary = built.messages[0].content
    assert GOAL in summary
    ids = {m.content.split(" costs")[0].removeprefix("order "): m.id for m in client.window("a1")}
    entries = ledger.parse(summary)
    assert len(entries) == stats.ledger_entries
    for entry in entries:
        if entry.text.startswith("ORD-"):
            assert ids[entry.text] == entry.source, entry
    assert any(e.text.startswith("ORD-") for e in entries)
