"""The rules every call's input must meet: sizes, names, options, update masks.

Checked by the use cases before anything is stored; each failure is INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED for a size) naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from contextd import core
from contextd.domain.errors import (
    InvalidArgument,
    ResourceExhausted,
)
from contextd.domain.model import (
    Agent,
    AgentDoc,
    AgentSettings,
    BuildOverrides,
    ContextKey,
    NewMessage,
    StoredMessage,
)
from contextd.domain.retention import RETENTION_FIELDS, check_retention
from contextd.domain.validation import (
    MAX_DOC_NAME_CHARS,
    MAX_EXTERNAL_ID_CHARS,
    check_json,
    check_name,
    check_size,
    check_text,
    quote,
    tool_call_ids,
)

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
    # A snapshot holds at most this many messages and bytes (content, tool_calls and
    # metadata in UTF-8): its document is written, read and restored whole.
    snapshot_max_messages: int = 10_000
    snapshot_max_bytes: int = 16 << 20
    # Most bytes one tenant stores (messages and snapshots; see domain/quota.py); 0: none.
    tenant_max_bytes: int = 0


OPTION_PATHS = frozenset(f"build_options.{name}" for name in BuildOverrides.__slots__)


def mask_fields(paths: Sequence[str]) -> frozenset[str]:
    """The fields an update_mask names; INVALID_ARGUMENT naming any it cannot update."""
    if "*" in paths:
        if len(paths) > 1:
            raise InvalidArgument(
                "update_mask '*' names every field; give it alone", field="update_mask"
            )
        return UPDATABLE_AGENT_FIELDS | RETENTION_FIELDS
    unknown = sorted(set(paths) - UPDATABLE_AGENT_FIELDS - OPTION_PATHS - RETENTION_FIELDS)
    if unknown:
        raise InvalidArgument(
            f"update_mask names fields that cannot be updated: "
            f"{', '.join(quote(u) for u in unknown[:5])} (updatable: "
            f"{', '.join(sorted(UPDATABLE_AGENT_FIELDS | RETENTION_FIELDS))}, "
            "build_options.<option>, or *)",
            field="update_mask",
        )
    return frozenset(paths)


def message_bytes(m: StoredMessage) -> int:
    """About a message's size on the wire (characters; what a page's byte cap counts)."""
    return len(m.content) + len(m.tool_calls) + len(m.metadata) + 128


def agent_bytes(a: Agent) -> int:
    return len(a.system_prompt) + sum(len(d.name) + len(d.content) for d in a.docs) + 128


# Bounds of the build options that add tool output excerpts (app/build/excerpts.py).
EXCERPT_OPTION_BOUNDS = (
    ("tool_output_excerpts", 0, 20),
    ("tool_output_excerpt_tokens", 1, 8_000),
    ("tool_output_excerpts_max_tokens", 1, 32_000),
)


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
    for name, low, high in EXCERPT_OPTION_BOUNDS:
        value = getattr(options, name)
        if value is not None and not low <= value <= high:
            raise InvalidArgument(
                f"options.{name} must be {low} to {high:,}", field=f"options.{name}"
            )
    if options.safety_margin is not None and not 0.0 <= options.safety_margin < 1.0:
        raise InvalidArgument(
            "options.safety_margin must be at least 0 and below 1", field="options.safety_margin"
        )


@lru_cache(maxsize=4096)
def context_key(tenant: str, agent: str, scope: str, thread: str) -> ContextKey:
    """The key of a context, its names checked (INVALID_ARGUMENT for a bad one).

    Kept for the last 4,096 keys asked: every append checks its three names with a
    regular expression each, and a fleet appends to the same contexts over and over. A
    pure function of its arguments (the key is immutable), so nothing kept can go stale;
    a bad name raises every time (exceptions are not kept)."""
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


def check_field_size(size: int, limit: int, field: str, what: str) -> None:
    if size > limit:
        raise ResourceExhausted(
            f"{what} is {size:,} bytes; the limit is {limit:,} bytes",
            reason="FIELD_TOO_LARGE",
            field=field,
        )


def checked_settings(settings: AgentSettings) -> AgentSettings:
    check_overrides(settings.build_options)
    check_retention(settings.retention, settings.retention_overrides)
    check_text(settings.system_prompt, "agent.system_prompt")
    check_field_size(
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
    check_field_size(
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
        check_doc(doc, i, seen)
    return settings


def check_doc(doc: AgentDoc, index: int, seen: set[str]) -> None:
    field = f"agent.docs[{index}].name"
    if not doc.name or len(doc.name) > MAX_DOC_NAME_CHARS:
        raise InvalidArgument(
            f"{field} must be 1 to {MAX_DOC_NAME_CHARS} characters long", field=field
        )
    if doc.name in seen:
        raise InvalidArgument(f"{field}: two docs are named {doc.name!r}", field=field)
    check_text(doc.name, field)
    check_text(doc.content, f"agent.docs[{index}].content")
    seen.add(doc.name)


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_message(
    message: NewMessage, index: int, max_bytes: int, latest_us: int
) -> tuple[str, ...]:
    """Reject what cannot be stored; return the tool-call ids the message declares.

    Runs once per message of every append, so the field names of error messages are
    built only when there is an error, and sizes are measured in UTF-8 only when the
    character count alone cannot show the message is under the limit.
    """
    tool_calls, metadata = message.tool_calls, message.metadata
    if "\x00" in message.content:
        check_text(message.content, f"messages[{index}].content")
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
        if "\x00" in value:
            check_text(value, f"messages[{index}].{name}")
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


def check_messages(
    messages: Sequence[NewMessage], max_bytes: int, latest_us: int
) -> list[tuple[str, ...]]:
    """`check_message` of every message of an append, with its results and errors.

    A thousand-message import spends more on calling `check_message` per message than on
    the checks, so the common message (content only: no tool calls, metadata, ids or
    source time, no NUL, clearly under the size limit) is passed in one test here; any
    other goes through `check_message`, which raises the same errors as before.
    """
    out: list[tuple[str, ...]] = []
    append = out.append
    quarter = max_bytes // 4  # 4 bytes per character bound UTF-8 (as in check_message)
    for index, m in enumerate(messages):
        if (
            m.tool_calls
            or m.metadata
            or m.external_id
            or m.tool_call_id
            or m.source_time_us is not None
            or len(m.content) > quarter
            or "\x00" in m.content
        ):
            append(check_message(m, index, max_bytes, latest_us))
        else:
            append(())
    return out


# ------------------------------------------------------------------ tool outputs
# (see domain/tool_outputs.py and proto/contextd/v1/tool_output_service.proto)

# Results at most this size are kept in the pointer's row; larger ones in chunks.
TOOL_OUTPUT_INLINE_BYTES = 32 << 10
# Stored results above this size are compressed (zstd), a chunk at a time.
TOOL_OUTPUT_COMPRESS_BYTES = 64 << 10
# The largest result a stream may carry, and the largest a unary put may.
TOOL_OUTPUT_MAX_BYTES = 1 << 30
TOOL_OUTPUT_MAX_UNARY_BYTES = 4 << 20
# Results are stored, streamed and read in chunks of this many bytes (the last shorter);
# a streamed piece may be at most this long.
TOOL_OUTPUT_CHUNK_BYTES = 1 << 20
MAX_TOOL_NAME_CHARS = 128
MAX_TOOL_DESCRIPTION_CHARS = 4096
MAX_TOOL_ARGS_BYTES = 64 << 10
MAX_TOOL_TAG_CHARS = 128  # task_id and query_id
MAX_GET_TOOL_OUTPUT_IDS = 100
DEFAULT_READ_BYTES = 64 << 10
MAX_READ_BYTES = 1 << 20
MAX_GREP_PATTERN_CHARS = 256
MAX_GREP_CONTEXT_LINES = 20
DEFAULT_GREP_MATCHES = 20
MAX_GREP_MATCHES = 100
MAX_GREP_SCAN_BYTES = 64 << 20
MAX_GREP_LINE_CHARS = 1000
MAX_QUERY_BYTES = 64 << 10
DEFAULT_RELEVANT_K = 10
MAX_RELEVANT_K = 100
# A selection ranks at most this many outputs of its filter (the newest).
MAX_RELEVANCE_CANDIDATES = 10_000
# SearchMessages on PostgreSQL ranks at most this many matching messages (the newest):
# ranking reads each candidate's whole search vector, so it is bounded, not the matches.
MAX_SEARCH_CANDIDATES = 4_000
# What of a result BM25 indexes: its first and last characters.
INDEX_HEAD_CHARS = 12_000
INDEX_TAIL_CHARS = 4_000
MAX_EXCERPT_TOKENS = 32_000
# Excerpts look for matches in at most this many bytes of a result (head and tail are
# always read), in passages of about this many characters.
MAX_EXCERPT_SCAN_BYTES = 16 << 20
EXCERPT_PASSAGE_CHARS = 1200
# A TOOL_RESULT kept aside on append keeps this many characters of its head and tail.
PREVIEW_HEAD_CHARS = 1500
PREVIEW_TAIL_CHARS = 1500


@dataclass(frozen=True, slots=True)
class ToolOutputLimits:
    """The server's tool-output settings (config.py sets them; tests shrink them)."""

    inline_bytes: int = TOOL_OUTPUT_INLINE_BYTES
    compress_bytes: int = TOOL_OUTPUT_COMPRESS_BYTES
    max_bytes: int = TOOL_OUTPUT_MAX_BYTES
