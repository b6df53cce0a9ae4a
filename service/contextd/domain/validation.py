"""Input rules, checked before anything reaches the store, so a rejected batch writes nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from contextd.domain.context import parse_tool_calls
from contextd.domain.errors import InvalidArgument, ResourceExhausted

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


def check_text(value: str, field: str) -> str:
    """Free text without the NUL character: PostgreSQL cannot store one in a text
    column, so every engine refuses it alike (a JSON text may spell it \\u0000)."""
    if "\x00" in value:
        raise InvalidArgument(f"{field} must not contain the NUL character (U+0000)", field=field)
    return value


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


# JSON nested deeper than this is rejected: Python's parser (and every renderer after it)
# recurses per level, so a client's 100,000 brackets would otherwise surface as a
# RecursionError deep inside a build. Real tool calls and metadata nest a handful of levels.
MAX_JSON_DEPTH = 64


def _first_flaw(parsed: object, check_depth: bool, check_text: bool) -> str | None:
    """What is wrong with a parsed document, or None: containers nested deeper than
    MAX_JSON_DEPTH, or a string that is not valid Unicode. Iterative, so no recursion."""
    stack: list[tuple[object, int]] = [(parsed, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if check_text and not _encodable(node):
                return "holds a string that is not valid Unicode (a lone surrogate escape)"
            continue
        if isinstance(node, dict):
            children: Iterable[object] = (*node.keys(), *node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        if check_depth and depth > MAX_JSON_DEPTH:
            return f"nests more than {MAX_JSON_DEPTH} levels deep"
        stack.extend((child, depth + 1) for child in children)
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_json(value: str, what: str, *, object_only: bool = False) -> object:
    """Empty, or well-formed JSON (an object when `object_only`) nested at most
    MAX_JSON_DEPTH levels whose strings are valid Unicode; returns the parsed value."""
    if not value:
        return None
    try:
        parsed = json.loads(value)
    except RecursionError as exc:
        raise InvalidArgument(
            f"{what} nests more than {MAX_JSON_DEPTH} levels deep", field=what
        ) from exc
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}", field=what) from exc
    if object_only and not isinstance(parsed, dict):
        raise InvalidArgument(
            f"{what} must be a JSON object, got {type(parsed).__name__}", field=what
        )
    # The text came as valid UTF-8, so only a \\u escape can spell a lone surrogate, and
    # the bracket count bounds the depth from above: most documents skip the walk.
    check_depth = value.count("[") + value.count("{") > MAX_JSON_DEPTH
    check_text = "\\u" in value
    if check_depth or check_text:
        flaw = _first_flaw(parsed, check_depth, check_text)
        if flaw:
            raise InvalidArgument(f"{what} {flaw}", field=what)
    return parsed


def check_size(size_bytes: int, limit_bytes: int, what: str) -> None:
    if size_bytes > limit_bytes:
        raise ResourceExhausted(
            f"{what} is {size_bytes:,} bytes; the limit is {limit_bytes:,} bytes",
            reason="MESSAGE_TOO_LARGE",
            field=what,
        )


def tool_call_ids(tool_calls: str, what: str) -> tuple[str, ...]:
    """The ids of the calls a message's tool_calls JSON declares; INVALID_ARGUMENT when it
    is not JSON (or an OpenAI call's `arguments` text is JSON too deep or not valid
    Unicode). What counts as a call is :func:`parse_tool_calls`'s to say, so the tool
    groups the store records are the ones builds and renderings see."""
    check_json(tool_calls, what)
    calls = parse_tool_calls(tool_calls)
    for i, call in enumerate(calls):
        function = call.raw.get("function")
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str) and arguments.strip().startswith(("{", "[")):
            try:
                check_json(arguments, f"{what}[{i}].function.arguments")
            except InvalidArgument as exc:
                # Arguments that are not JSON are rendered as text, which is fine; only
                # JSON that later code could not handle is refused.
                if "not valid JSON" not in exc.message:
                    raise
    return tuple(call.id for call in calls if call.id)
