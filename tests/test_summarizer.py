"""The summarizer through the real anthropic SDK client against a local fake server."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_anthropic import FakeAnthropic

from contextd.app.build.summarizer import (
    SPECIFICS_HEADING,
    SUMMARY_SECTIONS,
    AnthropicConfig,
    AnthropicSummarizer,
    ExtractiveSummarizer,
    parse_specifics,
)
from contextd.domain.context import HistoryItem
from contextd.domain.model import Role

CHECKPOINT = "\n\n".join(f"## {s}\nfrom the model" for s in SUMMARY_SECTIONS)

ITEMS = [
    HistoryItem(1, Role.USER, "Please fix the failing test in /work/app/tests/test_api.py " * 8),
    HistoryItem(
        2,
        Role.TOOL_USE,
        "",
        tool_calls='[{"id":"c1","name":"bash","input":{"cmd":"pytest -q"}}]',
        metadata='{"action":"ran tests"}',
    ),
    HistoryItem(
        3, Role.TOOL_RESULT, "ValueError: invalid literal for int() at line 42", tool_call_id="c1"
    ),
    HistoryItem(
        4, Role.ASSISTANT, "The parser breaks on `parse_port`; see https://example.com/issue/7"
    ),
]


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


def sent_key(headers: dict[str, str]) -> str:
    """The API key as the SDK sent it (``x-api-key``, or a bearer token in SDK 2.x)."""
    if "x-api-key" in headers:
        return headers["x-api-key"]
    return headers.get("authorization", "").removeprefix("Bearer ")


def summarizer(fake: FakeAnthropic, **kw: Any) -> AnthropicSummarizer:
    config = AnthropicConfig(api_key="test-key", base_url=fake.base_url, timeout_s=2.0)
    return AnthropicSummarizer(dataclasses.replace(config, **kw))


def test_success_returns_the_models_text_and_specifics(fake: FakeAnthropic) -> None:
    fake.reply_text(CHECKPOINT)
    result = summarizer(fake).summarize(ITEMS, None)
    assert result.path == "llm"
    assert result.error is None
    goal = "- Original request (message:1): Please fix the failing test"
    assert result.text.startswith("## Goal\n" + goal)
    assert result.text.replace(result.text.splitlines()[1] + "\n", "") == CHECKPOINT
    assert result.attempts == 1
    assert "/work/app/tests/test_api.py" in result.specifics
    assert "https://example.com/issue/7" in result.specifics
    assert "parse_port" in result.specifics
    assert any("ValueError" in s for s in result.specifics)
    (request,) = fake.requests
    assert request.path == "/v1/messages"
    assert sent_key(request.headers) == "test-key"
    assert request.body["model"] == "claude-haiku-4-5"
    assert request.body["max_tokens"] == 2048
    prompt = request.body["messages"][0]["content"]
    assert "<conversation>" in prompt and "pytest -q" in prompt
    assert "## Goal" in request.body["system"]


def test_update_prompt_carries_the_previous_summary_and_its_ledger(fake: FakeAnthropic) -> None:
    fake.reply_text(CHECKPOINT)
    previous = f"## Goal\nold goal\n\n{SPECIFICS_HEADING}\n- /etc/old.conf\n- OLD_ID_1"
    result = summarizer(fake, model="claude-opus-4-5", max_tokens=999).summarize(ITEMS, previous)
    assert result.path == "llm", result.error
    assert result.specifics[:2] == ("/etc/old.conf", "OLD_ID_1")
    body = fake.requests[0].body
    assert body["model"] == "claude-opus-4-5" and body["max_tokens"] == 999
    prompt = body["messages"][0]["content"]
    assert "<previous-checkpoint>\n## Goal\nold goal\n</previous-checkpoint>" in prompt


@pytest.mark.parametrize("status", [500, 529, 429, 401])
def test_api_errors_fall_back(fake: FakeAnthropic, status: int) -> None:
    fake.reply_error(status)
    result = summarizer(fake).summarize(ITEMS, None)
    assert result.path == "fallback"
    assert result.error is not None and str(status) in result.error
    assert "## Goal" in result.text and "User asked: Please fix" in result.text
    assert "/work/app/tests/test_api.py" in result.specifics
    assert len(fake.requests) == 1, "max_retries=0: one attempt, then the fallback"


def test_timeout_falls_back(fake: FakeAnthropic) -> None:
    fake.reply_slow(5.0)
    started = time.monotonic()
    result = summarizer(fake, timeout_s=0.3).summarize(ITEMS, None)
    assert time.monotonic() - started < 3.0
    assert result.path == "fallback"
    assert result.error is not None and "Timeout" in result.error


def test_no_key_falls_back_without_a_request(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    config = AnthropicConfig(base_url=fake.base_url)
    result = AnthropicSummarizer(config).summarize(ITEMS, None)
    assert result.path == "fallback"
    assert result.error is not None and "ANTHROPIC_API_KEY" in result.error
    assert fake.requests == []


def test_key_from_environment(fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "env-key")
    fake.reply_text(CHECKPOINT)
    result = AnthropicSummarizer(AnthropicConfig(base_url=fake.base_url)).summarize(ITEMS, None)
    assert result.path == "llm"
    assert sent_key(fake.requests[0].headers) == "env-key"


@pytest.mark.parametrize(
    "reply",
    [
        {"kind": "raw", "body": b"<html>not json</html>"},
        {"kind": "json", "payload": {"unexpected": True}},
        {"kind": "json", "payload": {**json.loads('{"content": []}'), "type": "message"}},
        {"kind": "text", "text": "   "},
    ],
    ids=["not-json", "no-content", "empty-content", "blank-text"],
)
def test_malformed_answers_fall_back(fake: FakeAnthropic, reply: dict[str, object]) -> None:
    if reply["kind"] == "raw":
        body = reply["body"]
        assert isinstance(body, bytes)
        fake.reply_raw(body, content_type="application/json")
    elif reply["kind"] == "json":
        fake.reply_json(reply["payload"])
    else:
        text = reply["text"]
        assert isinstance(text, str)
        fake.reply_text(text)
    result = summarizer(fake).summarize(ITEMS, None)
    assert result.path == "fallback"
    assert result.error


def test_unreachable_server_falls_back() -> None:
    with FakeAnthropic() as server:
        url = server.base_url
    result = AnthropicSummarizer(
        AnthropicConfig(api_key="k", base_url=url, timeout_s=1.0)
    ).summarize(ITEMS, None)
    assert result.path == "fallback"
    assert result.error is not None and "Connection" in result.error


def test_extractive_summary_follows_seed_002() -> None:
    long_request = "x" * 500
    items = [
        HistoryItem(1, Role.USER, long_request),
        HistoryItem(2, Role.ASSISTANT, "done", metadata='{"agent_type":"invoices"}'),
        *ITEMS,
    ]
    result = ExtractiveSummarizer().summarize(items, None)
    assert result.path == "fallback" and result.error is None
    assert "User asked: " + "x" * 199 + "…" in result.text
    assert "x" * 201 not in result.text
    assert "invoices" in result.text and "called bash" in result.text
    assert [line for line in result.text.splitlines() if line.startswith("## ")] == [
        f"## {s}" for s in SUMMARY_SECTIONS
    ]


def test_specifics_round_trip_through_rendered_text() -> None:
    text = f"## Goal\ng\n\n{SPECIFICS_HEADING}\n- a/b.py\n- `make test`\n"
    assert parse_specifics(text) == ["a/b.py", "`make test`"]
    assert parse_specifics("no ledger") == []
