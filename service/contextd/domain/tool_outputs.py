"""Tool outputs kept aside: their pointers, keys, filters, kinds and input rules.

A tool output is a tool's result stored out of the message history and addressed by a
light pointer (everything but the result). Pointers are what lists and selections
return; the result is loaded lazily, read in parts or searched (app/tool_outputs.py).
No I/O here.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import re
import secrets
from dataclasses import dataclass

from contextd.domain.errors import InvalidArgument, NotFound, ResourceExhausted
from contextd.domain.limits import (
    MAX_GET_TOOL_OUTPUT_IDS,
    MAX_QUERY_BYTES,
    MAX_TOOL_ARGS_BYTES,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOL_NAME_CHARS,
    MAX_TOOL_TAG_CHARS,
)
from contextd.domain.validation import check_name, check_text, quote


class ToolOutputKind(enum.IntEnum):
    """What a result holds (the proto's ToolOutputKind values)."""

    TEXT = 1
    JSON = 2
    BINARY = 3


@dataclass(frozen=True, slots=True)
class NewToolOutput:
    """A tool output to store, apart from its result (checked by `check_new_output`)."""

    tenant: str
    agent: str
    scope: str
    thread: str
    tool_name: str
    tool_description: str
    args_json: str
    task_id: str | None = None
    query_id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolOutputPointer:
    """A stored output without its result."""

    id: str
    key: str
    tenant: str
    agent: str
    scope: str
    thread: str
    tool_name: str
    tool_description: str
    args_json: str
    task_id: str | None
    query_id: str | None
    size_bytes: int
    token_count: int
    create_time_us: int
    kind: ToolOutputKind
    stored_inline: bool
    stored_bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class StoredBody:
    """How a result is stored: inline bytes, or chunks (their stored lengths, in order;
    every chunk but the last holds TOOL_OUTPUT_CHUNK_BYTES of the result)."""

    inline: bytes | None
    chunk_lengths: tuple[int, ...]
    compressed: bool


@dataclass(frozen=True, slots=True)
class ToolOutputFilter:
    """Which outputs of one agent in one scope a call covers (None: any).

    `expired_through_us` (0: none) leaves out what the retention sweep may delete: an
    output stored at or before that time whose context's newest message is at or before
    it too. Reads set it to now - ttl, so an expired context's outputs vanish from every
    read at the moment its messages do, not when the sweep gets to them."""

    tenant: str
    agent: str
    scope: str
    thread: str | None = None
    task_id: str | None = None
    query_id: str | None = None
    tool_name: str | None = None
    expired_through_us: int = 0


_TOOL_NAME = re.compile(r"[A-Za-z0-9._:-]+")
_OUTPUT_ID = re.compile(r"to_[0-9a-f]{20}")
_TAG = re.compile(r"[\x20-\x7e]+")
# Numbers outputs stored by this process, as the key form asks (`{counter}`).
_COUNTER = itertools.count()


def new_output_id() -> str:
    return f"to_{secrets.token_hex(10)}"


def args_hash(args_json: str) -> str:
    """First 6 hex digits of the SHA-256 of the canonical args JSON."""
    return hashlib.sha256(args_json.encode()).hexdigest()[:6]


def output_key(tool_name: str, args_json: str, time_us: int) -> str:
    """The readable key `{toolName}_{argsHash}_{timestamp}_{counter}_{random}`."""
    random = "".join(secrets.choice("0123456789abcdefghijklmnopqrstuvwxyz") for _ in range(4))
    return f"{tool_name}_{args_hash(args_json)}_{time_us // 1000}_{next(_COUNTER)}_{random}"


def hash_query(query: str) -> str:
    """The deterministic query id of a query text: "q_" and 16 hex digits of SHA-256."""
    check_query(query)
    return "q_" + hashlib.sha256(query.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def check_query(query: str, field: str = "query") -> str:
    if not query.strip():
        raise InvalidArgument(f"{field} must not be empty", field=field)
    if len(query) > MAX_QUERY_BYTES or len(query.encode("utf-8", "replace")) > MAX_QUERY_BYTES:
        raise InvalidArgument(f"{field} is over {MAX_QUERY_BYTES:,} bytes", field=field)
    return query


def check_output_id(output_id: str, field: str = "id") -> str:
    if not _OUTPUT_ID.fullmatch(output_id):
        raise InvalidArgument(
            f"{field} {quote(output_id[:40])} is not a tool output id (to_ and 20 hex digits)",
            field=field,
        )
    return output_id


def check_output_ids(ids: list[str]) -> list[str]:
    if not ids:
        raise InvalidArgument("ids must name at least one output", field="ids")
    if len(ids) > MAX_GET_TOOL_OUTPUT_IDS:
        raise InvalidArgument(
            f"ids names {len(ids)} outputs; the limit is {MAX_GET_TOOL_OUTPUT_IDS}", field="ids"
        )
    for i, output_id in enumerate(ids):
        check_output_id(output_id, f"ids[{i}]")
    return list(dict.fromkeys(ids))


def _check_tag(value: str | None, field: str) -> str | None:
    if value is None:
        return None
    if len(value) > MAX_TOOL_TAG_CHARS or not _TAG.fullmatch(value):
        raise InvalidArgument(
            f"{field} must be 1 to {MAX_TOOL_TAG_CHARS} printable ASCII characters", field=field
        )
    return value


def check_tool_name(name: str, field: str) -> str:
    if not name or len(name) > MAX_TOOL_NAME_CHARS or not _TOOL_NAME.fullmatch(name):
        raise InvalidArgument(
            f"{field} must be 1 to {MAX_TOOL_NAME_CHARS} characters from [A-Za-z0-9._:-]",
            field=field,
        )
    return name


def canonical_args(args_json: str, field: str) -> str:
    """The args as canonical JSON (sorted keys, no spaces): equal args, equal hash."""
    if len(args_json) > MAX_TOOL_ARGS_BYTES or len(args_json.encode()) > MAX_TOOL_ARGS_BYTES:
        raise ResourceExhausted(
            f"{field} is over {MAX_TOOL_ARGS_BYTES:,} bytes", reason="FIELD_TOO_LARGE", field=field
        )
    if not args_json.strip():
        return "{}"
    try:
        parsed = json.loads(args_json)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{field} is not valid JSON", field=field) from exc
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{field} must be a JSON object", field=field)
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def check_new_output(output: NewToolOutput, prefix: str = "output") -> NewToolOutput:
    """The output with its fields checked and its args canonical; INVALID_ARGUMENT naming
    the first bad field."""
    check_name(output.agent, f"{prefix}.agent")
    check_name(output.thread, f"{prefix}.thread")
    check_tool_name(output.tool_name, f"{prefix}.tool_name")
    if len(output.tool_description) > MAX_TOOL_DESCRIPTION_CHARS:
        raise InvalidArgument(
            f"{prefix}.tool_description is over {MAX_TOOL_DESCRIPTION_CHARS:,} characters",
            field=f"{prefix}.tool_description",
        )
    check_text(output.tool_description, f"{prefix}.tool_description")
    return NewToolOutput(
        tenant=output.tenant,
        agent=output.agent,
        scope=output.scope,
        thread=output.thread,
        tool_name=output.tool_name,
        tool_description=output.tool_description,
        args_json=canonical_args(output.args_json, f"{prefix}.args_json"),
        task_id=_check_tag(output.task_id, f"{prefix}.task_id"),
        query_id=_check_tag(output.query_id, f"{prefix}.query_id"),
    )


def check_filter(where: ToolOutputFilter, prefix: str = "filter") -> ToolOutputFilter:
    check_name(where.agent, f"{prefix}.agent")
    if where.thread is not None:
        check_name(where.thread, f"{prefix}.thread")
    if where.tool_name is not None:
        check_tool_name(where.tool_name, f"{prefix}.tool_name")
    _check_tag(where.task_id, f"{prefix}.task_id")
    _check_tag(where.query_id, f"{prefix}.query_id")
    return where


def tool_output_not_found(output_id: str) -> NotFound:
    return NotFound(
        f"no tool output {output_id!r} in this agent and scope", reason="TOOL_OUTPUT_NOT_FOUND"
    )


def too_large(size: int, limit: int, field: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"the result is over {limit:,} bytes (at least {size:,})"
        + ("; send it with StreamPutToolOutput" if field == "result" else ""),
        reason="TOOL_OUTPUT_TOO_LARGE",
        field=field,
    )


class KindSniffer:
    """Classifies a result from its pieces without keeping them: binary-like when it is
    not UTF-8 or its first 64 KiB hold a NUL byte; JSON when it is text that starts with
    `{` or `[` and ends with `}` or `]` (and, when it was seen whole, parses); else text."""

    _HEAD = 64 << 10

    def __init__(self) -> None:
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._seen = 0
        self._binary = False
        self._first = b""
        self._last = b""

    def feed(self, data: bytes) -> None:
        if not data:
            return
        if self._seen < self._HEAD and b"\0" in data[: self._HEAD - self._seen]:
            self._binary = True
        self._seen += len(data)
        if not self._binary:
            try:
                self._decoder.decode(data)
            except UnicodeDecodeError:
                self._binary = True
        if not self._first:
            self._first = data.lstrip()[:1]
        stripped = data.rstrip()
        if stripped:
            self._last = stripped[-1:]

    def kind(self, whole: bytes | None = None) -> ToolOutputKind:
        if not self._binary:
            try:
                self._decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                self._binary = True
        if self._binary:
            return ToolOutputKind.BINARY
        shaped = (self._first, self._last) in ((b"{", b"}"), (b"[", b"]"))
        if shaped and whole is not None:
            try:
                json.loads(whole)
            except (ValueError, RecursionError):
                return ToolOutputKind.TEXT
        return ToolOutputKind.JSON if shaped else ToolOutputKind.TEXT


# ------------------------------------------------------------ handles in messages

# The metadata key under which a message records the tool output holding its whole
# result: {"id": "to_...", "size_bytes": N}.
METADATA_KEY = "contextd_tool_output"


def with_tool_output(metadata: str, output_id: str, size_bytes: int | None, index: int) -> str:
    """A message's metadata (a JSON object, or empty) with its tool-output handle set."""
    field = f"messages[{index}].tool_output_id"
    check_output_id(output_id, field)
    try:
        parsed = json.loads(metadata) if metadata.strip() else {}
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidArgument(
            f"messages[{index}].metadata must be a JSON object", field=f"messages[{index}].metadata"
        )
    handle: dict[str, object] = {"id": output_id}
    if size_bytes is not None:
        handle["size_bytes"] = size_bytes
    parsed[METADATA_KEY] = handle
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)


def tool_output_handle(metadata: str) -> tuple[str, int | None] | None:
    """The (id, size) a message's metadata records, if any."""
    if METADATA_KEY not in metadata:
        return None
    try:
        handle = json.loads(metadata).get(METADATA_KEY)
    except (ValueError, RecursionError, AttributeError):
        return None
    if not isinstance(handle, dict) or not isinstance(handle.get("id"), str):
        return None
    size = handle.get("size_bytes")
    return handle["id"], size if isinstance(size, int) else None


def preview_text(output_id: str, head: str, tail: str, head_bytes: int, size: int) -> str:
    """What a TOOL_RESULT kept aside shows: its head, the handle, its tail."""
    elided = size - head_bytes - len(tail.encode("utf-8", "replace"))
    return (
        f"{head}\n\n[... {elided:,} of {size:,} bytes not shown. The whole result is tool "
        f'output {output_id}: ReadToolOutput(id="{output_id}", offset={head_bytes}) reads on '
        f"from here; GrepToolOutput searches it.]\n\n{tail}"
    )
