"""Renderings checked structurally: Anthropic Messages, OpenAI Chat Completions, text."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_assembly import STRATEGIES, History, histories, texts

from contextd.app.build.assembly import assemble
from contextd.app.build.render import CONTINUATION, system_text, to_anthropic, to_openai, to_text
from contextd.domain.context import (
    AssembledContext,
    BuildStats,
    HistoryItem,
    estimate_counter,
)
from contextd.domain.model import AgentDoc, Role


def context(history: list[HistoryItem], new: str | None = None) -> AssembledContext:
    """A context as given, not assembled: rendering must cope with any history."""
    return AssembledContext(
        "sys", (AgentDoc("d.md", "doc"),), "status", tuple(history), new, BuildStats(budget=0)
    )


def check_anthropic(payload: dict[str, Any]) -> None:
    messages = payload["messages"]
    assert isinstance(payload["system"], str)
    if not messages:
        return
    assert messages[0]["role"] == "user"
    seen_ids: set[str] = set()
    for i, message in enumerate(messages):
        assert message["role"] in ("user", "assistant")
        if i:
            assert message["role"] != messages[i - 1]["role"], "roles alternate"
        blocks = message["content"]
        assert blocks, "no empty message"
        for block in blocks:
            if block["type"] == "text":
                assert block["text"], "no empty text block"
        if message["role"] == "assistant":
            uses = [b["id"] for b in blocks if b["type"] == "tool_use"]
            for b in blocks:
                if b["type"] == "tool_use":
                    assert isinstance(b["input"], dict) and b["name"]
            assert not seen_ids & set(uses) and len(set(uses)) == len(uses)
            seen_ids |= set(uses)
            if uses:
                nxt = messages[i + 1]
                answered = [b["tool_use_id"] for b in nxt["content"] if b["type"] == "tool_result"]
                assert sorted(answered) == sorted(uses), "each tool_use answered once, next turn"
        else:
            kinds = [b["type"] for b in blocks]
            assert kinds == sorted(kinds, key=lambda k: k != "tool_result"), "results first"
            results = [b["tool_use_id"] for b in blocks if b["type"] == "tool_result"]
            if results:
                prev = messages[i - 1]
                assert prev["role"] == "assistant"
                issued = {b["id"] for b in prev["content"] if b["type"] == "tool_use"}
                assert set(results) <= issued, "a tool_result answers the previous turn"
    json.dumps(payload)


def check_openai(messages: list[dict[str, Any]]) -> None:
    pending: set[str] = set()
    all_calls: set[str] = set()
    for message in messages:
        role = message["role"]
        if role == "tool":
            assert message["tool_call_id"] in pending, "tool message answers a preceding call"
            pending.discard(message["tool_call_id"])
            continue
        assert not pending, "results follow their assistant message directly"
        if role == "assistant" and "tool_calls" in message:
            for call in message["tool_calls"]:
                assert call["type"] == "function" and call["function"]["name"]
                json.loads(call["function"]["arguments"])
                assert call["id"] not in all_calls
                all_calls.add(call["id"])
                pending.add(call["id"])
        else:
            assert isinstance(message["content"], str)
    assert not pending, "every tool_call answered"
    json.dumps(messages)


@settings(max_examples=150, deadline=None)
@given(
    h=histories(),
    new=st.none() | texts(20),
    strategy=st.sampled_from(sorted(STRATEGIES)),
    budget=st.integers(60, 3000),
)
def test_assembled_contexts_render_valid_for_both_apis(
    h: History, new: str | None, strategy: str, budget: int
) -> None:
    ctx = assemble(
        system_prompt="sys",
        history=h.items,
        new_message=new,
        budget=budget,
        count_tokens=estimate_counter,
        options=STRATEGIES[strategy],
    )
    check_anthropic(to_anthropic(ctx))
    check_openai(to_openai(ctx))
    to_text(ctx)


@settings(max_examples=150, deadline=None)
@given(h=histories(), new=st.none() | texts(20))
def test_raw_histories_render_valid_too(h: History, new: str | None) -> None:
    ctx = context(h.items, new)
    check_anthropic(to_anthropic(ctx))
    check_openai(to_openai(ctx))


MIXED = [
    HistoryItem(1, Role.USER, "check both files"),
    HistoryItem(
        2,
        Role.ASSISTANT,
        "Reading them.",
        tool_calls=json.dumps(
            [
                {"id": "a1", "name": "read", "input": {"path": "a.py"}},
                {
                    "id": "o1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path": "b.py"}'},
                },
            ]
        ),
    ),
    HistoryItem(3, Role.TOOL_RESULT, "A", tool_call_id="o1"),
    HistoryItem(4, Role.USER, "hurry up"),  # written while the tools ran
    HistoryItem(5, Role.TOOL_RESULT, "B", tool_call_id="a1"),
    HistoryItem(6, Role.ASSISTANT, "Both fine."),
]


def test_anthropic_rendering_of_parallel_calls_in_both_styles() -> None:
    payload = to_anthropic(context(MIXED, "thanks"))
    assert payload["system"] == 'sys\n\n<document name="d.md">\ndoc\n</document>'
    assert payload["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "check both files"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading them."},
                {"type": "tool_use", "id": "a1", "name": "read", "input": {"path": "a.py"}},
                {"type": "tool_use", "id": "o1", "name": "read", "input": {"path": "b.py"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "o1", "content": "A"},
                {"type": "tool_result", "tool_use_id": "a1", "content": "B"},
                {"type": "text", "text": "hurry up"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Both fine."}]},
        # The volatile status opens the last user turn, after the cacheable history.
        {
            "role": "user",
            "content": [{"type": "text", "text": "status"}, {"type": "text", "text": "thanks"}],
        },
    ]


def test_openai_rendering_of_parallel_calls_in_both_styles() -> None:
    messages = to_openai(context(MIXED))
    assert messages[0] == {"role": "system", "content": system_text(context(MIXED))}
    assert messages[2] == {
        "role": "assistant",
        "content": "Reading them.",
        "tool_calls": [
            {
                "id": "a1",
                "type": "function",
                "function": {"name": "read", "arguments": '{"path":"a.py"}'},
            },
            {
                "id": "o1",
                "type": "function",
                "function": {"name": "read", "arguments": '{"path":"b.py"}'},
            },
        ],
    }
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "user",
        "assistant",
        "user",
    ]
    assert messages[-1] == {"role": "user", "content": "status"}
    assert messages[3] == {"role": "tool", "tool_call_id": "o1", "content": "A"}


def test_orphans_and_leading_assistant_turns_stay_valid() -> None:
    history = [
        HistoryItem(1, Role.ASSISTANT, "as I was saying"),
        HistoryItem(2, Role.TOOL_RESULT, "late output", tool_call_id="gone"),
        HistoryItem(3, Role.TOOL_USE, "", tool_calls='[{"id":"x","name":"ls","input":{}}]'),
    ]
    payload = to_anthropic(context(history))
    check_anthropic(payload)
    assert payload["messages"][0]["content"] == [{"type": "text", "text": CONTINUATION}]
    assert "late output" in json.dumps(payload) and "ls" in json.dumps(payload)
    check_openai(to_openai(context(history)))


def test_text_rendering_is_a_transcript() -> None:
    ctx = context([HistoryItem(1, Role.USER, "Hello"), HistoryItem(2, Role.ASSISTANT, "Hi there")])
    assert to_text(ctx, include_system=False) == "User: Hello\nAssistant: Hi there\nstatus"
    full = to_text(context(MIXED, "thanks"))
    assert full.startswith("System: sys")
    assert 'Assistant: [calls read({"path":"a.py"})]' in full
    assert "Tool (read): B" in full and full.endswith("status\nUser: thanks")
