"""BuildContext and CompactContext: the provider (all store I/O) around the pure assembly.

This is the only part of context building that does I/O. It reads the window as integer
columns first (ids, roles, token counts, lengths, tool groups), lets the Rust trimmer pick
which newest messages can possibly fit, and loads content for those alone, so the cost of a
build follows the budget, not the length of the thread. The pure modules (assembly,
compaction, render, summarizer) then do the rest on plain values.

Here is the flow of a build and a compaction: the plan, the status block, every read in
one snapshot, the results and windows remembered between builds, the summary stored and
its event. The window's reads are `ContextBuilder`'s through its mixins
(window_loading.py, and window_extension.py for a remembered window extended by
appends); the values passed between the steps are in build_types.py, the stats over the
whole window in accounting.py, a request's options in build_options.py.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy.typing as npt

from contextd import core
from contextd.app.build.accounting import whole_window_stats
from contextd.app.build.assembly import BudgetTooSmallError, assemble
from contextd.app.build.build_options import (
    MAX_BUILD_BUDGET_TOKENS,
    governing_formats,
    strategy_name,
    strategy_options,
)
from contextd.app.build.build_types import (
    BuildPlan,
    BuildRequest,
    BuildResult,
    BuildWindow,
    CompactResult,
    compaction_payload,
)
from contextd.app.build.compaction import (
    make_summary_item,
    plan_compaction,
    repair_tool_pairs,
    summary_body,
)
from contextd.app.build.excerpts import add_excerpts
from contextd.app.build.memo import Memo
from contextd.app.build.render import render
from contextd.app.build.status_text import status_body, status_with_time
from contextd.app.build.summarizer import Summarizer
from contextd.app.build.window_extension import WindowExtension, tail_extendable
from contextd.app.build.window_loading import FIRST_PAGE, HELD_DROPPED_IDS
from contextd.domain.batches import prepare_batch
from contextd.domain.context import (
    DEFAULT_SAFETY_MARGIN,
    AssembledContext,
    Budget,
    HistoryItem,
    StatusEntry,
    ThreadActivity,
    counter_for_model,
    counter_with_known,
)
from contextd.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import (
    BuildOverrides,
    ContextKey,
    Event,
    MessageStamp,
    NewMessage,
    Role,
    StoredMessage,
)
from contextd.domain.validation import quote
from contextd.domain.window import WindowSpec
from contextd.ports.store import (
    BuildReads,
    ContextRef,
    Store,
    read_consistently,
    status_and_activity,
)

COMPRESSED_EVENT = "context.compressed"
STATUS_ENTRIES = 100
# Results of pure-read builds remembered by what they read (see `ContextBuilder._read`),
# and as many windows: one per hot thread and request shape. Few: a remembered window
# holds a view of its thread's cached id column, which an eviction without a commit (a
# commit empties both) would otherwise leave alive outside the cache's bound.
BUILT_RESULTS = 16
STATUS_THREADS = 30


@dataclass(frozen=True, slots=True)
class _StatusKept:
    """A status block's body (`status_body`) and what it is a function of: the entries
    and thread activity read, and a time in ``[since_us, until_us)``. The reads are
    compared by identity first (the DuckDB hot cache hands the same activity list until
    the agent's threads change), else by value."""

    entries: Sequence[StatusEntry]
    activity: Sequence[ThreadActivity]
    since_us: int
    until_us: int
    body: str | None
    second: int  # the whole second of the clock `text` was made at ("as of")
    text: str  # the block (`status_with_time`) at that second

    def answers(
        self, entries: Sequence[StatusEntry], activity: Sequence[ThreadActivity], now_us: int
    ) -> bool:
        return (
            self.since_us <= now_us < self.until_us
            and (self.activity is activity or self.activity == activity)
            and (self.entries is entries or self.entries == entries)
        )


class ContextBuilder(WindowExtension):
    def __init__(self, store: Store, summarizer: Summarizer) -> None:
        self._store = store
        self._summarizer = summarizer
        # Newest-first builds whose unread part held tool rows (they asked the store for
        # its orphans instead of reading the whole window): for tests and probes.
        self.unread_tool_builds = 0
        # What a store can tell of the reads of a snapshot (`build_token`; engines that
        # cannot tell have none): a build whose reads match an earlier one's, with the
        # same request and status block, answers that build's result.
        tokens: Callable[[ContextRef, WindowSpec], tuple[int, Hashable] | None] | None = getattr(
            store, "build_token", None
        )
        self._tokens = tokens
        # Whether the store can name the state a window was read at after reading it
        # though it could not before (PostgreSQL: its window reads remember the state they
        # saw), so that the window of a new state is kept from the first build of it.
        self._tokens_after_reads: bool = getattr(store, "tokens_after_reads", False)
        # The window's columns as NumPy arrays, where a store can hand them without
        # making an Arrow table (`window_arrays`; None: read `window_columns`).
        arrays: Callable[[ContextRef, WindowSpec], dict[str, npt.NDArray[Any]] | None] | None = (
            getattr(store, "window_arrays", None)
        )
        self._arrays = arrays
        # Where the store can send a build's later reads with its first (PostgreSQL: in
        # the snapshot's first round trip, when it can tell their arguments beforehand).
        plan_reads: Callable[[BuildReads], None] | None = getattr(store, "plan_build_reads", None)
        self._plan_reads = plan_reads
        self._built: Memo[Hashable, BuildResult] = Memo(BUILT_RESULTS)
        # Windows by (thread, model, budget, options), each with the thread's part of the
        # token it was read under (`build_token`'s second item: the thread's state and the
        # window's run): a commit to another thread leaves it valid, and a new state of
        # the thread replaces it (one window per thread and parameters is kept).
        self._windows: Memo[Hashable, tuple[Hashable, BuildWindow]] = Memo(BUILT_RESULTS)
        # The status block of each thread's last build but its "as of" line, with what it
        # was made of and until when it reads the same (`_StatusKept`): an agent with
        # many threads formatted their lines again at every build.
        self._statuses: Memo[ContextKey, _StatusKept] = Memo(BUILT_RESULTS)
        # The newest generation remembered: results of older ones cannot be asked for
        # again (a new snapshot reads the newest), so `_built` is emptied when it moves.
        self._generation = -1
        self.memo_hits = 0  # builds answered from `_built`: for tests and probes
        self.window_hits = 0  # ... and windows from `_windows`
        self.window_extensions = 0  # ... and windows extended from one there (`_extended`)
        appended: (
            Callable[
                [ContextRef, WindowSpec, Hashable],
                tuple[dict[str, Any], int, list[StoredMessage]] | None,
            ]
            | None
        ) = getattr(store, "appended_window", None)
        self._appended = appended
        # Where the store can tell the messages appended since a state it names instead
        # (PostgreSQL, whose windows are read newest first: `_extended_tail`).
        appended_tail: (
            Callable[
                [ContextRef, WindowSpec, Hashable],
                tuple[list[StoredMessage], list[int]] | None,
            ]
            | None
        ) = getattr(store, "appended_messages", None)
        self._appended_tail = appended_tail
        # Threads whose last build left a window `_extended_tail` may extend (what a
        # build tells the store beforehand: `BuildReads.extend`).
        self._extendable: dict[ContextKey, bool] = {}
        # Off: every build reads and assembles (its status block made afresh too), and
        # sends no read ahead on what earlier builds read (`plan_build_reads`): tests
        # comparing read paths on one store.
        self.remember_results = True

    # ----------------------------------------------------------------- BuildContext

    def build(self, request: BuildRequest) -> BuildResult:
        # One snapshot for every read of the build; the summarizer (a network call) and
        # any write come after it.
        plan, window, status, key = read_consistently(self._store, lambda: self._read(request))
        if isinstance(window, BuildResult):
            self.memo_hits += 1
            return window
        count = counter_with_known(counter_for_model(plan.model), window.known_counts)
        try:
            context = assemble(
                system_prompt=plan.agent.system_prompt,
                budget=plan.budget,
                count_tokens=count,
                docs=plan.agent.docs,
                status=status,
                history=window.items,
                new_message=request.user_message or None,
                options=plan.options,
                previous_summary=window.previous_summary,
                summarizer=self._summarizer,
                formats=governing_formats(plan.model, request.formats),
                cost_key=plan.model,  # the counter is the model's (with stored counts)
                prepared_memo=window.prepared,
                dropped_ranges=False,  # made over the whole window by `whole_window_stats`
                prepared_base=window.prepared_base,
            )
        except BudgetTooSmallError as exc:
            raise InvalidArgument(str(exc), reason="BUDGET_TOO_SMALL") from exc
        context = replace(context, stats=whole_window_stats(context, window))
        context, excerpts = add_excerpts(
            self._store,
            plan.key,
            request.user_message,
            (plan.agent.build_options or BuildOverrides()).over(request.overrides),
            context,
            count,
            plan.agent.retention_for(plan.key.scope).expired_through_us(plan.now_us),
        )
        stats = context.stats
        summary_id: int | None = None
        new_summary = context.summary is not None and stats.summarizer_path in ("llm", "fallback")
        if context.summary is not None and new_summary:
            stored = self._store_summary(plan, context.summary)
            summary_id = stored.id
            context = _with_summary_id(context, stored.id)
            # A new dict: the window's may be remembered (`_windows`).
            window = replace(window, stamps={**window.stamps, stored.id: MessageStamp.of(stored)})
        elif context.summary is not None:
            summary_id = context.summary.id
        strategy = strategy_name(plan.options)
        event = None
        if new_summary:
            # Only a build that changed something durable (it stored a summary) records
            # an event, right after that write: a build that only trims is a pure read,
            # and never waits on the writer or syncs the disk.
            event = self._record_compression(
                plan,
                original_count=stats.messages_before,
                compressed_count=stats.messages_after,
                estimated_tokens=stats.total_tokens,
                strategy=strategy,
                summary_id=summary_id,
                summarized_ids=stats.summarized_range,
                elided_ids=stats.elided_ids,
                truncated_ids=stats.truncated_ids,
                dropped_count=len(stats.dropped_ids),
                summarizer_path=stats.summarizer_path or "",
                summarizer_error=stats.summarizer_error,
            )
        renderings = {f: render(f, context) for f in request.formats}
        result = BuildResult(
            context,
            core.model_info(plan.model).tokenizer,
            strategy,
            summary_id,
            window.stamps,
            renderings,
            event,
            len(window.items),
            window.orphaned_ids,
            excerpts,
        )
        if key is not None and not new_summary:
            # A pure read of a state the key names: the same reads answer the same.
            self._built.put(key, result)
        return result

    def _read(
        self, request: BuildRequest
    ) -> tuple[BuildPlan, BuildWindow | BuildResult, str, Hashable | None]:
        """Every read of a build (inside its snapshot): the plan, the window, the status,
        and the key its result is remembered by (None: not remembered). When the store
        tells that this snapshot's reads so far (the plan's and the status block's) are
        those of an earlier build, and the window it would read selects the same
        messages of the same state, the earlier build's result stands for the window:
        the build is a pure function of those reads, the request and the status text
        (which carries the clock: "as of", "ago"). A build whose excerpts read tool
        outputs outside the snapshot is not remembered."""
        plan = self._plan(
            request.tenant,
            request.agent,
            request.scope,
            request.thread,
            request.model,
            request.overrides,
            reads_ahead=True,
        )
        status = self._status(plan)
        key: Hashable | None = None
        token: tuple[int, Hashable] | None = None
        asked = (
            self.remember_results
            and self._tokens is not None
            and plan.context is not None
            and _pure_read(plan, request)
        )
        if asked:
            assert self._tokens is not None and plan.context is not None
            token = self._tokens(plan.context, plan.window)
            if token is not None and token[0] > self._generation:
                self._generation = token[0]
                self._built.clear()
            if token is not None:
                key = (token, status, request)
                found = self._built.peek(key)
                if found is not None:
                    return plan, found, status, key
        # The window's part of the build reads the thread alone (the token's second item:
        # its state and the window's run) and is a function of the plan's model, budget
        # and options: remembered apart from the status block, which changes whenever one
        # of the threads it lists grows a second older, and across other threads' commits.
        wkey = (
            (token[1][0], plan.model, plan.budget, plan.options)
            if token is not None and isinstance(token[1], tuple)
            else None
        )
        found_window = self._windows.peek(wkey) if wkey is not None else None
        if found_window is None and token is None and asked and self._tokens_after_reads:
            # A store that names a state only after reading it (the thread's part of its
            # token leads with the thread's id): the window kept of an earlier state.
            assert plan.context is not None
            found_window = self._windows.peek(
                (plan.context.context_id, plan.model, plan.budget, plan.options)
            )
        window: BuildWindow | None = None
        if found_window is not None and token is not None and found_window[0] == token[1]:
            self.window_hits += 1
            window = found_window[1]
        else:
            if found_window is not None:
                # The thread's state moved since: by appends alone, the window extends.
                window = self._extended(plan, *found_window) or self._extended_tail(
                    plan, *found_window
                )
                if window is not None:
                    self.window_extensions += 1
            if window is None:
                window = self._load_history(plan)
            if wkey is not None:
                assert self._tokens is not None and plan.context is not None and token
                if self._tokens(plan.context, plan.window) != token:
                    key = None  # the window's reads went to SQL: not of the cached state
                else:
                    self._windows.put(wkey, (token[1], window))
            elif token is None and self._tokens_after_reads and asked:
                assert self._tokens is not None and plan.context is not None
                late = self._tokens(plan.context, plan.window)
                if late is not None and isinstance(late[1], tuple):
                    wkey = (late[1][0], plan.model, plan.budget, plan.options)
                    self._windows.put(wkey, (late[1], window))
        if self._appended_tail is not None and asked:
            if len(self._extendable) >= BUILT_RESULTS and plan.key not in self._extendable:
                self._extendable.clear()
            self._extendable[plan.key] = tail_extendable(window)
        return plan, window, status, key

    def _status(self, plan: BuildPlan) -> str:
        """The status block of a build (its reads are the snapshot's)."""
        entries, activity = status_and_activity(
            self._store,
            plan.key.tenant,
            plan.key.agent,
            plan.key.scope,
            plan.now_us,
            STATUS_ENTRIES,
            plan.agent_window,
            STATUS_THREADS,
        )
        now = plan.now_us
        second = now // 1_000_000
        kept = self._statuses.peek(plan.key) if self.remember_results else None
        if kept is not None and kept.answers(entries, activity, now):
            if kept.second == second:
                return kept.text  # the same string: its hash (the frame memo's key) is kept
            since, until, body = kept.since_us, kept.until_us, kept.body
        else:
            since = now
            body, until = status_body(entries, activity, now, plan.key.thread)
        text = status_with_time(body, now)
        self._statuses.put(
            plan.key, _StatusKept(entries, activity, since, until, body, second, text)
        )
        return text

    # ----------------------------------------------------------------- CompactContext

    def compact(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        model: str,
        overrides: BuildOverrides,
        record: RequestRecord | None = None,
    ) -> CompactResult:
        """Summarize on demand. With a record, the summary is stored with the request id
        in one transaction; a concurrent retry that loses the race gets AlreadyDone."""

        def read() -> tuple[BuildPlan, BuildWindow]:
            plan = self._plan(tenant, agent, scope, thread, model, overrides)
            if plan.context is None:
                raise NotFound(
                    f"agent {agent!r} has no thread {plan.key.thread!r} in scope {scope!r}",
                    reason="THREAD_NOT_FOUND",
                )
            return plan, self._load_history(plan, everything=True)

        plan, window = read_consistently(self._store, read)
        count = counter_with_known(counter_for_model(plan.model), window.known_counts)
        previous = window.previous_summary
        items, _repaired = repair_tool_pairs(window.items)
        costs = count([it.counted_text for it in items]) if items else []
        compaction = plan_compaction(
            items,
            costs,
            previous_summary=previous,
            keep_recent_tokens=min(
                plan.options.keep_recent_tokens,
                int(plan.budget.prompt_budget * plan.options.keep_recent_share),
            ),
            keep_recent_messages=plan.options.keep_recent_messages,
            max_recent_tokens=plan.budget.prompt_budget,
        )
        if not compaction.to_summarize or compaction.covers is None:
            raise FailedPrecondition(
                f"thread {plan.key.thread!r} has nothing older than its most recent "
                f"{plan.options.keep_recent_messages} messages / "
                f"{plan.options.keep_recent_tokens} tokens to summarize",
                reason="NOTHING_TO_COMPACT",
            )
        previous_text = None
        if previous is not None:
            previous_text = summary_body(previous)
        result = self._summarizer.summarize(compaction.to_summarize, previous_text)
        item = make_summary_item(result, compaction.covers, count)
        if record is not None:
            path, error = result.path, result.error
            record = record.with_encoder(
                lambda receipts: compaction_payload(receipts[0].id, path, error)
            )
        stored = self._store_summary(plan, item, record)
        self._record_compression(
            plan,
            original_count=len(items),
            compressed_count=len(compaction.kept) + 1,
            estimated_tokens=item.token_count + sum(costs[compaction.cut_index :]),
            strategy="summarize",
            summary_id=stored.id,
            summarized_ids=compaction.covers,
            summarizer_path=result.path,
            summarizer_error=result.error,
        )
        return CompactResult(stored, result.path, result.error)

    # ----------------------------------------------------------------- steps

    def _plan(
        self,
        tenant: str,
        agent_name: str,
        scope: str,
        thread: str,
        model: str,
        overrides: BuildOverrides,
        *,
        reads_ahead: bool = False,
    ) -> BuildPlan:
        """`reads_ahead`: a build's plan, whose status block and window reads follow;
        the store may send them with the thread's read (`plan_build_reads`)."""
        # The thread first: on PostgreSQL its read carries the agent row's version, so
        # that get_agent may answer from the replica's cache of agents. The build's time
        # is taken before it, so that the store can send the reads that depend on it
        # (the status block's, the window's bounds) with the thread's read.
        key = ContextKey(tenant, agent_name, scope, thread)
        now = self._store.clock.now_us()
        if reads_ahead and self._plan_reads is not None and self.remember_results:
            self._plan_reads(
                BuildReads(
                    key,
                    now,
                    STATUS_ENTRIES,
                    STATUS_THREADS,
                    FIRST_PAGE,
                    HELD_DROPPED_IDS,
                    self._extendable.get(key, False),
                    key in self._extendable,
                )
            )
        context = self._store.context_ref(key)
        agent = self._store.get_agent(tenant, agent_name)
        chosen = model or agent.model or "default"
        try:
            core.model_info(chosen)
        except core.UnknownModelError as exc:
            raise InvalidArgument(
                f"model {quote(chosen)} is not in the model registry", field="model"
            ) from exc
        merged = agent.build_options.over(overrides) if agent.build_options else overrides
        options = strategy_options(merged)
        if merged.budget_tokens:
            # An explicit budget never exceeds what the model can read, nor the server's
            # cap: a budget of 2**31 would otherwise load a whole long window.
            budget = Budget.tokens(
                min(
                    merged.budget_tokens,
                    core.model_info(chosen).context_window,
                    MAX_BUILD_BUDGET_TOKENS,
                )
            )
        else:
            budget = Budget.for_model(
                chosen,
                output_reserve=merged.output_reserve_tokens,
                safety_margin=(
                    DEFAULT_SAFETY_MARGIN if merged.safety_margin is None else merged.safety_margin
                ),
            )
        agent_window = agent.window_at(scope, now)
        window = agent_window.with_thread_clear(context.last_clear_time_us if context else None)
        return BuildPlan(agent, key, chosen, budget, options, now, agent_window, window, context)

    def _record_compression(
        self,
        plan: BuildPlan,
        *,
        original_count: int,
        compressed_count: int,
        estimated_tokens: int,
        strategy: str,
        summary_id: int | None,
        summarized_ids: tuple[int, int] | None,
        summarizer_path: str,
        summarizer_error: str | None,
        elided_ids: Sequence[int] = (),
        truncated_ids: Sequence[int] = (),
        dropped_count: int = 0,
    ) -> Event:
        """The `context.compressed` event of a compaction."""
        return self._store.record_event(
            plan.key,
            COMPRESSED_EVENT,
            {
                "original_count": original_count,
                "compressed_count": compressed_count,
                "estimated_tokens": estimated_tokens,
                "budget_tokens": plan.budget.prompt_budget,
                "strategy": strategy,
                "summary_id": summary_id,
                "summarized_ids": list(summarized_ids or ()),
                "elided_ids": list(elided_ids),
                "truncated_ids": list(truncated_ids),
                "dropped_count": dropped_count,
                "summarizer_path": summarizer_path,
                "summarizer_error": summarizer_error or "",
                "model": plan.model,
            },
        )

    def _store_summary(
        self, plan: BuildPlan, item: HistoryItem, record: RequestRecord | None = None
    ) -> StoredMessage:
        assert item.summary_of is not None
        message = NewMessage(role=Role.USER, content=item.content, metadata=item.metadata)
        batch = prepare_batch([message], plan.model, [()], summarized_ids=item.summary_of)
        receipt = self._store.append(plan.key, batch, None, record)  # never re-creates an agent
        stored = self._store.messages_by_ids(plan.key, [receipt[0].id])
        return stored[0]


def _pure_read(plan: BuildPlan, request: BuildRequest) -> bool:
    """Whether a build reads nothing outside its snapshot: no excerpts of tool outputs
    (`add_excerpts` reads them after the snapshot, when a user message asks for them)."""
    if not request.user_message.strip():
        return True
    merged = (plan.agent.build_options or BuildOverrides()).over(request.overrides)
    return (merged.tool_output_excerpts or 0) <= 0


def _with_summary_id(context: AssembledContext, stored_id: int) -> AssembledContext:
    summary = context.summary
    assert summary is not None
    renamed = replace(summary, id=stored_id)
    history = tuple(renamed if it is summary else it for it in context.history)
    return replace(context, history=history, summary=renamed)
