"""Proto <-> domain: every conversion between the wire's messages and the domain's types.

Decoding checks what only the wire can get wrong (a Timestamp out of range, an enum value
the proto lacks, a scope of no kind) and raises InvalidArgument naming the field; the
domain's own rules are checked by the use cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from google.protobuf import duration_pb2, timestamp_pb2

from contextd import core
from contextd.app.build.build_types import BuildResult
from contextd.domain import scopes
from contextd.domain.context import IdList, StatusEntry, StatusKind
from contextd.domain.errors import InvalidArgument
from contextd.domain.model import (
    DEFAULT_ROLLING_WINDOW_US,
    Agent,
    AgentDoc,
    AgentSettings,
    BuildOverrides,
    ContextStats,
    Event,
    MessageRange,
    MessageReceipt,
    NewMessage,
    Role,
    StoredMessage,
    Thread,
)
from contextd.domain.retention import KEEP_EVERYTHING, RetentionPolicy, ScopeRetention
from contextd.domain.search import SearchHit
from contextd.domain.snapshots import SnapshotContents, SnapshotInfo
from contextd.domain.tool_outputs import tool_output_handle, with_tool_output
from contextd.v1 import context_service_pb2 as pb


def timestamp_pb(us: int | None) -> timestamp_pb2.Timestamp | None:
    if us is None:
        return None
    seconds, micros = divmod(us, 1_000_000)  # micros >= 0, as Timestamp requires
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=micros * 1_000)


# google.protobuf.Duration's documented range, which keeps every time sum within int64.
_MAX_DURATION_S = 315_576_000_000


def micros(value: timestamp_pb2.Timestamp | duration_pb2.Duration, field: str) -> int:
    """A Timestamp or Duration in microseconds; INVALID_ARGUMENT when it is outside what
    protobuf allows or what the store can hold (a signed 64-bit count of microseconds)."""
    try:
        micros = value.ToMicroseconds()  # checks a Timestamp's range, not a Duration's
    except ValueError as exc:
        raise InvalidArgument(f"{field} is out of range: {exc}", field=field) from exc
    if isinstance(value, duration_pb2.Duration) and abs(value.seconds) > _MAX_DURATION_S:
        raise InvalidArgument(
            f"{field} is out of range: at most {_MAX_DURATION_S:,} seconds (10,000 years)",
            field=field,
        )
    return micros


def duration_pb(us: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMicroseconds(us)
    return d


_OPTION_FIELDS = BuildOverrides.__slots__  # the proto's BuildOptions fields, same names


def overrides_of(options: pb.BuildOptions) -> BuildOverrides:
    values = {f: getattr(options, f) for f in _OPTION_FIELDS if options.HasField(f)}
    return BuildOverrides(**values)


def options_pb(overrides: BuildOverrides | None) -> pb.BuildOptions:
    return pb.BuildOptions(**(overrides.as_dict() if overrides else {}))  # type: ignore[arg-type]


_FORMAT_NAMES: dict[str, int] = {
    "anthropic": pb.CONTEXT_FORMAT_ANTHROPIC,
    "openai": pb.CONTEXT_FORMAT_OPENAI,
    "text": pb.CONTEXT_FORMAT_TEXT,
}
_FORMATS: dict[int, str] = {
    pb.CONTEXT_FORMAT_ANTHROPIC: "anthropic",
    pb.CONTEXT_FORMAT_OPENAI: "openai",
    pb.CONTEXT_FORMAT_TEXT: "text",
}


def formats_of(values: Sequence[int]) -> tuple[str, ...]:
    out: list[str] = []
    for i, value in enumerate(values):
        if value not in _FORMATS:
            raise InvalidArgument(
                f"formats[{i}] is {value}; use CONTEXT_FORMAT_ANTHROPIC, CONTEXT_FORMAT_OPENAI "
                "or CONTEXT_FORMAT_TEXT",
                field=f"formats[{i}]",
            )
        if _FORMATS[value] in out:
            raise InvalidArgument(
                f"formats[{i}] repeats {pb.ContextFormat.Name(value)}", field=f"formats[{i}]"
            )
        out.append(_FORMATS[value])
    return tuple(out)


def view_of(value: int) -> bool:
    """Whether the response carries the structured context (True) or renderings only."""
    if value in (pb.CONTEXT_VIEW_UNSPECIFIED, pb.CONTEXT_VIEW_FULL):
        return True
    if value == pb.CONTEXT_VIEW_RENDERINGS:
        return False
    raise InvalidArgument(
        f"view {value} is not a known view; use CONTEXT_VIEW_FULL or CONTEXT_VIEW_RENDERINGS",
        field="view",
    )


def status_pb(entry: StatusEntry) -> pb.StatusEntry:
    return pb.StatusEntry(
        key=entry.key,
        kind=pb.STATUS_KIND_THREAD if entry.kind == StatusKind.THREAD else pb.STATUS_KIND_PROCESS,
        state=entry.state,
        summary=entry.summary,
        update_time=timestamp_pb(entry.update_time_us or None),
        expire_time=timestamp_pb(entry.expire_time_us),
    )


def status_entry_of(entry: pb.StatusEntry) -> StatusEntry:
    if entry.kind == pb.STATUS_KIND_THREAD:
        kind = StatusKind.THREAD
    elif entry.kind == pb.STATUS_KIND_PROCESS:
        kind = StatusKind.PROCESS
    else:
        raise InvalidArgument(
            "entry.kind is required (STATUS_KIND_THREAD or STATUS_KIND_PROCESS)",
            field="entry.kind",
        )
    return StatusEntry(
        key=entry.key,
        kind=kind,
        state=entry.state,
        summary=entry.summary,
        update_time_us=0,
        expire_time_us=(
            micros(entry.expire_time, "entry.expire_time")
            if entry.HasField("expire_time")
            else None
        ),
    )


def scope_of(scope: pb.Scope, field: str = "scope") -> str:
    """The canonical scope string of a request's typed scope ("" when unset)."""
    kind = scope.WhichOneof("kind")
    if kind is None:
        return scopes.DEFAULT_SCOPE
    if kind == "key":
        return scopes.key_scope(scope.key, field)
    if kind == "channel":
        c = scope.channel
        return scopes.channel_scope(c.guild_id, c.channel_id, c.user_id, field)
    return scopes.direct_message_scope(scope.direct_message.user_id, field)


def scope_pb(scope: str) -> pb.Scope:
    kind = scopes.parse(scope)
    if isinstance(kind, scopes.ChannelScope):
        return pb.Scope(
            channel=pb.ChannelScope(
                guild_id=kind.guild_id, channel_id=kind.channel_id, user_id=kind.user_id
            )
        )
    if isinstance(kind, scopes.DirectMessageScope):
        return pb.Scope(direct_message=pb.DirectMessageScope(user_id=kind.user_id))
    if isinstance(kind, scopes.KeyScope):
        return pb.Scope(key=kind.key)
    return pb.Scope()


def event_pb(event: Event) -> pb.Event:
    return pb.Event(
        id=event.id,
        type=event.type,
        agent=event.agent,
        scope=scope_pb(event.scope),
        thread=event.thread,
        create_time=timestamp_pb(event.create_time_us),
        data=event.data,
    )


# A build over a million-message window may drop nearly all of it; listing every id would
# make the response larger than a default client accepts.
MAX_LISTED_DROPPED_IDS = 10_000


def build_response(result: BuildResult, full: bool) -> pb.BuildContextResponse:
    """The response of a build as a message (what `build_response_bytes` serializes)."""
    return pb.BuildContextResponse.FromString(build_response_bytes(result, full))


# BuildStats' fields numbered below dropped_ids (10): written before the listed ids, the
# others after them, so the joined bytes are in field-number order as the runtime writes.
_DROPPED_IDS_FIELD = pb.BuildStats.DROPPED_IDS_FIELD_NUMBER
_STATS_BEFORE_IDS = frozenset(
    f.name for f in pb.BuildStats.DESCRIPTOR.fields if f.number < _DROPPED_IDS_FIELD
)
# The key of BuildContextResponse.stats (field 5, length-delimited).
_STATS_TAG = bytes([pb.BuildContextResponse.STATS_FIELD_NUMBER << 3 | 2])


def build_response_bytes(result: BuildResult, full: bool) -> bytes:
    """The serialized BuildContextResponse of a build (`full`: with the structured
    context; else the stats, renderings and excerpts only), which the servicer returns
    as it is (see `contextd.api.server.pass_bytes`).

    Why bytes, joined from parts: this runs for every LLM call an agent makes, and
    building the response as one protobuf message (a ContextMessage and two Timestamps
    per kept message, up to 10,000 dropped ids packed and merged into the stats, then
    the whole message serialized by gRPC) cost a 10,000-message thread's call about as
    much interpreter time as its build. The kept messages and the dropped ids are
    written by the Rust core (`core.encode_context_messages`, `core.encode_packed_int64`)
    straight into wire bytes; the small fields are serialized by the protobuf runtime,
    in parts (fields 1-3, the stats on either side of the ids, fields 9-10), and the
    parts joined in field-number order: the same bytes as the message built whole and
    serialized, which tests/test_build_response_bytes.py checks against the earlier
    construction for varied results.
    """
    ctx = result.context
    s = ctx.stats
    parts: list[bytes] = []
    if full:
        if ctx.system_prompt or ctx.docs or ctx.status:
            parts.append(
                pb.BuildContextResponse(
                    system_prompt=ctx.system_prompt,
                    docs=[pb.AgentDoc(name=d.name, content=d.content) for d in ctx.docs],
                    status=ctx.status,
                ).SerializeToString()
            )
        new_message = (
            None
            if ctx.new_message is None
            else (ctx.new_message, s.new_message_tokens, s.new_message_truncated)
        )
        parts.append(
            core.encode_context_messages(
                ctx.history, result.stamps, s.truncated_ids, s.elided_ids, new_message
            )
        )
    stats = _stats_fields(result)
    before = {k: v for k, v in stats.items() if k in _STATS_BEFORE_IDS}
    after = {k: v for k, v in stats.items() if k not in _STATS_BEFORE_IDS}
    body = b"".join(
        (
            pb.BuildStats(**before).SerializeToString(),
            dropped_ids_field(s.dropped_ids),
            pb.BuildStats(**after).SerializeToString(),
        )
    )
    parts += (_STATS_TAG, varint(len(body)), body)  # present even when empty, as before
    if result.renderings or result.excerpts.added:
        parts.append(
            pb.BuildContextResponse(
                renderings=[
                    pb.Rendering(format=_FORMAT_NAMES[name], content=content)  # type: ignore[arg-type]
                    for name, content in result.renderings.items()
                ],
                tool_output_excerpts=[
                    pb.BuildExcerpt(
                        output_id=a.pointer.id,
                        tool_name=a.pointer.tool_name,
                        args_json=a.pointer.args_json,
                        score=a.score,
                        parts=[
                            pb.BuildExcerptPart(
                                offset=e.offset, length=e.length, text=e.text, part=e.part
                            )
                            for e in a.parts
                        ],
                        tokens=a.tokens,
                    )
                    for a in result.excerpts.added
                ],
            ).SerializeToString()
        )
    return b"".join(parts)


def _stats_fields(result: BuildResult) -> dict[str, Any]:
    """BuildStats' fields by name, all but the listed dropped ids."""
    s = result.context.stats
    first, last = s.summarized_range or (0, 0)
    return {
        "budget_tokens": s.budget,
        "total_tokens": s.total_tokens,
        "system_tokens": s.system_tokens,
        "docs_tokens": s.docs_tokens,
        "status_tokens": s.status_tokens,
        "history_tokens": s.history_tokens,
        "user_message_tokens": s.new_message_tokens,
        "messages_before": s.messages_before,
        "messages_after": s.messages_after,
        "dropped_count": len(s.dropped_ids),
        "truncated_ids": s.truncated_ids,
        "elided_ids": s.elided_ids,
        "first_summarized_id": first,
        "last_summarized_id": last,
        "summarizer_path": s.summarizer_path or "",
        "summarizer_error": s.summarizer_error or "",
        "tokenizer": result.tokenizer,
        "strategy": result.strategy,
        "user_message_truncated": s.new_message_truncated,
        "messages_loaded": result.messages_loaded,
        "orphaned_ids": result.orphaned_ids,
        "rendered_tokens": s.rendered_tokens,
        "rendered_format": s.rendered_format,
        "status_truncated": s.status_truncated,
        "status_dropped": s.status_dropped,
        "dropped_ranges": [pb.MessageIdRange(first_id=a, last_id=b) for a, b in s.dropped_ranges],
        "ledger_entries": s.ledger_entries,
        "ledger_tokens": s.ledger_tokens,
        "ledger_added": s.ledger_added,
        "ledger_evicted": s.ledger_evicted,
        "ledger_in_context": s.ledger_in_context,
        "compaction_deferred": s.compaction_deferred,
        "summary_attempts": s.summary_attempts,
        "tool_output_excerpt_ids": [a.pointer.id for a in result.excerpts.added],
        "tool_output_excerpt_tokens": result.excerpts.tokens,
        "tool_output_excerpts_left_out_ids": result.excerpts.left_out_ids,
        "tool_output_candidates": result.excerpts.candidates,
    }


def dropped_ids_field(ids: Sequence[int]) -> bytes:
    """BuildStats.dropped_ids as serialized: the newest MAX_LISTED_DROPPED_IDS of
    ``ids`` packed by the Rust core from an IdList's array (no Python int per id)."""
    newest = (
        ids.newest(MAX_LISTED_DROPPED_IDS)
        if isinstance(ids, IdList)
        else np.asarray(ids[-MAX_LISTED_DROPPED_IDS:], dtype=np.int64)
    )
    return core.encode_packed_int64(_DROPPED_IDS_FIELD, np.ascontiguousarray(newest))


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def agent_pb(agent: Agent) -> pb.Agent:
    return pb.Agent(
        name=agent.name,
        tenant=agent.tenant,
        system_prompt=agent.system_prompt,
        docs=[pb.AgentDoc(name=d.name, content=d.content) for d in agent.docs],
        rolling_window=duration_pb(agent.rolling_window_us),
        create_time=timestamp_pb(agent.create_time_us),
        update_time=timestamp_pb(agent.update_time_us),
        last_clear_time=timestamp_pb(agent.last_clear_time_us),
        model=agent.model,
        build_options=options_pb(agent.build_options),
        etag=agent.etag,
        retention=retention_pb(agent.retention),
        retention_overrides=[
            pb.ScopeRetention(scope_pattern=o.scope_pattern, policy=retention_pb(o.policy))
            for o in agent.retention_overrides
        ],
    )


def retention_pb(policy: RetentionPolicy) -> pb.RetentionPolicy | None:
    """A policy on the wire; None (unset) for the default, which keeps everything."""
    if policy == KEEP_EVERYTHING:
        return None
    return pb.RetentionPolicy(
        max_messages=policy.max_messages,
        ttl=duration_pb(policy.ttl_us) if policy.ttl_us else None,
        delete_overflow=policy.delete_overflow,
    )


def retention_of(policy: pb.RetentionPolicy, field: str) -> RetentionPolicy:
    """A policy from the wire (checked by the use case: domain/retention.py)."""
    return RetentionPolicy(
        max_messages=policy.max_messages,
        ttl_us=micros(policy.ttl, f"{field}.ttl") if policy.HasField("ttl") else 0,
        delete_overflow=policy.delete_overflow,
    )


def present_fields(agent: pb.Agent) -> list[str]:
    """The update paths of an UpdateAgent without a mask: the fields the request sets
    (AIP-134), each build option on its own, so an update of `model` alone leaves the
    system prompt, docs, window and every other option as they were."""
    paths = [f for f in ("system_prompt", "model") if getattr(agent, f)]
    if agent.docs:
        paths.append("docs")
    if agent.HasField("rolling_window"):
        paths.append("rolling_window")
    paths += [f"build_options.{f}" for f in _OPTION_FIELDS if agent.build_options.HasField(f)]
    if agent.HasField("retention"):
        paths.append("retention")
    if agent.retention_overrides:
        paths.append("retention_overrides")
    return paths


def settings_of(agent: pb.Agent) -> AgentSettings:
    window = (
        micros(agent.rolling_window, "agent.rolling_window")
        if agent.HasField("rolling_window")
        else DEFAULT_ROLLING_WINDOW_US
    )
    return AgentSettings(
        system_prompt=agent.system_prompt,
        docs=tuple(AgentDoc(d.name, d.content) for d in agent.docs),
        rolling_window_us=window,
        model=agent.model,
        build_options=overrides_of(agent.build_options),
        retention=retention_of(agent.retention, "agent.retention"),
        retention_overrides=tuple(
            ScopeRetention(
                o.scope_pattern,
                retention_of(o.policy, f"agent.retention_overrides[{i}].policy"),
            )
            for i, o in enumerate(agent.retention_overrides)
        ),
    )


def role_of(value: int, index: int) -> Role:
    if value == pb.ROLE_UNSPECIFIED:
        raise InvalidArgument(
            f"messages[{index}].role is required (ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL_USE "
            "or ROLE_TOOL_RESULT)",
            field=f"messages[{index}].role",
        )
    try:
        return Role(value)
    except ValueError as exc:
        raise InvalidArgument(
            f"messages[{index}].role {value} is not a known role", field=f"messages[{index}].role"
        ) from exc


def new_message_of(message: pb.Message, index: int) -> NewMessage:
    metadata = message.metadata
    if message.tool_output_id:  # a reference to a stored tool output: see tool_outputs.py
        metadata = with_tool_output(metadata, message.tool_output_id, None, index)
    return NewMessage(
        role=role_of(message.role, index),
        content=message.content,
        tool_calls=message.tool_calls,
        tool_call_id=message.tool_call_id,
        external_id=message.external_id,
        metadata=metadata,
        source_time_us=(
            micros(message.source_time, f"messages[{index}].source_time")
            if message.HasField("source_time")
            else None
        ),
    )


# The roles a message may have, by their proto value: the per-message lookup of
# `new_messages_of` (Role(value) costs an enum call per message).
_ROLES: dict[int, Role] = {int(r): r for r in Role if int(r) != pb.ROLE_UNSPECIFIED}


def new_messages_of(messages: Iterable[pb.Message]) -> list[NewMessage]:
    """The messages of an append, converted in one pass.

    Runs for every message of every append (a thousand in a batched import), so the
    common message (a known role, no source time, no tool output reference) costs one
    dict lookup and one construction; any other goes through `new_message_of`, which
    validates it and raises exactly the same errors.
    """
    roles = _ROLES
    new = NewMessage
    out: list[NewMessage] = []
    append = out.append
    for index, m in enumerate(messages):
        role = roles.get(m.role)
        if role is None or m.tool_output_id or m.HasField("source_time"):
            append(new_message_of(m, index))
        else:
            # Positional: a frozen dataclass takes keywords about 1.5 us slower.
            append(new(role, m.content, m.tool_calls, m.tool_call_id, m.external_id, m.metadata))
    return out


# What `core.decode_append_messages` is given: a role's Role at its proto value (0,
# unspecified, is never read: such a message is converted one by one), and the
# NewMessage slots it fills, in its order. It makes NewMessages without `__init__`
# (see its docstring), so NewMessage must keep these fields and no `__post_init__`.
_ROLE_COLUMN: list[Role | None] = [None, *(Role(v) for v in range(1, 5))]
_NEW_MESSAGE_FIELDS = (
    "role",
    "content",
    "tool_calls",
    "tool_call_id",
    "external_id",
    "metadata",
    "source_time_us",
)
# Checked at import, not by `assert` (which `python -O` drops): a NewMessage made by the
# core with other fields would be wrong silently.
if (
    set(_ROLES) != {1, 2, 3, 4}
    or tuple(f.name for f in dataclasses.fields(NewMessage)) != _NEW_MESSAGE_FIELDS
    or hasattr(NewMessage, "__post_init__")
):
    raise ImportError(
        "NewMessage or the roles changed: update the Rust decoder (rust_core/src/wire.rs) "
        "and _NEW_MESSAGE_FIELDS together"
    )
# From this many messages an append is decoded by the Rust core: below it the request's
# serialization and the call cost about what they save, and a single message keeps the
# one-pass path unchanged.
WIRE_MIN_MESSAGES = 16


def new_messages_of_request(request: pb.AppendMessagesRequest) -> list[NewMessage]:
    """The messages of an append: `new_messages_of(request.messages)`, decoded by the
    Rust core for a batch.

    Why: a 1,000-message append spent about 2 ms here under the GIL: reading each
    field of each protobuf message into Python, the loop, and the NewMessage
    construction (about 1 ms of it: a frozen dataclass sets each field through
    `object.__setattr__`). The request is serialized again (upb: about 0.1 ms for
    500 kB) and the core reads the stored fields straight out of the bytes and makes
    the NewMessages itself, with no Python per message. A message the plain path
    treats apart (a role other than the four, a tool output reference, a source time)
    is converted by `new_message_of` from the protobuf message, in index order, so its
    errors are exactly the plain path's. Should the core refuse the bytes (it cannot
    for bytes upb wrote; it is a guard), the plain path runs.
    tests/test_append_convert.py holds the two paths equal.
    """
    messages = request.messages
    if len(messages) < WIRE_MIN_MESSAGES:
        return new_messages_of(messages)
    try:
        out, odd = core.decode_append_messages(
            request.SerializeToString(), _ROLE_COLUMN, NewMessage, list(_NEW_MESSAGE_FIELDS)
        )
    except ValueError:
        return new_messages_of(messages)
    for index in odd:
        out[index] = new_message_of(messages[index], index)
    return out


def message_pb(m: StoredMessage) -> pb.Message:
    message = pb.Message(
        id=m.id,
        tenant=m.tenant,
        agent=m.agent,
        scope=scope_pb(m.scope),
        thread=m.thread,
        role=int(m.role),  # type: ignore[arg-type]
        content=m.content,
        tool_calls=m.tool_calls,
        tool_call_id=m.tool_call_id,
        external_id=m.external_id,
        metadata=m.metadata,
        token_estimate=m.token_estimate,
        create_time=timestamp_pb(m.create_time_us),
        token_count=m.token_count,
        is_summary=m.is_summary,
        first_summarized_id=m.summarized_ids[0] if m.summarized_ids else 0,
        last_summarized_id=m.summarized_ids[1] if m.summarized_ids else 0,
        source_time=timestamp_pb(m.source_time_us),
        sequence=m.sequence,
        restored_from_snapshot=m.restored_from,
    )
    handle = tool_output_handle(m.metadata) if m.metadata else None
    if handle is not None:  # a result kept aside: see domain/tool_outputs.py
        message.tool_output_id, message.tool_output_size_bytes = handle[0], handle[1] or 0
    return message


def snapshot_pb(s: SnapshotInfo) -> pb.Snapshot:
    return pb.Snapshot(
        id=s.id,
        agent=s.agent,
        scope=scope_pb(s.scope),
        thread=s.thread,
        create_time=timestamp_pb(s.create_time_us),
        description=s.description,
        summary=s.summary,
        message_count=s.message_count,
        window_start_time=timestamp_pb(s.window_start_us),
        window_end_time=timestamp_pb(s.window_end_us),
        threads=s.threads,
        size_bytes=s.size_bytes,
    )


def snapshot_view_of(value: int) -> bool:
    """Whether GetSnapshot returns what the snapshot holds (True) or its metadata only."""
    if value in (pb.SNAPSHOT_VIEW_UNSPECIFIED, pb.SNAPSHOT_VIEW_BASIC):
        return False
    if value == pb.SNAPSHOT_VIEW_FULL:
        return True
    raise InvalidArgument(
        f"view {value} is not a known view; use SNAPSHOT_VIEW_BASIC or SNAPSHOT_VIEW_FULL",
        field="view",
    )


def snapshot_response(
    info: SnapshotInfo, contents: SnapshotContents | None
) -> pb.GetSnapshotResponse:
    if contents is None:
        return pb.GetSnapshotResponse(snapshot=snapshot_pb(info))
    return pb.GetSnapshotResponse(
        snapshot=snapshot_pb(info),
        messages=[message_pb(m) for m in contents.messages],
        agent=agent_pb(contents.agent),
        specifics=contents.specifics,
    )


def thread_pb(t: Thread) -> pb.Thread:
    return pb.Thread(
        agent=t.agent,
        scope=scope_pb(t.scope),
        thread=t.thread,
        create_time=timestamp_pb(t.create_time_us),
        last_message_time=timestamp_pb(t.last_message_time_us),
        message_count=t.message_count,
        token_estimate=t.token_estimate,
        last_clear_time=timestamp_pb(t.last_clear_time_us),
        last_sequence=t.last_sequence,
    )


def stats_pb(s: ContextStats) -> pb.ContextStats:
    return pb.ContextStats(
        window_start_time=timestamp_pb(s.window_start_time_us),
        last_clear_time=timestamp_pb(s.last_clear_time_us),
        window_message_count=s.window_message_count,
        window_token_estimate=s.window_token_estimate,
        total_message_count=s.total_message_count,
        total_token_estimate=s.total_token_estimate,
        oldest_message_time=timestamp_pb(s.oldest_message_time_us),
        newest_message_time=timestamp_pb(s.newest_message_time_us),
        rolling_window=duration_pb(s.rolling_window_us),
        thread_count=s.thread_count,
        exists=s.exists,
        expires_in=None if s.expires_in_us is None else duration_pb(s.expires_in_us),
        expire_time=timestamp_pb(s.expire_time_us),
        retention=retention_pb(s.retention),
    )


def range_of(value: int) -> MessageRange:
    if value in (pb.MESSAGE_RANGE_UNSPECIFIED, pb.MESSAGE_RANGE_WINDOW):
        return MessageRange.WINDOW
    if value == pb.MESSAGE_RANGE_ALL:
        return MessageRange.ALL
    raise InvalidArgument(f"range {value} is not a known message range", field="range")


def receipt_pb(r: MessageReceipt) -> pb.MessageReceipt:
    return pb.MessageReceipt(
        id=r.id,
        create_time=timestamp_pb(r.create_time_us),
        token_estimate=r.token_estimate,
        token_count=r.token_count,
        sequence=r.sequence,
    )


def receipts_pb(receipts: Sequence[MessageReceipt]) -> pb.AppendMessagesResponse:
    """The response of an append: the same message as a list of `receipt_pb`.

    A batch's is encoded by the Rust core from the receipts' columns and parsed back by
    the protobuf runtime: this runs on the store's one writer thread (which records the
    response under the call's request id), and a 1,000-message append's response, built
    one receipt and one Timestamp at a time, cost about 1.1 ms of it; columns, encoding
    and parse take about a quarter of that. A few receipts are built in place (the
    crossing into Rust would cost a single append about 0.7 us more).
    tests/test_append_convert.py holds both to `receipt_pb`'s bytes."""
    if len(receipts) >= WIRE_MIN_MESSAGES:
        return pb.AppendMessagesResponse.FromString(receipts_bytes(receipts))
    response = pb.AppendMessagesResponse()
    add = response.receipts.add
    for r in receipts:
        seconds, micros = divmod(r.create_time_us, 1_000_000)  # as timestamp_pb
        receipt = add(
            id=r.id, token_estimate=r.token_estimate, token_count=r.token_count, sequence=r.sequence
        )
        stamp = receipt.create_time
        stamp.seconds, stamp.nanos = seconds, micros * 1_000
        stamp.SetInParent()  # present even at the epoch, as timestamp_pb's is
    return response


def receipts_bytes(receipts: Sequence[MessageReceipt]) -> bytes:
    """`receipts_pb(receipts)` serialized, without building the message."""
    return core.encode_receipts(
        [r.id for r in receipts],
        [r.create_time_us for r in receipts],
        [r.token_estimate for r in receipts],
        [r.token_count for r in receipts],
        [r.sequence for r in receipts],
    )


def search_hit_pb(hit: SearchHit) -> pb.SearchHit:
    return pb.SearchHit(
        message=message_pb(hit.message),
        score=hit.score,
        snippet=hit.snippet,
        highlights=[pb.TextSpan(start=a, end=b) for a, b in hit.highlights],
    )
