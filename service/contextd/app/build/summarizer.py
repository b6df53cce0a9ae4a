"""Summarizers: fold old messages into one structured checkpoint.

A summarizer never fails a context build. :class:`AnthropicSummarizer` asks Claude for a
structured checkpoint; on any failure (no key, network, API status, rate limit,
timeout, an empty or malformed answer) it falls back to :class:`ExtractiveSummarizer`
(the user's requests, up to 200 characters each, and what the agent did) and
reports which path ran and why. A summary never makes a build fail.

Both attach a *specifics ledger*: file paths, commands, URLs, identifiers, numbers and
error lines found by :func:`contextd.core.extract_specifics`, kept verbatim beside the
prose, because summaries keep the gist and lose exactly the details an agent needs to
carry on. The ledger of the previous summary is carried into the next one.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from contextd import core
from contextd.domain.context import HistoryItem, parse_tool_calls
from contextd.domain.model import Role
from contextd.domain.snapshots import SUMMARY_FAILED

SUMMARY_SECTIONS = (
    "Goal",
    "Constraints",
    "Progress",
    "Decisions",
    "Next steps",
    "Critical context",
)
"""The checkpoint's sections, in order (a compaction checkpoint)."""

SPECIFICS_HEADING = "## Specifics"
MAX_SPECIFICS = 80
"""The ledger keeps the most recent details; an unbounded ledger would grow with the
conversation and eventually crowd out the summary it supports."""

USER_REQUEST_CHARS = 200
"""User requests are kept up to 200 characters each."""

SYSTEM_PROMPT = (
    "You compress the history of a conversation between a user and an AI agent into a "
    "checkpoint the agent will read instead of the original messages. Write only the "
    "checkpoint, in Markdown, with exactly these sections in this order: "
    + ", ".join(f"'## {s}'" for s in SUMMARY_SECTIONS)
    + ". Be concise and factual. Keep file paths, commands, identifiers, numbers and error "
    "messages verbatim. Record what was done and what is still open; write 'None.' under "
    "a section with nothing to say."
)

CREATE_PROMPT = (
    "Summarize the conversation below into the checkpoint.\n\n"
    "<conversation>\n{conversation}\n</conversation>"
)

UPDATE_PROMPT = (
    "Below is the checkpoint of the earlier conversation and the messages that followed "
    "it. Update the checkpoint so it covers both: keep what still holds, move finished "
    "work to Progress, and add new goals, decisions and next steps.\n\n"
    "<previous-checkpoint>\n{previous}\n</previous-checkpoint>\n\n"
    "<conversation>\n{conversation}\n</conversation>"
)

SESSION_SYSTEM_PROMPT = (
    "You summarize a saved conversation between a user and an AI agent for a list of "
    "saved sessions. Answer with 2 to 4 plain sentences and nothing else: what was "
    "accomplished, the decisions made, and what is still unfinished. Keep file paths, "
    "commands and identifiers verbatim."
)

SESSION_PROMPT = (
    "Summarize the saved conversation below.\n\n<conversation>\n{conversation}\n</conversation>"
)

MAX_SESSION_SUMMARY_CHARS = 2_000
"""A session summary is a few sentences; a model that rambles is cut here."""

SESSION_SUMMARY_MAX_TOKENS = 400

SummaryPath = Literal["llm", "fallback"]


@dataclass(frozen=True, slots=True)
class SummaryResult:
    """A summary's prose, how it was made, why the LLM path failed if it did, and the
    specifics ledger (previous ledger first, then new details, most recent kept)."""

    text: str
    path: SummaryPath
    error: str | None = None
    specifics: tuple[str, ...] = ()


class Summarizer(Protocol):
    """Summarizes ``items`` (oldest first); with ``previous_summary`` (the body of the
    checkpoint they follow), returns a checkpoint covering both. Must not raise."""

    def summarize(
        self, items: Sequence[HistoryItem], previous_summary: str | None
    ) -> SummaryResult: ...


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """A snapshot's summary, or SUMMARY_FAILED with why (`error`) when none was written."""

    text: str
    error: str | None = None


@runtime_checkable
class SessionSummarizer(Protocol):
    """Summarizes a saved conversation (``items``, oldest first) in 2 to 4 sentences.
    Must not raise: on any failure the text is SUMMARY_FAILED and ``error`` says why."""

    def summarize_session(self, items: Sequence[HistoryItem]) -> SessionSummary: ...


class NoSessionSummarizer:
    """For a service built without a language model: every summary fails."""

    def summarize_session(self, items: Sequence[HistoryItem]) -> SessionSummary:
        return SessionSummary(SUMMARY_FAILED, "no summarizer is configured")


def transcript(items: Sequence[HistoryItem], max_chars_per_message: int = 2_000) -> str:
    """The items as "Role: text" lines, the form both the LLM prompt and the fallback use.

    Long messages are cut: the summary needs what happened, not every line of a log.
    """
    names = tool_names(items)
    lines: list[str] = []
    for item in items:
        text = _clip(item.content, max_chars_per_message)
        if item.role is Role.USER:
            lines.append(f"User: {text}")
        elif item.role is Role.TOOL_RESULT:
            name = names.get(item.tool_call_id, "unknown tool")
            lines.append(f"Tool result ({name}, {item.tool_call_id}): {text}")
        else:
            if text:
                lines.append(f"Assistant: {text}")
            for call in parse_tool_calls(item.tool_calls):
                args = _clip(call.arguments_json, max_chars_per_message)
                lines.append(f"Assistant called {call.name}({args}) [{call.id}]")
    return "\n".join(lines)


def tool_names(items: Sequence[HistoryItem]) -> dict[str, str]:
    """Tool call id -> tool name, from every call in ``items``."""
    names: dict[str, str] = {}
    for item in items:
        if item.role in (Role.TOOL_USE, Role.ASSISTANT) and item.tool_calls:
            for call in parse_tool_calls(item.tool_calls):
                if call.id:
                    names.setdefault(call.id, call.name)
    return names


def collect_specifics(items: Sequence[HistoryItem], previous: Sequence[str] = ()) -> list[str]:
    """The ledger: ``previous`` then details new in ``items``, deduplicated, the most
    recent :data:`MAX_SPECIFICS` kept."""
    seen = set(previous)
    merged = list(previous)
    texts = [f"{it.content}\n{it.tool_calls}" if it.tool_calls else it.content for it in items]
    for found in core.extract_specifics("\n".join(texts)) if texts else []:
        if found not in seen:
            seen.add(found)
            merged.append(found)
    return merged[-MAX_SPECIFICS:]


def parse_specifics(summary_text: str | None) -> list[str]:
    """The ledger of a rendered summary (the ``- `` lines under the last Specifics
    heading), so an update carries it forward."""
    if not summary_text:
        return []
    at = summary_text.rfind(SPECIFICS_HEADING)
    if at < 0:
        return []
    out: list[str] = []
    for line in summary_text[at + len(SPECIFICS_HEADING) :].splitlines():
        if line.startswith("- "):
            out.append(line[2:])
        elif line.startswith("#"):
            break
    return out


def strip_specifics(summary_text: str) -> str:
    """The summary without its ledger (the LLM gets the ledger back from code, not from
    its own rewriting of it)."""
    at = summary_text.rfind(SPECIFICS_HEADING)
    return summary_text[:at].rstrip() if at >= 0 else summary_text


class ExtractiveSummarizer:
    """The extractive summary, no LLM: the user's requests (up to 200 characters each) and the
    agent's actions (metadata ``action``/``agent_type``/``actions`` and tool names), laid
    out in the checkpoint's sections. Deterministic and pure; also the fallback."""

    def __init__(self, max_requests: int = 20, max_previous_chars: int = 6_000) -> None:
        self.max_requests = max_requests
        self.max_previous_chars = max_previous_chars

    def summarize(
        self, items: Sequence[HistoryItem], previous_summary: str | None
    ) -> SummaryResult:
        return SummaryResult(
            text=self.text(items, previous_summary),
            path="fallback",
            specifics=tuple(collect_specifics(items, parse_specifics(previous_summary))),
        )

    def text(self, items: Sequence[HistoryItem], previous_summary: str | None) -> str:
        requests = [
            _clip(" ".join(it.content.split()), USER_REQUEST_CHARS)
            for it in items
            if it.role is Role.USER and it.content.strip()
        ]
        actions = _agent_actions(items)
        goal = requests[-1] if requests else "Unknown (no user request in this span)."
        omitted = len(requests) - self.max_requests
        shown = requests[-self.max_requests :]
        progress = [f"- User asked: {r}" for r in shown]
        if omitted > 0:
            progress.insert(0, f"- ({omitted} earlier requests omitted)")
        if actions:
            progress.append("- Agent actions: " + ", ".join(actions))
        sections = {
            "Goal": goal,
            "Constraints": "None recorded (extractive summary).",
            "Progress": "\n".join(progress) or "None.",
            "Decisions": "None recorded (extractive summary).",
            "Next steps": "Continue from the most recent messages.",
            "Critical context": "None.",
        }
        if previous_summary:
            earlier = strip_specifics(previous_summary).strip()
            if len(earlier) > self.max_previous_chars:
                earlier = "…" + earlier[-self.max_previous_chars :]
            sections["Critical context"] = "Earlier checkpoint:\n" + earlier
        return "\n\n".join(f"## {name}\n{sections[name]}" for name in SUMMARY_SECTIONS)


def _agent_actions(items: Sequence[HistoryItem]) -> list[str]:
    """Distinct actions in order: metadata-declared ones first seen, tool names with
    counts. Metadata is free-form, so only string values of known keys are read."""
    counts: dict[str, int] = {}
    for item in items:
        if item.metadata:
            try:
                meta = json.loads(item.metadata)
            except ValueError:
                meta = None
            if isinstance(meta, dict):
                for key in ("action", "agent_type", "actions"):
                    value = meta.get(key)
                    values = value if isinstance(value, list) else [value]
                    for v in values:
                        if isinstance(v, str) and v:
                            counts[_clip(v, 80)] = counts.get(_clip(v, 80), 0) + 1
        if item.role in (Role.TOOL_USE, Role.ASSISTANT) and item.tool_calls:
            for call in parse_tool_calls(item.tool_calls):
                label = f"called {call.name}"
                counts[label] = counts.get(label, 0) + 1
    return [k if n == 1 else f"{k} (x{n})" for k, n in counts.items()]


@dataclass(frozen=True, slots=True)
class AnthropicConfig:
    """Settings of :class:`AnthropicSummarizer`. ``api_key`` ``None`` reads
    ``ANTHROPIC_API_KEY``; ``max_retries`` defaults to 0 because a context build waits on
    this call and the fallback is always available."""

    model: str = "claude-haiku-4-5"
    max_tokens: int = 2_048
    api_key: str | None = None
    base_url: str | None = None
    timeout_s: float = 30.0
    max_retries: int = 0
    system_prompt: str = SYSTEM_PROMPT
    create_prompt: str = CREATE_PROMPT
    update_prompt: str = UPDATE_PROMPT
    max_chars_per_message: int = 2_000
    max_transcript_chars: int = 400_000


class AnthropicSummarizer:
    """Checkpoint compaction through the Messages API; falls back instead of failing."""

    def __init__(
        self,
        config: AnthropicConfig | None = None,
        fallback: ExtractiveSummarizer | None = None,
    ) -> None:
        self.config = config or AnthropicConfig()
        self.fallback = fallback or ExtractiveSummarizer()
        # One client for every summary (it keeps its HTTP connections), remade only when
        # the API key in the environment changes.
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._client_key: str | None = None

    def close(self) -> None:
        """Close the HTTP client (at server shutdown)."""
        with self._client_lock:
            if self._client is not None:
                self._client.close()
            self._client, self._client_key = None, None

    def summarize(
        self, items: Sequence[HistoryItem], previous_summary: str | None
    ) -> SummaryResult:
        try:
            text = self._call_llm(items, previous_summary)
        except Exception as exc:  # any failure means: use the fallback, say why
            result = self.fallback.summarize(items, previous_summary)
            error = f"{type(exc).__name__}: {exc}"
            return SummaryResult(result.text, "fallback", error[:500], result.specifics)
        specifics = collect_specifics(items, parse_specifics(previous_summary))
        return SummaryResult(text, "llm", None, tuple(specifics))

    def prompt(self, items: Sequence[HistoryItem], previous_summary: str | None) -> str:
        """The user message sent to the model (create, or update over the previous one)."""
        conversation = transcript(items, self.config.max_chars_per_message)
        limit = self.config.max_transcript_chars
        if len(conversation) > limit:
            # Keep the newest part: it says what is still going on.
            conversation = "[… earlier messages omitted]\n" + conversation[-limit:]
        if previous_summary:
            return self.config.update_prompt.format(
                previous=strip_specifics(previous_summary), conversation=conversation
            )
        return self.config.create_prompt.format(conversation=conversation)

    def summarize_session(self, items: Sequence[HistoryItem]) -> SessionSummary:
        """A snapshot's summary in 2 to 4 sentences through the Messages API; on any
        failure (no key, an API error, a timeout, an empty answer) SUMMARY_FAILED."""
        conversation = transcript(items, self.config.max_chars_per_message)
        limit = self.config.max_transcript_chars
        if len(conversation) > limit:
            conversation = "[… earlier messages omitted]\n" + conversation[-limit:]
        try:
            text = self._ask(
                SESSION_SYSTEM_PROMPT,
                SESSION_PROMPT.format(conversation=conversation),
                min(self.config.max_tokens, SESSION_SUMMARY_MAX_TOKENS),
            )
        except Exception as exc:  # any failure: the snapshot is saved all the same
            return SessionSummary(SUMMARY_FAILED, f"{type(exc).__name__}: {exc}"[:500])
        return SessionSummary(" ".join(text.split())[:MAX_SESSION_SUMMARY_CHARS])

    def _call_llm(self, items: Sequence[HistoryItem], previous_summary: str | None) -> str:
        return self._ask(
            self.config.system_prompt,
            self.prompt(items, previous_summary),
            self.config.max_tokens,
        )

    def _ask(self, system: str, prompt: str, max_tokens: int) -> str:
        """One Messages API call: the text of the answer (ValueError when it has none)."""
        import anthropic  # imported lazily: the SDK is heavy and only this path needs it

        key = self.config.api_key or os.environ.get("ANTHROPIC_API_KEY")
        if not key:
            raise RuntimeError("no API key (set ANTHROPIC_API_KEY)")
        with self._client_lock:
            if self._client is None or self._client_key != key:
                if self._client is not None:
                    self._client.close()
                self._client = anthropic.Anthropic(
                    api_key=key,
                    base_url=self.config.base_url,
                    timeout=self.config.timeout_s,
                    max_retries=self.config.max_retries,
                )
                self._client_key = key
            client = self._client
        response = client.messages.create(
            model=self.config.model,
            max_tokens=max_tokens,
            system=system,
            messages=[{"role": "user", "content": prompt}],
        )
        blocks = getattr(response, "content", None)
        if not isinstance(blocks, list):
            raise ValueError("malformed response: no content list")
        parts = [
            b.text
            for b in blocks
            if getattr(b, "type", None) == "text" and isinstance(getattr(b, "text", None), str)
        ]
        text = "\n".join(parts).strip()
        if not text:
            raise ValueError("empty response: no text content")
        return text


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"
