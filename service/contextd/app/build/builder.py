"""BuildContext and CompactContext: the provider (all store I/O) around the pure assembly.

This is the only part of context building that does I/O. It reads the window as integer
columns first (ids, roles, token counts, lengths, tool groups), lets the Rust trimmer pick
which newest messages can possibly fit, and loads content for those alone, so the cost of a
build follows the budget, not the length of the thread. The pure modules (assembly,
compaction, render, summarizer) then do the rest on plain values.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from contextd import core
from contextd.app.build.assembly import BudgetTooSmallError, assemble
from contextd.app.build.compaction import (
    chat_only,
    make_summary_item,
    plan_compaction,
    repair_tool_pairs,
    summary_body,
)
from contextd.app.build.excerpts import ExcerptReport, add_excerpts
from contextd.app.build.memo import Memo
from contextd.app.build.render import render
from contextd.app.build.status_text import status_body, status_with_time
from contextd.app.build.summarizer import Summarizer
from contextd.app.build.trimming import NO_CHAR_LIMIT
from contextd.domain.batches import prepare_batch, stored_tokenizer
from contextd.domain.context import (
    DEFAULT_SAFETY_MARGIN,
    AssembledContext,
    Budget,
    BuildStats,
    HistoryItem,
    IdList,
    StatusEntry,
    StrategyOptions,
    ThreadActivity,
    ToolCall,
    counter_for_model,
    counter_with_known,
    derived,
    parse_tool_calls,
)
from contextd.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import (
    Agent,
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
# The first compaction of a very long window folds at most this many of its newest
# older messages; anything older is left out of the summary (and counted as dropped).
MAX_SUMMARIZED_MESSAGES = 5_000
# ... and reads at most this many characters of source besides the recent part the budget
# keeps (the summarizer reads every message it is given, in chunks, clipping long ones,
# so a window's first request stays in view). Chosen from the stored lengths before any
# content is read: it bounds the memory of one build.
MAX_SUMMARY_SOURCE_CHARS = 4_000_000
# A budget's worth of characters (a token is rarely more than this many characters).
CHARS_PER_TOKEN_BOUND = 8
# Stored counts may come from another tokenizer than the build's; reading this much more
# than the budget keeps the loaded set a superset of what the exact build keeps.
CANDIDATE_SLACK = 1.5
# An elided tool result costs about this much (its stub), at least.
ELIDED_COST = 16
# A newest-first window read (`_load_tail`) reads this many messages' columns first,
# then four times more per further page, until the trimmer's walk stops inside them.
FIRST_PAGE = 256
# ... and this many more when a tool_result read answers a call just before what was read
# (the rest of a tool turn), so that its pair is read whole.
STRADDLE_PAGE = 16
# ... and holds at least this many ids of the messages it leaves out (at least what a
# response lists: api.convert.MAX_LISTED_DROPPED_IDS); older ones are counted, not read.
HELD_DROPPED_IDS = 10_000
STATUS_ENTRIES = 100
# Results of pure-read builds remembered by what they read (see `ContextBuilder._read`),
# and as many windows: one per hot thread and request shape. Few: a remembered window
# holds a view of its thread's cached id column, which an eviction without a commit (a
# commit empties both) would otherwise leave alive outside the cache's bound.
BUILT_RESULTS = 16
STATUS_THREADS = 30

FORMATS = ("anthropic", "openai", "text")


@dataclass(frozen=True, slots=True)
class BuildRequest:
    tenant: str
    agent: str
    scope: str
    thread: str
    user_message: str = ""
    model: str = ""
    overrides: BuildOverrides = field(default_factory=BuildOverrides)
    formats: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BuildResult:
    context: AssembledContext
    tokenizer: str
    strategy: str
    summary_id: int | None
    # What the store assigned to each stored message of the context, by id.
    stamps: dict[int, MessageStamp]
    renderings: dict[str, str]
    event: Event | None
    messages_loaded: int = 0
    # Window messages whose tool call or results are outside the history being built,
    # rewritten as text (see `repair_tool_pairs`) or, when they did not fit, dropped.
    orphaned_ids: tuple[int, ...] = ()
    # Excerpts of stored tool outputs the build added (app/build/excerpts.py).
    excerpts: ExcerptReport = field(default_factory=ExcerptReport)


@dataclass(frozen=True, slots=True)
class CompactResult:
    summary: StoredMessage
    path: str
    error: str | None


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything a build or a compaction decides before assembling."""

    agent: Agent
    key: ContextKey
    model: str
    budget: Budget
    options: StrategyOptions
    now_us: int
    agent_window: WindowSpec  # the agent's (other threads apply their own markers)
    window: WindowSpec  # this thread's, its own clear marker included
    context: ContextRef | None  # None: the thread has no messages yet


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


@dataclass(frozen=True, slots=True)
class _Tail:
    """The trimmer's columns of what a newest-first read read (`_load_tail`): the
    window's rows from position `first` on, pair-repaired (a window extended from it
    walks them again with the appended rows: `ContextBuilder._extended_tail`)."""

    first: int
    roles: npt.NDArray[np.uint8]
    tokens: npt.NDArray[np.uint64]
    chars: npt.NDArray[np.uint64]
    groups: npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class _Window:
    """The part of a window a build works on, and what became of the rest of it."""

    items: list[HistoryItem]
    previous_summary: HistoryItem | None
    stamps: dict[int, MessageStamp]
    # Counts the store made at insert under the build's tokenizer, by counted text.
    known_counts: dict[str, int] = field(default_factory=dict)
    # Window messages (loaded or not) whose tool call or results are missing from the
    # history being built, in window order.
    orphaned_ids: tuple[int, ...] = ()
    # Every window message's id, in window order (summarized ones included).
    window_ids: npt.NDArray[np.int64] = field(default_factory=lambda: _NO_IDS)
    # Positions in `window_ids` of the messages the previous summary stands for, and of
    # those left out because they cannot fit (dropped), oldest first: the dropped runs
    # are found on NumPy masks, never from Python tuples of the window.
    summarized_at: slice | npt.NDArray[np.intp] = field(default_factory=lambda: slice(0, 0))
    not_loaded_at: slice | npt.NDArray[np.intp] = field(default_factory=lambda: slice(0, 0))
    # A newest-first read holds only the newest ids: `window_ids` is then the window from
    # position `hidden` on (the positions above stay window positions, and are slices),
    # and `edge_ids` names the ids at the unread positions a dropped run may start or
    # end at (the window's first, the summary's last, the first after it).
    hidden: int = 0
    edge_ids: dict[int, int] = field(default_factory=dict)
    # Its items made ready to fit, by options and formats (`assemble`'s prepared_memo):
    # a remembered window assembled again (its status block changed) reuses them.
    prepared: dict[Hashable, Any] = field(default_factory=dict)
    # A window extended from a remembered one (`ContextBuilder._extended`): that one's
    # `prepared`, and how many of its items this one left out (`assemble`'s
    # prepared_base: the items kept are made ready once, not again after each append).
    prepared_base: tuple[dict[Hashable, Any], int] | None = None
    # A newest-first read's columns (None: the window was read otherwise).
    tail: _Tail | None = None

    @property
    def summarized_ids(self) -> npt.NDArray[np.int64]:
        return self.window_ids[self._held(self.summarized_at)]

    @property
    def not_loaded_ids(self) -> npt.NDArray[np.int64]:
        return self.window_ids[self._held(self.not_loaded_at)]

    def unlisted(self, at: slice | npt.NDArray[np.intp]) -> int:
        """How many of the positions `at` (a slice when `hidden`) were not read."""
        if not self.hidden:
            return 0
        assert isinstance(at, slice)
        start = at.start or 0
        return max(0, min(at.stop or 0, self.hidden) - start)

    def _held(self, at: slice | npt.NDArray[np.intp]) -> slice | npt.NDArray[np.intp]:
        """`at` (window positions) as positions of `window_ids`, the unread ones left out."""
        if not self.hidden:
            return at
        assert isinstance(at, slice)
        h = self.hidden
        return slice(max((at.start or 0) - h, 0), max((at.stop or 0) - h, 0))

    def id_at(self, position: int) -> int:
        """The id at a window position (held, or one of `edge_ids`)."""
        if position >= self.hidden:
            return int(self.window_ids[position - self.hidden])
        return self.edge_ids[position]


class ContextBuilder:
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
        self._windows: Memo[Hashable, tuple[Hashable, _Window]] = Memo(BUILT_RESULTS)
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
                dropped_ranges=False,  # made over the whole window by `_account`
                prepared_base=window.prepared_base,
            )
        except BudgetTooSmallError as exc:
            raise InvalidArgument(str(exc), reason="BUDGET_TOO_SMALL") from exc
        context = replace(context, stats=_account(context, window))
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
        strategy = _strategy(plan.options)
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
    ) -> tuple[_Plan, _Window | BuildResult, str, Hashable | None]:
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
        window: _Window | None = None
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
            self._extendable[plan.key] = _tail_extendable(window)
        return plan, window, status, key

    def _status(self, plan: _Plan) -> str:
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

        def read() -> tuple[_Plan, _Window]:
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
    ) -> _Plan:
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
        return _Plan(agent, key, chosen, budget, options, now, agent_window, window, context)

    def _load_history(self, plan: _Plan, *, everything: bool = False) -> _Window:
        """The window's messages that can matter, with content, after the latest stored
        summary that covers part of this window (if any), pair-repaired.

        Orphans (a tool_result whose tool_use is before the window, a clear or inside the
        summary's range; a tool_use none of whose results is in the window) are repaired
        on the integer columns before the trimmer sees them: a result whose group has no
        head would otherwise keep its group open and stop the trimmer from keeping
        anything older. See :func:`_repair_pair_columns`.
        """
        if plan.context is None:
            return _Window([], None, {})
        stored_summary = self._store.latest_summary(plan.context)
        previous = HistoryItem.from_stored(stored_summary) if stored_summary else None
        stamps = {stored_summary.id: MessageStamp.of(stored_summary)} if stored_summary else {}
        if not everything and not plan.options.summarize:
            # Summarizing reads what it summarizes; a plain build reads newest first.
            tail = self._load_tail(plan, previous, stamps)
            if tail is not None:
                return tail
        cols = self._arrays(plan.context, plan.window) if self._arrays is not None else None
        if cols is None:
            table = self._store.window_columns(plan.context, plan.window)
            # NumPy views of the Arrow columns: no Python object per message on this path.
            cols = {name: table.column(name).to_numpy() for name in _WINDOW_COLUMNS}
        all_ids = cols["id"]
        rest: slice | npt.NDArray[np.intp] = slice(None)
        if previous is not None and previous.summary_of is not None:
            rest, previous = _not_summarized(all_ids, previous)
        ids = all_ids[rest]
        summarized_at = _covered_positions(len(all_ids), rest)
        if len(ids) == 0:
            return _Window([], previous, stamps, window_ids=all_ids, summarized_at=summarized_at)
        roles, groups, orphan_at = _repair_pair_columns(
            ids, cols["role"][rest], cols["group_id"][rest]
        )
        tokens = cols["token_count"][rest]
        chars = cols["chars"][rest]
        if everything or plan.options.summarize:
            too_long = int(tokens.sum()) > plan.budget.prompt_budget
            start = max(0, len(ids) - MAX_SUMMARIZED_MESSAGES) if too_long else 0
            if too_long:
                start = max(start, _source_start(chars, _summary_source_chars(plan)))
            start = _group_start(groups, start)
        else:
            start = self._candidates(plan, roles, tokens, chars, groups)
        sequences = cols["sequence"][rest]
        # Summarized messages may sit between kept ones when `rest` is not a range.
        items, stamps, known, orphaned = self._load_kept(
            plan, stamps, ids, start, int(sequences[start]), orphan_at, not isinstance(rest, slice)
        )
        return _Window(
            items,
            previous,
            stamps,
            known,
            orphaned,
            all_ids,
            summarized_at,
            slice(rest.start or 0, (rest.start or 0) + start)
            if isinstance(rest, slice)
            else rest[:start],
        )

    def _extended(self, plan: _Plan, since: Hashable, old: _Window) -> _Window | None:
        """`_load_history` of a plain build (no summarizing) from `old`, the window a
        build of the same thread and parameters read at the state `since` names, when
        the store tells that the thread changed since by appended messages alone and
        the window still starts where it did (`appended_window`); None otherwise (the
        caller reads the window afresh). A thread an agent appends to before every
        build then loads and derives only the appended messages.

        It answers what `_load_history` answers: the trimmer still walks the whole
        window's columns (in Rust, as there). The rest is taken from `old` only where it
        cannot differ, else the window is read afresh: `old` had no stored summary in
        effect (none, or one whose last message is not in the window: a summary stored
        since ends the store's run of ancestors, and appended messages are none of
        that one's) and no orphan (nothing its repair changed, loaded or not), and the
        appended rows are plain messages (no tool call, no tool result), so the window
        still has no orphan and its columns need no repair; the kept part starts no
        earlier than `old`'s, so it is a suffix of `old`'s loaded items followed by the
        appended messages."""
        if (
            self._appended is None
            or plan.context is None
            or plan.options.summarize
            or old.previous_summary is not None
            or old.orphaned_ids
            or old.hidden
            or not isinstance(old.not_loaded_at, slice)
            or not isinstance(old.summarized_at, slice)
            or (old.summarized_at.stop or 0) != 0
        ):
            return None
        found = self._appended(plan.context, plan.window, since)
        if found is None:
            return None
        cols, old_n, appended = found
        ids = cols["id"]
        n = len(ids)
        old_start = old.not_loaded_at.stop or 0
        if (
            n - old_n != len(appended)
            or len(old.items) != old_n - old_start
            or len(old.window_ids) != old_n
            or len(old.stamps) - len(old.items) not in (0, 1)  # the items' and a summary's
        ):
            return None
        for m in appended:  # a few: an agent's append (cheaper than NumPy on the columns)
            if m.group_id >= 0 or m.role is Role.TOOL_RESULT:
                return None  # tool rows appended: their pairs are read afresh
        start = self._candidates(
            plan, cols["role"], cols["token_count"], cols["chars"], cols["group_id"]
        )
        if start < old_start or start > old_n:
            return None  # (past every remembered item: rare, read afresh)
        carried = _carried_over(plan, old, start - old_start, appended)
        if carried is None:
            return None
        items, stamps, known = carried
        return _Window(
            items,
            None,
            stamps,
            known,
            (),
            ids,
            slice(0, 0),
            slice(0, start),
            prepared_base=(old.prepared, start - old_start),
        )

    def _extended_tail(self, plan: _Plan, since: Hashable, old: _Window) -> _Window | None:
        """`_extended` for a window `_load_tail` read (or this made from one), from the
        messages the store tells were appended since the state `since` names
        (`appended_messages`); None otherwise (the caller reads the window afresh).

        The same conditions as `_extended` (no summary in effect, no orphan, plain
        messages appended, the kept part starting no earlier), and it answers what
        `_load_tail` answers: the trimmer walks the rows that read read (`old.tail`)
        and the appended ones; where the walk stopped inside what was read, it stops
        there or later with more rows after it. The ids held are the window's from
        `HELD_DROPPED_IDS` positions before the kept part on, as `_load_tail` holds
        them when the kept part is short enough that its reads stop within the first
        pages (`_TAIL_KEPT`); past that, or past a bound on the rows carried, the
        window is read afresh."""
        tail = old.tail
        if (
            self._appended_tail is None
            or plan.context is None
            or tail is None
            or plan.options.summarize
            or not _tail_extendable(old)
            or HELD_DROPPED_IDS < _TAIL_HELD
        ):
            return None
        assert isinstance(old.not_loaded_at, slice)
        n_old = old.hidden + len(old.window_ids)
        old_from = old.not_loaded_at.stop or 0
        old_start = old_from - tail.first
        if (
            len(old.items) != n_old - old_from
            or len(old.window_ids) != min(n_old, n_old + HELD_DROPPED_IDS - old_from)
            or len(old.stamps) - len(old.items) not in (0, 1)  # the items' and a summary's
            or tail.first + len(tail.roles) != n_old
            or old_start < 0
        ):
            return None
        found = self._appended_tail(plan.context, plan.window, since)
        if found is None:
            return None
        appended, appended_chars = found
        for m in appended:  # a few: an agent's append
            if m.group_id >= 0 or m.role is Role.TOOL_RESULT:
                return None  # tool rows appended: their pairs are read afresh
        k = len(appended)
        roles = np.concatenate(
            [tail.roles, np.fromiter((int(m.role) for m in appended), tail.roles.dtype, k)]
        )
        tokens = np.concatenate(
            [tail.tokens, np.fromiter((m.token_count for m in appended), tail.tokens.dtype, k)]
        )
        chars = np.concatenate([tail.chars, np.asarray(appended_chars, dtype=tail.chars.dtype)])
        groups = np.concatenate([tail.groups, np.full(k, -1, dtype=tail.groups.dtype)])
        start = self._candidates(plan, roles, tokens, chars, groups)
        n = n_old + k
        loaded_from = tail.first + start
        if start < old_start or start > len(tail.roles) or n - loaded_from > _TAIL_KEPT:
            return None
        if len(roles) > _TAIL_ROWS + 2 * (n - loaded_from):
            return None  # what the window carries stays bounded: read it afresh
        carried = _carried_over(plan, old, start - old_start, appended)
        if carried is None:
            return None
        items, stamps, known = carried
        if len(known) > 2 * len(items) + _KNOWN_SLACK:
            return None
        # The window's ids from max(0, loaded_from - HELD_DROPPED_IDS) on, as a fresh
        # read holds them: fewer old ones (the kept part moved on) and the appended.
        held_n = min(n, n + HELD_DROPPED_IDS - loaded_from)
        keep_old = held_n - k
        held = np.concatenate(
            [
                old.window_ids[len(old.window_ids) - keep_old :],
                np.fromiter((m.id for m in appended), np.int64, k),
            ]
        )
        return _Window(
            items,
            None,
            stamps,
            known,
            (),
            held,
            slice(0, 0),
            slice(0, loaded_from),
            n - held_n,
            dict(old.edge_ids),
            prepared_base=(old.prepared, start - old_start),
            tail=_Tail(tail.first, roles, tokens, chars, groups),
        )

    def _load_tail(
        self, plan: _Plan, previous: HistoryItem | None, stamps: dict[int, MessageStamp]
    ) -> _Window | None:
        """`_load_history` of a build that does not summarize, reading the window newest
        first in pages, so its cost follows the budget, not the window; None when the
        store cannot count the window without reading it (`ContextReader.window_bounds`)
        or cannot list the orphans among the unread part's tool rows
        (`ContextReader.window_unread_orphans`): the caller then reads it all.

        It answers exactly what reading the whole window answers: the trimmer walks from
        the newest message and stops at the first that does not fit, so once its walk
        stops inside the pages read, older messages cannot change where it stops. The
        read goes on while a result read answers a call in the unread part
        (`_answers_unread`); then the orphan repair of the pages is the whole window's (a
        result's call is in the pages or before the window's part after the summary, and
        a call's results come after it), and the unread part's own orphans, which the
        build lists, come from the store. Ids of a thread grow with its
        sequence on this path (appends of a thread are serialized), so a stored summary
        covers a prefix of the window. Counts, and the ids dropped runs start and end at,
        come from the running counts; the newest HELD_DROPPED_IDS ids of what is left out
        are read, older ones only counted."""
        assert plan.context is not None
        summary_last = 0
        if previous is not None and previous.summary_of is not None:
            summary_last = previous.summary_of[1]
            if summary_last > previous.id:
                return None  # not a prefix of the window: read it all
        bounds = self._store.window_bounds(
            plan.context, plan.window, summary_last, FIRST_PAGE, HELD_DROPPED_IDS
        )
        if bounds is None:
            return None
        n = bounds.count
        se, region_from, region_tools = 0, bounds.first_sequence, bounds.base_tools
        if previous is not None and previous.summary_of is not None:
            if bounds.summarized < 0:
                previous = None  # its last message left the window: it stands for none
            else:
                se = bounds.summarized
                region_from = bounds.after_summary_sequence
                region_tools = bounds.summary_tools
        edges = {0: bounds.first_id}
        if se:
            edges |= {se - 1: summary_last, se: bounds.after_summary_id}
        region = n - se
        # The id of the region's first message: ids grow with sequence along the thread.
        region_first_id = bounds.after_summary_id if se else bounds.first_id
        parts: list[pa.Table] = []
        got, before, page = 0, _NO_SEQUENCE, FIRST_PAGE
        read = _EMPTY_PAGE
        roles = groups = orphans = None
        first = bounds.first_page
        while got < region:
            if first is not None:  # read with the bounds
                more, first = first, None
            else:
                size = min(page, region - got)
                more = self._store.window_page(plan.context, region_from, before, size)
            if more.num_rows == 0:
                return None
            parts.insert(0, more)
            got += more.num_rows
            before = int(more.column("sequence")[0].as_py())
            read = pa.concat_tables(parts).combine_chunks()
            ids = read.column("id").to_numpy()
            roles, groups, orphans = _repair_pair_columns(
                ids, read.column("role").to_numpy(), read.column("group_id").to_numpy()
            )
            stops = got < region and self._walk_stops(plan, read, roles)
            straddle = _answers_unread(read, region_first_id) if stops else 0
            if stops and not straddle:
                break
            # A pair across the unread edge: the rest of its turn is a few rows away
            # (at most `straddle`, the distance in ids to its call).
            page = min(straddle, STRADDLE_PAGE) if stops else page * 4
        c = n - got  # the window position of the oldest message read
        unread_orphans: list[int] = []
        if got:
            ordinal, tools = (
                read.column("ordinal")[0].as_py(),
                read.column("tools_total")[0].as_py(),
            )
            oldest_is_tool = read.column("group_id")[0].as_py() >= 0 or read.column("role")[
                0
            ].as_py() == int(Role.TOOL_RESULT)
            if ordinal - 1 - bounds.base_ordinal != c or tools < 0:
                return None  # the counts do not match the rows: read it all
            if got < region and tools - int(oldest_is_tool) != region_tools:
                # Tool rows in the unread part: no result read answers a call there
                # (`_answers_unread`), so they change nothing read; the orphans among
                # them are listed, as the whole read lists them.
                found = self._store.window_unread_orphans(plan.context, region_from, before)
                if found is None:
                    return None
                unread_orphans = found
                self.unread_tool_builds += 1
        start = 0
        if got:
            assert roles is not None and groups is not None
            start = self._candidates(
                plan,
                roles,
                read.column("token_count").to_numpy(),
                read.column("chars").to_numpy(),
                groups,
            )
        loaded_from = c + start
        read_ids = read.column("id").to_numpy() if got else _NO_IDS
        # The ids of the window left out that a response may list, from before the pages.
        need = min(c, HELD_DROPPED_IDS - start) if region else min(n, HELD_DROPPED_IDS)
        older = _NO_IDS
        # Rows read past the first page (a pair's rest): the run of ids before the first
        # page's oldest still holds before the oldest read when those rows continue it.
        extra = got - (bounds.first_page.num_rows if bounds.first_page is not None else got)
        if (
            need > 0
            and got
            and need <= bounds.contiguous_before - extra
            and int(read_ids[0]) == int(read_ids[extra]) - extra
        ):
            older = np.arange(int(read_ids[0]) - need, int(read_ids[0]), dtype=np.int64)
            need = 0
        if need > 0 and got:
            # Ids grow along the thread, so id - ordinal never falls: if the message
            # `need` ids before the oldest one read sits `need` positions before it, every
            # id between is a window message's (a thread appended alone, in batches).
            first_read = int(read_ids[0])
            guess = first_read - need
            at = bounds.base_ordinal + c - need + 1
            if guess > 0 and self._store.window_ordinal(plan.context, guess) == at:
                older = np.arange(guess, first_read, dtype=np.int64)
                need = 0
        if need > 0:
            page_before = before if got else _NO_SEQUENCE
            extra = self._store.window_page(
                plan.context, bounds.first_sequence, page_before, need, ids_only=True
            )
            if extra.num_rows != need:
                return None
            older = extra.column("id").to_numpy()
        held = np.concatenate([older, read_ids]) if len(older) else read_ids
        hidden = n - len(held)
        if not got:
            return _Window(
                [],
                previous,
                stamps,
                window_ids=held,
                summarized_at=slice(0, se),
                hidden=hidden,
                edge_ids=edges,
            )
        assert orphans is not None and roles is not None and groups is not None
        first_sequence = int(read.column("sequence")[start].as_py())
        items, stamps, known, orphaned = self._load_kept(
            plan, stamps, read_ids, start, first_sequence, orphans, False, unread_orphans
        )
        return _Window(
            items,
            previous,
            stamps,
            known,
            orphaned,
            held,
            slice(0, se),
            slice(se, loaded_from),
            hidden,
            edges,
            tail=_Tail(
                c,
                roles,
                read.column("token_count").to_numpy(),
                read.column("chars").to_numpy(),
                groups,
            ),
        )

    @staticmethod
    def _walk_stops(plan: _Plan, read: pa.Table, roles: npt.NDArray[np.uint8]) -> bool:
        """Whether the trimmer's walk over these newest messages stops among them: their
        costs (as `_candidates` gives them to the trimmer, each cut to what truncation
        leaves) add up to more than its budget."""
        opts = plan.options
        tokens = read.column("token_count").to_numpy()
        chars = read.column("chars").to_numpy()
        costs = tokens.astype(np.int64)
        if opts.elide_tool_results:
            elidable = (roles == int(Role.TOOL_RESULT)) & (chars > opts.elide_threshold_chars)
            costs = np.where(elidable, np.minimum(costs, ELIDED_COST), costs)
        max_chars = opts.max_chars_per_message if opts.truncate else NO_CHAR_LIMIT
        if max_chars < NO_CHAR_LIMIT:
            cut = -(-max_chars // 4)
            costs = np.where(chars > max_chars, np.minimum(costs, cut), costs)
        budget = int(plan.budget.prompt_budget * CANDIDATE_SLACK) + 1
        return int(costs.sum()) > budget

    def _load_kept(
        self,
        plan: _Plan,
        stamps: dict[int, MessageStamp],
        ids: npt.NDArray[np.int64],
        start: int,
        first_sequence: int,
        orphan_at: npt.NDArray[np.intp],
        only_kept_ids: bool,
        unread_orphans: Sequence[int] = (),
    ) -> tuple[list[HistoryItem], dict[int, MessageStamp], dict[str, int], tuple[int, ...]]:
        """The messages the trimmer may keep (`ids` from position `start` on, the first
        at `first_sequence`), read whole and with their tool pairs repaired: the items,
        the stamps with theirs added, the counts stored under the build's tokenizer, and
        the orphans (those left unloaded, then what the repair changed among the loaded,
        which includes the loaded orphans and calls of which only some were answered).
        `only_kept_ids` drops loaded messages not among the ids (summarized ones that
        sit between kept ones). `unread_orphans` are the orphans of the window before
        `ids` (a newest-first read's unread part), listed first. The whole and the
        newest-first read both end here."""
        assert plan.context is not None
        kept_ids = ids[start:]
        loaded = self._store.window_messages_from(
            plan.context, plan.window, first_sequence, (int(kept_ids.min()), int(kept_ids.max()))
        )
        if only_kept_ids:
            wanted = set(kept_ids.tolist())
            loaded = [m for m in loaded if m.id in wanted]
        # Made once per message object (the hot cache keeps them): see `derived`.
        made = list(map(derived, loaded))
        items, repaired = repair_tool_pairs(
            [item for item, _ in made],
            self._outside_calls(plan, loaded, set(ids[orphan_at].tolist())),
        )
        orphaned = [*unread_orphans, *ids[orphan_at[orphan_at < start]].tolist(), *repaired]
        label = stored_tokenizer(plan.model)
        return (
            items,
            stamps | {item.id: stamp for item, stamp in made},
            {m.content + m.tool_calls: m.token_count for m in loaded if m.tokenizer == label},
            tuple(orphaned),
        )

    def _outside_calls(
        self, plan: _Plan, loaded: Sequence[StoredMessage], orphaned: set[int]
    ) -> dict[str, ToolCall]:
        """The calls answered by loaded orphan results whose tool_use is stored but outside
        the history being built, by call id, so the repaired result can name its tool."""
        if not orphaned:  # the usual window: no walk over what was loaded
            return {}
        heads = {
            m.group_id
            for m in loaded
            if m.id in orphaned and m.role is Role.TOOL_RESULT and m.group_id >= 0
        }
        if not heads:
            return {}
        found: dict[str, ToolCall] = {}
        for head in self._store.messages_by_ids(plan.key, sorted(heads)):
            for call in parse_tool_calls(head.tool_calls) if head.tool_calls else []:
                found.setdefault(call.id, call)
        return found

    def _candidates(
        self,
        plan: _Plan,
        roles: npt.NDArray[np.uint8],
        tokens: npt.NDArray[np.uint64],
        chars: npt.NDArray[np.uint64],
        groups: npt.NDArray[np.int64],
    ) -> int:
        """Index of the oldest message that can possibly fit (the Rust trimmer on the
        stored counts, with slack), so only the newest suffix is loaded."""
        opts = plan.options
        costs = tokens
        if opts.elide_tool_results:
            elidable = (roles == int(Role.TOOL_RESULT)) & (chars > opts.elide_threshold_chars)
            costs = np.where(elidable, np.minimum(tokens, ELIDED_COST), tokens).astype(np.uint64)
        budget = int(plan.budget.prompt_budget * CANDIDATE_SLACK) + 1
        max_chars = opts.max_chars_per_message if opts.truncate else NO_CHAR_LIMIT
        trim = core.trim_columns_to_budget(
            np.ascontiguousarray(roles),
            np.ascontiguousarray(costs),
            np.ascontiguousarray(chars),
            np.ascontiguousarray(groups),
            budget,
            max_chars,
        )
        if trim.kept_start is None:  # not even the newest fits: load its whole turn
            return _group_start(groups, max(0, len(roles) - 1))
        return _group_start(groups, trim.kept_start)

    def _record_compression(
        self,
        plan: _Plan,
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
        self, plan: _Plan, item: HistoryItem, record: RequestRecord | None = None
    ) -> StoredMessage:
        assert item.summary_of is not None
        message = NewMessage(role=Role.USER, content=item.content, metadata=item.metadata)
        batch = prepare_batch([message], plan.model, [()], summarized_ids=item.summary_of)
        receipt = self._store.append(plan.key, batch, None, record)  # never re-creates an agent
        stored = self._store.messages_by_ids(plan.key, [receipt[0].id])
        return stored[0]


_NO_IDS: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
# Stored counts an extended window may hold beyond twice its items (`_extended`).
_KNOWN_SLACK = 64
# `_extended_tail`: the longest kept part it extends (a fresh read of it reads at most
# the first two pages, and a few rows of a straddling pair), the fewest held ids for
# which that holds (a fresh read holds every id it read, past HELD_DROPPED_IDS before
# the kept part when it read that far), and the rows it carries beyond twice the kept.
_TAIL_KEPT = 4 * FIRST_PAGE
_TAIL_HELD = 21 * FIRST_PAGE
_TAIL_ROWS = 6 * FIRST_PAGE


def _carried_over(
    plan: _Plan, old: _Window, dropped: int, appended: list[StoredMessage]
) -> tuple[list[HistoryItem], dict[int, MessageStamp], dict[str, int]] | None:
    """What an extended window (`ContextBuilder._extended`, `_extended_tail`) takes
    from `old` with its first `dropped` loaded items left out and the `appended`
    messages added: its items (pair-repaired: None if that changed any, the caller
    reads afresh), stamps and stored counts.

    `old`'s items are ones the repair left unchanged (both callers extend only a window
    with no orphan), so when the items left out and the appended ones are all chat
    turns (`chat_only`), the items need no repair and none is made: the pair check
    follows what an append changed, not the window (it repaired every kept item again
    after each append). Otherwise the items are repaired as a fresh read repairs them.

    The stamps are `old`'s (its items' and the stored summary's, which `_load_history`
    gives even when it applies to none of the window) less the dropped items', plus the
    appended ones': a copy, then a step per changed message only. Stored counts are
    keyed by counted text, as `_load_kept` keys them: `old`'s and the appended
    messages'. A dropped message's count stays (a count of the very text under the
    build's tokenizer answers what counting it does), until they are more than the
    items: then the window is read afresh, which keeps the loaded messages' alone (a
    bound on what a remembered window holds)."""
    stamps = old.stamps.copy()
    for it in old.items[:dropped]:
        if stamps.pop(it.id, None) is None:
            return None  # not a window `_load_history` or an extension made: read afresh
    known = old.known_counts.copy()
    if len(known) > 2 * len(old.items) + _KNOWN_SLACK:
        return None
    label = stored_tokenizer(plan.model)
    made = list(map(derived, appended))
    for m, (item, stamp) in zip(appended, made, strict=True):
        stamps[item.id] = stamp
        if m.tokenizer == label:
            known[m.content + m.tool_calls] = m.token_count
    added = [item for item, _ in made]
    items = old.items[dropped:] + added
    if not (chat_only(old.items[:dropped]) and chat_only(added)):
        items, repaired = repair_tool_pairs(items)
        if repaired:
            return None
    return items, stamps, known


def _tail_extendable(window: _Window) -> bool:
    """Whether `ContextBuilder._extended_tail` may extend `window`: a newest-first read
    with no summary in effect and no orphan."""
    return (
        window.tail is not None
        and window.previous_summary is None
        and not window.orphaned_ids
        and bool(window.items)
        and isinstance(window.not_loaded_at, slice)
        and (window.not_loaded_at.start or 0) == 0
        and isinstance(window.summarized_at, slice)
        and (window.summarized_at.stop or 0) == 0
    )


_NO_SEQUENCE = 2**62  # "before" no sequence: a page from the newest message
_WINDOW_COLUMNS = ("id", "role", "token_count", "chars", "group_id", "sequence")
_EMPTY_PAGE = pa.table({"id": pa.array([], pa.int64())})

# The largest prompt budget a build applies, whatever a request or agent asks for.
MAX_BUILD_BUDGET_TOKENS = 1_000_000


def compaction_payload(summary_id: int, path: str, error: str | None) -> bytes:
    """What a CompactContext with a request id remembers: its summary and how it came."""
    return json.dumps({"summary_id": summary_id, "path": path, "error": error}).encode()


def replayed_compaction(store: Store, key: ContextKey, payload: bytes) -> CompactResult:
    """The result of a compaction done before, from what it remembered."""
    data = json.loads(payload)
    found = store.messages_by_ids(key, [int(data["summary_id"])])
    if not found:
        raise NotFound(
            f"the summary of this request is gone (thread {key.thread!r} was deleted)",
            reason="THREAD_NOT_FOUND",
        )
    return CompactResult(found[0], str(data["path"]), data["error"])


def _pure_read(plan: _Plan, request: BuildRequest) -> bool:
    """Whether a build reads nothing outside its snapshot: no excerpts of tool outputs
    (`add_excerpts` reads them after the snapshot, when a user message asks for them)."""
    if not request.user_message.strip():
        return True
    merged = (plan.agent.build_options or BuildOverrides()).over(request.overrides)
    return (merged.tool_output_excerpts or 0) <= 0


def _summary_source_chars(plan: _Plan) -> int:
    """How many characters a summarizing build may read: the summarizer's share plus the
    recent part the budget keeps."""
    return MAX_SUMMARY_SOURCE_CHARS + CHARS_PER_TOKEN_BOUND * plan.budget.prompt_budget


def _source_start(chars: npt.NDArray[Any], limit: int) -> int:
    """The first index of the longest suffix whose characters stay within `limit`."""
    suffix = np.cumsum(chars[::-1], dtype=np.int64)
    within = int(np.searchsorted(suffix, limit, side="right"))
    return max(0, len(chars) - within)


# Strategy options by the overrides they came from (few distinct ones: agents' and calls').
_OPTIONS: Memo[BuildOverrides, StrategyOptions] = Memo(1_024)

# The build options that are strategy options under the same name.
_STRATEGY_FIELDS = tuple(
    f.name for f in fields(StrategyOptions) if f.name in BuildOverrides.__slots__
)


def strategy_options(overrides: BuildOverrides) -> StrategyOptions:
    """The options of a build: the overrides over the documented defaults. Remembered by
    the (frozen) overrides: making and checking them through ``dataclasses.replace`` cost
    a warm build about 20 microseconds, and a hot thread asks with the same ones."""
    return _OPTIONS.get(overrides, _strategy_options)


def _strategy_options(overrides: BuildOverrides) -> StrategyOptions:
    chosen = {
        name: value for name in _STRATEGY_FIELDS if (value := getattr(overrides, name)) is not None
    }
    try:
        return replace(StrategyOptions(), **chosen)
    except ValueError as exc:
        raise InvalidArgument(f"invalid build options: {exc}", field="options") from exc


def _not_summarized(
    ids: npt.NDArray[np.int64], summary: HistoryItem
) -> tuple[slice | npt.NDArray[np.intp], HistoryItem | None]:
    """Which window positions (ids in window order) a stored summary leaves, and the
    summary if it still applies.

    It replaces the window up to its last summarized message. The window is in sequence
    (append) order, so every message up to there was appended before that message and
    so before the summary; a message appended later, whatever its source_time, comes
    after it. The check for ids above the summary's own only guards that: the store's
    one writer hands out ids in append order too. A summary whose last message has left
    the window summarizes nothing in it.
    """
    assert summary.summary_of is not None
    at = np.flatnonzero(ids == summary.summary_of[1])
    if len(at) == 0:
        return slice(None), None
    end = int(at[0]) + 1
    late = np.flatnonzero(ids[:end] > summary.id)
    if len(late) == 0:
        return slice(end, None), summary  # the common case: a plain suffix
    return np.concatenate([late, np.arange(end, len(ids))]), summary


def _covered_positions(n: int, rest: slice | npt.NDArray[np.intp]) -> slice | npt.NDArray[np.intp]:
    """The window positions a stored summary stands for: those `rest` leaves out."""
    if isinstance(rest, slice):
        return slice(0, rest.start or 0)
    covered = np.ones(n, dtype=bool)
    covered[rest] = False
    return np.flatnonzero(covered)


def _answers_unread(read: pa.Table, region_first_id: int) -> int:
    """Whether a tool_result of these newest rows answers a call among the region's
    unread rows (its group, the id of the message that issued the call, lies between the
    region's first id and the oldest id read: ids grow with sequence along a thread):
    0 when none does, else how far in ids the oldest such call is from the oldest row
    read. Its pair would then span the unread edge, so the read goes on."""
    if read.num_rows == 0:
        return 0
    groups = read.column("group_id").to_numpy()
    results = read.column("role").to_numpy() == int(Role.TOOL_RESULT)
    oldest = int(read.column("id")[0].as_py())
    calls = groups[results & (groups >= region_first_id) & (groups < oldest)]
    return oldest - int(calls.min()) if len(calls) else 0


def _repair_pair_columns(
    ids: npt.NDArray[np.int64],
    roles: npt.NDArray[np.uint8],
    groups: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.intp]]:
    """The trimmer's role and group columns with orphans repaired, and the orphans'
    positions (ascending).

    The store gives a tool-using message the group of its own id and each tool_result
    the id of the message that issued its call (or -1). In a window, a result is an
    orphan when no message of its group comes before it (the call is before the window,
    a clear, or folded into a summary); a tool-using message is an orphan when none of
    its results is in the window. :func:`repair_tool_pairs` turns orphan results into
    user text and orphan calls into assistant text, so here they lose their group and
    take those roles: the trimmer may then start the kept part at them, and an orphan
    result no longer holds a group open that nothing would close (which kept the trimmer
    from keeping anything older). The window is scanned once by the Rust core
    (:func:`contextd.core.pair_orphans_columns`, which skips ungrouped rows in blocks):
    no Python object per row, and positions rather than a mask over the window, so what
    follows costs what the orphans are, not the window's length.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    found_results, found_calls = core.pair_orphans_columns(
        ids,
        np.ascontiguousarray(roles, dtype=np.uint8),
        np.ascontiguousarray(groups, dtype=np.int64),
    )
    if not found_results and not found_calls:
        return roles, groups, _NO_POSITIONS
    orphan_results = np.asarray(found_results, dtype=np.intp)
    orphan_calls = np.asarray(found_calls, dtype=np.intp)
    roles = roles.copy()
    roles[orphan_results] = int(Role.USER)
    roles[orphan_calls] = int(Role.ASSISTANT)
    groups = groups.copy()
    groups[orphan_results] = -1
    groups[orphan_calls] = -1
    return roles, groups, np.union1d(orphan_results, orphan_calls)


_NO_POSITIONS: npt.NDArray[np.intp] = np.empty(0, dtype=np.intp)


def _group_start(groups: Sequence[int] | npt.NDArray[np.int64], index: int) -> int:
    """Move `index` back so it does not split a tool group (results follow their use)."""
    while index > 0 and groups[index] >= 0 and groups[index - 1] == groups[index]:
        index -= 1
    return index


def _with_summary_id(context: AssembledContext, stored_id: int) -> AssembledContext:
    summary = context.summary
    assert summary is not None
    renamed = replace(summary, id=stored_id)
    history = tuple(renamed if it is summary else it for it in context.history)
    return replace(context, history=history, summary=renamed)


def _account(context: AssembledContext, window: _Window) -> BuildStats:
    """The build's stats over the whole window, not just the part assembly saw: every
    window message is kept, in `dropped_ids`, or in the summarized range, exactly once.

    Assembly reports what it dropped of the loaded part; the messages not loaded (too old
    to fit) are dropped too, and so are the messages a stored summary stood for when that
    summary did not fit. A summary that heads the context, new or reused, reports the
    range it stands for.
    """
    stats = context.stats
    summarized = stats.summarized_range
    lost = _NO_IDS
    unlisted = window.unlisted(window.not_loaded_at)
    lost_unread = 0
    if context.summary is None:
        lost = window.summarized_ids
        lost_unread = window.unlisted(window.summarized_at)
        unlisted += lost_unread
    elif summarized is None:
        summarized = context.summary.summary_of
    # Kept as arrays: a long window's dropped ids are nearly all of it (see IdList).
    # The unread ones are the oldest (a summary covers a prefix when ids are unread).
    dropped = IdList(lost, window.not_loaded_ids, stats.dropped_ids, unlisted=unlisted)
    not_loaded = len(window.not_loaded_ids) + window.unlisted(window.not_loaded_at)
    runs: tuple[tuple[int, int], ...] = ()
    order = window.window_ids
    if (
        dropped
        and isinstance(window.summarized_at, slice)
        and isinstance(window.not_loaded_at, slice)
    ):
        # The common case: what the summary stands for and what was not loaded are two
        # ranges of window positions, and assembly dropped a few of the loaded rest.
        loaded_from = window.not_loaded_at.stop or 0
        intervals = [(window.not_loaded_at.start or 0, loaded_from)]
        if len(lost) or lost_unread:
            intervals.append((0, window.summarized_at.stop or 0))
        if stats.dropped_ids:  # a set over the loaded part: np.isin's setup costs more
            intervals.extend(
                _loaded_runs(order[loaded_from - window.hidden :], loaded_from, stats.dropped_ids)
            )
        runs = _runs_of_intervals(window.id_at, intervals)
    elif dropped:
        gone = np.zeros(len(order), dtype=bool)
        if len(lost):
            gone[window.summarized_at] = True
        gone[window.not_loaded_at] = True
        if stats.dropped_ids:  # what assembly dropped of the loaded part: a few
            gone |= np.isin(order, np.asarray(stats.dropped_ids, dtype=np.int64))
        runs = _runs_of(order, gone)
    return _stats_with(
        stats,
        messages_before=stats.messages_before + not_loaded,
        dropped_ids=dropped,
        dropped_ranges=runs,
        summarized_range=summarized,
    )


# BuildStats' fields in their order, and a getter of them all (`_stats_with`).
_STATS_FIELDS = tuple(f.name for f in fields(BuildStats))
_STATS_VALUES = operator.attrgetter(*_STATS_FIELDS)
_STATS_AT = {name: at for at, name in enumerate(_STATS_FIELDS)}
if not all(f.init for f in fields(BuildStats)):  # pragma: no cover
    raise ImportError("BuildStats has a field its constructor does not take: see _stats_with")


def _stats_with(stats: BuildStats, **changed: Any) -> BuildStats:
    """``replace(stats, **changed)`` about twice cheaper (every build makes its stats
    over the whole window: ``dataclasses.replace`` plumbs 29 fields by keyword, 13 us).
    The same constructor call, its arguments by position (checked at import: every
    field is one)."""
    values = list(_STATS_VALUES(stats))
    for name, value in changed.items():
        values[_STATS_AT[name]] = value
    return BuildStats(*values)


def _loaded_runs(
    loaded: npt.NDArray[np.int64], first: int, dropped: Sequence[int]
) -> list[tuple[int, int]]:
    """The window positions (``loaded`` starts at position ``first``) of the ids of
    ``dropped`` found in ``loaded``, as half-open ranges of consecutive positions, oldest
    first. The walk stops once every dropped id was found: assembly drops the oldest
    turns, so that is usually after a short prefix of what was loaded."""
    wanted = set(dropped)
    left = len(wanted)
    runs: list[tuple[int, int]] = []
    start = end = -1
    for at, i in enumerate(loaded.tolist(), first):
        if i in wanted:
            if at == end:
                end += 1
            else:
                if end > start:
                    runs.append((start, end))
                start, end = at, at + 1
            left -= 1
            if not left:
                break
    if end > start:
        runs.append((start, end))
    return runs


def _runs_of_intervals(
    id_at: Callable[[int], int], intervals: list[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """As :func:`_runs_of`, from half-open ranges of dropped window positions (merged
    where they touch or overlap): no pass over the whole window (`id_at` names the id at
    a position)."""
    runs: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return tuple((id_at(a), id_at(b - 1)) for a, b in runs)


def _runs_of(
    order: npt.NDArray[np.int64], gone: npt.NDArray[np.bool_]
) -> tuple[tuple[int, int], ...]:
    """The dropped ids (`gone`, a mask over the window's ids in window order) as (first,
    last) of each run of consecutive window messages that were all dropped: every dropped
    message is in exactly one run and no other window message is. Vectorised, as the
    window may hold a million messages."""
    edges = np.diff(np.concatenate(([False], gone, [False])).astype(np.int8))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1) - 1
    return tuple(
        (int(order[a]), int(order[b])) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    )


def governing_formats(model: str, asked: Sequence[str]) -> tuple[str, ...]:
    """The renderings whose provider counts a build's budget bounds: those asked for,
    and the model's own provider's (Anthropic for Claude models, else OpenAI), so a build
    that asks for none still fits the request its model will be sent."""
    native = "anthropic" if core.model_info(model).name.startswith("claude") else "openai"
    return tuple(dict.fromkeys([native, *asked]))


def _strategy(options: StrategyOptions) -> str:
    used = []
    if options.truncate:
        used.append("truncate")
    if options.summarize:
        used.append("summarize")
    if options.elide_tool_results:
        used.append("elide_tool_results")
    return ",".join(used)
