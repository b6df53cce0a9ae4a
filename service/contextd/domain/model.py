"""Plain types of the domain: what the service reasons about, free of proto and SQL.

Times are integers of microseconds since the Unix epoch throughout the domain and the store:
they compare and subtract exactly, and they are what DuckDB stores without conversion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, TypeVar

from contextd.domain.retention import KEEP_EVERYTHING, RetentionPolicy, ScopeRetention, policy_for
from contextd.domain.window import WindowSpec, window_spec

T = TypeVar("T")

DEFAULT_TENANT = "default"
DEFAULT_THREAD = "main"
DEFAULT_ROLLING_WINDOW_US = 86_400 * 1_000_000


class Role(IntEnum):
    """Message roles; the values equal the proto enum's and are what the store keeps."""

    USER = 1
    ASSISTANT = 2
    TOOL_USE = 3
    TOOL_RESULT = 4


class MessageRange(IntEnum):
    WINDOW = 1
    ALL = 2


@dataclass(frozen=True, slots=True)
class AgentDoc:
    name: str
    content: str


@dataclass(frozen=True, slots=True)
class Agent:
    tenant: str
    name: str
    system_prompt: str
    docs: tuple[AgentDoc, ...]
    rolling_window_us: int
    create_time_us: int
    update_time_us: int
    last_clear_time_us: int
    model: str = ""
    build_options: BuildOverrides | None = None
    # The agent's retention policy, and policies for the scopes patterns name (see
    # retention.py); the default keeps everything.
    retention: RetentionPolicy = KEEP_EVERYTHING
    retention_overrides: tuple[ScopeRetention, ...] = ()

    def retention_for(self, scope: str) -> RetentionPolicy:
        """The retention policy of the agent's contexts in `scope`."""
        return policy_for(self.retention, self.retention_overrides, scope)

    def window_at(self, scope: str, now_us: int) -> WindowSpec:
        """The window of the agent's contexts in `scope` at `now_us`: the rolling window
        and the agent-wide clear, with the scope's retention (caps, expiry). Every read of
        a window starts here, so none of them can leave retention out."""
        return window_spec(now_us, self.rolling_window_us, self.last_clear_time_us).with_retention(
            self.retention_for(scope), now_us
        )

    @property
    def etag(self) -> str:
        """Changes whenever the settings change (update_time is strictly increasing) and
        differs between an agent and a later one of the same name (create_time)."""
        digest = hashlib.sha256(
            f"{self.tenant}\0{self.name}\0{self.create_time_us}\0{self.update_time_us}".encode()
        ).hexdigest()
        return f'"{digest[:20]}"'


@dataclass(frozen=True, slots=True)
class BuildOverrides:
    """Build options where None means "not set here": an agent's defaults, a call's
    overrides; `over` layers one on another, field by field."""

    truncate: bool | None = None
    max_chars_per_message: int | None = None
    summarize: bool | None = None
    keep_recent_tokens: int | None = None
    elide_tool_results: bool | None = None
    elide_threshold_chars: int | None = None
    safety_margin: float | None = None
    output_reserve_tokens: int | None = None
    budget_tokens: int | None = None
    # Excerpts of the scope's stored tool outputs (app/build/excerpts.py).
    tool_output_excerpts: int | None = None
    tool_output_excerpt_tokens: int | None = None
    tool_output_excerpts_max_tokens: int | None = None

    def over(self, top: BuildOverrides) -> BuildOverrides:
        """`top`'s set fields over this one's. Remembered by the (frozen) pair: every
        build merges its agent's options and its call's, twice, and a hot thread asks
        with the same ones (the merge made its twenty fields anew each time)."""
        key = (self, top)
        found = _MERGED.get(key)
        if found is None:
            found = self._over(top)
            if len(_MERGED) >= _MERGED_ENTRIES:
                _MERGED.clear()
            _MERGED[key] = found
        return found

    def _over(self, top: BuildOverrides) -> BuildOverrides:
        merged = {
            name: getattr(top, name) if getattr(top, name) is not None else getattr(self, name)
            for name in self.__slots__
        }
        return BuildOverrides(**merged)

    def as_dict(self) -> dict[str, object]:
        return {n: getattr(self, n) for n in self.__slots__ if getattr(self, n) is not None}


# Merged build options by (under, over): few distinct ones (agents' and calls'); the
# whole memo is dropped when full, each dict operation atomic under the GIL.
_MERGED: dict[tuple[BuildOverrides, BuildOverrides], BuildOverrides] = {}
_MERGED_ENTRIES = 1_024


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """The mutable settings of an agent, as given to create or update."""

    system_prompt: str = ""
    docs: tuple[AgentDoc, ...] = ()
    rolling_window_us: int = DEFAULT_ROLLING_WINDOW_US
    model: str = ""
    build_options: BuildOverrides = field(default_factory=lambda: BuildOverrides())
    retention: RetentionPolicy = KEEP_EVERYTHING
    retention_overrides: tuple[ScopeRetention, ...] = ()


@dataclass(frozen=True, slots=True)
class ContextKey:
    """One context: the unit of isolation. Nothing reads across two keys' scopes."""

    tenant: str
    agent: str
    scope: str
    thread: str


@dataclass(frozen=True, slots=True)
class NewMessage:
    """A message as a client appends it (validated by the service)."""

    role: Role
    content: str
    tool_calls: str = ""
    tool_call_id: str = ""
    external_id: str = ""
    metadata: str = ""
    # The client's own time of the message (display, import, the window's age test);
    # never a commit time: the store stamps its own.
    source_time_us: int | None = None


@dataclass(frozen=True, slots=True)
class MessageBatch:
    """The messages of one append and what the service computed for them, as parallel
    columns (see the messages table in storage.py): no per-message copies to fill in."""

    messages: Sequence[NewMessage]
    token_estimates: Sequence[int]
    token_counts: Sequence[int]
    tokenizer: str
    chars: Sequence[int]
    tool_call_ids: Sequence[tuple[str, ...]]
    # For a compaction summary (a batch of one): the first and last message id it replaces.
    summarized_ids: tuple[int, int] | None = None
    # For messages written by RestoreSnapshot: the id of the snapshot they came from.
    restored_from: str = ""
    # The thread's retention ttl when the append was asked for (0: none). An append that
    # finds its thread expired (newest message ttl or more before its commit) writes, in
    # its transaction, a clear marker at the moment the thread expired and records the
    # expired messages for the sweep (see retention.py), so none of them reappears.
    ttl_us: int = 0

    def __len__(self) -> int:
        return len(self.messages)


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: int
    tenant: str
    agent: str
    scope: str
    thread: str
    role: Role
    content: str
    tool_calls: str
    tool_call_id: str
    external_id: str
    metadata: str
    token_estimate: int
    # The commit time, from the server's clock (clear markers are compared with it).
    create_time_us: int
    token_count: int = 0
    group_id: int = -1
    is_summary: bool = False
    summarized_ids: tuple[int, int] | None = None
    # What `token_count` was counted with ("o200k_base", "o200k_base*1.3", "estimate"):
    # a build reuses the stored count when it equals its model's.
    tokenizer: str = ""
    # The client's time of the message, if it gave one.
    source_time_us: int | None = None
    # The position in its thread: 1, 2, 3, ... in append order.
    sequence: int = 0
    # The snapshot a restored message came from ("" for every other message).
    restored_from: str = ""
    # What a build derives from the message (its history item and stamp; see
    # `contextd.domain.context.derived`), made once per object: the hot cache keeps a
    # thread's newest messages, which every build of it loads again. Not part of the
    # message's value: not an argument, not compared, not shown.
    derived: object = field(default=None, init=False, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class MessageStamp:
    """What the server assigned to a stored message, as a build reports it."""

    create_time_us: int
    source_time_us: int | None
    sequence: int

    @classmethod
    def of(cls, message: StoredMessage) -> MessageStamp:
        return cls(message.create_time_us, message.source_time_us, message.sequence)


@dataclass(frozen=True, slots=True)
class MessageReceipt:
    id: int
    create_time_us: int
    token_estimate: int
    token_count: int = 0
    sequence: int = 0


@dataclass(frozen=True, slots=True)
class Thread:
    tenant: str
    agent: str
    scope: str
    thread: str
    create_time_us: int
    last_message_time_us: int
    message_count: int
    token_estimate: int
    last_clear_time_us: int | None
    last_sequence: int = 0


@dataclass(frozen=True, slots=True)
class ContextStats:
    window_start_time_us: int
    last_clear_time_us: int
    rolling_window_us: int
    window_message_count: int
    window_token_estimate: int
    total_message_count: int
    total_token_estimate: int
    oldest_message_time_us: int | None
    newest_message_time_us: int | None
    thread_count: int
    # Whether the window holds any message (false once expired, cleared or aged out).
    exists: bool = False
    # When the context expires under its retention policy (None: never, or nothing in it).
    expire_time_us: int | None = None
    expires_in_us: int | None = None
    retention: RetentionPolicy = KEEP_EVERYTHING


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T] = field(default_factory=list)
    next_page_token: str = ""


@dataclass(frozen=True, slots=True)
class Event:
    """Something the service did that operators and clients may audit."""

    id: int
    type: str
    agent: str
    scope: str
    thread: str
    create_time_us: int
    data: str
