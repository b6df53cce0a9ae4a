"""The values the client takes and returns: frozen dataclasses and enums, not protobufs.

Why not hand out the protobuf messages: their unset fields read as "" or 0, times are
Timestamp messages and enums are bare ints. Here an unset time or option is None, times
are timezone-aware UTC datetimes, spans are timedeltas, lists are tuples and roles are
enums, and results are immutable (safe to share and to use as dict keys).

Output dataclasses name their fields exactly as the proto does: the conversion
(`_convert.from_pb`) is driven by those names, so a result type for a new RPC is a
dataclass and one line in its registry. Fields a newer server adds are ignored until a
dataclass names them.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Role(enum.Enum):
    """The role of a message (proto `Role`, without its prefix)."""

    UNSPECIFIED = "unspecified"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL_USE = "tool_use"
    TOOL_RESULT = "tool_result"


class MessageRange(enum.Enum):
    """Which messages a list covers: the rolling window (default) or the whole history."""

    WINDOW = "window"
    ALL = "all"


class StatusKind(enum.Enum):
    """What a status entry describes."""

    UNSPECIFIED = "unspecified"
    THREAD = "thread"
    PROCESS = "process"


class ContextFormat(enum.Enum):
    """A rendering of a built context."""

    UNSPECIFIED = "unspecified"
    ANTHROPIC = "anthropic"
    OPENAI = "openai"
    TEXT = "text"


class ContextView(enum.Enum):
    """How much of a built context the response carries."""

    FULL = "full"
    RENDERINGS = "renderings"


# Scopes: where a context lives inside an agent. None is the agent's default scope.


@dataclass(frozen=True, slots=True)
class KeyScope:
    """A free-form scope key (platforms without guilds and channels)."""

    key: str


@dataclass(frozen=True, slots=True)
class ChannelScope:
    """One user in one channel of one guild."""

    guild_id: str
    channel_id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class DirectMessageScope:
    """One user's direct messages with the agent."""

    user_id: str


Scope = KeyScope | ChannelScope | DirectMessageScope
"""A typed scope; where a parameter takes `Scope | str | None`, a str is a KeyScope and None
the agent's default scope."""


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """How much of each context (a thread of the agent in one scope) is kept, and how
    long: at most the newest `max_messages` (0: no cap), expired after `ttl` without a new
    message (None: never), overflow deleted by the sweep when `delete_overflow`."""

    max_messages: int = 0
    ttl: timedelta | None = None
    delete_overflow: bool = False


@dataclass(frozen=True, slots=True)
class ScopeRetention:
    """The policy of the scopes a pattern names ("dm:*", "guild:123/*", a key, "*")."""

    scope_pattern: str
    policy: RetentionPolicy


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """How a build fits its budget. None leaves an option to the agent, then the server."""

    truncate: bool | None = None
    max_chars_per_message: int | None = None
    summarize: bool | None = None
    keep_recent_tokens: int | None = None
    elide_tool_results: bool | None = None
    elide_threshold_chars: int | None = None
    safety_margin: float | None = None
    output_reserve_tokens: int | None = None
    budget_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class AgentDoc:
    """A named document given to the agent with every context."""

    name: str
    content: str


@dataclass(frozen=True, slots=True)
class Agent:
    """An agent and the settings that shape its contexts."""

    name: str
    tenant: str
    system_prompt: str
    docs: tuple[AgentDoc, ...]
    rolling_window: timedelta | None
    create_time: datetime | None
    update_time: datetime | None
    last_clear_time: datetime | None
    model: str
    build_options: BuildOptions
    etag: str
    retention: RetentionPolicy
    retention_overrides: tuple[ScopeRetention, ...]


@dataclass(frozen=True, slots=True)
class NewMessage:
    """A message to append. `tool_calls` and `metadata` take JSON text or a value that
    json.dumps accepts; `role` takes a Role or its value ("user", "assistant", ...)."""

    role: Role | str
    content: str = ""
    tool_calls: str | Sequence[Any] = ""
    tool_call_id: str = ""
    external_id: str = ""
    metadata: str | Mapping[str, Any] = ""
    source_time: datetime | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            object.__setattr__(self, "role", Role(self.role))

    def tool_calls_json(self) -> str:
        """tool_calls as JSON text ("" when there are none)."""
        return _json_text(self.tool_calls)

    def metadata_json(self) -> str:
        """metadata as JSON text ("" when there is none)."""
        return _json_text(self.metadata)


def _json_text(value: str | Sequence[Any] | Mapping[str, Any]) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")) if value else ""


@dataclass(frozen=True, slots=True)
class Message:
    """A stored message: what was appended plus what the server assigned."""

    id: int
    tenant: str
    agent: str
    scope: Scope | None
    thread: str
    role: Role
    content: str
    tool_calls: str
    tool_call_id: str
    external_id: str
    metadata: str
    token_estimate: int
    token_count: int
    create_time: datetime | None
    source_time: datetime | None
    sequence: int
    is_summary: bool
    first_summarized_id: int
    last_summarized_id: int
    restored_from_snapshot: str = ""  # the snapshot a restored message came from


@dataclass(frozen=True, slots=True)
class MessageReceipt:
    """What the server assigned to one appended message."""

    id: int
    create_time: datetime | None
    token_estimate: int
    token_count: int
    sequence: int


@dataclass(frozen=True, slots=True)
class Thread:
    """One conversation of an agent within a scope, with its running metadata."""

    agent: str
    scope: Scope | None
    thread: str
    create_time: datetime | None
    last_message_time: datetime | None
    message_count: int
    token_estimate: int
    last_clear_time: datetime | None
    last_sequence: int


@dataclass(frozen=True, slots=True)
class ContextStats:
    """Counts and times of a context (one thread, or every thread of a scope)."""

    window_start_time: datetime | None
    last_clear_time: datetime | None
    window_message_count: int
    window_token_estimate: int
    total_message_count: int
    total_token_estimate: int
    oldest_message_time: datetime | None
    newest_message_time: datetime | None
    rolling_window: timedelta | None
    thread_count: int
    exists: bool
    expires_in: timedelta | None
    expire_time: datetime | None
    retention: RetentionPolicy


@dataclass(frozen=True, slots=True)
class ContextMessage:
    """One message of a built context, as it goes to the model."""

    id: int
    role: Role
    content: str
    tool_calls: str
    tool_call_id: str
    token_count: int
    truncated: bool
    elided: bool
    is_summary: bool
    create_time: datetime | None
    source_time: datetime | None
    sequence: int


@dataclass(frozen=True, slots=True)
class MessageIdRange:
    """A run of a thread's window messages, by the ids of its first and last message."""

    first_id: int
    last_id: int


@dataclass(frozen=True, slots=True)
class BuildStats:
    """What a build did (see the proto's BuildStats for each field)."""

    budget_tokens: int
    total_tokens: int
    system_tokens: int
    docs_tokens: int
    status_tokens: int
    history_tokens: int
    user_message_tokens: int
    messages_before: int
    messages_after: int
    dropped_ids: tuple[int, ...]
    dropped_count: int
    truncated_ids: tuple[int, ...]
    elided_ids: tuple[int, ...]
    orphaned_ids: tuple[int, ...]
    first_summarized_id: int
    last_summarized_id: int
    summarizer_path: str
    summarizer_error: str
    tokenizer: str
    strategy: str
    user_message_truncated: bool
    messages_loaded: int
    rendered_tokens: int
    rendered_format: str
    status_truncated: bool
    status_dropped: bool
    dropped_ranges: tuple[MessageIdRange, ...]
    ledger_entries: int
    ledger_tokens: int
    ledger_added: int
    ledger_evicted: int
    compaction_deferred: bool
    summary_attempts: int
    ledger_in_context: int


@dataclass(frozen=True, slots=True)
class Rendering:
    """A built context rendered in one format (JSON text for the API formats)."""

    format: ContextFormat
    content: str


@dataclass(frozen=True, slots=True)
class BuiltContext:
    """The context of one LLM call. In ContextView.RENDERINGS only `renderings` and
    `stats` are filled."""

    system_prompt: str
    docs: tuple[AgentDoc, ...]
    status: str
    messages: tuple[ContextMessage, ...]
    stats: BuildStats
    renderings: tuple[Rendering, ...]

    def rendering(self, format: ContextFormat | str) -> str:
        """The content of the rendering in `format` (KeyError if it was not asked for)."""
        wanted = format if isinstance(format, ContextFormat) else ContextFormat(format)
        for r in self.renderings:
            if r.format is wanted:
                return r.content
        raise KeyError(f"the build has no {wanted.value} rendering; ask for it in `formats`")


@dataclass(frozen=True, slots=True)
class Compaction:
    """The result of compact_context: the stored summary and how it was made."""

    summary: Message
    summarizer_path: str
    summarizer_error: str


@dataclass(frozen=True, slots=True)
class StatusEntry:
    """What a thread or process of the agent is doing."""

    key: str
    kind: StatusKind
    state: str
    summary: str
    update_time: datetime | None
    expire_time: datetime | None


@dataclass(frozen=True, slots=True)
class Event:
    """A recorded event, e.g. "context.compressed"; `data` is a JSON object's text."""

    id: int
    type: str
    agent: str
    scope: Scope | None
    thread: str
    create_time: datetime | None
    data: str

    def data_json(self) -> Any:
        """`data` decoded."""
        return json.loads(self.data) if self.data else {}


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list; an empty next_page_token means it is the last."""

    items: tuple[T, ...]
    next_page_token: str


class Paged(Generic[T]):
    """A list call: iterating it yields every item of every page, fetching the next page
    only when the previous one is used up. The first page is fetched by the call itself,
    so a bad request raises there, not on iteration. `pages()` yields whole pages (with
    their tokens, to resume later with `page_token=`)."""

    __slots__ = ("_fetch", "first_page")

    def __init__(self, first_page: Page[T], fetch: Callable[[str], Page[T]]) -> None:
        self.first_page = first_page
        self._fetch = fetch

    def pages(self) -> Iterator[Page[T]]:
        page = self.first_page
        yield page
        while page.next_page_token:
            page = self._fetch(page.next_page_token)
            yield page

    def __iter__(self) -> Iterator[T]:
        for page in self.pages():
            yield from page.items


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A saved window: its metadata (the messages come with `SnapshotContent`)."""

    id: str
    agent: str
    scope: Scope | None
    thread: str
    create_time: datetime | None
    description: str
    summary: str
    message_count: int
    window_start_time: datetime | None
    window_end_time: datetime | None
    threads: tuple[str, ...]
    size_bytes: int


@dataclass(frozen=True, slots=True)
class SnapshotContent:
    """A snapshot with what it holds: its messages, the agent's settings when it was
    saved, and the specifics ledger."""

    snapshot: Snapshot
    messages: tuple[Message, ...]
    agent: Agent
    specifics: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore wrote: how many messages, into which threads, their receipts."""

    restored_count: int
    threads: tuple[str, ...]
    receipts: tuple[MessageReceipt, ...]


@dataclass(frozen=True, slots=True)
class TextSpan:
    """A range of characters of a text (code point offsets; end exclusive)."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One message found by a search: the message (its thread is `message.thread`), its
    relevance (higher is better; comparable within one result only), a short excerpt and
    where the query's words are in it."""

    message: Message
    score: float
    snippet: str
    highlights: tuple[TextSpan, ...]

    def marked(self, before: str = "[", after: str = "]") -> str:
        """The snippet with each highlight between `before` and `after`."""
        out, at = [], 0
        for span in self.highlights:
            out += [self.snippet[at : span.start], before, self.snippet[span.start : span.end]]
            out.append(after)
            at = span.end
        return "".join([*out, self.snippet[at:]])


@dataclass(frozen=True, slots=True)
class SearchResults:
    """The best-matching messages, best first, and the window searched (None: the whole
    history)."""

    hits: tuple[SearchHit, ...]
    window_start_time: datetime | None


class KeyRole(enum.Enum):
    """What an API key may do (proto `KeyRole`, without its prefix)."""

    UNSPECIFIED = "unspecified"
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key without its secret."""

    key_id: str
    tenant: str
    role: KeyRole
    name: str
    create_time: datetime | None
    revoke_time: datetime | None
