"""The domain operations behind the gRPC API: plain Python over plain types.

This layer owns the rules (validation, defaults, windows, paging); the store owns the SQL;
the servicer only translates. Every method takes the tenant explicitly so that, once
authentication exists, isolation is a matter of passing the caller's tenant.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

from contextd import core
from contextd.app.build.builder import (
    FORMATS,
    BuildRequest,
    BuildResult,
    CompactResult,
    ContextBuilder,
    replayed_compaction,
)
from contextd.app.build.summarizer import Summarizer
from contextd.app.paging import PageTokens, page_size
from contextd.domain.batches import prepare_batch
from contextd.domain.context import StatusEntry
from contextd.domain.errors import (
    Aborted,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StaleModel,
    Unavailable,
)
from contextd.domain.idempotency import AlreadyDone, Remembered, RequestRecord, replay
from contextd.domain.model import (
    DEFAULT_THREAD,
    Agent,
    AgentDoc,
    AgentSettings,
    BuildOverrides,
    ContextKey,
    ContextStats,
    Event,
    MessageRange,
    MessageReceipt,
    NewMessage,
    Page,
    StoredMessage,
    Thread,
)
from contextd.domain.validation import (
    MAX_DOC_NAME_CHARS,
    MAX_EXTERNAL_ID_CHARS,
    check_json,
    check_name,
    check_size,
    quote,
    tool_call_ids,
)
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec, window_spec
from contextd.ports.store import Store, ThreadFilter

UPDATABLE_AGENT_FIELDS = frozenset(
    {"system_prompt", "docs", "rolling_window", "model", "build_options"}
)
MAX_STATUS_KEY_CHARS = 256
MAX_STATUS_STATE_CHARS = 64
MAX_STATUS_SUMMARY_CHARS = 500


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 1 << 20
    max_batch_messages: int = 10_000


@dataclass(frozen=True, slots=True)
class MessagePage:
    messages: list[StoredMessage]
    next_page_token: str
    window: WindowSpec | None


class ContextService:
    def __init__(
        self,
        store: Store,
        summarizer: Summarizer,
        limits: Limits | None = None,
        page_tokens: PageTokens | None = None,
    ) -> None:
        self._store = store
        # The server's one clock, owned by the store (see clock.py).
        self._clock = store.clock
        self._limits = limits or Limits()
        # Without a key from the data directory, tokens are signed with a key of this
        # process only (fine for a service object that lives and dies with its caller).
        self._pages = page_tokens or PageTokens(secrets.token_bytes(32))
        self._builder = ContextBuilder(store, summarizer)
        # The model of each agent, read on every append to count its tokens. Invalidated on
        # update and delete here; an engine shared by replicas checks it in the append
        # transaction (StaleModel), so a stale entry costs a recount, never a wrong count.
        self._models: dict[tuple[str, str], str] = {}

    def _model_of(self, tenant: str, agent: str) -> str:
        key = (tenant, agent)
        model = self._models.get(key)
        if model is None:
            found = self._store.find_agent(tenant, agent)
            model = found.model if found else ""
            if found:
                self._models[key] = model
        return model

    def remembered(self, tenant: str, request_id: str) -> Remembered | None:
        """A write recorded under this request id, if any (see idempotency.py)."""
        return self._store.remembered(tenant, request_id)

    # ----------------------------------------------------------------- agents

    def create_agent(
        self, tenant: str, name: str, settings: AgentSettings, record: RequestRecord | None = None
    ) -> Agent:
        check_name(name, "agent.name")
        return self._store.create_agent(tenant, name, _checked_settings(settings), record)

    def get_agent(self, tenant: str, name: str) -> Agent:
        check_name(name, "name")
        return self._store.get_agent(tenant, name)

    def update_agent(
        self,
        tenant: str,
        name: str,
        settings: AgentSettings,
        fields: Sequence[str],
        etag: str = "",
        record: RequestRecord | None = None,
    ) -> Agent:
        """Update exactly `fields` (mask paths: the updatable fields, "build_options.<option>"
        for one option, "*" for all); an empty list updates nothing. The api layer turns
        an absent mask into the fields the request sets (AIP-134)."""
        check_name(name, "agent.name")
        chosen = _mask_fields(fields)
        if not chosen:
            current = self._store.get_agent(tenant, name)
            if etag and etag != current.etag:
                raise Aborted(
                    f"agent {name!r} changed since etag {quote(etag)} was read; read it again",
                    reason="ETAG_MISMATCH",
                    field="agent.etag",
                )
            return current
        updated = self._store.update_agent(
            tenant, name, _checked_settings(settings), chosen, etag, record
        )
        self._models.pop((tenant, name), None)  # after the commit, so no stale re-read
        return updated

    def list_agents(self, tenant: str, requested_size: int, token: str) -> Page[Agent]:
        size = page_size(requested_size)
        params = ("agents", tenant)
        position = self._pages.decode(token, params, (str,))
        after = str(position.position[0]) if position else None
        agents = self._store.list_agents(tenant, after, size + 1)
        return Page(*self._pages.cut(agents, size, params, lambda a: (a.name,), None, _agent_bytes))

    def delete_agent(
        self, tenant: str, name: str, etag: str = "", record: RequestRecord | None = None
    ) -> int:
        check_name(name, "name")
        deleted = self._store.delete_agent(tenant, name, etag, record)
        self._models.pop((tenant, name), None)
        return deleted

    # ----------------------------------------------------------------- messages

    def append_messages(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        messages: Sequence[NewMessage],
        create_agent: bool = False,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Validate the whole batch, estimate its tokens in one Rust call, append durably."""
        key = _context_key(tenant, agent, scope, thread or DEFAULT_THREAD)
        if not messages:
            raise InvalidArgument("messages must hold at least one message", field="messages")
        if len(messages) > self._limits.max_batch_messages:
            raise ResourceExhausted(
                f"a batch holds at most {self._limits.max_batch_messages:,} messages; "
                f"got {len(messages):,}",
                reason="BATCH_TOO_LARGE",
                field="messages",
            )
        latest_allowed = self._clock.now_us() + MAX_SOURCE_LEAD_US
        call_ids = [
            _check_message(m, i, self._limits.max_message_bytes, latest_allowed)
            for i, m in enumerate(messages)
        ]
        model = self._model_of(tenant, key.agent)
        for _ in range(3):
            batch = prepare_batch(messages, model, call_ids)
            try:
                return self._store.append(
                    key, batch, AgentSettings() if create_agent else None, record
                )
            except StaleModel as changed:
                # Another replica changed the agent's model since this one cached it.
                model = changed.model
                self._models[(tenant, key.agent)] = model
        raise Unavailable(
            "the agent's model kept changing during this append; retry",
            retry_after_s=0.1,
        )

    def list_messages(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        message_range: MessageRange,
        requested_size: int,
        token: str,
    ) -> MessagePage:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_name(thread, "thread", allow_empty=True)
        size = page_size(requested_size)
        # "messages/2": positions became (sequence, id) for one thread; older tokens are
        # rejected as issued for other parameters rather than misread.
        params = ("messages/2", tenant, agent, scope, thread, int(message_range))
        position = self._pages.decode(token, params, (int, int))
        found = self._store.get_agent(tenant, agent)
        window: WindowSpec | None = None
        if message_range == MessageRange.WINDOW:
            if position is not None and position.window is not None:
                window = WindowSpec(*position.window)  # the first page's window
            else:
                window = window_spec(
                    self._clock.now_us(), found.rolling_window_us, found.last_clear_time_us
                )
        after = (int(position.position[0]), int(position.position[1])) if position else None
        where = ThreadFilter(tenant, agent, scope, thread or None)
        rows = self._store.list_messages(where, window, after, size + 1)
        # One thread pages by sequence, all threads by (create_time, id): the store's order.
        page, next_token = self._pages.cut(
            rows,
            size,
            params,
            (lambda m: (m.sequence, m.id)) if thread else (lambda m: (m.create_time_us, m.id)),
            None if window is None else (window.clear_after_us, window.age_after_us),
            _message_bytes,
        )
        return MessagePage(page, next_token, window)

    # ----------------------------------------------------------------- clears

    def clear_context(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        all_scopes: bool = False,
        record: RequestRecord | None = None,
    ) -> int:
        """Move a clear marker to now and return it: of one thread, of every thread of one
        scope (thread empty), or of the whole agent (all_scopes, and nothing narrower).
        A clear never reaches past the scope it names."""
        check_name(agent, "agent")
        check_name(thread, "thread", allow_empty=True)
        if all_scopes:
            if scope or thread:
                field = "scope" if scope else "thread"
                raise InvalidArgument(
                    f"all_scopes clears every scope and thread of the agent; leave {field} "
                    "unset, or drop all_scopes to clear only what it names",
                    field=field,
                )
            return self._store.clear_agent(tenant, agent, record)
        if not thread:
            return self._store.clear_scope(tenant, agent, scope, record)
        return self._store.clear_thread(_context_key(tenant, agent, scope, thread), record)

    # ----------------------------------------------------------------- threads and stats

    def list_threads(
        self, tenant: str, agent: str, scope: str, requested_size: int, token: str
    ) -> Page[Thread]:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        size = page_size(requested_size)
        params = ("threads", tenant, agent, scope)
        position = self._pages.decode(token, params, (str,))
        self._store.get_agent(tenant, agent)
        after = str(position.position[0]) if position else None
        threads = self._store.list_threads(tenant, agent, scope, after, size + 1)
        return Page(*self._pages.cut(threads, size, params, lambda t: (t.thread,)))

    # ----------------------------------------------------------------- building

    def build_context(self, request: BuildRequest) -> BuildResult:
        _context_key(request.tenant, request.agent, request.scope, request.thread or DEFAULT_THREAD)
        check_overrides(request.overrides)
        _check_field_size(
            _utf8_len(request.user_message), MAX_USER_MESSAGE_BYTES, "user_message", "user_message"
        )
        unknown = sorted(set(request.formats) - set(FORMATS))
        if unknown:
            raise InvalidArgument(f"unknown formats: {', '.join(unknown)}", field="formats")
        return self._builder.build(replace(request, thread=request.thread or DEFAULT_THREAD))

    def compact_context(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        model: str,
        overrides: BuildOverrides,
        record: RequestRecord | None = None,
    ) -> CompactResult:
        """Summarize on demand. A retry (same request id) returns the first summary: it
        is looked up before the summarizer runs, and again in the summary's transaction."""
        key = _context_key(tenant, agent, scope, thread or DEFAULT_THREAD)
        check_overrides(overrides)
        if record is not None:
            found = self._store.remembered(record.tenant, record.request_id)
            if found is not None:
                return replayed_compaction(self._store, key, replay(record, found))
        try:
            return self._builder.compact(tenant, agent, scope, key.thread, model, overrides, record)
        except AlreadyDone as done:
            return replayed_compaction(self._store, key, done.payload)

    # ----------------------------------------------------------------- status entries

    def set_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        entry: StatusEntry,
        ttl_us: int | None,
        record: RequestRecord | None = None,
    ) -> StatusEntry:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        if not entry.key or len(entry.key) > MAX_STATUS_KEY_CHARS:
            raise InvalidArgument(
                f"entry.key must be 1 to {MAX_STATUS_KEY_CHARS} characters", field="entry.key"
            )
        if len(entry.state) > MAX_STATUS_STATE_CHARS:
            raise InvalidArgument(
                f"entry.state is longer than {MAX_STATUS_STATE_CHARS} characters",
                field="entry.state",
            )
        if not entry.summary or len(entry.summary) > MAX_STATUS_SUMMARY_CHARS:
            raise InvalidArgument(
                f"entry.summary must be 1 to {MAX_STATUS_SUMMARY_CHARS} characters",
                field="entry.summary",
            )
        now = self._clock.now_us()
        expire = entry.expire_time_us
        if ttl_us is not None:
            if ttl_us <= 0:
                raise InvalidArgument("ttl must be positive", field="ttl")
            expire = now + ttl_us
        if expire is not None and expire <= now:
            raise InvalidArgument("entry.expire_time is in the past", field="entry.expire_time")
        return self._store.set_status(
            tenant, agent, scope, replace(entry, expire_time_us=expire), record
        )

    def list_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        include_expired: bool,
        requested_size: int,
        token: str,
    ) -> Page[StatusEntry]:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        size = page_size(requested_size)
        params = ("status", tenant, agent, scope, include_expired)
        position = self._pages.decode(token, params, (str,))
        self._store.get_agent(tenant, agent)
        after = str(position.position[0]) if position else None
        live_at = None if include_expired else self._clock.now_us()
        entries = self._store.list_status(tenant, agent, scope, after, size + 1, live_at)
        return Page(*self._pages.cut(entries, size, params, lambda e: (e.key,)))

    def clear_status(
        self, tenant: str, agent: str, scope: str, key: str, record: RequestRecord | None = None
    ) -> int:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        return self._store.clear_status(tenant, agent, scope, key or None, record)

    # ----------------------------------------------------------------- events

    def list_events(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        event_type: str,
        start_us: int | None,
        end_us: int | None,
        requested_size: int,
        token: str,
    ) -> Page[Event]:
        """Events of one scope, optionally of one thread: never another scope's."""
        check_name(agent, "agent")
        check_name(thread, "thread", allow_empty=True)
        size = page_size(requested_size)
        params = ("events", tenant, agent, scope, thread, event_type, start_us, end_us)
        position = self._pages.decode(token, params, (int,))
        self._store.get_agent(tenant, agent)
        after = int(position.position[0]) if position else 0
        where = ThreadFilter(tenant, agent, scope, thread or None)
        events = self._store.list_events(where, event_type, start_us, end_us, after, size + 1)
        return Page(*self._pages.cut(events, size, params, lambda e: (e.id,)))

    # ----------------------------------------------------------------- stats

    def context_stats(self, tenant: str, agent: str, scope: str, thread: str) -> ContextStats:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_name(thread, "thread", allow_empty=True)
        found = self._store.get_agent(tenant, agent)
        thread_clear: int | None = None
        if thread:
            one = self._store.get_thread(ContextKey(tenant, agent, scope, thread))
            if one is None:
                raise NotFound(
                    f"agent {agent!r} has no thread {thread!r} in scope {scope!r}",
                    reason="THREAD_NOT_FOUND",
                )
            thread_clear = one.last_clear_time_us
        window = window_spec(
            self._clock.now_us(), found.rolling_window_us, found.last_clear_time_us
        )
        counts = self._store.context_counts(
            ThreadFilter(tenant, agent, scope, thread or None), window
        )
        window_count, window_tokens, total_count, total_tokens, oldest, newest, threads = counts
        return ContextStats(
            window_start_time_us=window.age_after_us,
            last_clear_time_us=max(found.last_clear_time_us, thread_clear or 0),
            rolling_window_us=found.rolling_window_us,
            window_message_count=int(window_count),
            window_token_estimate=int(window_tokens),
            total_message_count=int(total_count),
            total_token_estimate=int(total_tokens),
            oldest_message_time_us=oldest,
            newest_message_time_us=newest,
            thread_count=int(threads),
        )


_OPTION_PATHS = frozenset(f"build_options.{name}" for name in BuildOverrides.__slots__)


def _mask_fields(paths: Sequence[str]) -> frozenset[str]:
    """The fields an update_mask names; INVALID_ARGUMENT naming any it cannot update."""
    if "*" in paths:
        if len(paths) > 1:
            raise InvalidArgument(
                "update_mask '*' names every field; give it alone", field="update_mask"
            )
        return UPDATABLE_AGENT_FIELDS
    unknown = sorted(set(paths) - UPDATABLE_AGENT_FIELDS - _OPTION_PATHS)
    if unknown:
        raise InvalidArgument(
            f"update_mask names fields that cannot be updated: "
            f"{', '.join(quote(u) for u in unknown[:5])} (updatable: "
            f"{', '.join(sorted(UPDATABLE_AGENT_FIELDS))}, build_options.<option>, or *)",
            field="update_mask",
        )
    return frozenset(paths)


def _message_bytes(m: StoredMessage) -> int:
    """About a message's size on the wire (characters; what a page's byte cap counts)."""
    return len(m.content) + len(m.tool_calls) + len(m.metadata) + 128


def _agent_bytes(a: Agent) -> int:
    return len(a.system_prompt) + sum(len(d.name) + len(d.content) for d in a.docs) + 128


def check_overrides(options: BuildOverrides) -> None:
    """Reject option values no build could honour, naming the field."""
    positive = {
        "max_chars_per_message": options.max_chars_per_message,
        "budget_tokens": options.budget_tokens,
    }
    for name, value in positive.items():
        if value is not None and value <= 0:
            raise InvalidArgument(f"options.{name} must be positive", field=f"options.{name}")
    non_negative = {
        "keep_recent_tokens": options.keep_recent_tokens,
        "elide_threshold_chars": options.elide_threshold_chars,
        "output_reserve_tokens": options.output_reserve_tokens,
    }
    for name, value in non_negative.items():
        if value is not None and value < 0:
            raise InvalidArgument(f"options.{name} must not be negative", field=f"options.{name}")
    if options.safety_margin is not None and not 0.0 <= options.safety_margin < 1.0:
        raise InvalidArgument(
            "options.safety_margin must be at least 0 and below 1", field="options.safety_margin"
        )


def _context_key(tenant: str, agent: str, scope: str, thread: str) -> ContextKey:
    return ContextKey(
        tenant=tenant,
        agent=check_name(agent, "agent"),
        scope=check_name(scope, "scope", allow_empty=True),
        thread=check_name(thread, "thread"),
    )


# Settings are parsed on every GetAgent, ListAgents page and build, so their size is
# bounded like a message's.
MAX_SYSTEM_PROMPT_BYTES = 256 << 10
MAX_DOCS = 32
MAX_DOCS_BYTES = 1 << 20
MAX_USER_MESSAGE_BYTES = 1 << 20


def _check_field_size(size: int, limit: int, field: str, what: str) -> None:
    if size > limit:
        raise ResourceExhausted(
            f"{what} is {size:,} bytes; the limit is {limit:,} bytes",
            reason="FIELD_TOO_LARGE",
            field=field,
        )


def _checked_settings(settings: AgentSettings) -> AgentSettings:
    check_overrides(settings.build_options)
    _check_field_size(
        _utf8_len(settings.system_prompt),
        MAX_SYSTEM_PROMPT_BYTES,
        "agent.system_prompt",
        "agent.system_prompt",
    )
    if len(settings.docs) > MAX_DOCS:
        raise ResourceExhausted(
            f"agent.docs holds {len(settings.docs)} docs; the limit is {MAX_DOCS}",
            reason="FIELD_TOO_LARGE",
            field="agent.docs",
        )
    _check_field_size(
        sum(_utf8_len(d.name) + _utf8_len(d.content) for d in settings.docs),
        MAX_DOCS_BYTES,
        "agent.docs",
        "agent.docs together",
    )
    if settings.model:
        try:
            core.model_info(settings.model)
        except core.UnknownModelError as exc:
            raise InvalidArgument(
                f"agent.model {quote(settings.model)} is not in the model registry; known models: "
                f"{', '.join(core.list_models())}",
                field="agent.model",
            ) from exc
    if settings.rolling_window_us <= 0:
        raise InvalidArgument(
            "agent.rolling_window must be positive (e.g. 86400s for one day)",
            field="agent.rolling_window",
        )
    seen: set[str] = set()
    for i, doc in enumerate(settings.docs):
        _check_doc(doc, i, seen)
    return settings


def _check_doc(doc: AgentDoc, index: int, seen: set[str]) -> None:
    field = f"agent.docs[{index}].name"
    if not doc.name or len(doc.name) > MAX_DOC_NAME_CHARS:
        raise InvalidArgument(
            f"{field} must be 1 to {MAX_DOC_NAME_CHARS} characters long", field=field
        )
    if doc.name in seen:
        raise InvalidArgument(f"{field}: two docs are named {doc.name!r}", field=field)
    seen.add(doc.name)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _check_message(
    message: NewMessage, index: int, max_bytes: int, latest_us: int
) -> tuple[str, ...]:
    """Reject what cannot be stored; return the tool-call ids the message declares.

    Runs once per message of every append, so the field names of error messages are
    built only when there is an error, and sizes are measured in UTF-8 only when the
    character count alone cannot show the message is under the limit.
    """
    tool_calls, metadata = message.tool_calls, message.metadata
    ids = tool_call_ids(tool_calls, f"messages[{index}].tool_calls") if tool_calls else ()
    if metadata:
        check_json(metadata, f"messages[{index}].metadata", object_only=True)
    for name, value in (
        ("external_id", message.external_id),
        ("tool_call_id", message.tool_call_id),
    ):
        if len(value) > MAX_EXTERNAL_ID_CHARS:
            raise InvalidArgument(
                f"messages[{index}].{name} is longer than {MAX_EXTERNAL_ID_CHARS} characters",
                field=f"messages[{index}].{name}",
            )
    content = message.content
    # Four bytes per character bounds UTF-8, so most messages skip the encode.
    if 4 * (len(content) + len(tool_calls) + len(metadata)) > max_bytes:
        size = _utf8_len(content) + _utf8_len(tool_calls) + _utf8_len(metadata)
        check_size(size, max_bytes, f"messages[{index}] (content + tool_calls + metadata)")
    if message.source_time_us is not None and message.source_time_us > latest_us:
        raise InvalidArgument(
            f"messages[{index}].source_time is more than 5 minutes ahead of the server's "
            "clock; leave it unset when the message has no time of its own",
            field=f"messages[{index}].source_time",
        )
    return ids
