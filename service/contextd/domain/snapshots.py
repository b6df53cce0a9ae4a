"""Snapshots: a saved cut of a rolling window, and the document that holds it.

A snapshot is read in one read transaction (so it is a consistent cut: every thread's
part is a prefix of that thread's window, and no append is in it half), then written as
one self-describing JSON document beside a row of metadata. The metadata answers lists
without opening documents; the document is what GetSnapshot (full view) and
RestoreSnapshot read, and it is checked against the metadata on every read, so a missing,
corrupt or swapped document is reported as DATA_LOSS instead of being restored wrongly.
Pure code: the engines store the bytes.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from contextd.domain.errors import DataLoss, InvalidArgument, NotFound
from contextd.domain.model import Agent, AgentDoc, BuildOverrides, Role, StoredMessage
from contextd.domain.validation import check_text, quote

DOCUMENT_FORMAT = "contextd.snapshot/1"
SUMMARY_FAILED = "(summary generation failed)"
MAX_DESCRIPTION_CHARS = 1_000
# Ids are issued as 16 lowercase hex characters; anything of this shape is looked up
# (and is NOT_FOUND when unknown), anything else is INVALID_ARGUMENT.
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ROLES = {role.name.lower(): role for role in Role}


def new_snapshot_id() -> str:
    """A fresh id: 64 random bits, so ids never collide in practice and say nothing."""
    return secrets.token_hex(8)


def check_snapshot_id(value: str, field: str = "id") -> str:
    if not value:
        raise InvalidArgument(f"{field} must not be empty", field=field)
    if not _ID.fullmatch(value):
        raise InvalidArgument(
            f"{field} {quote(value)} is not a snapshot id (1 to 64 letters, digits, _ or -)",
            field=field,
        )
    return value


def check_description(value: str) -> str:
    check_text(value, "description")
    if len(value) > MAX_DESCRIPTION_CHARS:
        raise InvalidArgument(
            f"description is {len(value):,} characters long; the limit is "
            f"{MAX_DESCRIPTION_CHARS:,}",
            field="description",
        )
    return value


def message_size(m: StoredMessage) -> int:
    """What the snapshot byte limit counts of a message: content, tool_calls and metadata
    in UTF-8 bytes (as the append's message size limit does)."""
    text = m.content + m.tool_calls + m.metadata
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def utc_name(us: int) -> str:
    """A time as it appears in a document's file name: 20250102T030405.678901Z."""
    return datetime.fromtimestamp(us / 1_000_000, UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def _iso(us: int) -> str:
    seconds, micros = divmod(us, 1_000_000)
    stamp = datetime.fromtimestamp(seconds, UTC).replace(microsecond=micros)
    return stamp.isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A snapshot's metadata: what lists show, kept beside the document."""

    id: str
    tenant: str
    agent: str
    scope: str
    thread: str  # "" when every thread of the scope was saved
    create_time_us: int
    description: str
    summary: str
    message_count: int
    window_start_us: int | None  # the oldest saved message's commit time
    window_end_us: int | None  # the newest saved message's commit time
    threads: tuple[str, ...]
    size_bytes: int


@dataclass(frozen=True, slots=True)
class SnapshotContents:
    """What a snapshot holds: its messages (by (create_time, id)), the agent as it was,
    and the specifics ledger."""

    info: SnapshotInfo
    messages: tuple[StoredMessage, ...]
    agent: Agent
    specifics: tuple[str, ...]


def info_of(
    snapshot_id: str,
    agent: Agent,
    scope: str,
    thread: str,
    create_time_us: int,
    description: str,
    summary: str,
    messages: Sequence[StoredMessage],
) -> SnapshotInfo:
    return SnapshotInfo(
        id=snapshot_id,
        tenant=agent.tenant,
        agent=agent.name,
        scope=scope,
        thread=thread,
        create_time_us=create_time_us,
        description=description,
        summary=summary,
        message_count=len(messages),
        window_start_us=min((m.create_time_us for m in messages), default=None),
        window_end_us=max((m.create_time_us for m in messages), default=None),
        threads=tuple(sorted({m.thread for m in messages})),
        size_bytes=sum(message_size(m) for m in messages),
    )


# ----------------------------------------------------------------- the document


def _agent_json(agent: Agent) -> dict[str, Any]:
    return {
        "name": agent.name,
        "system_prompt": agent.system_prompt,
        "docs": [{"name": d.name, "content": d.content} for d in agent.docs],
        "rolling_window_us": agent.rolling_window_us,
        "model": agent.model,
        "build_options": agent.build_options.as_dict() if agent.build_options else {},
        "create_time_us": agent.create_time_us,
        "update_time_us": agent.update_time_us,
        "last_clear_time_us": agent.last_clear_time_us,
    }


def _message_json(m: StoredMessage) -> dict[str, Any]:
    return {
        "id": m.id,
        "thread": m.thread,
        "sequence": m.sequence,
        "role": m.role.name.lower(),
        "content": m.content,
        "tool_calls": m.tool_calls,
        "tool_call_id": m.tool_call_id,
        "external_id": m.external_id,
        "metadata": m.metadata,
        "create_time_us": m.create_time_us,
        "create_time": _iso(m.create_time_us),
        "source_time_us": m.source_time_us,
        "token_estimate": m.token_estimate,
        "token_count": m.token_count,
        "tokenizer": m.tokenizer,
        "restored_from_snapshot": m.restored_from,
    }


def encode_document(contents: SnapshotContents) -> bytes:
    """The document of a snapshot: one JSON object, readable without contextd."""
    info = contents.info
    document = {
        "format": DOCUMENT_FORMAT,
        "id": info.id,
        "tenant": info.tenant,
        "agent": info.agent,
        "scope": info.scope,
        "thread": info.thread,
        "create_time_us": info.create_time_us,
        "create_time": _iso(info.create_time_us),
        "description": info.description,
        "summary": info.summary,
        "message_count": info.message_count,
        "window_start_time_us": info.window_start_us,
        "window_end_time_us": info.window_end_us,
        "threads": list(info.threads),
        "size_bytes": info.size_bytes,
        "agent_settings": _agent_json(contents.agent),
        "specifics": list(contents.specifics),
        "messages": [_message_json(m) for m in contents.messages],
    }
    return json.dumps(document, ensure_ascii=False, indent=1).encode("utf-8")


_INT64 = (-(1 << 63), (1 << 63) - 1)
# The type of each build option, as BuildOverrides (and the proto) hold them.
_OPTION_KINDS: dict[str, tuple[type, ...]] = {
    "truncate": (bool,),
    "summarize": (bool,),
    "elide_tool_results": (bool,),
    "safety_margin": (float, int),
}


def _value(key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """`value` if it is of `kind` (a bool is no int here) and, for an int, within int64:
    a document edited by hand must not reach the wire as a value it cannot carry."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise TypeError(f"{key} is not of the right type")
    if not isinstance(value, kinds):
        raise TypeError(f"{key} is not of the right type")
    in_range = _INT64[0] <= value <= _INT64[1] if type(value) is int else True
    if not in_range:
        raise ValueError(f"{key} is out of range")
    return value


def _get(obj: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    return _value(key, obj[key], kind)


def _opt_int(obj: Any, key: str) -> int | None:
    value = obj[key]
    return None if value is None else int(_value(key, value, int))


def _options(raw: Any) -> BuildOverrides:
    """The build options of a document, each of its type (the int ones int32, as in the
    proto)."""
    if not isinstance(raw, dict):
        raise TypeError("build_options is not an object")
    options: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in BuildOverrides.__slots__:
            raise ValueError(f"build_options holds an unknown option {str(name)[:40]!r}")
        kinds = _OPTION_KINDS.get(name, (int,))
        options[name] = _value(name, value, kinds)
        if kinds == (int,) and not -(1 << 31) <= value < 1 << 31:
            raise ValueError(f"{name} is out of range")
    return BuildOverrides(**options)


def decode_document(raw: bytes, info: SnapshotInfo) -> SnapshotContents:
    """The snapshot `info` describes, from its document; DATA_LOSS when the document
    does not parse, lacks a field, or is another snapshot's."""
    unreadable = f"the document of snapshot {info.id!r} is corrupt"
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != DOCUMENT_FORMAT:
            raise ValueError("not a snapshot document")
        identity = (doc["id"], doc["tenant"], doc["agent"], doc["scope"])
        if identity != (info.id, info.tenant, info.agent, info.scope):
            raise DataLoss(
                f"the document stored for snapshot {info.id!r} belongs to another "
                "snapshot; restore it from a backup"
            )
        a = _get(doc, "agent_settings", dict)
        agent = Agent(
            tenant=info.tenant,
            name=_get(a, "name", str),
            system_prompt=_get(a, "system_prompt", str),
            docs=tuple(
                AgentDoc(_get(d, "name", str), _get(d, "content", str))
                for d in _get(a, "docs", list)
            ),
            rolling_window_us=_get(a, "rolling_window_us", int),
            create_time_us=_get(a, "create_time_us", int),
            update_time_us=_get(a, "update_time_us", int),
            last_clear_time_us=_get(a, "last_clear_time_us", int),
            model=_get(a, "model", str),
            build_options=_options(a["build_options"]),
        )
        messages = tuple(
            StoredMessage(
                id=_get(m, "id", int),
                tenant=info.tenant,
                agent=info.agent,
                scope=info.scope,
                thread=_get(m, "thread", str),
                role=_ROLES[_get(m, "role", str)],
                content=_get(m, "content", str),
                tool_calls=_get(m, "tool_calls", str),
                tool_call_id=_get(m, "tool_call_id", str),
                external_id=_get(m, "external_id", str),
                metadata=_get(m, "metadata", str),
                token_estimate=_get(m, "token_estimate", int),
                create_time_us=_get(m, "create_time_us", int),
                token_count=_get(m, "token_count", int),
                tokenizer=_get(m, "tokenizer", str),
                source_time_us=_opt_int(m, "source_time_us"),
                sequence=_get(m, "sequence", int),
                restored_from=_get(m, "restored_from_snapshot", str),
            )
            for m in _get(doc, "messages", list)
        )
        specifics = tuple(_get(doc, "specifics", list))
        if not all(isinstance(s, str) for s in specifics):
            raise TypeError("specifics are not strings")
        if len(messages) != info.message_count:
            raise ValueError(
                f"it holds {len(messages)} messages, the snapshot {info.message_count}"
            )
    except DataLoss:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise DataLoss(f"{unreadable} ({str(exc)[:120]}); restore it from a backup") from exc
    return SnapshotContents(info, messages, agent, specifics)


def snapshot_agent_gone(agent: str) -> NotFound:
    """A save whose agent was deleted while its summary was written."""
    return NotFound(
        f"agent {agent!r} was deleted while the snapshot was saved", reason="AGENT_NOT_FOUND"
    )


def snapshot_not_found(snapshot_id: str) -> NotFound:
    return NotFound(
        f"no snapshot {snapshot_id!r} in this scope of the agent", reason="SNAPSHOT_NOT_FOUND"
    )
