"""The build's stats over the whole window (`whole_window_stats`): every window
message is kept, dropped, or in the summarized range, exactly once, with the dropped
ones as runs of consecutive window messages found on position ranges or NumPy masks.

Kept apart from the builder: assembly reports what it did to the part it was given,
and this step turns that into the whole window's account from the `BuildWindow` alone,
with no store read; a newcomer looking for why a response lists a dropped id reads
this module alone.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import numpy.typing as npt

from contextd.app.build.build_types import (
    NO_IDS,
    BuildWindow,
)
from contextd.domain.context import (
    AssembledContext,
    BuildStats,
    IdList,
)


def whole_window_stats(context: AssembledContext, window: BuildWindow) -> BuildStats:
    """The build's stats over the whole window, not just the part assembly saw: every
    window message is kept, in `dropped_ids`, or in the summarized range, exactly once.

    Assembly reports what it dropped of the loaded part; the messages not loaded (too old
    to fit) are dropped too, and so are the messages a stored summary stood for when that
    summary did not fit. A summary that heads the context, new or reused, reports the
    range it stands for.
    """
    stats = context.stats
    summarized = stats.summarized_range
    lost = NO_IDS
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
