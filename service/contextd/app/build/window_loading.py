"""Loading a build's window (`WindowLoading`, a mixin of `ContextBuilder`): its integer
columns first, the Rust trimmer's pick of which newest messages can possibly fit, then
content for those alone, pair-repaired; a plain build reads the window newest first in
pages (`_load_tail`), so its cost follows the budget, not the thread.

Kept apart from the builder's flow (plan, status, assemble, account): these are the
window's reads and the column work around them (orphan repair on the columns, the
summary's place in the window, the candidates' start). A mixin rather than functions,
so that the steps move as they were, calling each other and the store through `self`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from contextd import core
from contextd.app.build.build_types import (
    NO_IDS,
    BuildPlan,
    BuildWindow,
    TailColumns,
)
from contextd.app.build.compaction import (
    repair_tool_pairs,
)
from contextd.app.build.trimming import NO_CHAR_LIMIT
from contextd.domain.batches import stored_tokenizer
from contextd.domain.context import (
    HistoryItem,
    ToolCall,
    derived,
    parse_tool_calls,
)
from contextd.domain.model import (
    MessageStamp,
    Role,
    StoredMessage,
)
from contextd.domain.window import WindowSpec
from contextd.ports.store import (
    ContextRef,
    Store,
)

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


class WindowLoading:
    """The window-loading steps of `ContextBuilder` (which sets these attributes)."""

    _store: Store
    _arrays: Callable[[ContextRef, WindowSpec], dict[str, npt.NDArray[Any]] | None] | None
    unread_tool_builds: int

    def _load_history(self, plan: BuildPlan, *, everything: bool = False) -> BuildWindow:
        """The window's messages that can matter, with content, after the latest stored
        summary that covers part of this window (if any), pair-repaired.

        Orphans (a tool_result whose tool_use is before the window, a clear or inside the
        summary's range; a tool_use none of whose results is in the window) are repaired
        on the integer columns before the trimmer sees them: a result whose group has no
        head would otherwise keep its group open and stop the trimmer from keeping
        anything older. See :func:`_repair_pair_columns`.
        """
        if plan.context is None:
            return BuildWindow([], None, {})
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
            return BuildWindow(
                [], previous, stamps, window_ids=all_ids, summarized_at=summarized_at
            )
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
        return BuildWindow(
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

    def _load_tail(
        self, plan: BuildPlan, previous: HistoryItem | None, stamps: dict[int, MessageStamp]
    ) -> BuildWindow | None:
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
        read_ids = read.column("id").to_numpy() if got else NO_IDS
        # The ids of the window left out that a response may list, from before the pages.
        need = min(c, HELD_DROPPED_IDS - start) if region else min(n, HELD_DROPPED_IDS)
        older = NO_IDS
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
            return BuildWindow(
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
        return BuildWindow(
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
            tail=TailColumns(
                c,
                roles,
                read.column("token_count").to_numpy(),
                read.column("chars").to_numpy(),
                groups,
            ),
        )

    @staticmethod
    def _walk_stops(plan: BuildPlan, read: pa.Table, roles: npt.NDArray[np.uint8]) -> bool:
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
        plan: BuildPlan,
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
        self, plan: BuildPlan, loaded: Sequence[StoredMessage], orphaned: set[int]
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
        plan: BuildPlan,
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


_NO_SEQUENCE = 2**62  # "before" no sequence: a page from the newest message
_WINDOW_COLUMNS = ("id", "role", "token_count", "chars", "group_id", "sequence")
_EMPTY_PAGE = pa.table({"id": pa.array([], pa.int64())})


def _summary_source_chars(plan: BuildPlan) -> int:
    """How many characters a summarizing build may read: the summarizer's share plus the
    recent part the budget keeps."""
    return MAX_SUMMARY_SOURCE_CHARS + CHARS_PER_TOKEN_BOUND * plan.budget.prompt_budget


def _source_start(chars: npt.NDArray[Any], limit: int) -> int:
    """The first index of the longest suffix whose characters stay within `limit`."""
    suffix = np.cumsum(chars[::-1], dtype=np.int64)
    within = int(np.searchsorted(suffix, limit, side="right"))
    return max(0, len(chars) - within)


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
