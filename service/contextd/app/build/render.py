"""Render an :class:`~contextd.domain.context.AssembledContext` for an LLM API.

Three forms: Anthropic Messages (:func:`to_anthropic`), OpenAI Chat Completions
(:func:`to_openai`) and plain text (:func:`to_text`). The system prompt and the docs form
the system part; the status preamble, which says "as of <time>" and so changes between
builds, comes after the history, right before the new user message. Everything before it
is then byte-identical from one build to the next while the history only grows, which is
what the providers' prompt caches need.

Both APIs reject a tool result that does not directly answer a call: Anthropic wants the
``tool_result`` blocks in the user message right after the assistant message holding the
``tool_use`` (results first in it), OpenAI wants the ``tool`` messages right after the
assistant message with ``tool_calls``. A stored window can interleave (the user writes
while a tool runs), so rendering first repairs pairs (orphans become text, unanswered
calls are removed) and then moves each result to just after its call. The assembled
context itself keeps the stored order; only the wire form is reordered.

``tool_calls`` JSON is read by :func:`contextd.domain.context.parse_tool_calls`: Anthropic
style ``[{"id","name","input"}]`` and OpenAI style
``[{"id","type":"function","function":{"name","arguments"}}]`` are both accepted and
each is written out in the target API's own shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contextd import core
from contextd.app.build.assembly import render_docs
from contextd.app.build.compaction import repair_tool_pairs, trim_columns
from contextd.domain.context import AssembledContext, HistoryItem, parse_tool_calls
from contextd.domain.model import Role

EMPTY_TEXT = "(empty)"
"""Stands in for empty text: the Messages API rejects empty text blocks."""

CONTINUATION = "[The conversation continues from earlier messages.]"
"""Opens a message list that would otherwise start with an assistant turn."""

JsonObject = dict[str, Any]


def system_text(ctx: AssembledContext) -> str:
    """System prompt and docs, blank-line separated, empty parts skipped: the stable
    prefix (the status preamble goes after the history)."""
    parts = [ctx.system_prompt, render_docs(ctx.docs)]
    return "\n\n".join(p for p in parts if p)


def wire_order(history: Sequence[HistoryItem]) -> list[HistoryItem]:
    """The history made pair-complete, each call's results directly after it."""
    items, _ = repair_tool_pairs(history)
    roles, groups = trim_columns(items)
    results: dict[int, list[HistoryItem]] = {}
    for i, item in enumerate(items):
        if roles[i] == core.ROLE_TOOL_RESULT and groups[i] >= 0:
            results.setdefault(groups[i], []).append(item)
    out: list[HistoryItem] = []
    for i, item in enumerate(items):
        if roles[i] == core.ROLE_TOOL_RESULT and groups[i] >= 0:
            continue
        out.append(item)
        if roles[i] == core.ROLE_TOOL_USE:
            out.extend(results.get(i, []))
    return out


def to_anthropic(ctx: AssembledContext) -> JsonObject:
    """``{"system": str, "messages": [...]}`` for the Messages API.

    Roles alternate (consecutive items of a role merge into one message of several
    blocks), the first message is a user message, and every ``tool_result`` answers a
    ``tool_use`` of the assistant message just before it.
    """
    messages: list[JsonObject] = []

    def push(role: str, blocks: list[JsonObject]) -> None:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": list(blocks)})

    for item in wire_order(ctx.history):
        if item.role is Role.USER:
            push("user", [_text(item.content)])
        elif item.role is Role.TOOL_RESULT:
            push(
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": item.tool_call_id,
                        "content": item.content or EMPTY_TEXT,
                    }
                ],
            )
        else:
            blocks: list[JsonObject] = [_text(item.content)] if item.content else []
            blocks.extend(
                {"type": "tool_use", "id": c.id, "name": c.name, "input": c.input_object}
                for c in parse_tool_calls(item.tool_calls)
            )
            push("assistant", blocks or [_text("")])
    if ctx.status:
        push("user", [_text(ctx.status)])  # opens (or ends) the last user turn
    if ctx.new_message:
        push("user", [_text(ctx.new_message)])
    _check_anthropic_pairs(messages)
    for message in messages:
        if message["role"] == "user":  # tool_result blocks must come first
            blocks = message["content"]
            message["content"] = [b for b in blocks if b["type"] == "tool_result"] + [
                b for b in blocks if b["type"] != "tool_result"
            ]
    if messages and messages[0]["role"] != "user":
        messages.insert(0, {"role": "user", "content": [_text(CONTINUATION)]})
    return {"system": system_text(ctx), "messages": messages}


def _check_anthropic_pairs(messages: list[JsonObject]) -> None:
    """Defensive: turn into text any tool block that is not in an answered pair. After
    :func:`wire_order` nothing should change; this keeps the output valid even so."""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        answered = {
            b["tool_use_id"]
            for b in (nxt["content"] if nxt is not None else [])
            if b["type"] == "tool_result"
        }
        message["content"] = [
            _text(f"[called {b['name']} with {b['input']}]")
            if b["type"] == "tool_use" and b["id"] not in answered
            else b
            for b in message["content"]
        ]
    for i, message in enumerate(messages):
        if message["role"] != "user":
            continue
        prev = messages[i - 1] if i > 0 else None
        issued = {
            b["id"]
            for b in (prev["content"] if prev is not None else [])
            if b["type"] == "tool_use"
        }
        message["content"] = [
            _text(f"[tool output]\n{b['content']}")
            if b["type"] == "tool_result" and b["tool_use_id"] not in issued
            else b
            for b in message["content"]
        ]


def to_openai(ctx: AssembledContext) -> list[JsonObject]:
    """The ``messages`` list for Chat Completions: one system message, then the history
    (calls as ``tool_calls`` of assistant messages, results as ``tool`` messages right
    after them), then the new user message."""
    out: list[JsonObject] = []
    system = system_text(ctx)
    if system:
        out.append({"role": "system", "content": system})
    for item in wire_order(ctx.history):
        if item.role is Role.USER:
            out.append({"role": "user", "content": item.content})
        elif item.role is Role.TOOL_RESULT:
            out.append({"role": "tool", "tool_call_id": item.tool_call_id, "content": item.content})
        else:
            calls = parse_tool_calls(item.tool_calls)
            message: JsonObject = {"role": "assistant", "content": item.content or None}
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments_json},
                    }
                    for c in calls
                ]
            elif message["content"] is None:
                message["content"] = ""
            out.append(message)
    if ctx.status:
        out.append({"role": "user", "content": ctx.status})
    if ctx.new_message:
        out.append({"role": "user", "content": ctx.new_message})
    return out


def to_text(ctx: AssembledContext, include_system: bool = True) -> str:
    """A ``"User: ...\\nAssistant: ..."`` transcript, for models or logs that take
    one string. Calls and results are written as text lines."""
    lines: list[str] = []
    system = system_text(ctx)
    if include_system and system:
        lines.append(f"System: {system}")
    names: dict[str, str] = {}
    for item in wire_order(ctx.history):
        if item.role is Role.USER:
            lines.append(f"User: {item.content}")
        elif item.role is Role.TOOL_RESULT:
            lines.append(f"Tool ({names.get(item.tool_call_id, 'tool')}): {item.content}")
        else:
            if item.content:
                lines.append(f"Assistant: {item.content}")
            for call in parse_tool_calls(item.tool_calls):
                names[call.id] = call.name
                lines.append(f"Assistant: [calls {call.name}({call.arguments_json})]")
    if ctx.status:
        lines.append(ctx.status)
    if ctx.new_message:
        lines.append(f"User: {ctx.new_message}")
    return "\n".join(lines)


def _text(text: str) -> JsonObject:
    return {"type": "text", "text": text or EMPTY_TEXT}
