"""Extending a remembered window by the messages appended since (`WindowExtension`, a
mixin of `ContextBuilder`): a thread an agent appends to before every build then loads
and derives only the appended messages, whether the window was read whole
(`_extended`) or newest first (`_extended_tail`), and answers what a fresh read would.

Kept apart from the window's loading, which it builds on (the trimmer's candidates) and
which never depends on it: when a window may be carried over, and what of it is, is
read here alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from contextd.app.build.build_types import (
    BuildPlan,
    BuildWindow,
    TailColumns,
)
from contextd.app.build.compaction import (
    chat_only,
    repair_tool_pairs,
)
from contextd.app.build.window_loading import FIRST_PAGE, HELD_DROPPED_IDS, WindowLoading
from contextd.domain.batches import stored_tokenizer
from contextd.domain.context import (
    HistoryItem,
    derived,
)
from contextd.domain.model import (
    MessageStamp,
    Role,
    StoredMessage,
)
from contextd.domain.window import WindowSpec
from contextd.ports.store import (
    ContextRef,
)

# Stored counts an extended window may hold beyond twice its items (`_extended`).
_KNOWN_SLACK = 64
# `_extended_tail`: the most rows a fresh read of a window reads before it answers what
# the extension answers, the first three pages (a fresh read holds every id it read,
# past HELD_DROPPED_IDS before the loaded part when it read that far, where the
# extension holds HELD_DROPPED_IDS); the longest loaded part it extends, the longest a
# fresh read reads within those pages (one row past the loaded part, where the walk
# stops); the rows it carries, at most twice the loaded part and `_TAIL_ROWS`, or a
# fresh three pages' read and `_TAIL_ROWS` appended since: past that the window is read
# afresh, once, and carries what that read read. (The bound before, a loaded part of at
# most four first pages, left a thread of short turns, whose budget loads thousands of
# messages, reading its window afresh at every build: tens of milliseconds on
# PostgreSQL, more as the loaded part grows.)
_TAIL_ROWS = 6 * FIRST_PAGE
_TAIL_HELD = 21 * FIRST_PAGE
_TAIL_LOADED = _TAIL_HELD - 1


class WindowExtension(WindowLoading):
    """The window-extension steps of `ContextBuilder` (which sets these attributes)."""

    _appended: (
        Callable[
            [ContextRef, WindowSpec, Hashable],
            tuple[dict[str, Any], int, list[StoredMessage]] | None,
        ]
        | None
    )
    _appended_tail: (
        Callable[
            [ContextRef, WindowSpec, Hashable],
            tuple[list[StoredMessage], list[int]] | None,
        ]
        | None
    )

    def _extended(self, plan: BuildPlan, since: Hashable, old: BuildWindow) -> BuildWindow | None:
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
        return BuildWindow(
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

    def _extended_tail(
        self, plan: BuildPlan, since: Hashable, old: BuildWindow
    ) -> BuildWindow | None:
        """`_extended` for a window `_load_tail` read (or this made from one), from the
        messages the store tells were appended since the state `since` names
        (`appended_messages`); None otherwise (the caller reads the window afresh).

        The same conditions as `_extended` (no summary in effect, no orphan, plain
        messages appended, the kept part starting no earlier), and it answers what
        `_load_tail` answers: the trimmer walks the rows that read read (`old.tail`)
        and the appended ones; where the walk stopped inside what was read, it stops
        there or later with more rows after it. The ids held are the window's from
        `HELD_DROPPED_IDS` positions before the loaded part on, as `_load_tail` holds
        them when the loaded part is short enough that its read stops within the first
        three pages (`_TAIL_LOADED`); past that, or past a bound on the rows carried, the
        window is read afresh."""
        tail = old.tail
        if (
            self._appended_tail is None
            or plan.context is None
            or tail is None
            or plan.options.summarize
            or not tail_extendable(old)
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
        if start < old_start or start > len(tail.roles) or n - loaded_from > _TAIL_LOADED:
            return None
        if len(roles) > max(_TAIL_ROWS + 2 * (n - loaded_from), _TAIL_HELD + _TAIL_ROWS):
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
        return BuildWindow(
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
            tail=TailColumns(tail.first, roles, tokens, chars, groups),
        )


def _carried_over(
    plan: BuildPlan, old: BuildWindow, dropped: int, appended: list[StoredMessage]
) -> tuple[list[HistoryItem], dict[int, MessageStamp], dict[str, int]] | None:
    """What an extended window (`WindowExtension._extended`, `_extended_tail`) takes
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


def tail_extendable(window: BuildWindow) -> bool:
    """Whether `WindowExtension._extended_tail` may extend `window`: a newest-first read
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
