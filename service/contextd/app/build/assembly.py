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
:func:`compressor.compress_history`) takes what is left, and its newest turn is kept, truncated if
need be, never dropped without being recorded in the stats.

The history's compressor is compressor.py, what cuts and trims items trimming.py, and the
status block's text status_text.py: this module fits those parts together.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from contextd.app.build.compressor import (
    OnceSummarizer,
    PreparedHistory,
    compress_prepared,
    extend_prepared,
    prepare_history,
)
from contextd.app.build.memo import Memo
from contextd.app.build.render import Framing, joined_system, render_docs
from contextd.app.build.status_text import shrink_status
from contextd.app.build.summarizer import ExtractiveSummarizer, Summarizer
from contextd.domain.context import (
    AssembledContext,
    Budget,
    BuildStats,
    HistoryItem,
    StrategyOptions,
    TokenCounter,
)
from contextd.domain.model import AgentDoc

__all__ = [
    "BudgetTooSmallError",
    "assemble",
    "id_ranges",
    "render_docs",
]

NEW_MESSAGE_NOTE = "\n[… message truncated to fit the context]"
RENDER_CHECKS = 6
"""How often a build may tighten the history budget after counting its rendering (the
item-by-item costs are exact for OpenAI and an upper estimate otherwise: this is a net)."""


class BudgetTooSmallError(ValueError):
    """The budget cannot hold the system prompt and docs (plus one token of the new
    message). Surfaced as an error because any context built anyway would be wrong."""


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
    `WindowExtension._extended`). The history is then made ready from that one's where
    that is what preparing afresh gives (`extend_prepared`), else afresh.
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
        prepared = prepare_history(history, opts, framing.items, previous_summary)
    else:
        pkey = (opts, framing.formats, cost_key)
        found: PreparedHistory | None = prepared_memo.get(pkey)
        if found is None and prepared_base is not None and previous_summary is None:
            earlier: PreparedHistory | None = prepared_base[0].get(pkey)
            if earlier is not None:
                found = extend_prepared(earlier, prepared_base[1], history, opts, framing)
        if found is None:
            found = prepare_history(history, opts, framing.items, previous_summary)
        prepared = prepared_memo[pkey] = found
    status_dropped = status_truncated = False
    if status:
        keep = room - prepared.protected_cost(with_request=new is None)
        if status_c > keep:
            status, status_c = shrink_status(status, keep, _part_cost(framing, "status"))
            status_truncated, status_dropped = bool(status), not status
            status_t = count_tokens([status])[0] if status else 0
    if not status:
        status_t = status_c = 0
    engine = OnceSummarizer(summarizer if summarizer is not None else ExtractiveSummarizer())
    history_budget = room - status_c
    for check in range(RENDER_CHECKS + 1):
        hist = compress_prepared(prepared, history_budget, framing.items, opts, engine)
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


# The stats of a context only counted for its rendering (which does not read them).
_NO_STATS = BuildStats(budget=0)

# What the parts around the history cost (their bare counts, then as framed in the
# formats), by cost key, formats and the texts themselves: every build of an agent counts
# the same system prompt, docs and (mostly) status block again, and counting them (text
# and rendered JSON) was a tenth of a build that follows an append. Never stale: the key
# is the whole input (the counter is a function of the cost key, as for the items).
_FRAMES: Memo[Hashable, tuple[int, int, int, int, int, int, int]] = Memo(256)


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
