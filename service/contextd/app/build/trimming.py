"""Trimming a window to its budget and cutting texts: the parts of assembly that shrink
history items.

`WindowColumns` is the window counted once with the columns the Rust trimmer reads;
`trim_window` keeps the newest whole turns that fit (cutting the newest turn's messages
when even it does not), `enforce_budget` is the safety net after it; `cut_text` and
`cut_marker` cut one text around a marker that names where the whole text is read back,
`fit_item` the longest cut of an item within a token count. Kept apart from assembly and
the compressor, which both call it and on neither of which it depends: how a message is
cut, and which turns are dropped, is read here alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

from contextd import core
from contextd.app.build.compaction import newest_unit_start, trim_columns, valid_cuts
from contextd.app.build.handles import full_text_handle
from contextd.domain.context import HistoryItem

__all__ = [
    "NO_CHAR_LIMIT",
    "ItemCost",
    "WindowColumns",
    "cut_marker",
    "cut_text",
    "enforce_budget",
    "fit_item",
    "trim_window",
]

NO_CHAR_LIMIT = 2**62
"""``max_chars_per_message`` for the Rust trimmer when per-message truncation is off."""

ItemCost = Callable[[Sequence[HistoryItem]], list[int]]
"""What each history item costs as rendered (see :meth:`Framing.items`)."""


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
    raise ImportError("HistoryItem's fields changed: update trimming._counted")


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


@dataclass(frozen=True, slots=True)
class WindowColumns:
    """The window with its trimming columns, counted once."""

    items: list[HistoryItem]
    tokens: list[int]
    chars: list[int]
    cut: dict[int, HistoryItem]  # index -> the item cut to max_chars, counted
    costs: list[int]
    max_chars: int

    @classmethod
    def build(cls, raw: list[HistoryItem], max_chars: int, cost: ItemCost) -> WindowColumns:
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

    def tail(self, start: int) -> WindowColumns:
        cut = {i - start: it for i, it in self.cut.items() if i >= start}
        return WindowColumns(
            self.items[start:],
            self.tokens[start:],
            self.chars[start:],
            cut,
            self.costs[start:],
            self.max_chars,
        )


def trim_window(
    work: WindowColumns, budget: int, summary: HistoryItem | None, cost: ItemCost
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
                fitted = fit_item(items[i], avail, cost)
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
        fitted = fit_item(it, allowance, cost)
        if fitted is None:
            return None
        out.append(fitted)
    return out


def enforce_budget(items: list[HistoryItem], budget: int) -> tuple[list[HistoryItem], list[int]]:
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


def fit_item(item: HistoryItem, max_tokens: int, cost: ItemCost) -> HistoryItem | None:
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
