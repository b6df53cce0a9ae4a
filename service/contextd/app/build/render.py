"""Render an :class:`~contextd.domain.context.AssembledContext` for an LLM API, and count
what a rendering costs as its provider counts it.

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

No text block is empty or whitespace-only (the Messages API rejects both): such text is
sent as :data:`EMPTY_TEXT`, or left out where a message has other blocks.

``tool_calls`` JSON is read by :func:`contextd.domain.context.parse_tool_calls`: Anthropic
style ``[{"id","name","input"}]`` and OpenAI style
``[{"id","type":"function","function":{"name","arguments"}}]`` are both accepted and
each is written out in the target API's own shape.

Accounting (:class:`Framing`, :func:`rendered_tokens`)
    A budget bounds the request as its provider counts it, framing included:

    * ``openai``: every rendered message costs 3 tokens plus the tokens of each of its
      string values (role, content, tool_call_id, name; a ``name`` one more), its
      ``tool_calls`` the tokens of their JSON as rendered (``json.dumps`` of the list,
      ``ensure_ascii=False``); the reply priming costs 3 more. This is OpenAI's published
      chat accounting, exact under tiktoken for OpenAI models; the sum is additive over
      messages, so assembly can count it exactly item by item.
    * ``anthropic``: the model's count (for Claude, o200k_base times the registry's
      margin) of the whole request JSON as rendered (``{"system", "messages"}``).
    * ``text``: the model's count of the transcript.

    :class:`Framing` gives assembly each part's cost in advance (exact for ``openai``,
    an upper estimate for the others); :func:`rendered_tokens` counts a finished
    rendering, and assembly checks it before returning.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from contextd import core
from contextd.app.build.compaction import repair_tool_pairs, trim_columns
from contextd.app.build.memo import Memo
from contextd.domain.context import (
    AssembledContext,
    HistoryItem,
    TokenCounter,
    parse_tool_calls,
)
from contextd.domain.model import AgentDoc, Role

EMPTY_TEXT = "(empty)"
"""Stands in for empty or whitespace-only text: the Messages API rejects both."""

CONTINUATION = "[The conversation continues from earlier messages.]"
"""Opens a message list that would otherwise start with an assistant turn."""

FORMATS = ("anthropic", "openai", "text")

OPENAI_MESSAGE_TOKENS = 3
"""OpenAI's per-message framing (``<|start|>{role}\\n{content}<|end|>\\n``)."""
OPENAI_REPLY_TOKENS = 3
"""OpenAI's priming of the reply (``<|start|>assistant<|message|>``)."""
OPENAI_NAME_TOKENS = 1
"""What a message's ``name`` costs beyond its own tokens."""

JsonObject = dict[str, Any]


def render_docs(docs: Sequence[AgentDoc]) -> str:
    """The docs part as the model sees it; what is counted is exactly what is sent."""
    return "\n\n".join(f'<document name="{d.name}">\n{d.content}\n</document>' for d in docs)


def joined_system(system_prompt: str, docs_text: str) -> str:
    """System prompt and rendered docs, blank-line separated, empty parts skipped."""
    return "\n\n".join(p for p in (system_prompt, docs_text) if p)


def system_text(ctx: AssembledContext) -> str:
    """System prompt and docs: the stable prefix (the status goes after the history)."""
    return joined_system(ctx.system_prompt, render_docs(ctx.docs))


def wire_text(text: str) -> str:
    """``text``, or :data:`EMPTY_TEXT` when it is empty or whitespace only."""
    return text if text.strip() else EMPTY_TEXT


_ROLE_OF = operator.attrgetter("role")


def wire_order(history: Sequence[HistoryItem]) -> list[HistoryItem]:
    """The history made pair-complete, each call's results directly after it."""
    items, _ = repair_tool_pairs(history)
    if Role.TOOL_RESULT not in set(map(_ROLE_OF, items)):
        return items  # no result to move (a chat window): the order is the stored one
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


# ----------------------------------------------------------------- one item on the wire


def anthropic_message(item: HistoryItem) -> tuple[str, list[JsonObject]]:
    """The role and content blocks of one history item in the Messages API."""
    if item.role is Role.USER:
        return "user", [_text(item.content)]
    if item.role is Role.TOOL_RESULT:
        block = {
            "type": "tool_result",
            "tool_use_id": item.tool_call_id,
            "content": wire_text(item.content),
        }
        return "user", [block]
    blocks: list[JsonObject] = [_text(item.content)] if item.content.strip() else []
    blocks.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.input_object}
        for c in parse_tool_calls(item.tool_calls)
    )
    return "assistant", blocks or [_text("")]


def openai_message(item: HistoryItem) -> JsonObject:
    """One history item as a Chat Completions message."""
    if item.role is Role.USER:
        return {"role": "user", "content": wire_text(item.content)}
    if item.role is Role.TOOL_RESULT:
        return {
            "role": "tool",
            "tool_call_id": item.tool_call_id,
            "content": wire_text(item.content),
        }
    calls = parse_tool_calls(item.tool_calls)
    if not calls:
        return {"role": "assistant", "content": wire_text(item.content)}
    return {
        "role": "assistant",
        "content": item.content if item.content.strip() else None,
        "tool_calls": [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_json},
            }
            for c in calls
        ],
    }


def text_line(item: HistoryItem, names: dict[str, str]) -> list[str]:
    """The transcript lines of one history item (``names``: call id -> tool name)."""
    if item.role is Role.USER:
        return [f"User: {item.content}"]
    if item.role is Role.TOOL_RESULT:
        return [f"Tool ({names.get(item.tool_call_id, 'tool')}): {item.content}"]
    lines = [f"Assistant: {item.content}"] if item.content else []
    for call in parse_tool_calls(item.tool_calls):
        names[call.id] = call.name
        lines.append(f"Assistant: [calls {call.name}({call.arguments_json})]")
    return lines


# ----------------------------------------------------------------- renderings


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
        push(*anthropic_message(item))
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
    out.extend(openai_message(item) for item in wire_order(ctx.history))
    if ctx.status:
        out.append({"role": "user", "content": wire_text(ctx.status)})
    if ctx.new_message:
        out.append({"role": "user", "content": wire_text(ctx.new_message)})
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
        lines.extend(text_line(item, names))
    if ctx.status:
        lines.append(ctx.status)
    if ctx.new_message:
        lines.append(f"User: {ctx.new_message}")
    return "\n".join(lines)


def render(fmt: str, ctx: AssembledContext) -> str:
    """The rendering ``fmt`` (one of :data:`FORMATS`) as the text a response carries."""
    if fmt == "anthropic":
        return json.dumps(to_anthropic(ctx), ensure_ascii=False)
    if fmt == "openai":
        return json.dumps(to_openai(ctx), ensure_ascii=False)
    return to_text(ctx)


def _text(text: str) -> JsonObject:
    return {"type": "text", "text": wire_text(text)}


# ----------------------------------------------------------------- accounting


def openai_message_strings(message: JsonObject) -> tuple[list[str], int]:
    """The strings OpenAI's accounting counts in one rendered message, and its fixed
    tokens (3 per message, 1 more for a ``name``)."""
    strings: list[str] = []
    fixed = OPENAI_MESSAGE_TOKENS
    for key, value in message.items():
        if value is None:
            continue
        if isinstance(value, str):
            strings.append(value)
        else:  # tool_calls: their JSON as rendered
            strings.append(json.dumps(value, ensure_ascii=False))
        if key == "name":
            fixed += OPENAI_NAME_TOKENS
    return strings, fixed


def openai_tokens(messages: Sequence[JsonObject], count: TokenCounter) -> list[int]:
    """What each rendered message costs under OpenAI's chat accounting (without the
    reply priming, :data:`OPENAI_REPLY_TOKENS`)."""
    strings: list[str] = []
    spans: list[tuple[int, int, int]] = []
    for message in messages:
        values, fixed = openai_message_strings(message)
        spans.append((len(strings), len(strings) + len(values), fixed))
        strings.extend(values)
    counts = count(strings) if strings else []
    return [fixed + sum(counts[a:b]) for a, b, fixed in spans]


def openai_item_tokens(items: Sequence[HistoryItem], count: TokenCounter) -> list[int]:
    """``openai_tokens([openai_message(it) for it in items], count)`` without making the
    messages: a warm build counts every loaded message and its whole rendering this way,
    and a text message's strings are its role and its wire text. A message carrying tool
    calls goes through :func:`openai_message` (its calls' JSON is rendered)."""
    strings: list[str] = []
    spans: list[tuple[int, int, int]] = []
    for item in items:
        at = len(strings)
        role = item.role
        if role is Role.USER:
            strings += ("user", wire_text(item.content))
        elif role is Role.TOOL_RESULT:
            strings += ("tool", item.tool_call_id, wire_text(item.content))
        elif not item.tool_calls:
            strings += ("assistant", wire_text(item.content))
        else:
            values, fixed = openai_message_strings(openai_message(item))
            strings += values
            spans.append((at, len(strings), fixed))
            continue
        spans.append((at, len(strings), OPENAI_MESSAGE_TOKENS))
    counts = count(strings) if strings else []
    return [fixed + sum(counts[a:b]) for a, b, fixed in spans]


def rendered_tokens(
    fmt: str,
    ctx: AssembledContext,
    count: TokenCounter,
    item_tokens: Callable[[Sequence[HistoryItem]], list[int]] | None = None,
    cost_key: object = None,
) -> int:
    """The rendering ``fmt`` of ``ctx`` as its provider counts it (see the module
    docstring): what a budget bounds. For ``openai``, the messages :func:`to_openai` sends,
    counted as :func:`openai_tokens` counts them, without making them (see
    :func:`openai_item_tokens`; ``item_tokens``, when given, answers what it would).
    ``cost_key`` names what ``count`` is a function of (the model, see `Framing.key`):
    the messages around the history are then counted once per key and texts."""
    if fmt == "openai":
        system = system_text(ctx)
        status, new = ctx.status, ctx.new_message

        def around_cost(_key: object) -> int:
            around: list[JsonObject] = []
            if system:
                around.append({"role": "system", "content": system})
            if status:
                around.append({"role": "user", "content": wire_text(status)})
            if new:
                around.append({"role": "user", "content": wire_text(new)})
            return sum(openai_tokens(around, count))

        if cost_key is None:
            around_c = around_cost(None)
        else:
            around_c = _AROUND.get((cost_key, system, status, new), around_cost)
        items = wire_order(ctx.history)
        per_item = openai_item_tokens(items, count) if item_tokens is None else item_tokens(items)
        return around_c + sum(per_item) + OPENAI_REPLY_TOKENS
    return count([render(fmt, ctx)])[0]


# What the messages around the history cost in the OpenAI rendering, by the counter's key
# and their texts (system, status block, new message): every build of a thread with a
# status block counted the block's rendering again. Never stale: the key is the input.
_AROUND: Memo[Hashable, int] = Memo(256)


@dataclass(frozen=True, slots=True)
class PartCosts:
    """What the parts around the history cost in a rendering: ``base`` (the system part,
    the request's own framing and any placeholder the renderer may insert), the status
    preamble and the new user message (0 when absent)."""

    base: int
    status: int
    new_message: int


# The formats whose cost of an item is that of the item alone (the text transcript names
# a result's tool from the calls before it).
_PER_ITEM = frozenset({"openai", "anthropic"})


@dataclass(frozen=True, slots=True)
class Framing:
    """The costs of a context's parts as rendered in ``formats`` (each the most any of
    them charges), so that assembly fits the rendered request, not bare texts.

    ``count`` is the model's counter (margin included). With ``formats`` empty a part
    costs its bare text count, as without framing.
    """

    count: TokenCounter
    formats: tuple[str, ...] = ("openai",)
    # What ``count`` is a function of (the model), or None. With a key, an item's cost
    # in formats that cost each item alone is kept on the items that allow it
    # (`HistoryItem.cost_memo`), so a build of a hot thread counts only new messages.
    key: object = None

    @property
    def costs_each_item_alone(self) -> bool:
        """Whether an item's cost depends on the item alone (bare counts, or formats of
        `_PER_ITEM`), so that costs of a history's items hold in a longer one."""
        return _PER_ITEM.issuperset(self.formats)

    def items(self, items: Sequence[HistoryItem]) -> list[int]:
        """The cost of each history item as its own message(s) in every format."""
        return self._kept_costs(self.formats, items)

    def _kept_costs(self, formats: tuple[str, ...], items: Sequence[HistoryItem]) -> list[int]:
        """`_costs` in ``formats``, taken from the items' memos where they hold it under
        this framing's key, and kept there for the items that allow it. Equal to
        counting: a format of `_PER_ITEM` costs each item by itself alone, and ``count``
        is a function of the key."""
        if self.key is None or not formats or not _PER_ITEM.issuperset(formats):
            return self._costs(formats, items)
        key = (self.key, formats)
        # Two comprehensions, not one loop: a build after an append finds all but the
        # new message's costs here, and this is its most repeated loop.
        held = [
            memo[1] if memo is not None and memo[0] == key else None
            for memo in [item.cost_memo for item in items]
        ]
        missing = [i for i, cost in enumerate(held) if cost is None]
        out = cast(list[int], held)  # the missing ones are filled in below
        if missing:
            fresh = self._costs(formats, [items[i] for i in missing])
            for i, cost in zip(missing, fresh, strict=True):
                out[i] = cost
                item = items[i]
                if item.cost_memo is not None:  # an item that keeps its cost
                    object.__setattr__(item, "cost_memo", (key, cost, None))
        return out

    def _costs(self, formats: tuple[str, ...], items: Sequence[HistoryItem]) -> list[int]:
        if not items:
            return []
        costs = [0] * len(items)
        for fmt in formats:
            for i, c in enumerate(self._items(fmt, items)):
                costs[i] = max(costs[i], c)
        if not formats:
            return self.count([it.counted_text for it in items])
        return costs

    def _items(self, fmt: str, items: Sequence[HistoryItem]) -> list[int]:
        if fmt == "openai":
            return openai_item_tokens(items, self.count)
        if fmt == "anthropic":
            # As if each item were a message of its own (merging only saves), ", " after.
            return self.count(
                [
                    json.dumps({"role": role, "content": blocks}, ensure_ascii=False) + ", "
                    for role, blocks in map(anthropic_message, items)
                ]
            )
        names: dict[str, str] = {}
        for it in items:  # the call names, as the transcript would know them
            for call in parse_tool_calls(it.tool_calls) if it.tool_calls else []:
                names.setdefault(call.id, call.name)
        return self.count(["\n".join(text_line(it, dict(names))) + "\n" for it in items])

    def parts(self, system: str, status: str, new_message: str | None) -> PartCosts:
        """The costs around the history (``system`` is the joined system text)."""
        base = status_cost = new_cost = 0
        if not self.formats:
            sys_t, status_t, new_t = self.count([system, status, new_message or ""])
            return PartCosts(sys_t, status_t if status else 0, new_t if new_message else 0)
        for fmt in self.formats:
            b, s, n = self._parts(fmt, system, status, new_message)
            base, status_cost, new_cost = max(base, b), max(status_cost, s), max(new_cost, n)
        return PartCosts(base, status_cost, new_cost)

    def _parts(
        self, fmt: str, system: str, status: str, new_message: str | None
    ) -> tuple[int, int, int]:
        if fmt == "openai":
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": wire_text(status)},
                {"role": "user", "content": wire_text(new_message or "")},
            ]
            sys_c, status_c, new_c = openai_tokens(messages, self.count)
            return (
                (sys_c if system else 0) + OPENAI_REPLY_TOKENS,
                status_c if status else 0,
                new_c if new_message else 0,
            )
        if fmt == "anthropic":
            shell = json.dumps({"system": system, "messages": []}, ensure_ascii=False)
            opening = json.dumps({"role": "user", "content": [_text(CONTINUATION)]}) + ", "
            blocks = [
                json.dumps({"role": "user", "content": [_text(t)]}, ensure_ascii=False) + ", "
                for t in (status, new_message or "")
            ]
            shell_c, opening_c, status_c, new_c = self.count([shell, opening, *blocks])
            return (
                shell_c + opening_c,
                status_c if status else 0,
                new_c if new_message else 0,
            )
        sys_c, status_c, new_c = self.count(
            [f"System: {system}\n", f"{status}\n", f"User: {new_message or ''}\n"]
        )
        return (sys_c if system else 0, status_c if status else 0, new_c if new_message else 0)

    def rendered(self, ctx: AssembledContext) -> tuple[int, str]:
        """The largest rendered count over ``formats``, and its format ("" without)."""
        best, which = -1, ""
        for fmt in self.formats:
            tokens = rendered_tokens(
                fmt,
                ctx,
                self.count,
                functools.partial(self._kept_costs, ("openai",)),
                self.key,
            )
            if tokens > best:
                best, which = tokens, fmt
        return max(best, 0), which
