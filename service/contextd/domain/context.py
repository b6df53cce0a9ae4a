"""Plain types of context building: what goes into a BuildContext and what comes out.

They are frozen dataclasses over plain values (no proto, no SQL) so the assembly,
compaction and rendering code is pure and testable without a server. Times are integers
of microseconds since the Unix epoch, as in :mod:`contextd.domain.model`.

Tool calls
    A message's ``tool_calls`` is JSON text. :func:`parse_tool_calls` is the one place
    that interprets it, so every module (the store's tool groups at insert included)
    agrees on what a call is. Accepted shapes, as a list, a single object, or an object
    whose ``"tool_calls"`` is the list (an OpenAI assistant message):

    * Anthropic style ``{"id", "name", "input"}`` (an optional ``"type": "tool_use"``);
    * OpenAI style ``{"id", "type": "function", "function": {"name", "arguments"}}``
      where ``arguments`` is JSON text (or, leniently, an already decoded value).

    Anything else (invalid JSON, entries without a name) yields no call rather than an
    error: the text was validated as JSON at append time, and a context build must not
    fail on a shape it does not understand. A call without an ``id`` cannot be answered
    by a tool_result, so it is kept with ``id == ""`` and later treated as unanswered.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from contextd import core
from contextd.domain.model import AgentDoc, MessageStamp, Role, StoredMessage

TokenCounter = Callable[[list[str]], list[int]]
"""Counts tokens of each text, in order. The caller picks the tokenizer (the character
estimate, an exact BPE, or a model's count with its margin); see :func:`counter_for_model`."""

DEFAULT_SAFETY_MARGIN = 0.20
"""A 20% buffer for formatting and the per-message overhead of the APIs."""


def estimate_counter(texts: list[str]) -> list[int]:
    """The character estimate ``(chars + 3) // 4`` for each text: cheap and model-independent."""
    return core.estimate_tokens_batch(texts)


def counter_for_model(model: str) -> TokenCounter:
    """The model's tokenizer count times its registry margin (raises
    :class:`contextd.core.UnknownModelError` now, not at the first count)."""
    core.model_info(model)

    def count(texts: list[str]) -> list[int]:
        return core.count_tokens_for_model_batch(texts, model)

    return count


def counter_with_known(count: TokenCounter, known: dict[str, int]) -> TokenCounter:
    """`count`, answering texts whose count is already known without counting them again.

    A build loads messages whose counts the store computed at insert with the same
    tokenizer; keyed by the exact text, a known count can only be reused for the very
    text it was computed on, so any text that assembly changes is counted afresh.
    """

    def counted(texts: list[str]) -> list[int]:
        missing = [t for t in texts if t not in known]
        fresh = iter(count(missing) if missing else ())
        return [known[t] if t in known else next(fresh) for t in texts]

    return counted


def counter_for_encoding(encoding: core.EncodingName) -> TokenCounter:
    """An exact BPE (``o200k_base``, ``cl100k_base``) or a seed estimate by name."""

    def count(texts: list[str]) -> list[int]:
        return core.count_tokens_batch(texts, encoding)

    return count


@dataclass(frozen=True, slots=True)
class HistoryItem:
    """One message of the thread's window as context building sees it.

    ``id`` is the stored message id; a summary item, which is not a stored message until
    the caller stores it, has a negative id (``-summary_of[1]``). ``token_count`` is what
    the item costs under the build's counter (assembly recounts it; a stored estimate in
    the input is only informative). ``summary_of`` is the inclusive range of stored ids a
    summary replaces.
    """

    id: int
    role: Role
    content: str
    tool_calls: str = ""
    tool_call_id: str = ""
    token_count: int = 0
    is_summary: bool = False
    metadata: str = ""
    summary_of: tuple[int, int] | None = None
    # What assembly counted this item at under one cost key (see
    # `contextd.app.build.render.Framing`): (key, cost, the item counted at it or None
    # when it is that item). Set only on items derived from a stored message the hot
    # cache keeps (`derived`), so that every build of a hot thread counts only what is
    # new. Not part of the item's value: not an argument, not compared, not shown.
    cost_memo: tuple[object, int, HistoryItem | None] | None = field(
        default=None, init=False, compare=False, repr=False
    )
    # On such an item, True once a build found it has no blob to stub (see
    # `contextd.app.build.blobs.stub_blobs`). Not part of the value either.
    stub_memo: bool = field(default=False, init=False, compare=False, repr=False)

    @classmethod
    def from_stored(cls, message: StoredMessage) -> HistoryItem:
        """A stored message as a history item; a stored compaction summary (the store's
        ``is_summary`` column, never a client's metadata) keeps the range it covers."""
        return cls(
            id=message.id,
            role=message.role,
            content=message.content,
            tool_calls=message.tool_calls,
            tool_call_id=message.tool_call_id,
            token_count=message.token_count,
            is_summary=message.is_summary,
            metadata=message.metadata,
            summary_of=message.summarized_ids,
        )

    @property
    def counted_text(self) -> str:
        """The text whose tokens the item costs: content plus tool calls, as the store's
        token estimate counts them."""
        return self.content + self.tool_calls if self.tool_calls else self.content


# The cost memo of an item that keeps its cost and has none yet (see `derived`).
NOT_COUNTED: tuple[object, int, HistoryItem | None] = (None, 0, None)


def derived(message: StoredMessage) -> tuple[HistoryItem, MessageStamp]:
    """``(HistoryItem.from_stored(message), MessageStamp.of(message))``, made once per
    message object and kept on it: the hot cache keeps a thread's newest messages as
    objects and derives them when it takes them in (its accounting counts these), so a
    build of a hot thread makes no object per loaded message. Equal to making them anew:
    both are frozen functions of the frozen message."""
    found = message.derived
    if found is None:
        item = HistoryItem.from_stored(message)
        object.__setattr__(item, "cost_memo", NOT_COUNTED)  # it may keep its cost
        found = (item, MessageStamp.of(message))
        object.__setattr__(message, "derived", found)
    return found  # type: ignore[return-value]


class StatusKind(StrEnum):
    """What a status entry describes: an execution thread or a running process."""

    THREAD = "thread"
    PROCESS = "process"


@dataclass(frozen=True, slots=True)
class StatusEntry:
    """One line of the status preamble (the thread and process view)."""

    key: str
    kind: StatusKind
    state: str
    summary: str
    update_time_us: int
    expire_time_us: int | None = None

    def is_live(self, now_us: int) -> bool:
        """Expired entries are stale claims about the world; they never reach a prompt."""
        return self.expire_time_us is None or self.expire_time_us > now_us


@dataclass(frozen=True, slots=True)
class ThreadActivity:
    """The service's own view of one thread of the agent: what it stores, not a claim."""

    thread: str
    last_message_time_us: int
    window_message_count: int


@dataclass(frozen=True, slots=True)
class Budget:
    """How many tokens the prompt may use.

    ``prompt_budget`` is ``explicit_tokens`` when given, else
    ``floor((context_window - output_reserve) * (1 - safety_margin))``. The margin (20% by
    default) absorbs what per-part accounting does not see: role framing and block
    overhead of the wire formats, and tokenizer drift for estimated counts.
    """

    context_window: int
    output_reserve: int = 0
    safety_margin: float = DEFAULT_SAFETY_MARGIN
    explicit_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.context_window < 0 or self.output_reserve < 0:
            raise ValueError("context_window and output_reserve must be >= 0")
        if not 0.0 <= self.safety_margin < 1.0:
            raise ValueError("safety_margin must be in [0, 1)")
        if self.explicit_tokens is not None and self.explicit_tokens < 0:
            raise ValueError("explicit_tokens must be >= 0")

    @property
    def prompt_budget(self) -> int:
        if self.explicit_tokens is not None:
            return self.explicit_tokens
        room = max(0, self.context_window - self.output_reserve)
        return math.floor(room * (1.0 - self.safety_margin))

    @classmethod
    def tokens(cls, tokens: int) -> Budget:
        """An explicit budget, used as is (the caller already took its margins)."""
        return cls(context_window=tokens, explicit_tokens=tokens)

    @classmethod
    def for_model(
        cls,
        model: str,
        *,
        output_reserve: int | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
    ) -> Budget:
        """The registry's window and output reserve for ``model`` (unknown names raise
        :class:`contextd.core.UnknownModelError`; pass ``"default"`` explicitly)."""
        info = core.model_info(model)
        reserve = info.output_reserve if output_reserve is None else output_reserve
        return cls(info.context_window, reserve, safety_margin)


@dataclass(frozen=True, slots=True)
class StrategyOptions:
    """How the history is made to fit. Dropping the oldest messages is always the last
    resort, whatever is chosen, because the budget is a hard limit.

    truncate
        Cut any message longer than ``max_chars_per_message`` characters to at most that
        many, marker included: its head and its tail (errors are usually at the end) with
        a note between them naming what was cut and the ``message:<id>`` handle, so one
        huge paste or tool output does not evict the whole conversation.
    summarize
        checkpoint compaction: when the window does not fit, fold everything older than the
        recent part into one checkpoint message. In a build the recent part is everything
        that fits beside the checkpoint's reserve (``min(4,096, history budget / 4)``
        tokens, or the previous checkpoint's size up to half of it when larger): at least as
        much as truncation keeps under the budget less that reserve.
        ``keep_recent_messages`` (10 by default) and ``keep_recent_tokens``, capped at
        ``keep_recent_share`` of the budget, choose the recent part of ``CompactContext``.
    elide_tool_results
        Tool results older than the ``elide_keep_recent_turns`` most recent turns (a turn
        starts at a user message) and longer than ``elide_threshold_chars`` become a stub
        naming the tool and a ``message:<id>`` handle to fetch the full output.
    """

    truncate: bool = True
    max_chars_per_message: int = core.DEFAULT_MAX_CHARS
    summarize: bool = False
    keep_recent_tokens: int = 20_000
    keep_recent_share: float = 0.5
    keep_recent_messages: int = 10
    elide_tool_results: bool = False
    elide_threshold_chars: int = 2_000
    elide_keep_recent_turns: int = 3

    def __post_init__(self) -> None:
        if self.max_chars_per_message < 1:
            raise ValueError("max_chars_per_message must be >= 1")
        if self.keep_recent_tokens < 0 or self.keep_recent_messages < 0:
            raise ValueError("keep_recent_tokens and keep_recent_messages must be >= 0")
        if not 0.0 < self.keep_recent_share <= 1.0:
            raise ValueError("keep_recent_share must be in (0, 1]")
        if self.elide_threshold_chars < 0 or self.elide_keep_recent_turns < 0:
            raise ValueError("elide thresholds must be >= 0")


SummarizerPath = Literal["llm", "fallback", "reused"]
"""How the summary in a context came to be: a fresh LLM summary, the extractive fallback,
or the previous summary reused because nothing new had to be folded."""


class IdList(Sequence[int]):
    """Message ids held as NumPy int64 arrays, made Python ints only where read.

    A build over a million-message window drops nearly all of it; a tuple of a million
    ints cost more than the rest of the build (the response lists only the newest 10,000
    and the count). Compares equal to any sequence of the same ids.

    `unlisted` counts ids older than every held one that were never read (a PostgreSQL
    build counts the older part of a long window without reading it): they count in
    `len`, but only the held ids can be indexed, sliced or iterated, so a list with
    unlisted ids serves its length and its newest ids (what a response lists), and
    anything else raises ValueError rather than answer wrongly."""

    __slots__ = ("_flat", "_parts", "_unlisted")

    def __init__(self, *parts: npt.NDArray[np.int64] | Sequence[int], unlisted: int = 0) -> None:
        self._parts = [np.asarray(p, dtype=np.int64) for p in parts if len(p)]
        self._flat: npt.NDArray[np.int64] | None = None
        self._unlisted = unlisted

    def _held(self) -> npt.NDArray[np.int64]:
        if self._flat is None:
            if len(self._parts) == 1:
                self._flat = self._parts[0]
            elif self._parts:
                self._flat = np.concatenate(self._parts)
            else:
                self._flat = np.empty(0, dtype=np.int64)
        return self._flat

    def array(self) -> npt.NDArray[np.int64]:
        """All the ids, in order, as one array (made once)."""
        if self._unlisted:
            raise ValueError(f"{self._unlisted} of these ids were counted, not read")
        return self._held()

    def __len__(self) -> int:
        return self._unlisted + sum(len(p) for p in self._parts)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if not self._unlisted:
                if self._flat is None and step == 1:
                    return tuple(self._range(start, stop).tolist())
                return tuple(self._held()[index].tolist())
            if step < 0 or (start < stop and start < self._unlisted):
                raise ValueError("only the held (newest) ids can be sliced")
            skip = self._unlisted
            lo, hi = max(start - skip, 0), max(stop - skip, 0)
            if self._flat is None and step == 1:
                return tuple(self._range(lo, hi).tolist())
            return tuple(self._held()[lo:hi:step].tolist())
        at = index + len(self) if index < 0 else index
        if not 0 <= at < len(self):
            raise IndexError("IdList index out of range")
        if self._unlisted and 0 <= at < self._unlisted:
            raise ValueError("only the held (newest) ids can be indexed")
        return int(self._held()[at - self._unlisted])

    def newest(self, k: int) -> npt.NDArray[np.int64]:
        """The newest ``k`` ids (all when fewer), as an array: what a response lists,
        without a Python int per id. Held ids only (ValueError past them, as slicing)."""
        n = len(self)
        start = max(0, n - k)
        if start < self._unlisted:
            raise ValueError("only the held (newest) ids can be sliced")
        lo, hi = start - self._unlisted, n - self._unlisted
        if self._flat is None:
            return self._range(lo, hi)
        return self._flat[lo:hi]

    def _range(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        """Ids ``start:stop`` from the parts that hold them, without joining the rest: a
        response lists the newest 10,000 dropped ids of a window that may drop a million,
        and joining them all first cost a millisecond per build."""
        out: list[npt.NDArray[np.int64]] = []
        at = 0
        for part in self._parts:
            lo, hi = max(start, at), min(stop, at + len(part))
            if lo < hi:
                out.append(part[lo - at : hi - at])
            at += len(part)
        if not out:
            return np.empty(0, dtype=np.int64)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def __iter__(self) -> Iterator[int]:
        return iter(self.array().tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdList):
            return self._unlisted == other._unlisted and bool(
                np.array_equal(self._held(), other._held())
            )
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == len(self) and tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        if self._unlisted:
            return f"IdList({self._unlisted} unlisted, then {self._held().tolist()!r})"
        return f"IdList({list(self)!r})"


@dataclass(frozen=True, slots=True)
class BuildStats:
    """What a build did, for the caller's response and logs (the
    ``context.compressed`` event: counts before and after, tokens against the budget)."""

    budget: int
    system_tokens: int = 0
    docs_tokens: int = 0
    status_tokens: int = 0
    history_tokens: int = 0
    new_message_tokens: int = 0
    messages_before: int = 0
    messages_after: int = 0
    dropped_ids: Sequence[int] = ()
    dropped_ranges: tuple[tuple[int, int], ...] = ()
    """``dropped_ids`` as (first, last) id of each run of consecutive window messages
    that were all dropped, oldest first."""
    truncated_ids: tuple[int, ...] = ()
    elided_ids: tuple[int, ...] = ()
    repaired_ids: tuple[int, ...] = ()
    summarized_range: tuple[int, int] | None = None
    summarizer_path: SummarizerPath | None = None
    summarizer_error: str | None = None
    new_message_truncated: bool = False
    status_dropped: bool = False
    status_truncated: bool = False
    """The status preamble was cut (from its end) so the newest turn and the current
    request keep their room; ``status_dropped``: it was left out for them."""
    rendered_tokens: int = 0
    """The request as its provider counts it (the largest over the renderings counted;
    0 when the build counted bare texts only)."""
    rendered_format: str = ""
    """Which rendering ``rendered_tokens`` is ("openai", "anthropic", "text")."""
    newest_turn_dropped: bool = False
    """Only when the budget cannot hold even the newest turn's tool calls: it is then
    listed in ``dropped_ids`` and flagged here, never dropped silently."""
    ledger_entries: int = 0
    """Entries in the ledger of the summary in the context (0 without one)."""
    ledger_tokens: int = 0
    """What that ledger costs (part of the summary's tokens)."""
    ledger_added: int = 0
    """Entries this build's compaction added to the ledger."""
    ledger_evicted: int = 0
    """Entries this build left out of the ledger to keep it within its share of the
    budget (the least referenced, oldest first)."""
    ledger_in_context: int = 0
    """Entries left out of the ledger because a message the context keeps whole holds
    them verbatim (they come back when that message is folded)."""
    compaction_deferred: bool = False
    """The fold was too small to be worth a new summary: its specifics joined the stored
    summary's ledger for this build, and nothing was summarized or stored."""
    summary_attempts: int = 0
    """Model calls this build's summary took (a retry after the quality gate counts)."""

    @property
    def total_tokens(self) -> int:
        return (
            self.system_tokens
            + self.docs_tokens
            + self.status_tokens
            + self.history_tokens
            + self.new_message_tokens
        )


@dataclass(frozen=True, slots=True)
class AssembledContext:
    """The context in its documented order: system prompt, docs, status, history, new message.

    ``summary`` is the summary item at the head of ``history`` when there is one; when
    ``stats.summarizer_path`` is ``"llm"`` or ``"fallback"`` it is new and the caller should
    store it so the next build can reuse it instead of summarizing again.
    """

    system_prompt: str
    docs: tuple[AgentDoc, ...]
    status: str
    history: tuple[HistoryItem, ...]
    new_message: str | None
    stats: BuildStats
    summary: HistoryItem | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call, whatever style its JSON was written in."""

    id: str
    name: str
    input: Any = field(default=None)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def input_object(self) -> dict[str, Any]:
        """The input as a JSON object, as Anthropic's ``tool_use.input`` requires."""
        if isinstance(self.input, dict):
            return self.input
        if self.input is None:
            return {}
        return {"value": self.input}

    @property
    def arguments_json(self) -> str:
        """The input as JSON text, as OpenAI's ``function.arguments`` requires."""
        return json.dumps(self.input_object, ensure_ascii=False, separators=(",", ":"))


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in a ``tool_calls`` JSON text (see the module docstring for the shapes)."""
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
        data = data["tool_calls"]
    entries: Sequence[Any] = data if isinstance(data, list) else [data]
    calls: list[ToolCall] = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        call_id = entry.get("id")
        call_id = call_id if isinstance(call_id, str) else ""
        function = entry.get("function")
        if isinstance(function, dict):
            name = function.get("name")
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    value: Any = json.loads(arguments) if arguments.strip() else {}
                except (ValueError, RecursionError):
                    value = {"arguments": arguments}
            else:
                value = arguments
        else:
            name = entry.get("name")
            value = entry.get("input")
        if isinstance(name, str) and name:
            calls.append(ToolCall(call_id, name, value, entry))
    return calls


def tool_calls_json(calls: Sequence[ToolCall]) -> str:
    """Serialize calls back in their original shape (used when unanswered calls are
    removed from a message)."""
    return json.dumps([c.raw for c in calls], ensure_ascii=False, separators=(",", ":"))
