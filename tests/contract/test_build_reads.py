"""What a build reads for its status block: `status_and_activity` answers exactly what
`list_status` and `thread_activity` answer (one read on PostgreSQL, two on DuckDB)."""

from __future__ import annotations

import pytest

from contextd.app.build.builder import BuildRequest, BuildResult
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import AgentSettings, BuildOverrides, NewMessage, Role
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store, status_and_activity

from .support import BIG, DAY, HOUR, MINUTE, SECOND, batch, key


def _fill(store: Store, clock: ManualClock) -> int:
    now = clock.now_us()
    store.append(key("quiet"), batch("old only", source_time_us=now - DAY), AgentSettings())
    for i, thread in enumerate(("b", "a", "c", "cleared", "d")):
        store.append(key(thread), batch(*[f"{thread}{n}" for n in range(i + 1)]), AgentSettings())
        clock.advance(MINUTE)
    store.clear_thread(key("cleared"))
    store.append(key("a", scope="dm:1"), batch("elsewhere"), AgentSettings())
    for name, expires in (("zeta", None), ("alpha", now + DAY), ("gone", now + 1), ("mid", None)):
        entry = StatusEntry(name, StatusKind.PROCESS, "running", f"{name} runs", 0, expires)
        store.set_status("default", "a1", "", entry)
    store.set_status(
        "default", "a1", "dm:1", StatusEntry("other", StatusKind.THREAD, "idle", "", 0)
    )
    clock.advance(MINUTE)
    return clock.now_us()


@pytest.mark.parametrize(("entries", "threads"), [(BIG, BIG), (2, 2), (1, 1), (100, 30)], ids=str)
def test_status_and_activity_answer_what_the_two_reads_answer(
    store: Store, clock: ManualClock, entries: int, threads: int
) -> None:
    start = clock.now_us()
    now = _fill(store, clock)
    for window in (WindowSpec(0, 0), WindowSpec(0, start - HOUR), WindowSpec(start + MINUTE, 0)):
        both = status_and_activity(store, "default", "a1", "", now, entries, window, threads)
        assert both == (
            store.list_status("default", "a1", "", None, entries, now),
            store.thread_activity("default", "a1", "", window, threads),
        )
    statuses, activity = status_and_activity(
        store, "default", "a1", "", now, BIG, WindowSpec(0, start - HOUR), BIG
    )
    assert [s.key for s in statuses] == ["alpha", "mid", "zeta"]  # "gone" expired
    assert [(a.thread, a.window_message_count) for a in activity] == [
        ("d", 5),
        ("c", 3),
        ("a", 2),
        ("b", 1),
    ]


def test_status_and_activity_of_an_agent_without_either(store: Store) -> None:
    assert status_and_activity(store, "default", "nobody", "", 0, BIG, WindowSpec(0, 0), BIG) == (
        [],
        [],
    )


def _history(result: BuildResult) -> list[tuple[int, str]]:
    return [(m.id, m.content) for m in result.context.history]


def test_a_build_after_other_agents_commits_sees_every_change_of_its_thread(
    store: Store, clock: ManualClock
) -> None:
    """Commits to another agent leave a thread's window as it was (the DuckDB builder
    keeps the window it read by the thread's state, across them); every change of the
    thread itself (an append, a clear, the agent deleted and made again) is in the next
    build, which is the build of a builder that remembers nothing."""
    service = ContextService(store, ExtractiveSummarizer())
    plain = ContextService(store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    request = BuildRequest(
        "default", "a1", "", "main", overrides=BuildOverrides(budget_tokens=600, truncate=False)
    )
    for agent in ("a1", "a2"):
        service.create_agent("default", agent, AgentSettings())
    service.append_messages(
        "default", "a1", "", "main", [_said(f"older words {i} " * 12) for i in range(60)]
    )
    n = [0]

    def elsewhere() -> None:
        n[0] += 1
        service.append_messages("default", "a2", "", "main", [_said(f"meanwhile {n[0]}")])
        clock.advance(SECOND)

    def build() -> BuildResult:
        result = service.build_context(request)
        assert _history(result) == _history(plain.build_context(request))
        assert result.context == plain.build_context(request).context
        return result

    for _ in range(2):
        build()
    before = build()
    elsewhere()
    assert _history(build()) == _history(before)
    # A stored summary leaves the thread's messages (and the window's run) as they were.
    service.compact_context("default", "a1", "", "main", "", BuildOverrides(keep_recent_tokens=200))
    elsewhere()
    compacted = build()
    assert compacted.summary_id is not None and _history(compacted) != _history(before)
    service.append_messages("default", "a1", "", "main", [_said("the newest words")])
    elsewhere()
    assert build().context.history[-1].content == "the newest words"
    elsewhere()
    assert build().context.history[-1].content == "the newest words"
    service.clear_context("default", "a1", "", "main")
    elsewhere()
    assert not build().context.history
    service.append_messages("default", "a1", "", "main", [_said("after the clear")])
    elsewhere()
    assert [m.content for m in build().context.history] == ["after the clear"]
    service.delete_agent("default", "a1")
    service.create_agent("default", "a1", AgentSettings())
    service.append_messages("default", "a1", "", "main", [_said("a new life")])
    elsewhere()
    assert [m.content for m in build().context.history] == ["a new life"]


def _said(text: str) -> NewMessage:
    return NewMessage(role=Role.USER, content=text)


def test_a_build_counts_its_changed_parts_as_counting_afresh_does(
    store: Store, clock: ManualClock
) -> None:
    """What the parts around the history cost is remembered across builds (by the
    model, the formats and the texts): after each change of the system prompt, the docs,
    the status block (another thread), the new message, the thread (append, summary,
    clear), a build equals one that counted everything afresh."""
    from contextd.app.build import assembly
    from contextd.app.build.memo import Memo
    from contextd.domain.model import AgentDoc

    service = ContextService(store, ExtractiveSummarizer())
    plain = ContextService(store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    service.create_agent("default", "a1", AgentSettings(system_prompt="be brief"))
    service.append_messages(
        "default", "a1", "", "main", [_said(f"older words {i} " * 12) for i in range(40)]
    )

    def build(message: str = "", formats: tuple[str, ...] = ()) -> None:
        request = BuildRequest(
            "default",
            "a1",
            "",
            "main",
            user_message=message,
            overrides=BuildOverrides(budget_tokens=900, truncate=False),
            formats=formats,
        )
        result = service.build_context(request)
        remembered = assembly._FRAMES
        assembly._FRAMES = Memo(1)  # the plain build counts every part afresh
        try:
            expected = plain.build_context(request)
        finally:
            assembly._FRAMES = remembered
        assert result.context == expected.context
        assert result.renderings == expected.renderings

    def settings(**changed: object) -> None:
        service.update_agent("default", "a1", AgentSettings(**changed), list(changed))  # type: ignore[arg-type]
        clock.advance(SECOND)

    build()
    build(formats=("anthropic", "text"))
    settings(system_prompt="be brief, and kind " * 20)
    build()
    settings(docs=(AgentDoc("guide", "read the guide first " * 10),))
    build()
    build("what next?")
    build("what next? " * 30, formats=("anthropic",))
    service.append_messages("default", "a1", "", "other", [_said("elsewhere")])
    clock.advance(SECOND)
    build()
    service.append_messages("default", "a1", "", "main", [_said("the newest words")])
    build()
    service.compact_context("default", "a1", "", "main", "", BuildOverrides(keep_recent_tokens=200))
    build("and now?")
    service.clear_context("default", "a1", "", "main")
    build()
    settings(system_prompt="")
    build("after all that")
