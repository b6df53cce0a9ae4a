"""The build's plain values: what BuildContext and CompactContext are asked and answer
(`BuildRequest`, `BuildResult`, `CompactResult`, and the payload a compaction with a
request id remembers), and what the builder passes between its steps: the plan a build
decides before assembling (`BuildPlan`) and the part of the window it works on
(`BuildWindow`, with a newest-first read's columns: `TailColumns`).

Kept apart from the builder: the window's loading, its extension and the stats
accounting all take and make these values, and none of them depends on another's code.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from contextd.app.build.excerpts import ExcerptReport
from contextd.domain.context import (
    AssembledContext,
    Budget,
    HistoryItem,
    StrategyOptions,
)
from contextd.domain.errors import NotFound
from contextd.domain.model import (
    Agent,
    BuildOverrides,
    ContextKey,
    Event,
    MessageStamp,
    StoredMessage,
)
from contextd.domain.window import WindowSpec
from contextd.ports.store import (
    ContextRef,
    Store,
)


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
class BuildPlan:
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
class TailColumns:
    """The trimmer's columns of what a newest-first read read (`WindowLoading._load_tail`): the
    window's rows from position `first` on, pair-repaired (a window extended from it
    walks them again with the appended rows: `WindowExtension._extended_tail`)."""

    first: int
    roles: npt.NDArray[np.uint8]
    tokens: npt.NDArray[np.uint64]
    chars: npt.NDArray[np.uint64]
    groups: npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class BuildWindow:
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
    window_ids: npt.NDArray[np.int64] = field(default_factory=lambda: NO_IDS)
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
    # A window extended from a remembered one (`WindowExtension._extended`): that one's
    # `prepared`, and how many of its items this one left out (`assemble`'s
    # prepared_base: the items kept are made ready once, not again after each append).
    prepared_base: tuple[dict[Hashable, Any], int] | None = None
    # A newest-first read's columns (None: the window was read otherwise).
    tail: TailColumns | None = None

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


NO_IDS: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)


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
