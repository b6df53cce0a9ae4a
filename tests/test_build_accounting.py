"""A stateful property test of build accounting over the real store and builder.

Random appends (user and assistant turns, tool turns of 1-3 parallel calls whose results
come at once, later, interleaved, out of order or never, stray results), thread and
agent clears, compactions (CompactContext and summarizing builds), and restarts (the
store closed and reopened on the same DuckDB file). After every step, for each thread:

(a) a build with an unbounded budget and truncation off keeps the whole window after
    pair repair: nothing is dropped, the kept messages and the summarized range make up
    the window, and the orphans it lists are exactly those of the history being built;
(b) a build under any budget and options accounts for every window message exactly
    once: kept, in dropped_ids, or inside the summarized range.

In process (the `ContextService` over a real DuckDB file in a temporary directory, the
real Rust core, the extractive summarizer that the server falls back to without an API
key). Messages and clears take the store's clock; the rolling window is a day, so the
wall clock never matters and nothing sleeps.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from contextd.adapters.duckdb.store import Store
from contextd.app.build.build_types import BuildRequest, BuildResult
from contextd.app.build.render import to_anthropic, to_openai
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.errors import FailedPrecondition
from contextd.domain.model import AgentSettings, BuildOverrides, ContextKey, NewMessage, Role
from contextd.domain.window import WindowSpec

TENANT, AGENT = "default", "a1"
THREADS = ("t1", "t2")
UNBOUNDED = BuildOverrides(budget_tokens=1_000_000, truncate=False)

texts = st.builds(
    lambda word, n: f"{word} " * n,
    st.sampled_from(["alpha", "path/to/file.py", "naïve", "東京", "x"]),
    st.one_of(st.integers(1, 60), st.just(1_500)),
)


class BuildAccounting(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="contextd-accounting-"))
        self.path = self.dir / "contextd.duckdb"
        self._open()
        self.service.create_agent(TENANT, AGENT, AgentSettings())
        # The model: each thread's window (ids in order) and what each message is.
        self.window: dict[str, list[int]] = {t: [] for t in THREADS}
        self.started = {t: False for t in THREADS}  # has the thread ever had a message
        self.role: dict[int, Role] = {}
        self.calls_of: dict[int, list[str]] = {}  # tool-using message -> its call ids
        self.answers: dict[int, str] = {}  # tool_result -> the call id it names
        self.pending: list[tuple[str, str]] = []  # (thread, call id) results not yet sent
        self.call_ids = itertools.count(1)
        self.builds = itertools.count()

    # ----------------------------------------------------------------- plumbing

    def _open(self) -> None:
        self.store = Store.open(self.path)
        self.service = ContextService(self.store, ExtractiveSummarizer())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _append(self, thread: str, messages: list[NewMessage]) -> list[int]:
        receipts = self.service.append_messages(
            TENANT, AGENT, "", thread, messages, create_agent=True
        )
        ids = [r.id for r in receipts]
        self.window[thread].extend(ids)
        self.started[thread] = True
        for i, m in zip(ids, messages, strict=True):
            self.role[i] = m.role
            if m.role is Role.TOOL_RESULT:
                self.answers[i] = m.tool_call_id
        return ids

    def _build(self, thread: str, overrides: BuildOverrides) -> BuildResult:
        return self.service.build_context(
            BuildRequest(TENANT, AGENT, "", thread, overrides=overrides)
        )

    # ----------------------------------------------------------------- rules

    @rule(
        thread=st.sampled_from(THREADS),
        text=texts,
        role=st.sampled_from([Role.USER] * 2 + [Role.ASSISTANT]),
    )
    def say(self, thread: str, text: str, role: Role) -> None:
        self._append(thread, [NewMessage(role=role, content=text)])

    @rule(
        thread=st.sampled_from(THREADS),
        fates=st.lists(st.sampled_from(["now", "now", "later", "never"]), min_size=1, max_size=3),
        openai_style=st.booleans(),
        interleave=st.booleans(),
        reverse=st.booleans(),
        output=texts,
    )
    def tool_turn(
        self,
        thread: str,
        fates: list[str],
        openai_style: bool,
        interleave: bool,
        reverse: bool,
        output: str,
    ) -> None:
        ids = [f"call_{next(self.call_ids)}" for _ in fates]
        if openai_style:
            calls = [
                {"id": c, "type": "function", "function": {"name": "grep", "arguments": "{}"}}
                for c in ids
            ]
            use = NewMessage(role=Role.ASSISTANT, content="", tool_calls=json.dumps(calls))
        else:
            calls = [{"id": c, "name": "grep", "input": {"q": c}} for c in ids]
            use = NewMessage(role=Role.TOOL_USE, content="", tool_calls=json.dumps(calls))
        [head] = self._append(thread, [use])
        self.calls_of[head] = ids
        now = [c for c, fate in zip(ids, fates, strict=True) if fate == "now"]
        self.pending.extend(
            (thread, c) for c, fate in zip(ids, fates, strict=True) if fate == "later"
        )
        if reverse:
            now.reverse()
        for k, call in enumerate(now):
            if interleave and k == 1:
                self._append(thread, [NewMessage(role=Role.USER, content="while it runs")])
            self._append(
                thread, [NewMessage(role=Role.TOOL_RESULT, content=output, tool_call_id=call)]
            )

    @precondition(lambda self: bool(self.pending))
    @rule(pick=st.integers(0, 1_000))
    def late_result(self, pick: int) -> None:
        thread, call = self.pending.pop(pick % len(self.pending))
        self._append(
            thread, [NewMessage(role=Role.TOOL_RESULT, content="late output", tool_call_id=call)]
        )

    @rule(thread=st.sampled_from(THREADS))
    def stray_result(self, thread: str) -> None:
        self._append(
            thread, [NewMessage(role=Role.TOOL_RESULT, content="stray", tool_call_id="nobody")]
        )

    @precondition(lambda self: any(self.started.values()))
    @rule(thread=st.sampled_from(THREADS))
    def clear_thread(self, thread: str) -> None:
        if not self.started[thread]:
            return  # a thread without messages has nothing to clear (NOT_FOUND)
        self.service.clear_context(TENANT, AGENT, "", thread)
        self.window[thread] = []

    @rule()
    def clear_agent(self) -> None:
        self.service.clear_context(TENANT, AGENT, "", "")
        self.window = {t: [] for t in THREADS}

    @rule(thread=st.sampled_from(THREADS), keep=st.integers(0, 400))
    def compact(self, thread: str, keep: int) -> None:
        try:
            self.service.compact_context(
                TENANT, AGENT, "", thread, "", BuildOverrides(keep_recent_tokens=keep)
            )
        except FailedPrecondition:
            pass  # nothing older than the recent part, or no messages yet
        except Exception as exc:  # NotFound for a thread with no messages at all
            assert type(exc).__name__ == "NotFound" and not self.window[thread], exc

    @rule()
    def restart(self) -> None:
        self.store.close()
        self._open()

    @rule(
        thread=st.sampled_from(THREADS),
        budget=st.integers(3, 3_000),  # the OpenAI reply priming alone costs 3
        truncate=st.booleans(),
        summarize=st.booleans(),
        elide=st.booleans(),
        keep=st.integers(0, 500),
    )
    def build(
        self, thread: str, budget: int, truncate: bool, summarize: bool, elide: bool, keep: int
    ) -> None:
        overrides = BuildOverrides(
            budget_tokens=budget,
            truncate=truncate,
            summarize=summarize,
            elide_tool_results=elide,
            elide_threshold_chars=200,
            keep_recent_tokens=keep,
        )
        self._check_accounting(thread, self._build(thread, overrides), budget)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def store_window_is_the_model(self) -> None:
        for thread in THREADS:
            ref = self.store.context_ref(ContextKey(TENANT, AGENT, "", thread))
            whole = WindowSpec(-(2**62), -(2**62))
            stored = self.store.window_columns(ref, whole) if ref else None
            # An unbounded spec reads the whole history: keep the part after the clears.
            if stored is not None:
                ids = stored.column("id").to_pylist()
                assert ids[len(ids) - len(self.window[thread]) :] == self.window[thread]

    @invariant()
    def unbounded_build_keeps_the_whole_window(self) -> None:
        for thread in THREADS:
            result = self._build(thread, UNBOUNDED)
            stats = result.context.stats
            kept, summarized = self._check_accounting(thread, result, 1_000_000)
            assert stats.dropped_ids == ()
            assert summarized + kept == self.window[thread]
            assert list(result.orphaned_ids) == self._expected_orphans(kept)

    @invariant()
    def small_build_accounts_for_everything(self) -> None:
        budget = (40, 250, 1_200)[next(self.builds) % 3]
        for thread in THREADS:
            self._check_accounting(
                thread, self._build(thread, BuildOverrides(budget_tokens=budget)), budget
            )

    # ----------------------------------------------------------------- checks

    def _check_accounting(
        self, thread: str, result: BuildResult, budget: int
    ) -> tuple[list[int], list[int]]:
        """(b): kept, dropped and summarized partition the window; the kept part is the
        newest messages not summarized, in order; the renderings are valid. Returns the
        kept and the summarized ids."""
        window = self.window[thread]
        stats = result.context.stats
        assert stats.total_tokens <= budget
        kept = [it.id for it in result.context.history if not it.is_summary]
        lo, hi = stats.summarized_range or (1, 0)
        summarized = [i for i in window if lo <= i <= hi]
        dropped = list(stats.dropped_ids)
        assert sorted(kept + dropped + summarized) == sorted(window), (kept, dropped, summarized)
        # The ranges name the dropped messages exactly, as runs of the window's order.
        named: list[int] = []
        for first, last in stats.dropped_ranges:
            run = window[window.index(first) : window.index(last) + 1]
            assert set(run) <= set(dropped), (first, last, dropped)
            named.extend(run)
        assert sorted(named) == sorted(dropped)
        assert stats.rendered_tokens <= budget
        rest = [i for i in window if i not in set(summarized)]
        assert kept == rest[len(rest) - len(kept) :], "kept is the newest part, in order"
        # Orphans are rewritten before anything else: then kept, dropped or summarized.
        assert set(result.orphaned_ids) <= set(window)
        assert (result.context.summary is not None) == (stats.summarized_range is not None)
        _check_renderings(result)
        return kept, summarized

    def _expected_orphans(self, kept: list[int]) -> list[int]:
        """The model's orphans of a history: results answering no earlier call of it, and
        tool-using messages with a call no result of it answers."""
        issued: set[str] = set()
        answered: set[str] = set()
        orphans: list[int] = []
        for i in kept:
            if i in self.answers:
                call = self.answers[i]
                if call in issued and call not in answered:
                    answered.add(call)
                else:
                    orphans.append(i)
            issued.update(self.calls_of.get(i, ()))
        heads = [i for i in kept if i in self.calls_of and not set(self.calls_of[i]) <= answered]
        return sorted(orphans + heads, key=kept.index)


def _check_renderings(result: BuildResult) -> None:
    """Both APIs' pairing rules hold: each Anthropic tool_result answers a tool_use of the
    message just before it, each OpenAI tool message a call of an earlier message."""
    messages = to_anthropic(result.context)["messages"]
    assert not messages or messages[0]["role"] == "user"
    for i, message in enumerate(messages):
        for block in message["content"]:
            if block["type"] == "tool_result":
                before = messages[i - 1]["content"]
                assert block["tool_use_id"] in {b.get("id") for b in before}
    issued: set[str] = set()
    for message in to_openai(result.context):
        issued.update(c["id"] for c in message.get("tool_calls", []))
        if message["role"] == "tool":
            assert message["tool_call_id"] in issued


BuildAccounting.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBuildAccounting = BuildAccounting.TestCase
