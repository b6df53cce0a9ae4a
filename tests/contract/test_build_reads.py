"""What a build reads for its status block: `status_and_activity` answers exactly what
`list_status` and `thread_activity` answer (one read on PostgreSQL, two on DuckDB)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from contextd.app.build.build_types import BuildRequest, BuildResult
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


def _tool_turn(call: str) -> list[NewMessage]:
    """A tool_use and its tool_result (appended apart, they straddle an append)."""
    return [
        NewMessage(
            role=Role.TOOL_USE,
            content="",
            tool_calls=f'[{{"id": "{call}", "name": "ls", "arguments": "{{}}"}}]',
        ),
        NewMessage(role=Role.TOOL_RESULT, content=f"listing of {call} " * 8, tool_call_id=call),
    ]


@pytest.mark.parametrize(
    ("budget", "formats"),
    [(600, ()), (50_000, ()), (600, ("anthropic",)), (600, ("text", "openai"))],
    ids=["trimmed", "whole", "anthropic", "text"],
)
def test_a_build_after_appends_mixed_with_other_changes_is_a_build_afresh(
    store: Store, clock: ManualClock, budget: int, formats: tuple[str, ...]
) -> None:
    """A builder that remembers a thread's window extends it with the messages appended
    since (DuckDB: `ContextBuilder._extended`) only when appends of plain messages are
    all that changed; each build here, after each kind of change of the thread, mixed
    with appends, equals the build of a builder that remembers nothing, and the builds
    that follow any other change (a tool row appended, a clear, a stored summary, the
    agent deleted, a retention cap or sweep, the window's start moving with the clock,
    agent settings) read the window afresh. The renderings asked for decide how items
    are costed (the text transcript costs a result by the calls before it: a window
    extended then prepares its items afresh)."""
    from contextd.domain.retention import RetentionPolicy

    service = ContextService(store, ExtractiveSummarizer())
    plain = ContextService(store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    builder = service._builder
    # Engines that can tell appends apart (PostgreSQL: by schema version 15's counter,
    # for windows of no retention, which it reads newest first).
    extends = hasattr(store, "appended_window") or hasattr(store, "appended_messages")
    embedded = hasattr(store, "appended_window")
    request = BuildRequest(
        "default",
        "a1",
        "",
        "main",
        overrides=BuildOverrides(budget_tokens=budget, truncate=False),
        formats=formats,
    )
    service.create_agent("default", "a1", AgentSettings())
    n = [0]

    def append(*messages: NewMessage) -> None:
        service.append_messages("default", "a1", "", "main", list(messages))
        clock.advance(SECOND)

    def words(count: int = 1) -> list[NewMessage]:
        out = []
        for _ in range(count):
            n[0] += 1
            out.append(_said(f"words {n[0]} " * 12))
        return out

    def build(extended: bool | None) -> BuildResult:
        """The build, checked against one afresh; `extended`: whether it may extend
        the remembered window (False: it must read it afresh; None: either)."""
        before = builder.window_extensions
        result = service.build_context(request)
        expected = plain.build_context(request)
        assert result.context == expected.context
        assert _history(result) == _history(expected)
        assert result.messages_loaded == expected.messages_loaded
        assert result.orphaned_ids == expected.orphaned_ids
        assert result.stamps == expected.stamps
        assert result.renderings == expected.renderings
        grew = builder.window_extensions - before
        if extended is not None:
            assert grew == (1 if extended and extends else 0)
        return result

    def appends(rounds: int = 3) -> None:
        build(False)  # nothing changed (a build after a reload remembers no window)
        for _ in range(rounds):
            append(*words())
            build(True)
        append(*words(2))  # a batch
        build(True)
        build(False)  # nothing changed: the remembered window itself (or its result)

    append(*words(50))
    build(False)
    appends()
    # A snapshot restored into the thread appends copies of its messages (plain ones:
    # extended or read afresh, equal either way), then plain appends extend again.
    saved = service.save_snapshot("default", "a1", "", "main", "plain words")
    clock.advance(SECOND)
    service.restore_snapshot("default", "a1", "", saved.id, "")
    clock.advance(SECOND)
    build(None)
    appends()
    # A tool turn straddling an append: the tool rows are read afresh, then plain
    # appends extend a window holding the pair (kept whole or left out whole).
    use, result = _tool_turn("c1")
    append(use)
    build(False)
    append(result)
    build(False)
    appends()
    append(*_tool_turn("c2"), *words())
    build(False)
    appends(4)
    # A stored summary: the thread's summary changed, not only its rows.
    service.compact_context("default", "a1", "", "main", "", BuildOverrides(keep_recent_tokens=200))
    build(False)
    append(*words())
    build(False)  # a window with a stored summary is read afresh
    service.clear_context("default", "a1", "", "main")
    build(False)
    batch_at = clock.now_us()
    append(*words(30))
    build(False)
    appends()
    # Agent settings: a rolling window, then the clock moves its start past old messages.
    service.update_agent("default", "a1", AgentSettings(rolling_window_us=HOUR), ["rolling_window"])
    clock.advance(SECOND)
    append(*words())
    build(True)  # the window still starts where it did
    counted = build(False).context.stats.messages_before
    clock.advance(batch_at + HOUR - SECOND // 2 - clock.now_us())  # built 1 s later
    append(*words())
    moved = build(False)  # the batch of 30 left the window, the appends after it did not
    assert moved.context.stats.messages_before == counted + 1 - 30
    service.update_agent("default", "a1", AgentSettings(), ["rolling_window"])
    build(False)  # the window's start moved back
    appends()
    # A retention cap: the window's first message moves with every append.
    service.update_agent(
        "default", "a1", AgentSettings(retention=RetentionPolicy(max_messages=20)), ["retention"]
    )
    append(*words())
    build(False)
    append(*words())
    build(False)
    service.update_agent("default", "a1", AgentSettings(), ["retention"])
    append(*words())
    # (PostgreSQL may extend the window it kept from before the cap, which deleted
    # nothing, by the appends since: it takes the bounds sent with the thread's read
    # instead, as its last build kept no window it could extend.)
    build(False if embedded else None)
    appends()
    # A retention sweep deleting the thread's expired messages.
    service.update_agent(
        "default", "a1", AgentSettings(retention=RetentionPolicy(ttl_us=MINUTE)), ["retention"]
    )
    append(*words())
    # A time to live moves no window's start while the thread lives (PostgreSQL reads a
    # window under retention whole, each build).
    build(embedded)
    clock.advance(MINUTE + SECOND)
    assert service.sweep_retention().expired_deleted > 0
    assert not build(False).context.history
    service.update_agent("default", "a1", AgentSettings(), ["retention"])
    append(*words(40))
    build(False)
    appends()
    # The agent deleted and made again: another thread of the same name.
    service.delete_agent("default", "a1")
    service.create_agent("default", "a1", AgentSettings())
    append(*words(40))
    build(False)
    appends()


def test_a_long_run_of_appends_extends_the_window_within_its_bounds(
    store: Store, clock: ManualClock
) -> None:
    """An agent that appends before every build: each build equals one of a builder that
    remembers nothing. On DuckDB the builder extends its remembered window by the
    appended messages, carrying the stored counts of those that left it until they
    outnumber its items past a bound: then it reads the window afresh, so what a
    remembered window holds stays bounded however long the run."""
    from contextd.app.build import window_extension

    service = ContextService(store, ExtractiveSummarizer())
    plain = ContextService(store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    builder = service._builder
    request = BuildRequest(
        "default", "a1", "", "main", overrides=BuildOverrides(budget_tokens=400, truncate=False)
    )
    service.create_agent("default", "a1", AgentSettings())
    service.append_messages(
        "default", "a1", "", "main", [_said(f"older words {i} " * 12) for i in range(30)]
    )
    service.build_context(request)
    steps = 150
    most = 0
    for i in range(steps):
        role = Role.ASSISTANT if i % 2 else Role.USER
        service.append_messages(
            "default", "a1", "", "main", [NewMessage(role=role, content=f"step {i} " * 12)]
        )
        clock.advance(SECOND)
        result = service.build_context(request)
        expected = plain.build_context(request)
        assert result.context == expected.context
        assert result.stamps == expected.stamps
        assert result.messages_loaded == expected.messages_loaded
        for _, window in builder._windows._found.values():
            assert len(window.stamps) <= len(window.items) + 1
            held = len(window.known_counts) - 2 * len(window.items)
            assert held <= window_extension._KNOWN_SLACK + 1
            most = max(most, held)
    if hasattr(store, "appended_window") or hasattr(store, "appended_messages"):
        # Most builds extended the window; the counts reached their bound, and a few
        # builds read it afresh (each of those keeps the loaded messages' counts alone).
        assert steps - 10 <= builder.window_extensions < steps
        assert most > window_extension._KNOWN_SLACK - 8


# One change of a thread (`test_random_appends_build_what_a_build_afresh_builds`); plain
# turns most often, as an agent appends them (what extends a remembered window).
_SAID = st.tuples(st.just("said"), st.integers(1, 3))  # plain turns, in one append
_STEPS = st.one_of(
    _SAID,
    _SAID,
    _SAID,
    _SAID,
    st.tuples(st.just("call"), st.integers(1, 2)),  # a tool_use; its results come later
    st.tuples(st.just("answer"), st.integers(1, 2)),  # results of the oldest pending calls
    st.tuples(st.just("turn"), st.integers(1, 2)),  # a tool_use and its results at once
    st.tuples(st.just("orphan"), st.just(1)),  # a result whose call is nowhere
    st.tuples(st.just("long"), st.just(1)),  # a turn longer than the window's budget
    st.tuples(st.just("clear"), st.just(1)),
    st.tuples(st.just("cap"), st.integers(2, 6)),  # retention deletes all but the newest
)
_examples = itertools.count()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(_STEPS, min_size=1, max_size=40), budget=st.sampled_from([150, 400]))
def test_random_appends_build_what_a_build_afresh_builds(
    store: Store, clock: ManualClock, steps: list[tuple[str, int]], budget: int
) -> None:
    """Random runs of appends (plain turns; tool calls whose results come in a later
    append, one by one or together; orphan results; a turn longer than the budget) mixed
    with clears and messages deleted by retention: after each, the build of a builder
    that remembers the thread's window (and extends it after appends, checking only
    what an append changed: `ContextBuilder._extended`, `_carried_over`,
    `compressor.extend_prepared`) equals the build of one that remembers nothing, in
    kept messages, dropped and orphaned ids, token counts and renderings. The budgets
    are small, so the kept part moves with each append and the turns leaving it hold
    tool rows or not."""
    from contextd.domain.retention import RetentionPolicy

    agent = f"r{next(_examples)}"
    service = ContextService(store, ExtractiveSummarizer())
    plain = ContextService(store, ExtractiveSummarizer())
    plain._builder.remember_results = False
    request = BuildRequest(
        "default",
        agent,
        "",
        "main",
        overrides=BuildOverrides(budget_tokens=budget, truncate=False),
        formats=("openai", "anthropic"),
    )
    service.create_agent("default", agent, AgentSettings())
    pending: list[str] = []
    n = itertools.count()

    def append(*messages: NewMessage) -> None:
        service.append_messages("default", agent, "", "main", list(messages))
        clock.advance(SECOND)

    def use(k: int) -> tuple[NewMessage, list[str]]:
        calls = [f"c{next(n)}" for _ in range(k)]
        spec = ", ".join(f'{{"id": "{c}", "name": "ls", "arguments": "{{}}"}}' for c in calls)
        return NewMessage(role=Role.TOOL_USE, content="", tool_calls=f"[{spec}]"), calls

    def result(call: str) -> NewMessage:
        return NewMessage(role=Role.TOOL_RESULT, content=f"listing {call} " * 6, tool_call_id=call)

    append(*[_said(f"older words {i} " * 6) for i in range(8)])
    extended = 0
    for kind, k in steps:
        if kind == "said":
            append(
                *[
                    NewMessage(
                        role=Role.ASSISTANT if i % 2 else Role.USER,
                        content=f"turn {next(n)} " * 8,
                    )
                    for i in range(k)
                ]
            )
        elif kind == "call":
            message, calls = use(k)
            append(message)
            pending += calls
        elif kind == "answer" and pending:
            answered, pending = pending[:k], pending[k:]
            append(*map(result, answered))
        elif kind == "turn":
            message, calls = use(k)
            append(message, *map(result, calls))
        elif kind == "orphan":
            append(result(f"nowhere{next(n)}"))
        elif kind == "long":
            append(_said(f"a long turn {next(n)} " * 200))
        elif kind == "clear":
            service.clear_context("default", agent, "", "main")
            clock.advance(SECOND)
        elif kind == "cap":
            policy = RetentionPolicy(max_messages=k, delete_overflow=True)
            service.update_agent("default", agent, AgentSettings(retention=policy), ["retention"])
            service.sweep_retention()
            service.update_agent("default", agent, AgentSettings(), ["retention"])
            clock.advance(SECOND)
        before = service._builder.window_extensions
        got = service.build_context(request)
        extended += service._builder.window_extensions - before
        expected = plain.build_context(request)
        assert got.context == expected.context
        assert _history(got) == _history(expected)
        assert got.context.stats.dropped_ids == expected.context.stats.dropped_ids
        assert got.orphaned_ids == expected.orphaned_ids
        assert got.messages_loaded == expected.messages_loaded
        assert got.stamps == expected.stamps
        assert got.renderings == expected.renderings
    # Toward runs whose builds extend the remembered window (an orphan or a pending call
    # in the window keeps it from extending): those are the ones checked here.
    target(float(extended), label="windows extended")
