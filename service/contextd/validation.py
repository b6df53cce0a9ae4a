"""Input rules, checked before anything reaches the store, so a rejected batch writes nothing."""

from __future__ import annotations

import json
import re

from contextd.context_types import parse_tool_calls
from contextd.errors import InvalidArgument, ResourceExhausted

MAX_NAME_CHARS = 128
MAX_DOC_NAME_CHARS = 256
MAX_EXTERNAL_ID_CHARS = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/\-]*")
# Error messages travel in gRPC trailers, which clients cap (8 KiB by default in Python):
# echoing a whole bad value could turn a clear error into a metadata-size failure.
QUOTE_CHARS = 40


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """A short, printable rendering of a client's value for an error message."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def check_name(value: str, what: str, *, allow_empty: bool = False) -> str:
    """Agent, scope and thread names: short, printable, safe in logs and URLs."""
    if not value:
        if allow_empty:
            return value
        raise InvalidArgument(f"{what} must not be empty", field=what)
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(
            f"{what} is {len(value)} characters long; the limit is {MAX_NAME_CHARS}", field=what
        )
    if not _NAME.fullmatch(value):
        raise InvalidArgument(
            f"{what} {quote(value)} may only contain letters, digits and . _ : @ / - "
            "and must start with a letter or a digit",
            field=what,
        )
    return value


def check_json(value: str, what: str, *, object_only: bool = False) -> str:
    """Empty, or well-formed JSON (an object when `object_only`)."""
    if not value:
        return value
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}", field=what) from exc
    if object_only and not isinstance(parsed, dict):
        raise InvalidArgument(
            f"{what} must be a JSON object, got {type(parsed).__name__}", field=what
        )
    return value


def check_size(size_bytes: int, limit_bytes: int, what: str) -> None:
    if size_bytes > limit_bytes:
        raise ResourceExhausted(
            f"{what} is {size_bytes:,} bytes; the limit is {limit_bytes:,} bytes",
            reason="MESSAGE_TOO_LARGE",
            field=what,
        )


def tool_call_ids(tool_calls: str, what: str) -> tuple[str, ...]:
    """The ids of the calls a message's tool_calls JSON declares; INVALID_ARGUMENT when it
    is not JSON. What counts as a call is :func:`parse_tool_calls`'s to say, so the tool
    groups the store records are the ones builds and renderings see."""
    check_json(tool_calls, what)
    return tuple(call.id for call in parse_tool_calls(tool_calls) if call.id)
