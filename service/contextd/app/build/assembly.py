"""Context assembly under a hard token budget. Pure functions.

    1. system prompt   2. agent docs   3. history   4. status preamble   5. new user message

(The renderings put the status, which changes with every build, after the history so
that everything before it stays byte-stable for prompt caches.)

Every part is counted with the caller's :data:`~contextd.domain.context.TokenCounter`
(estimate or exact tokenizer: the caller's choice), and the sum never exceeds the budget.
Priorities when it does not all fit: the system prompt and docs are the agent's
configuration and are never cut (a budget too small for them is an error, not a silent
mutilation); the new user message comes next and is truncated only if it alone is too
big; the status preamble is dropped before the new message is cut; the history
(the compressor, :func:`compress_history`) takes what is left, and its newest turn
is kept, truncated if need be, never dropped without being recorded in the stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from contextd import core
from contextd.app.build.compaction import (
    elide_tool_results,
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
from contextd.app.build.summarizer import ExtractiveSummarizer, Summarizer
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
from contextd.domain.model import AgentDoc

NO_CHAR_LIMIT = 2**62
"""``max_chars_per_message`` for the Rust trimmer when per-message truncation is off."""

SUMMARY_RESERVE_TOKENS = 4_096
"""Room kept for a new checkpoint when choosing the cut (at most a quarter of the
history budget): about what a summary of ``max_tokens`` 2,048 plus its ledger costs."""


class BudgetTooSmallError(ValueError):
    """The budget cannot hold the system prompt and docs (plus one token of the new
    message). Surfaced as an error because any context built anyway would be wrong."""


def render_docs(docs: Sequence[AgentDoc]) -> str:
    """The docs part as the model sees it; what is counted is exactly what is sent."""
    return "\n\n".join(f'<document name="{d.name}">\n{d.content}\n</document>' for d in docs)


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
    live = sorted(
        (e for e in entries if e.is_live(now_us)), key=lambda e: (-e.update_time_us, e.key)
    )
    threads = sorted(
        (a for a in activity if a.window_message_count > 0 or a.thread == current_thread),
        key=lambda a: (a.thread != current_thread, -a.last_message_time_us, a.thread),
    )
    others = [a for a in threads if a.thread != current_thread]
    if not live and not others:
        return ""
    as_of = datetime.fromtimestamp(now_us / 1_000_000, UTC).isoformat(timespec="seconds")
    lines = [f"Status as of {as_of}:"]
    if threads:
        lines.append("Threads of this agent with messages in the context window:")
        for a in threads[:max_threads]:
            mark = " (this thread)" if a.thread == current_thread else ""
            lines.append(
                f"- {a.thread}{mark}: {a.window_message_count} messages, "
                f"last {_ago(now_us - a.last_message_time_us)}"
            )
        if len(threads) > max_threads:
            lines.append(f"- … {len(threads) - max_threads} more threads")
    if live:
        lines.append("Thread and process status:")
        for e in live[:max_entries]:
            when = f"updated {_ago(now_us - e.update_time_us)}"
            if e.expire_time_us is not None:
                when += f", expires in {_span(e.expire_time_us - now_us)}"
            lines.append(
                f"- [{e.kind.value}] {_one_line(e.key, 80)} — {_one_line(e.state, 40)}: "
                f"{_one_line(e.summary, 200)} ({when})"
            )
        if len(live) > max_entries:
            lines.append(f"- … {len(live) - max_entries} more entries")
    return "\n".join(lines)


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
) -> AssembledContext:
    """Build the context in its documented order within ``budget`` (see the module docstring).

    ``history`` is the thread's window, oldest first; it may contain stored summary items
    (the latest one in effect is reused, the messages it covers are skipped), or pass
    the summary as ``previous_summary``. ``summarizer`` is used only when
    ``options.summarize`` is set and the window does not fit; without one the extractive
    summary is used. Raises :class:`BudgetTooSmallError` when the system prompt and docs
    alone do not fit.
    """
    opts = options or StrategyOptions()
    limit = budget.prompt_budget if isinstance(budget, Budget) else budget
    docs = tuple(docs)
    docs_text = render_docs(docs)
    new = new_message or None
    sys_t, docs_t, status_t, new_t = count_tokens([system_prompt, docs_text, status, new or ""])
    if sys_t + docs_t + (1 if new else 0) > limit:
        raise BudgetTooSmallError(
            f"system prompt and docs need {sys_t + docs_t} tokens; the budget is {limit}"
        )
    status_dropped = False
    if status and sys_t + docs_t + status_t + new_t > limit:
        status, status_t, status_dropped = "", 0, True
    room = limit - sys_t - docs_t - status_t
    new_truncated = False
    if new is not None and new_t > room:
        cut = _fit_text(new, room, count_tokens, "\n[… message truncated to fit the context]")
        if cut is None:
            raise BudgetTooSmallError(f"no room for the new message within {limit} tokens")
        new, new_t, new_truncated = cut[0], cut[1], True
    hist = compress_history(
        history,
        room - new_t,
        count_tokens,
        opts,
        previous_summary=previous_summary,
        summarizer=summarizer,
    )
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
        truncated_ids=hist.truncated_ids,
        elided_ids=hist.elided_ids,
        repaired_ids=hist.repaired_ids,
        summarized_range=hist.summarized_range,
        summarizer_path=hist.summarizer_path,
        summarizer_error=hist.summarizer_error,
        new_message_truncated=new_truncated,
        status_dropped=status_dropped,
        newest_turn_dropped=hist.newest_turn_dropped and new is None,
    )
    return AssembledContext(system_prompt, docs, status, hist.items, new, stats, hist.summary)


def compress_history(
    history: Sequence[HistoryItem],
    budget: int,
    count_tokens: TokenCounter,
    options: StrategyOptions,
    *,
    previous_summary: HistoryItem | None = None,
    summarizer: Summarizer | None = None,
) -> CompressedHistory:
    """Make the window fit ``budget`` tokens: repair pairs, elide, summarize, truncate,
    then let the Rust trimmer drop the oldest whole turns. The summary (if any) heads the
    result; every returned item's ``token_count`` is its cost under ``count_tokens``."""
    budget = max(0, budget)
    summary, raw = split_summary(history, previous_summary)
    before = len(raw)
    raw, repaired = repair_tool_pairs(raw)
    elided: list[int] = []
    if options.elide_tool_results:
        raw, elided = elide_tool_results(
            raw,
            threshold_chars=options.elide_threshold_chars,
            keep_recent_turns=options.elide_keep_recent_turns,
        )
    max_chars = options.max_chars_per_message if options.truncate else NO_CHAR_LIMIT
    work = _Columns.build(raw, max_chars, count_tokens)

    path: SummarizerPath | None = None
    error: str | None = None
    summarized: tuple[int, int] | None = None
    folded: list[int] = []
    if summary is not None:
        summary = replace(summary, token_count=count_tokens([summary.content])[0])
        path = "reused"
    summary_t = summary.token_count if summary is not None else 0
    reserve = min(SUMMARY_RESERVE_TOKENS, budget // 4)
    if options.summarize and work.items and summary_t + sum(work.costs) > budget:
        plan = plan_compaction(
            work.items,
            work.costs,
            previous_summary=summary,
            keep_recent_tokens=min(
                options.keep_recent_tokens, int(budget * options.keep_recent_share)
            ),
            keep_recent_messages=options.keep_recent_messages,
            max_recent_tokens=budget - reserve,
        )
        if plan.to_summarize and plan.covers is not None:
            engine = summarizer if summarizer is not None else ExtractiveSummarizer()
            previous = summary_body(summary) if summary is not None else None
            result = engine.summarize(plan.to_summarize, previous)
            summary = make_summary_item(result, plan.covers, count_tokens)
            path, error, summarized = result.path, result.error, plan.covers
            folded = [it.id for it in plan.to_summarize]
            work = work.tail(plan.cut_index)
    if summary is not None:
        # The recent part comes first; the summary gets what is left, at least `reserve`.
        cap = max(budget - sum(work.costs), reserve)
        summary = _fit_item(summary, cap, count_tokens) if summary.token_count > cap else summary
    out, dropped, truncated = _trim(work, budget, summary, count_tokens)
    if out is None and summary is not None:
        summary = None  # the newest turn outranks the summary
        out, dropped, truncated = _trim(work, budget, None, count_tokens)
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
        messages_before=before,
        dropped_ids=tuple(all_dropped),
        truncated_ids=tuple(truncated),
        elided_ids=tuple(elided),
        repaired_ids=tuple(repaired),
        summarized_range=summarized,
        summarizer_path=path,
        summarizer_error=error,
        newest_turn_dropped=bool(work.items) and work.items[-1].id in all_dropped,
    )


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
    def build(cls, raw: list[HistoryItem], max_chars: int, count: TokenCounter) -> _Columns:
        tokens = count([it.counted_text for it in raw]) if raw else []
        items = [replace(it, token_count=t) for it, t in zip(raw, tokens, strict=True)]
        chars = [len(it.content) for it in items]
        long = [i for i, c in enumerate(chars) if c > max_chars]
        cut_items = [_cut(items[i], max_chars) for i in long]
        cut_tokens = count([it.counted_text for it in cut_items]) if cut_items else []
        cut = {
            i: replace(it, token_count=t)
            for i, it, t in zip(long, cut_items, cut_tokens, strict=True)
        }
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
    work: _Columns, budget: int, summary: HistoryItem | None, count: TokenCounter
) -> tuple[list[HistoryItem] | None, list[int], list[int]]:
    """The kept items, dropped ids and truncated ids; ``None`` when the newest turn cannot
    be made to fit even truncated."""
    items = work.items
    if not items:
        return [], [], []
    avail = max(0, budget - (summary.token_count if summary is not None else 0))
    roles, groups = trim_columns(items)
    truncated_tokens = [work.cut[i].token_count if i in work.cut else 0 for i in range(len(items))]
    result = core.trim_to_budget(
        roles, work.tokens, work.chars, groups, avail, work.max_chars, truncated_tokens
    )
    cuts = dict(zip(result.truncated, result.truncated_chars, strict=True))
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
                fitted = _fit_item(items[i], avail, count)
                if fitted is None:
                    return None, [], []
                out.append(fitted)
        start = result.kept[0]
        return out, [it.id for it in items[:start]], truncated
    # Nothing fits, not even the newest turn whole (a tool group, or one message): shrink
    # the contents of the newest turn's messages to share the budget.
    start = newest_unit_start(items)
    unit = _fit_unit(items[start:], avail, count)
    if unit is None:
        return None, [], []
    changed = [new.id for new, old in zip(unit, items[start:], strict=True) if new != old]
    return unit, [it.id for it in items[:start]], changed


def _fit_unit(
    unit: list[HistoryItem], budget: int, count: TokenCounter
) -> list[HistoryItem] | None:
    """Cut the contents of ``unit``'s messages so their sum fits ``budget``: each keeps its
    fixed cost (tool calls, the truncation note) plus a share of the rest in proportion
    to its size. ``None`` when even the fixed costs do not fit."""
    emptied = [_cut(it, 0) for it in unit]
    # A short message costs less whole than emptied with a note: its floor is the smaller.
    fixed = [
        min(whole.token_count, cost)
        for whole, cost in zip(unit, count([it.counted_text for it in emptied]), strict=True)
    ]
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
        fitted = _fit_item(it, allowance, count)
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


def _cut(item: HistoryItem, keep_chars: int) -> HistoryItem:
    """``item`` with its content cut to ``keep_chars`` plus a note saying how to get the
    whole text back (stored messages only; a summary has no handle)."""
    removed = len(item.content) - keep_chars
    if item.id > 0 and not item.is_summary:
        note = f"\n[… {removed} more chars truncated; full text: {full_text_handle(item)}]"
    else:
        note = "\n[… truncated]"
    return replace(item, content=item.content[:keep_chars] + note)


def _fit_item(item: HistoryItem, max_tokens: int, count: TokenCounter) -> HistoryItem | None:
    """The longest cut of ``item`` costing at most ``max_tokens`` under the real counter
    (binary search: token counts are not proportional to characters)."""
    full = count([item.counted_text])[0]
    if full <= max_tokens:
        return replace(item, token_count=full)
    best: HistoryItem | None = None
    lo, hi = 0, len(item.content) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = _cut(item, mid)
        cost = count([cand.counted_text])[0]
        if cost <= max_tokens:
            best, lo = replace(cand, token_count=cost), mid + 1
        else:
            hi = mid - 1
    return best


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


def _span(delta_us: int) -> str:
    s = max(0, delta_us) // 1_000_000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
