"""The history compressor: the window made to fit the room assembly leaves it.

`prepare_history` makes the window ready to fit (pairs repaired, blobs stubbed, tool
results elided, every item counted: a `PreparedHistory`, which the builder's memo keeps
across builds, and `extend_prepared` extends after an append); `compress_prepared` then
summarizes or folds into the ledger what does not fit and trims the rest
(`compress_history` is both in one call). Kept apart from assembly, which fits the parts
around the history and calls this for the history alone.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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
    valid_cuts,
)
from contextd.app.build.render import Framing
from contextd.app.build.summarizer import ExtractiveSummarizer, Summarizer, SummaryResult
from contextd.app.build.trimming import (
    NO_CHAR_LIMIT,
    ItemCost,
    WindowColumns,
    enforce_budget,
    fit_item,
    trim_window,
)
from contextd.domain.context import (
    HistoryItem,
    StrategyOptions,
    SummarizerPath,
    TokenCounter,
)
from contextd.domain.model import Role

__all__ = [
    "SUMMARY_RESERVE_TOKENS",
    "CompressedHistory",
    "OnceSummarizer",
    "PreparedHistory",
    "compress_history",
    "compress_prepared",
    "extend_prepared",
    "prepare_history",
]

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


_ID_OF = operator.attrgetter("id")


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
    prepared = prepare_history(history, options, cost, previous_summary)
    engine = summarizer if summarizer is not None else ExtractiveSummarizer()
    return compress_prepared(prepared, budget, cost, options, engine)


@dataclass(frozen=True, slots=True)
class PreparedHistory:
    """The window made ready to fit: pair-repaired, blobs stubbed, elided, counted."""

    summary: HistoryItem | None
    work: WindowColumns
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
    # by an append is a new `PreparedHistory`, which found its newest turn over every cut of
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


def prepare_history(
    history: Sequence[HistoryItem],
    options: StrategyOptions,
    cost: ItemCost,
    previous_summary: HistoryItem | None,
) -> PreparedHistory:
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
    work = WindowColumns.build(raw, max_chars, cost)
    return PreparedHistory(
        summary, work, before, repaired, elided, order, chat=chat_only(work.items)
    )


class OnceSummarizer:
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


def compress_prepared(
    prepared: PreparedHistory,
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
    out, dropped, truncated = trim_window(work, budget, summary, cost)
    if present and prepared_summary is not None and not _holds(out or [], present):
        # The recent part kept less than foreseen: the ledger keeps its entries after all.
        summary, ledger_stats, _ = _fit_summary(prepared_summary, cap, most, cost, added, ())
        out, dropped, truncated = trim_window(work, budget, summary, cost)
    if out is None and summary is not None:
        summary = None  # the newest turn outranks the summary
        out, dropped, truncated = trim_window(work, budget, None, cost)
    if out is None:
        out, dropped = [], [it.id for it in work.items]  # recorded, not silent
    if summary is None and path is not None:
        # A summary that did not fit: what it covered is dropped, and said so.
        dropped = folded + dropped
        path, summarized = None, None
    items = ([summary] if summary is not None else []) + out
    items, more_dropped = enforce_budget(items, budget)
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


def _plan(work: WindowColumns, recent: int, summary: HistoryItem | None) -> CompactionPlan:
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
    return (fit_item(fitted, cap, cost) if fitted.token_count > cap else fitted), stats, present


def _kept_texts(work: WindowColumns, room: int) -> list[str]:
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


def extend_prepared(
    base: PreparedHistory,
    dropped: int,
    history: Sequence[HistoryItem],
    options: StrategyOptions,
    framing: Framing,
) -> PreparedHistory | None:
    """`prepare_history` of ``history`` (no previous summary) from ``base``, that of a history
    whose first ``dropped`` items ``history`` leaves out and whose other items are
    ``history``'s first, the same objects; None when preparing afresh could give
    another answer. Each step of `prepare_history` is then a function of each item alone: no
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
    new = WindowColumns.build(added, max_chars, framing.items)
    cut = {i - dropped: it for i, it in old.cut.items() if i >= dropped} if old.cut else {}
    work = WindowColumns(
        old.items[dropped:] + new.items,
        old.tokens[dropped:] + new.tokens,
        old.chars[dropped:] + new.chars,
        cut | {i + kept: it for i, it in new.cut.items()} if new.cut else cut,
        old.costs[dropped:] + new.costs,
        max_chars,
    )
    return PreparedHistory(
        None, work, len(ids), [], [], ids, chat=base.chat and chat_only(new.items)
    )
