"""Context assembly under a hard token budget. Pure functions.

    1. system prompt   2. agent docs   3. history   4. status preamble   5. new user message

(The renderings put the status, which changes with every build, after the history so
that everything before it stays byte-stable for prompt caches.)

What is counted. With ``formats`` (the builder always passes them), every part costs what
it costs in those renderings as their providers count them (:class:`Framing`: per-message
framing, roles, tool_call JSON, the placeholder a rendering may insert), and the finished
context is rendered and counted once more before it is returned: the rendered request
never exceeds the budget. Without ``formats``, parts cost their bare text counts.

Priorities when it does not all fit: the system prompt and docs are the agent's
configuration and are never cut (a budget too small for them is an error, not a silent
mutilation); the new user message comes next and is truncated only if it alone is too
big; then the newest turn of the history (and, when the build has no new message, the
thread's latest user message, the current request): the status preamble is shortened,
then dropped, before they would have to yield; the history (the compressor,
:func:`compress_history`) takes what is left, and its newest turn is kept, truncated if
need be, never dropped without being recorded in the stats.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

from contextd import core
from contextd.app.build import ledger
from contextd.app.build.blobs import stub_blobs
from contextd.app.build.compaction import (
    CompactionPlan,
    chat_only,
    elide_tool_results,
    fold_into_ledger,
    make_summary_item,
    newest_unit_start,
    plan_compaction,
    repair_tool_pairs,
    split_summary,
    summary_body,
    trim_columns,
    valid_cuts,
)
from contextd.app.build.handles import full_text_handle
from contextd.app.build.memo import Memo
from contextd.app.build.render import Framing, joined_system, render_docs
from contextd.app.build.summarizer import ExtractiveSummarizer, Summarizer, SummaryResult
from contextd.domain.context import (
    AssembledContext,
    Budget,
    BuildStats,
    HistoryItem,
    StatusEntry,
    StrategyOptions,
    SummarizerPath,
    ThreadActivity,
    TokenCounter,
)
from contextd.domain.model import AgentDoc, Role

__all__ = [
    "NO_CHAR_LIMIT",
    "BudgetTooSmallError",
    "assemble",
    "compress_history",
    "cut_text",
    "render_docs",
    "status_preamble",
]

NO_CHAR_LIMIT = 2**62
"""``max_chars_per_message`` for the Rust trimmer when per-message truncation is off."""

MIN_COMPACTION_GAIN_SHARE = 0.25
"""A fold into a stored checkpoint smaller than this share of the history budget gains
nothing worth a new checkpoint: its specifics join the checkpoint's ledger for this build
(no summarizer call, nothing stored) until enough has accumulated."""

SUMMARY_RESERVE_TOKENS = 4_096
"""Room kept for a new checkpoint when choosing the cut (at most a quarter of the
history budget, or the previous checkpoint's size when that is larger, up to half):
about what a summary of ``max_tokens`` 2,048 plus its ledger costs."""

SUMMARY_PROSE_TOKENS = 512
"""About what a checkpoint's prose costs beside its ledger (a model's summary is asked
for in six short sections), for sizing the reserve of a ledger that needs more room."""

NEW_MESSAGE_NOTE = "\n[… message truncated to fit the context]"
STATUS_NOTE = "- … (status shortened to fit the context)"
RENDER_CHECKS = 6
"""How often a build may tighten the history budget after counting its rendering (the
item-by-item costs are exact for OpenAI and an upper estimate otherwise: this is a net)."""

ItemCost = Callable[[Sequence[HistoryItem]], list[int]]
"""What each history item costs as rendered (see :meth:`Framing.items`)."""


class BudgetTooSmallError(ValueError):
    """The budget cannot hold the system prompt and docs (plus one token of the new
    message). Surfaced as an error because any context built anyway would be wrong."""


def status_preamble(
    entries: Sequence[StatusEntry],
    activity: Sequence[ThreadActivity],
    now_us: int,
    current_thread: str,
    *,
    max_entries: int = 30,
    max_threads: int = 30,
) -> str:
    """The status block: live thread/process entries plus the agent's threads with
    messages in the window, so each thread knows what else is happening.

    Expired entries are dropped (a stale "running" is worse than none). Threads are the
    service's own view (message counts, last activity), the current one first. Returns ""
    when nothing else is going on, so a lone thread pays no tokens for it.
    """
    body, _until = status_body(
        entries, activity, now_us, current_thread, max_entries=max_entries, max_threads=max_threads
    )
    return status_with_time(body, now_us)


def status_with_time(body: str | None, now_us: int) -> str:
    """The status block of a `status_body` at ``now_us``: its "as of" line heads it."""
    if body is None:
        return ""
    as_of = datetime.fromtimestamp(now_us / 1_000_000, UTC).isoformat(timespec="seconds")
    return f"Status as of {as_of}:\n{body}"


def status_body(
    entries: Sequence[StatusEntry],
    activity: Sequence[ThreadActivity],
    now_us: int,
    current_thread: str,
    *,
    max_entries: int = 30,
    max_threads: int = 30,
) -> tuple[str | None, int]:
    """The status block but its "as of" line (None: no block), and the first time after
    ``now_us`` at which it reads otherwise (an entry expires, an "ago" or "expires in"
    shows another number): from ``now_us`` until then the same inputs give the same
    body, so a caller may keep it (the builder: an agent's builds within a second)."""
    live = sorted(
        (e for e in entries if e.is_live(now_us)), key=lambda e: (-e.update_time_us, e.key)
    )
    threads = sorted(
        (a for a in activity if a.window_message_count > 0 or a.thread == current_thread),
        key=lambda a: (a.thread != current_thread, -a.last_message_time_us, a.thread),
    )
    others = [a for a in threads if a.thread != current_thread]
    # An entry that expires later is no longer live then (the block may then be empty).
    until = min((e.expire_time_us for e in live if e.expire_time_us is not None), default=_NEVER)
    if not live and not others:
        return None, until
    lines: list[str] = []
    if threads:
        lines.append("Threads of this agent with messages in the context window:")
        for a in threads[:max_threads]:
            mark = " (this thread)" if a.thread == current_thread else ""
            lines.append(
                f"- {a.thread}{mark}: {a.window_message_count} messages, "
                f"last {_ago(now_us - a.last_message_time_us)}"
            )
            until = min(
                until, a.last_message_time_us + _ago_changes(now_us - a.last_message_time_us)
            )
        if len(threads) > max_threads:
            lines.append(f"- … {len(threads) - max_threads} more threads")
    if live:
        lines.append("Thread and process status:")
        for e in live[:max_entries]:
            when = f"updated {_ago(now_us - e.update_time_us)}"
            until = min(until, e.update_time_us + _ago_changes(now_us - e.update_time_us))
            if e.expire_time_us is not None:
                when += f", expires in {_span(e.expire_time_us - now_us)}"
                until = min(until, e.expire_time_us - _span_holds(e.expire_time_us - now_us))
            lines.append(
                f"- [{e.kind.value}] {_one_line(e.key, 80)} — {_one_line(e.state, 40)}: "
                f"{_one_line(e.summary, 200)} ({when})"
            )
        if len(live) > max_entries:
            lines.append(f"- … {len(live) - max_entries} more entries")
    return "\n".join(lines), until


_NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class CompressedHistory:
    """The history part of a context (the compressor's output) and what it took."""

    items: tuple[HistoryItem, ...]
    tokens: int
    summary: HistoryItem | None
    messages_before: int
    dropped_ids: tuple[int, ...] = ()
    truncated_ids: tuple[int, ...] = ()
    elided_ids: tuple[int, ...] = ()
    repaired_ids: tuple[int, ...] = ()
    summarized_range: tuple[int, int] | None = None
    summarizer_path: SummarizerPath | None = None
    summarizer_error: str | None = None
    newest_turn_dropped: bool = False
    order: tuple[int, ...] = ()
    ledger_stats: ledger.LedgerStats = field(default_factory=ledger.LedgerStats)
    compaction_deferred: bool = False
    summary_attempts: int = 0


def assemble(
    *,
    system_prompt: str,
    budget: Budget | int,
    count_tokens: TokenCounter,
    docs: Sequence[AgentDoc] = (),
    status: str = "",
    history: Sequence[HistoryItem] = (),
    new_message: str | None = None,
    options: StrategyOptions | None = None,
    previous_summary: HistoryItem | None = None,
    summarizer: Summarizer | None = None,
    formats: Sequence[str] = (),
    cost_key: object = None,
    prepared_memo: dict[Hashable, Any] | None = None,
    dropped_ranges: bool = True,
    prepared_base: tuple[Mapping[Hashable, Any], int] | None = None,
) -> AssembledContext:
    """Build the context in its documented order within ``budget`` (see the module docstring).

    ``history`` is the thread's window, oldest first; it may contain stored summary items
    (the latest one in effect is reused, the messages it covers are skipped), or pass
    the summary as ``previous_summary``. ``summarizer`` is used only when
    ``options.summarize`` is set and the window does not fit; without one the extractive
    summary is used. ``formats`` (``"openai"``, ``"anthropic"``, ``"text"``) are the
    renderings whose provider counts the budget bounds. ``cost_key`` names what
    ``count_tokens`` is a function of (the model): items that keep their costs
    (`HistoryItem.cost_memo`) are then counted once per key, not per build. Raises
    :class:`BudgetTooSmallError` when the system prompt and docs alone do not fit. A
    whitespace-only ``new_message`` is no new message.

    ``prepared_memo`` keeps the history made ready to fit (pair-repaired, stubbed, elided,
    counted: it does not depend on the status, the new message or the budget) by options,
    formats and ``cost_key``, for a caller that assembles the same ``history`` and
    ``previous_summary`` with the same ``count_tokens`` again (a builder's remembered
    window whose status block changed).

    Without ``dropped_ranges`` the stats' ``dropped_ranges`` are left empty, for a caller
    that makes them over a larger window itself (the builder's stats step).

    ``prepared_base`` is the ``prepared_memo`` of an earlier assembly of a history that
    this one extends, and how many of that history's first items this one leaves out:
    its other items are this ``history``'s first ones, the same objects, and the items
    after them were appended (a builder's window extended after an append, see
    `ContextBuilder._extended`). The history is then made ready from that one's where
    that is what preparing afresh gives (`_extend_prepared`), else afresh.
    """
    opts = options or StrategyOptions()
    limit = budget.prompt_budget if isinstance(budget, Budget) else budget
    framing = Framing(count_tokens, tuple(formats), cost_key)
    docs = tuple(docs)
    docs_text = render_docs(docs)
    new = new_message if new_message and new_message.strip() else None

    def frame(_key: object) -> tuple[int, int, int, int, int, int, int]:
        sys_t, docs_t, status_t, new_t = count_tokens([system_prompt, docs_text, status, new or ""])
        if framing.formats:
            parts = framing.parts(joined_system(system_prompt, docs_text), status, new)
            return sys_t, docs_t, status_t, new_t, parts.base, parts.status, parts.new_message
        return (
            sys_t,
            docs_t,
            status_t,
            new_t,
            sys_t + docs_t,
            status_t if status else 0,
            (new_t if new else 0),
        )

    if cost_key is None:
        framed = frame(None)
    else:  # `count_tokens` is a function of `cost_key`: the whole input is the key
        framed = _FRAMES.get(
            (cost_key, framing.formats, system_prompt, docs_text, status, new), frame
        )
    sys_t, docs_t, status_t, new_t, base, status_c, new_c = framed
    if base + (1 if new else 0) > limit:
        raise BudgetTooSmallError(
            f"the system prompt and docs need {base} tokens as rendered; the budget is {limit}"
        )
    new_truncated = False
    if new is not None and new_c > limit - base:
        cut = _fit_text(new, limit - base, _part_cost(framing, "new"), NEW_MESSAGE_NOTE)
        if cut is None:
            raise BudgetTooSmallError(f"no room for the new message within {limit} tokens")
        new, new_c, new_truncated = cut[0], cut[1], True
        new_t = count_tokens([new])[0]
    room = limit - base - new_c
    if prepared_memo is None or cost_key is None:
        prepared = _prepare(history, opts, framing.items, previous_summary)
    else:
        pkey = (opts, framing.formats, cost_key)
        found: _Prepared | None = prepared_memo.get(pkey)
        if found is None and prepared_base is not None and previous_summary is None:
            earlier: _Prepared | None = prepared_base[0].get(pkey)
            if earlier is not None:
                found = _extend_prepared(earlier, prepared_base[1], history, opts, framing)
        if found is None:
            found = _prepare(history, opts, framing.items, previous_summary)
        prepared = prepared_memo[pkey] = found
    status_dropped = status_truncated = False
    if status:
        keep = room - prepared.protected_cost(with_request=new is None)
        if status_c > keep:
            status, status_c = _shrink_status(status, keep, _part_cost(framing, "status"))
            status_truncated, status_dropped = bool(status), not status
            status_t = count_tokens([status])[0] if status else 0
    if not status:
        status_t = status_c = 0
    engine = _Once(summarizer if summarizer is not None else ExtractiveSummarizer())
    history_budget = room - status_c
    for check in range(RENDER_CHECKS + 1):
        hist = _compress(prepared, history_budget, framing.items, opts, engine)
        rendered, fmt = 0, ""
        if framing.formats:
            # Counted before the stats are made (the rendering does not read them), so
            # they are made once, with the count.
            rendered, fmt = framing.rendered(
                AssembledContext(
                    system_prompt, docs, status, hist.items, new, _NO_STATS, hist.summary
                )
            )
            if rendered > limit:
                if history_budget > 0:  # tighten by the excess; the last keeps no history
                    excess = rendered - limit
                    history_budget = (
                        0 if check == RENDER_CHECKS - 1 else max(0, history_budget - excess)
                    )
                elif status:
                    status, status_t, status_c = "", 0, 0
                    status_dropped, status_truncated = True, False
                    history_budget = room
                else:
                    break
                continue
        stats = BuildStats(
            budget=limit,
            system_tokens=sys_t,
            docs_tokens=docs_t,
            status_tokens=status_t,
            history_tokens=hist.tokens,
            new_message_tokens=new_t,
            messages_before=hist.messages_before,
            messages_after=len(hist.items),
            dropped_ids=hist.dropped_ids,
            dropped_ranges=id_ranges(hist.order, hist.dropped_ids) if dropped_ranges else (),
            truncated_ids=hist.truncated_ids,
            elided_ids=hist.elided_ids,
            repaired_ids=hist.repaired_ids,
            summarized_range=hist.summarized_range,
            summarizer_path=hist.summarizer_path,
            summarizer_error=hist.summarizer_error,
            new_message_truncated=new_truncated,
            status_dropped=status_dropped,
            status_truncated=status_truncated,
            newest_turn_dropped=hist.newest_turn_dropped and new is None,
            ledger_entries=hist.ledger_stats.entries,
            ledger_tokens=hist.ledger_stats.tokens,
            ledger_added=hist.ledger_stats.added,
            ledger_evicted=hist.ledger_stats.evicted,
            ledger_in_context=hist.ledger_stats.in_context,
            compaction_deferred=hist.compaction_deferred,
            summary_attempts=hist.summary_attempts,
            rendered_tokens=rendered,
            rendered_format=fmt,
        )
        return AssembledContext(system_prompt, docs, status, hist.items, new, stats, hist.summary)
    raise BudgetTooSmallError(f"the rendered request needs more than the budget of {limit} tokens")


_ID_OF = operator.attrgetter("id")

# The stats of a context only counted for its rendering (which does not read them).
_NO_STATS = BuildStats(budget=0)

# What the parts around the history cost (their bare counts, then as framed in the
# formats), by cost key, formats and the texts themselves: every build of an agent counts
# the same system prompt, docs and (mostly) status block again, and counting them (text
# and rendered JSON) was a tenth of a build that follows an append. Never stale: the key
# is the whole input (the counter is a function of the cost key, as for the items).
_FRAMES: Memo[Hashable, tuple[int, int, int, int, int, int, int]] = Memo(256)


def compress_history(
    history: Sequence[HistoryItem],
    budget: int,
    count_tokens: TokenCounter,
    options: StrategyOptions,
    *,
    previous_summary: HistoryItem | None = None,
    summarizer: Summarizer | None = None,
    item_cost: ItemCost | None = None,
) -> CompressedHistory:
    """Make the window fit ``budget`` tokens: repair pairs, stub blobs, elide, summarize,
    truncate, then let the Rust trimmer drop the oldest whole turns. The summary (if any)
    heads the result; every returned item's ``token_count`` is its cost under
    ``item_cost`` (default: its text under ``count_tokens``)."""
    cost = item_cost or Framing(count_tokens, ()).items
    prepared = _prepare(history, options, cost, previous_summary)
    engine = summarizer if summarizer is not None else ExtractiveSummarizer()
    return _compress(prepared, budget, cost, options, engine)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """The window made ready to fit: pair-repaired, blobs stubbed, elided, counted."""

    summary: HistoryItem | None
    work: _Columns
    before: int
    repaired: list[int]
    elided: list[int]
    order: tuple[int, ...]
    # `protected_cost` by its argument: a remembered window's prepared history is
    # assembled again by every build whose status block is not empty (the same answer:
    # the columns are never changed once made).
    protected: dict[bool, int] = field(default_factory=dict, compare=False, repr=False)
    # Whether the items are chat turns alone (`chat_only`): their newest turn is then the
    # last item, found without their tool groups (`_protected_cost`). A window extended
    # by an append is a new `_Prepared`, which found its newest turn over every cut of
    # the window (`valid_cuts`, twice) though only chat turns were appended.
    chat: bool = False

    def protected_cost(self, *, with_request: bool) -> int:
        """What the newest turn costs (as it would be kept, per-message cuts applied);
        with ``with_request``, from the latest user message on (the current request)."""
        found = self.protected.get(with_request)
        if found is None:
            found = self.protected[with_request] = self._protected_cost(with_request)
        return found

    def _protected_cost(self, with_request: bool) -> int:
        items = self.work.items
        if not items:
            return 0
        if self.chat:  # every cut is valid (`valid_cuts`): what follows, without them
            start = len(items) - 1
            if with_request:
                for k in range(start - 1, -1, -1):
                    if items[k].role is Role.USER and not items[k].is_summary:
                        start = k
                        break
            return sum(self.work.costs[start:])
        start = newest_unit_start(items)
        if with_request:
            cuts = valid_cuts(items)
            for k in range(start - 1, -1, -1):
                if items[k].role is Role.USER and not items[k].is_summary:
                    if cuts[k]:
                        start = k
                    break
        return sum(self.work.costs[start:])


def _prepare(
    history: Sequence[HistoryItem],
    options: StrategyOptions,
    cost: ItemCost,
    previous_summary: HistoryItem | None,
) -> _Prepared:
    summary, raw = split_summary(history, previous_summary)
    order = tuple([it.id for it in raw])
    before = len(raw)
    raw, repaired = repair_tool_pairs(raw)
    raw, stubbed = stub_blobs(raw)
    elided: list[int] = []
    if options.elide_tool_results:
        raw, elided = elide_tool_results(
            raw,
            threshold_chars=options.elide_threshold_chars,
            keep_recent_turns=options.elide_keep_recent_turns,
        )
    seen = set(elided)
    elided = [i for i in order if i in seen or i in stubbed]
    max_chars = options.max_chars_per_message if options.truncate else NO_CHAR_LIMIT
    if summary is not None:
        # Counted as stored: the entries it held out mostly stay out (see ledger.restore).
        summary = replace(ledger.restore(summary), token_count=cost([summary])[0])
    work = _Columns.build(raw, max_chars, cost)
    return _Prepared(summary, work, before, repaired, elided, order, chat=chat_only(work.items))


class _Once:
    """A summarizer asked at most once per input within one assembly (a build that
    tightens its budget after counting the rendering must not call the LLM again)."""

    def __init__(self, inner: Summarizer) -> None:
        self._inner = inner
        self._done: dict[tuple[tuple[int, ...], str | None], SummaryResult] = {}

    def summarize(
        self, items: Sequence[HistoryItem], previous_summary: str | None
    ) -> SummaryResult:
        key = (tuple(it.id for it in items), previous_summary)
        if key not in self._done:
            self._done[key] = self._inner.summarize(items, previous_summary)
        return self._done[key]


def _compress(
    prepared: _Prepared,
    budget: int,
    cost: ItemCost,
    options: StrategyOptions,
    engine: Summarizer,
) -> CompressedHistory:
    budget = max(0, budget)
    work = prepared.work
    summary = prepared.summary
    path: SummarizerPath | None = "reused" if summary is not None else None
    error: str | None = None
    summarized: tuple[int, int] | None = None
    folded: list[int] = []
    added = attempts = 0
    deferred = False
    text_cost = _text_cost(summary, cost)
    summary_t = summary.token_count if summary is not None else 0
    reserve = min(SUMMARY_RESERVE_TOKENS, budget // 4)
    if summary is not None:
        reserve = max(reserve, min(summary_t, budget // 2))
    covered_t = ledger.covered_tokens(summary) if summary is not None else 0
    window_t = (covered_t or summary_t) + sum(work.costs)
    share = ledger.ledger_share(window_t, budget)
    if options.summarize and work.items and window_t > budget and share > ledger.LEDGER_SHARE:
        # A window many times the budget: the ledger may need more than a quarter. The
        # reserve grows to what it needs (all it could hold, and a checkpoint's prose),
        # up to its larger share; the recent part keeps what truncation would beside it.
        # Sized by what the fold's entries need (the entries the recent part holds left
        # out), twice: at the usual reserve, then at the reserve that asks for, whose cut
        # folds more; so little room goes unused. A ledger that fits the usual reserve
        # beside the prose changes nothing.
        # The larger share never takes the room of the current request (the latest user
        # message) and the newest turn: they stay whole beside it when they fit the budget.
        base = reserve
        most = max(
            base, min(int(budget * share), budget - prepared.protected_cost(with_request=True))
        )
        for _ in range(2):
            plan = _plan(work, budget - reserve, summary)
            fold = work.items[: plan.cut_index]
            recent_texts = _kept_texts(work.tail(plan.cut_index), budget - reserve)
            wanted = _ledger_reserve(base, most, summary, fold, recent_texts, text_cost)
            if wanted == reserve:
                break
            reserve = wanted
    if options.summarize and work.items and window_t > budget:
        # The recent part is everything that fits beside the reserve: as much as
        # truncation would keep under the budget less the reserve.
        plan = _plan(work, max(0, budget - reserve), summary)
        fold_t = sum(work.costs[: plan.cut_index])
        if (
            plan.to_summarize
            and plan.covers is not None
            and summary is not None
            and (fold_t < budget * MIN_COMPACTION_GAIN_SHARE)
        ):
            # Too small to gain anything: not summarized again on every build.
            summary, added = fold_into_ledger(summary, plan.to_summarize, plan.covers, text_cost)
            summary = replace(summary, token_count=cost([summary])[0])
            summarized, deferred = plan.covers, True
            folded = [it.id for it in plan.to_summarize]
            work = work.tail(plan.cut_index)
            summary = ledger.with_covered_tokens(summary, covered_t + fold_t)
        elif plan.to_summarize and plan.covers is not None:
            previous = summary_body(summary) if summary is not None else None
            result = engine.summarize(plan.to_summarize, previous)
            summary = make_summary_item(result, plan.covers, lambda texts: [0] * len(texts))
            summary = replace(summary, token_count=cost([summary])[0])
            path, error, summarized = result.path, result.error, plan.covers
            added, attempts = result.added, result.attempts
            folded = [it.id for it in plan.to_summarize]
            work = work.tail(plan.cut_index)
            summary = ledger.with_covered_tokens(summary, covered_t + fold_t)
    ledger_stats = ledger.LedgerStats()
    prepared_summary = summary
    present: set[str] = set()
    if summary is not None:
        # The recent part comes first; the summary gets what is left, at least `reserve`;
        # its ledger at most its share of the budget (the least referenced entries go).
        cap = max(budget - sum(work.costs), reserve)
        kept_texts = _kept_texts(work, budget - cap)
        # The ledger takes its share, or all the room the recent part leaves when that is
        # more: room left unused holds no evidence.
        most = max(int(budget * share), cap)
        fitted = _fit_summary(summary, cap, most, cost, added, kept_texts)
        summary, ledger_stats, present = fitted
    out, dropped, truncated = _trim(work, budget, summary, cost)
    if present and prepared_summary is not None and not _holds(out or [], present):
        # The recent part kept less than foreseen: the ledger keeps its entries after all.
        summary, ledger_stats, _ = _fit_summary(prepared_summary, cap, most, cost, added, ())
        out, dropped, truncated = _trim(work, budget, summary, cost)
    if out is None and summary is not None:
        summary = None  # the newest turn outranks the summary
        out, dropped, truncated = _trim(work, budget, None, cost)
    if out is None:
        out, dropped = [], [it.id for it in work.items]  # recorded, not silent
    if summary is None and path is not None:
        # A summary that did not fit: what it covered is dropped, and said so.
        dropped = folded + dropped
        path, summarized = None, None
    items = ([summary] if summary is not None else []) + out
    items, more_dropped = _enforce(items, budget)
    tokens = sum(it.token_count for it in items)
    all_dropped = dropped + more_dropped
    return CompressedHistory(
        items=tuple(items),
        tokens=tokens,
        summary=summary if summary is not None and summary in items else None,
        messages_before=prepared.before,
        dropped_ids=tuple(all_dropped),
        truncated_ids=tuple(truncated),
        elided_ids=tuple(prepared.elided),
        repaired_ids=tuple(prepared.repaired),
        summarized_range=summarized,
        summarizer_path=path,
        summarizer_error=error,
        newest_turn_dropped=bool(work.items) and work.items[-1].id in all_dropped,
        order=prepared.order,
        ledger_stats=ledger_stats
        if summary is not None and summary in items
        else ledger.LedgerStats(),
        compaction_deferred=deferred,
        summary_attempts=attempts,
    )


def _ledger_reserve(
    base: int,
    most: int,
    summary: HistoryItem | None,
    fold: Sequence[HistoryItem],
    recent_texts: Sequence[str],
    count: TokenCounter,
) -> int:
    """The room to keep for a summary folding ``fold``: ``base``, or, when its ledger
    would need more than that beside the prose (and at least half of it), what it needs
    and :data:`SUMMARY_PROSE_TOKENS`, up to ``most``."""
    need = ledger.need(summary, fold, count, leave_out=recent_texts)
    if need > base // 2 and need + SUMMARY_PROSE_TOKENS > base:
        return max(base, min(most, need + SUMMARY_PROSE_TOKENS))
    return base


def _plan(work: _Columns, recent: int, summary: HistoryItem | None) -> CompactionPlan:
    """The compaction that keeps the newest ``recent`` tokens of ``work``."""
    return plan_compaction(
        work.items,
        work.costs,
        previous_summary=summary,
        keep_recent_tokens=max(0, recent),
        keep_recent_messages=0,
        max_recent_tokens=max(0, recent),
    )


def _fit_summary(
    summary: HistoryItem,
    cap: int,
    max_ledger: int,
    cost: ItemCost,
    added: int,
    context_texts: Sequence[str],
) -> tuple[HistoryItem | None, ledger.LedgerStats, set[str]]:
    """The summary fitted to ``cap`` (its ledger to ``max_ledger`` tokens, the entries
    ``context_texts`` hold verbatim left out), counted with ``cost`` (``None`` when not
    even a cut of it fits); and the texts left out."""
    present = ledger.in_context(ledger.parse(summary.content), context_texts)
    fitted, stats = ledger.fit_item(
        summary,
        max_item_tokens=cap,
        max_ledger_tokens=max_ledger,
        count=_text_cost(summary, cost),
        added=added,
        leave_out=present,
    )
    fitted = replace(fitted, token_count=cost([fitted])[0])
    return (_fit_item(fitted, cap, cost) if fitted.token_count > cap else fitted), stats, present


def _kept_texts(work: _Columns, room: int) -> list[str]:
    """The texts of the newest messages that will be kept whole beside a summary within
    ``room`` tokens: the longest suffix of ``work`` that starts where a turn may start and
    costs at most ``room`` (as a message cut to ``max_chars`` when it is cut)."""
    items = work.items
    cuts = valid_cuts(items)
    acc = 0
    start = len(items)
    for k in range(len(items) - 1, -1, -1):
        acc += work.costs[k]
        if acc > room:
            break
        if cuts[k]:
            start = k
    out: list[str] = []
    for k in range(start, len(items)):
        item = work.cut.get(k, items[k])
        out.append(item.content)
        if item.tool_calls:
            out.append(item.tool_calls)
    return out


def _holds(items: Sequence[HistoryItem], texts: set[str]) -> bool:
    """Whether ``items`` (the kept messages) contain every one of ``texts`` verbatim."""
    joined = "\n".join(
        part for it in items if not it.is_summary for part in (it.content, it.tool_calls)
    )
    return all(t in joined for t in texts)


def _text_cost(template: HistoryItem | None, cost: ItemCost) -> TokenCounter:
    """A text counter for the ledger's fitting: each text costs what a message of the
    summary's kind holding it costs (its framing included, so the fit errs on the safe
    side); the summary's own count is then taken again with ``cost``."""

    def count(texts: list[str]) -> list[int]:
        base = HistoryItem(id=0, role=Role.USER, content="") if template is None else template
        return cost([replace(base, content=t) for t in texts]) if texts else []

    return count


def id_ranges(order: Sequence[int], dropped: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``dropped`` as the first and last id of each run of consecutive entries of
    ``order`` (the window, oldest first) that were all dropped."""
    if not dropped:
        return ()
    gone = set(dropped)
    runs: list[tuple[int, int]] = []
    first: int | None = None
    last = 0
    for i in order:
        if i in gone:
            first = i if first is None else first
            last = i
        elif first is not None:
            runs.append((first, last))
            first = None
    if first is not None:
        runs.append((first, last))
    return tuple(runs)


_HISTORY_FIELDS = (
    "id",
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "token_count",
    "is_summary",
    "metadata",
    "summary_of",
)
if tuple(f.name for f in fields(HistoryItem) if f.init) != _HISTORY_FIELDS:  # pragma: no cover
    raise ImportError("HistoryItem's fields changed: update assembly._counted")


def _counted(item: HistoryItem, tokens: int) -> HistoryItem:
    """``replace(item, token_count=tokens)``, four times cheaper: a warm build counts
    every loaded message, and ``dataclasses.replace`` (keyword plumbing over the fields)
    was a fifth of its time. The field list is checked when the module loads.

    An item that keeps its cost (`HistoryItem.cost_memo`, a hot thread's message) keeps
    the copy too, and the copy the same cost: the next build at that cost gets the very
    copy back, and counting the rendering finds its cost on it."""
    memo = item.cost_memo
    if memo is None:
        return _copy_counted(item, tokens)
    found = memo[2]
    if found is not None and found.token_count == tokens:
        return found
    made = _copy_counted(item, tokens)
    object.__setattr__(made, "cost_memo", (memo[0], memo[1], None))
    if memo[1] == tokens:  # counted at its own cost: the copy is worth keeping
        object.__setattr__(item, "cost_memo", (memo[0], memo[1], made))
    return made


def _copy_counted(item: HistoryItem, tokens: int) -> HistoryItem:
    return HistoryItem(
        item.id,
        item.role,
        item.content,
        item.tool_calls,
        item.tool_call_id,
        tokens,
        item.is_summary,
        item.metadata,
        item.summary_of,
    )


def _extend_prepared(
    base: _Prepared,
    dropped: int,
    history: Sequence[HistoryItem],
    options: StrategyOptions,
    framing: Framing,
) -> _Prepared | None:
    """`_prepare` of ``history`` (no previous summary) from ``base``, that of a history
    whose first ``dropped`` items ``history`` leaves out and whose other items are
    ``history``'s first, the same objects; None when preparing afresh could give
    another answer. Each step of `_prepare` is then a function of each item alone: no
    summary, nothing repaired (``base`` repaired nothing, so when the items left out and
    the appended ones are chat turns, `chat_only`, ``history`` needs no repair either;
    otherwise it is checked whole), stubbed or elided in ``base`` nor among the appended
    items, no tool result to elide, and each item costed alone
    (`Framing.costs_each_item_alone`). The old items keep their
    prepared copies and costs; only the appended ones are made ready (a thread's build
    after an append prepared its whole window again, a third of the assembly)."""
    if base.summary is not None or base.repaired or base.elided:
        return None
    if not framing.costs_each_item_alone:
        return None
    kept = len(base.order) - dropped
    if dropped < 0 or kept < 0 or kept > len(history) or base.before != len(base.order):
        return None
    ids = tuple(map(_ID_OF, history))
    if ids[:kept] != base.order[dropped:]:
        return None
    added = list(history[kept:])
    if any(it.is_summary for it in added):
        return None
    if not (chat_only(base.work.items[:dropped]) and chat_only(added)):
        _, repaired = repair_tool_pairs(history)
        if repaired:
            return None
    added, stubbed = stub_blobs(added)
    if stubbed:
        return None
    if options.elide_tool_results and any(it.role is Role.TOOL_RESULT for it in history):
        return None
    max_chars = options.max_chars_per_message if options.truncate else NO_CHAR_LIMIT
    old = base.work
    if max_chars != old.max_chars:
        return None
    new = _Columns.build(added, max_chars, framing.items)
    cut = {i - dropped: it for i, it in old.cut.items() if i >= dropped} if old.cut else {}
    work = _Columns(
        old.items[dropped:] + new.items,
        old.tokens[dropped:] + new.tokens,
        old.chars[dropped:] + new.chars,
        cut | {i + kept: it for i, it in new.cut.items()} if new.cut else cut,
        old.costs[dropped:] + new.costs,
        max_chars,
    )
    return _Prepared(None, work, len(ids), [], [], ids, chat=base.chat and chat_only(new.items))


@dataclass(frozen=True, slots=True)
class _Columns:
    """The window with its trimming columns, counted once."""

    items: list[HistoryItem]
    tokens: list[int]
    chars: list[int]
    cut: dict[int, HistoryItem]  # index -> the item cut to max_chars, counted
    costs: list[int]
    max_chars: int

    @classmethod
    def build(cls, raw: list[HistoryItem], max_chars: int, cost: ItemCost) -> _Columns:
        tokens = cost(raw) if raw else []
        # `_counted`, its kept copy taken inline (all but the new messages of a hot thread).
        items = [
            found
            if (memo := it.cost_memo) is not None
            and (found := memo[2]) is not None
            and found.token_count == t
            else _counted(it, t)
            for it, t in zip(raw, tokens, strict=True)
        ]
        chars = [len(it.content) for it in items]
        if max_chars >= NO_CHAR_LIMIT or max(chars, default=0) <= max_chars:
            return cls(items, tokens, chars, {}, list(tokens), max_chars)  # nothing to cut
        long = [i for i, c in enumerate(chars) if c > max_chars]
        cut_items = [_cut(items[i], max_chars) for i in long]
        cut_tokens = cost(cut_items) if cut_items else []
        cut = {i: _counted(it, t) for i, it, t in zip(long, cut_items, cut_tokens, strict=True)}
        costs = [cut[i].token_count if i in cut else t for i, t in enumerate(tokens)]
        return cls(items, tokens, chars, cut, costs, max_chars)

    def tail(self, start: int) -> _Columns:
        cut = {i - start: it for i, it in self.cut.items() if i >= start}
        return _Columns(
            self.items[start:],
            self.tokens[start:],
            self.chars[start:],
            cut,
            self.costs[start:],
            self.max_chars,
        )


def _trim(
    work: _Columns, budget: int, summary: HistoryItem | None, cost: ItemCost
) -> tuple[list[HistoryItem] | None, list[int], list[int]]:
    """The kept items, dropped ids and truncated ids; ``None`` when the newest turn cannot
    be made to fit even truncated."""
    items = work.items
    if not items:
        return [], [], []
    avail = max(0, budget - (summary.token_count if summary is not None else 0))
    roles, groups = trim_columns(items)
    truncated_tokens = (
        [work.cut[i].token_count if i in work.cut else 0 for i in range(len(items))]
        if work.cut
        else [0] * len(items)
    )
    result = core.trim_to_budget(
        roles, work.tokens, work.chars, groups, avail, work.max_chars, truncated_tokens
    )
    cuts = dict(zip(result.truncated, result.truncated_chars, strict=True))
    if result.kept and not cuts:
        return [items[i] for i in result.kept], [it.id for it in items[: result.kept[0]]], []
    if result.kept:
        out: list[HistoryItem] = []
        truncated: list[int] = []
        for i in result.kept:
            if i not in cuts:
                out.append(items[i])
                continue
            truncated.append(items[i].id)
            if i in work.cut and cuts[i] >= work.max_chars:
                out.append(work.cut[i])
            else:  # the newest message alone, cut to the budget: fit with the real counter
                fitted = _fit_item(items[i], avail, cost)
                if fitted is None:
                    return None, [], []
                out.append(fitted)
        start = result.kept[0]
        return out, [it.id for it in items[:start]], truncated
    # Nothing fits, not even the newest turn whole (a tool group, or one message): shrink
    # the contents of the newest turn's messages to share the budget.
    start = newest_unit_start(items)
    unit = _fit_unit(items[start:], avail, cost)
    if unit is None:
        return None, [], []
    changed = [new.id for new, old in zip(unit, items[start:], strict=True) if new != old]
    return unit, [it.id for it in items[:start]], changed


def _fit_unit(unit: list[HistoryItem], budget: int, cost: ItemCost) -> list[HistoryItem] | None:
    """Cut the contents of ``unit``'s messages so their sum fits ``budget``: each keeps its
    fixed cost (tool calls, the truncation note) plus a share of the rest in proportion
    to its size. ``None`` when even the fixed costs do not fit."""
    emptied = [_cut(it, 0) for it in unit]
    # A short message costs less whole than emptied with a note: its floor is the smaller.
    fixed = [min(whole.token_count, c) for whole, c in zip(unit, cost(emptied), strict=True)]
    spare = budget - sum(fixed)
    if spare < 0:
        return None
    total = sum(it.token_count for it in unit) or 1
    out: list[HistoryItem] = []
    for it, base in zip(unit, fixed, strict=True):
        allowance = base + spare * it.token_count // total
        if it.token_count <= allowance:
            out.append(it)
            continue
        fitted = _fit_item(it, allowance, cost)
        if fitted is None:
            return None
        out.append(fitted)
    return out


def _enforce(items: list[HistoryItem], budget: int) -> tuple[list[HistoryItem], list[int]]:
    """Safety net: drop the oldest whole turns (then the summary) while over budget. The
    steps above are exact under an additive counter, so this should never act."""
    dropped: list[int] = []
    while items and sum(it.token_count for it in items) > budget:
        head = 1 if items[0].is_summary else 0
        body = items[head:]
        cuts = valid_cuts(body)
        nxt = next((k for k in range(1, len(body)) if cuts[k]), None)
        if nxt is None:
            if head:
                items = body
                continue
            dropped.extend(it.id for it in items)
            return [], dropped
        dropped.extend(it.id for it in body[:nxt])
        items = items[:head] + body[nxt:]
    return items, dropped


def cut_marker(handle: str | None, removed: int) -> str:
    """The note that stands where a cut took text out: how much, and the handle that
    fetches the whole text (stored messages only; a summary has no handle)."""
    if handle is not None:
        return f"\n[… {removed} more chars truncated; full text: {handle}]\n"
    return f"\n[… {removed} chars truncated]\n"


def cut_text(text: str, limit: int, handle: str | None) -> str:
    """``text`` cut to at most ``limit`` characters, marker included: its head and its
    tail (where errors usually are) with :func:`cut_marker` between them. A text within
    the limit is returned as is; a limit shorter than the marker gives the marker alone."""
    if len(text) <= limit:
        return text
    body = max(0, limit - len(cut_marker(handle, len(text))))
    for _ in range(2):  # the marker's length depends on the count it names
        body = max(0, limit - len(cut_marker(handle, len(text) - body)))
    head = body // 2
    tail = body - head
    marker = cut_marker(handle, len(text) - body)
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def _cut(item: HistoryItem, limit: int) -> HistoryItem:
    """``item`` with its content cut to ``limit`` characters (see :func:`cut_text`); the
    marker names where the whole text is read back (see handles.py)."""
    handle = full_text_handle(item) if item.id > 0 and not item.is_summary else None
    content = item.content
    if len(content) <= limit:  # a cut asked of a short text still marks it as cut
        return replace(item, content=content[:limit] + cut_marker(handle, 0))
    return replace(item, content=cut_text(content, limit, handle))


def _fit_item(item: HistoryItem, max_tokens: int, cost: ItemCost) -> HistoryItem | None:
    """The longest cut of ``item`` costing at most ``max_tokens`` as rendered (binary
    search: token counts are not proportional to characters)."""
    full = cost([item])[0]
    if full <= max_tokens:
        return _counted(item, full)
    best: HistoryItem | None = None
    lo, hi = 0, len(item.content) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = _cut(item, mid)
        c = cost([cand])[0]
        if c <= max_tokens:
            best, lo = _counted(cand, c), mid + 1
        else:
            hi = mid - 1
    return best


def _part_cost(framing: Framing, part: str) -> TokenCounter:
    """What texts cost as the status preamble or the new message, one by one."""

    def count(texts: list[str]) -> list[int]:
        if not framing.formats:
            return framing.count(texts)
        out = []
        for text in texts:
            costs = framing.parts(
                "", text if part == "status" else "", text if part == "new" else None
            )
            out.append(costs.status if part == "status" else costs.new_message)
        return out

    return count


def _shrink_status(status: str, max_tokens: int, count: TokenCounter) -> tuple[str, int]:
    """The status cut line by line from its end (with a note) to fit ``max_tokens``;
    ``("", 0)`` when not even its first two lines fit."""
    lines = status.split("\n")
    for k in range(len(lines) - 1, 1, -1):
        cand = "\n".join([*lines[:k], STATUS_NOTE])
        c = count([cand])[0]
        if c <= max_tokens:
            return cand, c
    return "", 0


def _fit_text(text: str, max_tokens: int, count: TokenCounter, note: str) -> tuple[str, int] | None:
    best: tuple[str, int] | None = None
    lo, hi = 0, len(text) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = text[:mid] + note
        cost = count([cand])[0]
        if cost <= max_tokens and mid > 0:
            best, lo = (cand, cost), mid + 1
        elif cost <= max_tokens:
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def _ago(delta_us: int) -> str:
    return "just now" if delta_us < 1_000_000 else _span(delta_us) + " ago"


def _unit(seconds: int) -> int:
    """The unit `_span` shows ``seconds`` in, in seconds."""
    for size in (86_400, 3_600, 60):
        if seconds >= size:
            return size
    return 1


def _ago_changes(delta_us: int) -> int:
    """The least delta after ``delta_us`` at which `_ago` reads otherwise (it grows with
    the clock): the next whole second under a second ("just now"), else the next whole
    unit `_span` shows."""
    if delta_us < 1_000_000:
        return 1_000_000
    s = delta_us // 1_000_000
    size = _unit(s)
    return (s // size + 1) * size * 1_000_000


def _span_holds(delta_us: int) -> int:
    """For a delta that shrinks with the clock ("expires in"): the largest delta below
    ``delta_us`` at which `_span` reads otherwise, as the time before the end it is
    reached at (the block changes at ``end - _span_holds(...)``)."""
    s = max(0, delta_us) // 1_000_000
    size = _unit(s)
    # Shows s // size units while the delta is at least (s // size) * size seconds.
    return (s // size) * size * 1_000_000 - 1


def _span(delta_us: int) -> str:
    s = max(0, delta_us) // 1_000_000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
