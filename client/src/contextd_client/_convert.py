"""Protobuf <-> the client's types.

Results are converted by field name (`from_pb`): each field of the target dataclass is read
from the proto field of the same name, and its proto type decides the conversion
(Timestamp -> datetime, Duration -> timedelta, enum -> the enum of the same members,
Scope -> a typed scope, a registered message -> its dataclass, repeated -> tuple, an
unset optional -> None). A dataclass naming a field the proto lacks fails loudly at its
first conversion (the tests convert every result type).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message as ProtoMessage

from contextd_client import types as t
from contextd_client.v1 import context_service_pb2 as pb

R = TypeVar("R")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# Proto message -> the dataclass it converts to. A result type for a new RPC: one line here.
_RESULTS: dict[str, type[Any]] = {
    "contextd.v1.Agent": t.Agent,
    "contextd.v1.AgentDoc": t.AgentDoc,
    "contextd.v1.BuildOptions": t.BuildOptions,
    "contextd.v1.RetentionPolicy": t.RetentionPolicy,
    "contextd.v1.ScopeRetention": t.ScopeRetention,
    "contextd.v1.Message": t.Message,
    "contextd.v1.MessageReceipt": t.MessageReceipt,
    "contextd.v1.Thread": t.Thread,
    "contextd.v1.ContextStats": t.ContextStats,
    "contextd.v1.ContextMessage": t.ContextMessage,
    "contextd.v1.BuildStats": t.BuildStats,
    "contextd.v1.MessageIdRange": t.MessageIdRange,
    "contextd.v1.Rendering": t.Rendering,
    "contextd.v1.BuildContextResponse": t.BuiltContext,
    "contextd.v1.CompactContextResponse": t.Compaction,
    "contextd.v1.StatusEntry": t.StatusEntry,
    "contextd.v1.Event": t.Event,
    "contextd.v1.Snapshot": t.Snapshot,
    "contextd.v1.GetSnapshotResponse": t.SnapshotContent,
    "contextd.v1.RestoreSnapshotResponse": t.Restored,
    "contextd.v1.ApiKey": t.ApiKey,
    "contextd.v1.SearchHit": t.SearchHit,
    "contextd.v1.TextSpan": t.TextSpan,
    "contextd.v1.SearchMessagesResponse": t.SearchResults,
}

# Proto enum -> the client's enum; members are matched by name without the proto prefix.
_ENUMS: dict[str, tuple[type[enum.Enum], str]] = {
    "contextd.v1.Role": (t.Role, "ROLE_"),
    "contextd.v1.StatusKind": (t.StatusKind, "STATUS_KIND_"),
    "contextd.v1.ContextFormat": (t.ContextFormat, "CONTEXT_FORMAT_"),
    "contextd.v1.KeyRole": (t.KeyRole, "KEY_ROLE_"),
}


def from_pb(cls: type[R], message: ProtoMessage) -> R:
    """`message` as the dataclass `cls`, field by field (see the module docstring)."""
    descriptor: Descriptor = message.DESCRIPTOR  # type: ignore[assignment]  # upb's is one too
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        proto_field = descriptor.fields_by_name.get(f.name)
        if proto_field is None:
            raise TypeError(f"{descriptor.full_name} has no field {f.name!r} for {cls.__name__}")
        values[f.name] = _field(message, proto_field)
    return cls(**values)


def _field(message: ProtoMessage, f: FieldDescriptor) -> Any:
    value = getattr(message, f.name)
    if f.is_repeated:
        return tuple(_value(f, item) for item in value)
    if f.has_presence and not message.HasField(f.name):
        if f.message_type is not None and f.message_type.full_name in _RESULTS:
            return from_pb(_RESULTS[f.message_type.full_name], value)  # unset -> defaults
        return None
    return _value(f, value)


def _value(f: FieldDescriptor, value: Any) -> Any:
    if f.enum_type is not None:
        return enum_of(f.enum_type, value)
    if f.message_type is None:
        return value
    name = f.message_type.full_name
    if name == "google.protobuf.Timestamp":
        return time_of(value)
    if name == "google.protobuf.Duration":
        return timedelta(microseconds=value.ToMicroseconds())
    if name == "contextd.v1.Scope":
        return scope_of(value)
    return from_pb(_RESULTS[name], value)


def enum_of(descriptor: EnumDescriptor, number: int) -> enum.Enum:
    """The client's member for a proto enum number (UNSPECIFIED for one it does not know,
    e.g. a value a newer server added)."""
    cls, prefix = _ENUMS[descriptor.full_name]
    value = descriptor.values_by_number.get(number)
    name = value.name.removeprefix(prefix) if value is not None else "UNSPECIFIED"
    return cls[name] if name in cls.__members__ else cls["UNSPECIFIED"]


def time_of(ts: timestamp_pb2.Timestamp) -> datetime:
    return _EPOCH + timedelta(microseconds=ts.ToMicroseconds())


def scope_of(scope: pb.Scope) -> t.Scope | None:
    kind = scope.WhichOneof("kind")
    if kind == "key":
        return t.KeyScope(scope.key)
    if kind == "channel":
        c = scope.channel
        return t.ChannelScope(c.guild_id, c.channel_id, c.user_id)
    if kind == "direct_message":
        return t.DirectMessageScope(scope.direct_message.user_id)
    return None


# Requests.


def scope_pb(scope: t.Scope | str | None) -> pb.Scope:
    """A typed scope for the wire: None is the default scope, a str a key scope."""
    if scope is None:
        return pb.Scope()
    if isinstance(scope, str):
        return pb.Scope(key=scope)
    if isinstance(scope, t.KeyScope):
        return pb.Scope(key=scope.key)
    if isinstance(scope, t.ChannelScope):
        return pb.Scope(
            channel=pb.ChannelScope(
                guild_id=scope.guild_id, channel_id=scope.channel_id, user_id=scope.user_id
            )
        )
    if isinstance(scope, t.DirectMessageScope):
        return pb.Scope(direct_message=pb.DirectMessageScope(user_id=scope.user_id))
    raise TypeError(f"not a scope: {type(scope).__name__}")


def timestamp_pb(when: datetime) -> timestamp_pb2.Timestamp:
    """A Timestamp of an aware datetime (a naive one is refused: its zone is unknown)."""
    if when.tzinfo is None:
        raise ValueError("datetimes sent to contextd must be timezone-aware (e.g. UTC)")
    ts = timestamp_pb2.Timestamp()
    ts.FromMicroseconds((when - _EPOCH) // timedelta(microseconds=1))
    return ts


def duration_pb(span: timedelta) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMicroseconds(span // timedelta(microseconds=1))
    return d


def retention_pb(policy: t.RetentionPolicy) -> pb.RetentionPolicy:
    """The policy as sent; a ttl of None stays unset (never expires)."""
    sent = pb.RetentionPolicy(
        max_messages=policy.max_messages, delete_overflow=policy.delete_overflow
    )
    if policy.ttl is not None:
        sent.ttl.CopyFrom(duration_pb(policy.ttl))
    return sent


def overrides_pb(overrides: Sequence[t.ScopeRetention]) -> list[pb.ScopeRetention]:
    return [
        pb.ScopeRetention(scope_pattern=o.scope_pattern, policy=retention_pb(o.policy))
        for o in overrides
    ]


def options_pb(options: t.BuildOptions | None) -> pb.BuildOptions:
    """Only the options that are set; the rest stay unset (the agent's, then the server's)."""
    if options is None:
        return pb.BuildOptions()
    fields = dataclasses.asdict(options)
    return pb.BuildOptions(**{k: v for k, v in fields.items() if v is not None})


def option_paths(options: t.BuildOptions) -> list[str]:
    """Update-mask paths of the options that are set ("build_options.<option>")."""
    return [
        f"build_options.{f.name}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) is not None
    ]


def docs_pb(docs: Sequence[t.AgentDoc] | Mapping[str, str]) -> list[pb.AgentDoc]:
    pairs = docs.items() if isinstance(docs, Mapping) else ((d.name, d.content) for d in docs)
    return [pb.AgentDoc(name=name, content=content) for name, content in pairs]


_ROLES = {member: getattr(pb, f"ROLE_{member.name}") for member in t.Role}


def message_pb(message: t.NewMessage) -> pb.Message:
    role = message.role if isinstance(message.role, t.Role) else t.Role(message.role)
    out = pb.Message(
        role=_ROLES[role],
        content=message.content,
        tool_calls=message.tool_calls_json(),
        tool_call_id=message.tool_call_id,
        external_id=message.external_id,
        metadata=message.metadata_json(),
    )
    if message.source_time is not None:
        out.source_time.CopyFrom(timestamp_pb(message.source_time))
    return out


def enum_pb(member: enum.Enum, prefix: str) -> str:
    """The proto name of a client enum member (ContextFormat.TEXT, "CONTEXT_FORMAT_" ->
    "CONTEXT_FORMAT_TEXT"), which protobuf's constructors take for the number."""
    return prefix + member.name
