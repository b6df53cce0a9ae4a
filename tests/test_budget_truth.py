"""Budgets that hold, and budgets used well.

The budget bounds the request as its provider counts it: the OpenAI rendering counted
with tiktoken and OpenAI's chat accounting (3 per message, the reply's 3, tool_calls as
their JSON) never exceeds it, and the stats report that count. Then what the budget is
spent on: the newest turn before the status, head and tail of a long output, stubs for
blobs, no whitespace-only text, every dropped message named.
"""

from __future__ import annotations

import base64
import json
import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_assembly import STRATEGIES, History, histories
from test_render import check_anthropic, check_openai

from conftest import Client, rendering
from contextd import core
from contextd.app.build.assembly import BudgetTooSmallError, assemble
from contextd.app.build.compressor import SUMMARY_RESERVE_TOKENS
from contextd.app.build.render import to_anthropic, to_openai
from contextd.domain.context import (
    HistoryItem,
    StrategyOptions,
    counter_for_model,
)
from contextd.domain.model import AgentDoc, Role
from contextd.v1 import context_service_pb2 as pb
from core_reference import tiktoken_encoding

GPT = counter_for_model("gpt-4o")
CLAUDE = counter_for_model("claude-sonnet-4-5")


def o200k() -> Any:
    enc = tiktoken_encoding("o200k_base")
    if enc is None:
        pytest.skip("tiktoken or its offline o200k_base copy is not available")
    return enc


def tiktoken_chat_tokens(messages: list[dict[str, Any]]) -> int:
    """OpenAI's published chat accounting, with tiktoken: 3 per message, every string
    value's tokens (a name 1 more), tool_calls as their JSON, 3 for the reply."""
    enc = o200k()
    total = 3
    for message in messages:
        total += 3
        for key, value in message.items():
            if value is None:
                continue
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            total += len(enc.encode(text, disallowed_special=()))
            total += 1 if key == "name" else 0
    return total


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + random.Random(7).randbytes(3_000)).decode()
ODD_TEXTS = [
    "   ",
    "\n\t \n",
    "",
    "naïve café 東京 🚀👩‍👩‍👧 e\u0301 ",
    "<|endoftext|> special-looking text",
    f"here is the screenshot: data:image/png;base64,{PNG} and that is all",
    "Traceback (most recent call last):\n" + "  frame\n" * 900 + "ValueError: boom",
    "日本語のテキスト。" * 400,
]


@st.composite
def rich_histories(draw: st.DrawFn) -> History:
    """The assembly suite's histories (tool calls, parallel calls in both styles, orphans,
    huge messages) with some contents replaced by whitespace, unicode, special-token
    look-alikes, base64 and long tracebacks."""
    h = draw(histories())
    items = []
    for item in h.items:
        if draw(st.integers(0, 4)) == 0:
            item = HistoryItem(
                item.id,
                item.role,
                draw(st.sampled_from(ODD_TEXTS)),
                item.tool_calls,
                item.tool_call_id,
            )
        items.append(item)
    return History(items)


STATUS = "Status as of 2025-01-01T00:00:00+00:00:\n" + "\n".join(
    f"- [process] job-{i} — running: building part {i} of the release" for i in range(12)
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=rich_histories(),
    budget=st.integers(40, 6_000),
    new_message=st.none() | st.sampled_from([*ODD_TEXTS, "what now?"]),
    strategy=st.sampled_from(sorted(STRATEGIES)),
    status=st.sampled_from(["", STATUS]),
    also_anthropic=st.booleans(),
)
def test_the_openai_rendering_counted_with_tiktoken_never_exceeds_the_budget(
    h: History,
    budget: int,
    new_message: str | None,
    strategy: str,
    status: str,
    also_anthropic: bool,
) -> None:
    formats = ("openai", "anthropic") if also_anthropic else ("openai",)
    try:
        ctx = assemble(
            system_prompt="You are a careful agent.",
            docs=[AgentDoc("notes.md", "Be brief.")],
            status=status,
            history=h.items,
            new_message=new_message,
            budget=budget,
            count_tokens=GPT,
            options=STRATEGIES[strategy],
            formats=formats,
        )
    except BudgetTooSmallError:
        assume(False)
        return
    messages = to_openai(ctx)
    check_openai(messages)
    counted = tiktoken_chat_tokens(messages)
    assert counted <= budget
    payload = to_anthropic(ctx)
    check_anthropic(payload)
    anthropic = GPT([json.dumps(payload, ensure_ascii=False)])[0]
    if also_anthropic:
        assert anthropic <= budget
        assert ctx.stats.rendered_tokens == max(counted, anthropic)
    else:
        assert ctx.stats.rendered_tokens == counted  # the Rust BPE agrees with tiktoken
    assert ctx.stats.rendered_format in formats


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=rich_histories(), budget=st.integers(200, 6_000))
def test_the_claude_estimate_over_the_rendered_json_never_exceeds_the_budget(
    h: History, budget: int
) -> None:
    try:
        ctx = assemble(
            system_prompt="sys",
            status=STATUS,
            history=h.items,
            new_message="go on",
            budget=budget,
            count_tokens=CLAUDE,
            formats=("anthropic",),
        )
    except BudgetTooSmallError:
        assume(False)
        return
    payload = to_anthropic(ctx)
    check_anthropic(payload)
    counted = core.count_tokens_for_model_batch(
        [json.dumps(payload, ensure_ascii=False)], "claude-sonnet-4-5"
    )[0]
    assert counted == ctx.stats.rendered_tokens <= budget


def _texts_of(payload: dict[str, Any]) -> list[str]:
    out = []
    for message in payload["messages"]:
        for block in message["content"]:
            if block["type"] == "text":
                out.append(block["text"])
            elif block["type"] == "tool_result":
                out.append(block["content"])
    return out


def test_whitespace_only_text_never_reaches_a_rendering() -> None:
    calls = json.dumps([{"id": "c1", "name": "ls", "input": {}}])
    history = [
        HistoryItem(1, Role.USER, "  \n "),
        HistoryItem(2, Role.TOOL_USE, " ", calls),
        HistoryItem(3, Role.TOOL_RESULT, "\t", tool_call_id="c1"),
        HistoryItem(4, Role.ASSISTANT, "\n\n"),
    ]
    ctx = assemble(
        system_prompt="sys", history=history, new_message="   ", budget=10_000, count_tokens=GPT
    )
    assert ctx.new_message is None  # a whitespace-only user_message is none
    payload = to_anthropic(ctx)
    check_anthropic(payload)
    assert all(text.strip() for text in _texts_of(payload))
    for message in to_openai(ctx):
        assert message["content"] is None or message["content"].strip()


def test_the_newest_turn_is_never_dropped_or_cut_for_the_status() -> None:
    # A status that takes most of the budget used to leave room for the new message only.
    history = [
        HistoryItem(1, Role.USER, "please fix the flaky test in src/lease.go"),
        HistoryItem(2, Role.ASSISTANT, "I changed the lease renewal; the test passes now. " * 3),
    ]
    options: dict[str, Any] = {
        "system_prompt": "sys",
        "history": history,
        "new_message": "thanks, what changed?",
        "count_tokens": GPT,
        "formats": ("openai",),
    }
    whole = assemble(**options, budget=10_000)
    need = whole.stats.rendered_tokens
    ctx = assemble(**options, status=STATUS, budget=need + 40)
    assert ctx.history[-1] == whole.history[-1]  # the newest turn, whole
    assert ctx.stats.status_truncated and ctx.status.endswith("shortened to fit the context)")
    assert ctx.status.startswith("Status as of") and ctx.stats.rendered_tokens <= need + 40
    tight = assemble(**options, status=STATUS, budget=need + 2)
    assert tight.history == whole.history
    assert tight.stats.status_dropped and tight.status == ""


def test_without_a_new_message_the_current_request_outranks_the_status() -> None:
    calls = json.dumps([{"id": "c1", "name": "grep", "input": {"q": "lease"}}])
    history = [
        HistoryItem(1, Role.USER, "find every lease renewal"),
        HistoryItem(2, Role.TOOL_USE, "", calls),
        HistoryItem(3, Role.TOOL_RESULT, "src/lease.go:12 renew()", tool_call_id="c1"),
    ]
    whole = assemble(
        system_prompt="", history=history, budget=10_000, count_tokens=GPT, formats=("openai",)
    )
    ctx = assemble(
        system_prompt="",
        history=history,
        status=STATUS,
        budget=whole.stats.rendered_tokens + 10,
        count_tokens=GPT,
        formats=("openai",),
    )
    assert [it.id for it in ctx.history] == [1, 2, 3]
    assert ctx.stats.status_dropped


def test_base64_blobs_become_a_stub_with_size_kind_and_handle() -> None:
    text = f"Screenshot attached:\n{PNG}\nThe error is in the header."
    history = [
        HistoryItem(5, Role.USER, "show me"),
        HistoryItem(6, Role.ASSISTANT, text),
    ]
    ctx = assemble(system_prompt="", history=history, budget=50_000, count_tokens=GPT)
    content = ctx.history[1].content
    assert PNG[:40] not in content
    assert content.startswith("Screenshot attached:\n[base64 image/png, ")
    assert f"{len(PNG):,} chars" in content and "message:6]" in content
    assert content.endswith("The error is in the header.")
    assert ctx.stats.elided_ids == (6,)
    # Hex, words and paths are not blobs.
    plain = "see src/a/b/c.py " * 40 + "deadbeef" * 10 + " " + "a" * 600
    ctx = assemble(
        system_prompt="",
        history=[HistoryItem(7, Role.USER, plain)],
        budget=50_000,
        count_tokens=GPT,
    )
    assert ctx.history[0].content == plain and ctx.stats.elided_ids == ()


def test_the_same_blob_in_two_messages_names_each_ones_own_handle() -> None:
    """Stubs are remembered between builds (a hot thread's newest messages come back on
    every build); the same text in two messages still gets each message's handle."""
    text = f"Screenshot attached:\n{PNG}\nsame again"
    history = [HistoryItem(8, Role.USER, text), HistoryItem(9, Role.ASSISTANT, text)]
    for _ in range(2):  # the second build answers from what the first remembered
        ctx = assemble(system_prompt="", history=history, budget=50_000, count_tokens=GPT)
        assert "message:8]" in ctx.history[0].content
        assert "message:9]" in ctx.history[1].content


def _conversation(n: int) -> list[HistoryItem]:
    items = []
    for i in range(1, n + 1):
        role = Role.USER if i % 2 else Role.ASSISTANT
        items.append(HistoryItem(i, role, f"message {i}: " + "the lease renewal logic " * 12))
    return items


@pytest.mark.parametrize("budget", [2_000, 8_000, 32_000])
def test_summarize_keeps_as_much_recent_history_as_truncate_beside_the_reserve(
    budget: int,
) -> None:
    history = _conversation(600)
    common: dict[str, Any] = {
        "system_prompt": "sys",
        "history": history,
        "count_tokens": GPT,
        "formats": ("openai",),
        "new_message": "next?",
    }
    summarized = assemble(**common, budget=budget, options=StrategyOptions(summarize=True))
    assert summarized.summary is not None
    room = budget - (summarized.stats.rendered_tokens - summarized.stats.history_tokens)
    reserve = min(SUMMARY_RESERVE_TOKENS, room // 4)
    truncated = assemble(**common, budget=budget - reserve)
    verbatim = [it for it in summarized.history if not it.is_summary]
    assert len(verbatim) >= len(truncated.history)
    assert summarized.stats.rendered_tokens <= budget
    # and the budget is used: no more than the reserve and one message is left over
    assert budget - summarized.stats.rendered_tokens <= reserve + 200


# ----------------------------------------------------------------- over gRPC, both engines


def _tool_heavy_thread(client: Client, seed: int, turns: int) -> None:
    rng = random.Random(seed)
    for t in range(turns):
        client.append("a1", f"turn {t}: please look at issue #{rng.randrange(9999)} ✓")
        n = rng.randint(1, 3)
        calls = [
            {
                "id": f"call_{t}_{k}",
                "type": "function",
                "function": {"name": "shell", "arguments": json.dumps({"cmd": f"cat f{k}.log"})},
            }
            for k in range(n)
        ]
        client.append("a1", "", role=pb.ROLE_TOOL_USE, tool_calls=json.dumps(calls))
        for k in range(n):
            size = rng.choice([20, 400, 9_000])
            body = "".join(rng.choice("abcdef 東京\n") for _ in range(size)) + "\nexit 1"
            client.append("a1", body, role=pb.ROLE_TOOL_RESULT, tool_call_id=f"call_{t}_{k}")
        client.append(
            "a1", rng.choice(["done", "   ", "it fails; retrying"]), role=pb.ROLE_ASSISTANT
        )


@pytest.mark.parametrize("summarize", [False, True])
def test_an_explicit_budget_holds_for_the_openai_rendering_counted_with_tiktoken(
    client: Client, summarize: bool
) -> None:
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1", model="gpt-4o", system_prompt="sys"))
    )
    _tool_heavy_thread(client, seed=3, turns=40)
    for budget in (800, 8_000):
        response = client.stub.BuildContext(
            pb.BuildContextRequest(
                agent="a1",
                thread="t1",
                user_message="what is left?",
                formats=[pb.CONTEXT_FORMAT_OPENAI, pb.CONTEXT_FORMAT_ANTHROPIC],
                options=pb.BuildOptions(budget_tokens=budget, summarize=summarize),
            )
        )
        stats = response.stats
        messages = json.loads(rendering(response, pb.CONTEXT_FORMAT_OPENAI))
        check_openai(messages)
        check_anthropic(json.loads(rendering(response, pb.CONTEXT_FORMAT_ANTHROPIC)))
        counted = tiktoken_chat_tokens(messages)
        assert stats.budget_tokens == budget
        assert counted <= stats.rendered_tokens <= budget
        if stats.rendered_format == "openai":
            assert counted == stats.rendered_tokens


def test_every_dropped_message_is_in_the_ranges_also_past_the_listing_cap(client: Client) -> None:
    for start in (0, 10_000):
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1",
                thread="t1",
                create_agent_if_missing=True,
                messages=[
                    pb.Message(role=pb.ROLE_USER, content=f"m{start + i}")
                    for i in range(min(10_000, 10_500 - start))
                ],
            )
        )
    window = client.window("a1")
    response = client.stub.BuildContext(
        pb.BuildContextRequest(
            agent="a1",
            thread="t1",
            options=pb.BuildOptions(budget_tokens=200),
            view=pb.CONTEXT_VIEW_FULL,
        )
    )
    stats = response.stats
    kept = [m.id for m in response.messages]
    assert stats.dropped_count == len(window) - len(kept) > 10_000
    assert len(stats.dropped_ids) == 10_000  # the listing stays bounded
    assert [(r.first_id, r.last_id) for r in stats.dropped_ranges] == [
        (window[0].id, window[len(window) - len(kept) - 1].id)
    ]


def test_a_blob_is_stubbed_with_its_handle_over_grpc(client: Client) -> None:
    sent = client.append("a1", f"log:\n{PNG}\nend", role=pb.ROLE_USER)
    message_id = sent.receipts[0].id
    response = client.stub.BuildContext(
        pb.BuildContextRequest(agent="a1", thread="t1", formats=[pb.CONTEXT_FORMAT_ANTHROPIC])
    )
    text = rendering(response, pb.CONTEXT_FORMAT_ANTHROPIC)
    assert PNG[:40] not in text
    assert re.search(
        r"\[base64 image/png, [\d,]+ chars, about [\d,]+ bytes, omitted; full text: "
        r"message:\d+\]",
        text,
    )
    assert f"message:{message_id}]" in text
    assert list(response.stats.elided_ids) == [message_id]


def test_a_summarizing_build_keeps_the_current_request_verbatim() -> None:
    # A coding turn: the request, then a chain of tool calls. The summary used to keep
    # only about half the budget of recent messages, so the request was folded.
    history = _conversation(200)
    next_id = 1_000
    request = HistoryItem(next_id, Role.USER, "Fix the double-leasing bug in src/lease.go")
    history.append(request)
    for k in range(8):
        call = json.dumps([{"id": f"c{k}", "name": "shell", "input": {"cmd": f"go test ./{k}"}}])
        history.append(HistoryItem(next_id + 1 + 2 * k, Role.TOOL_USE, "", call))
        history.append(
            HistoryItem(
                next_id + 2 + 2 * k,
                Role.TOOL_RESULT,
                f"ok package {k} " + "log line of the test run\n" * 80,
                tool_call_id=f"c{k}",
            )
        )
    ctx = assemble(
        system_prompt="sys",
        history=history,
        budget=8_000,
        count_tokens=GPT,
        options=StrategyOptions(summarize=True),
        formats=("openai",),
    )
    assert ctx.summary is not None
    assert request.id in [it.id for it in ctx.history]
    assert ctx.stats.rendered_tokens <= 8_000


def test_wrapped_base64_and_binary_text_are_stubbed_and_the_words_around_them_stay() -> None:
    wrapped = base64.encodebytes(random.Random(1).randbytes(2_000)).decode()  # 76-char lines
    binary = "".join(chr(c) for c in random.Random(2).randbytes(600)).replace("\n", "\x01")
    history = [
        HistoryItem(3, Role.USER, "Attached\n" + wrapped + "Done here\nok"),
        HistoryItem(4, Role.USER, binary),
    ]
    ctx = assemble(system_prompt="", history=history, budget=50_000, count_tokens=GPT)
    assert ctx.history[0].content == (
        "Attached\n[base64 data, 2,703 chars, about 2,000 bytes, omitted; "
        "full text: message:3]\nDone here\nok"
    )
    assert ctx.history[1].content.startswith("[binary data, 600 chars, about ")
    assert ctx.history[1].content.endswith("full text: message:4]")
    assert ctx.stats.elided_ids == (3, 4)


def _blob_texts() -> list[str]:
    """Texts around the blob patterns' edges: runs of base64 and hex characters just
    under and over their lengths, broken by a space, a non-ASCII letter or a line break,
    wrapped and prefixed blobs, binary and near-binary text, ASCII and not."""
    pick = random.Random(11)
    b64 = base64.b64encode(pick.randbytes(400)).decode()
    hexrun = pick.randbytes(300).hex()
    out = [
        "",
        "plain words " * 40,
        "a" * 255,
        "a" * 256,
        "é" + "a" * 256 + "é",
        "a" * 128 + "é" + "a" * 128,
        "a" * 128 + " " + "a" * 128,
        "a" * 128 + "\n" + "a" * 128,
        "x " + b64[:255] + " y",
        "x " + b64[:256] + " y",
        "x " + b64 + " y",
        "données: " + b64 + " ☃",
        "data:image/png;base64," + b64,
        base64.encodebytes(pick.randbytes(900)).decode(),
        "hex " + hexrun[:511] + " end",
        "hex " + hexrun[:512] + " end",
        "hex " + hexrun + " end",
        "".join(chr(c) for c in pick.randbytes(600)),
        "ok " * 90 + "\x01" * 30,
        "ok " * 90 + "\x01" * 20,
        "okü " * 90 + "\x01\x85\ufffd" * 12,
    ]
    alphabet = "ab01+/= \n\x01é"
    out += [
        "".join(pick.choice(alphabet) for _ in range(pick.randrange(200, 800))) for _ in range(40)
    ]
    out += ["Ab1" * pick.randrange(80, 120) for _ in range(5)]
    return out


def test_blob_scans_answer_what_the_patterns_alone_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte-level checks (`_may_hold_blob`, the ASCII count of `_is_binary`) only
    skip work: every text is stubbed exactly as by the patterns over the whole text."""
    from contextd.app.build import blobs

    texts = _blob_texts()
    fast = [blobs.replace_blobs(t, "message:9") for t in texts]
    monkeypatch.setattr(blobs, "_may_hold_blob", lambda text: True)
    monkeypatch.setattr(
        blobs,
        "_is_binary",
        lambda text: (
            len(text) >= blobs.MIN_BINARY_CHARS and len(blobs._ODD.findall(text)) * 10 >= len(text)
        ),
    )
    assert fast == [blobs.replace_blobs(t, "message:9") for t in texts]
    assert sum(f != t for f, t in zip(fast, texts, strict=True)) >= 8  # some were stubbed
