"""Summarizers: fold old messages into one structured checkpoint.

A summarizer never fails a context build. :class:`AnthropicSummarizer` asks Claude for a
structured checkpoint; on any failure (no key, network, API status, rate limit,
timeout, an empty or malformed answer) it falls back to :class:`ExtractiveSummarizer`
(the user's requests, up to 200 characters each, and what the agent did) and
reports which path ran and why. A summary never makes a build fail.

Both attach a *specifics ledger* (:mod:`contextd.app.build.ledger`): paths, commands,
URLs, ids, amounts, versions and error lines, verbatim and with the message each came
from, because summaries keep the gist and lose exactly the details an agent needs to
carry on. The ledger of the previous summary is carried into the next one.

Both carry the thread's *goal* forward: the first user request and later explicit
changes of goal head the Goal section of every checkpoint, copied from the previous
checkpoint, never replaced by the latest request (:func:`thread_goal`).

The LLM path reads a long span in chunks (at most ``max_transcript_chars`` in all, in
chunks of ``chunk_chars``; each message clipped shorter rather than old messages left
out), each chunk updating the checkpoint of the chunks before it; and it passes a
quality gate: an answer that is empty or misses a section is asked for once more, then
replaced by the extractive summary (:func:`quality_problem`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from contextd.app.build import ledger
from contextd.app.build.ledger import SPECIFICS_HEADING as SPECIFICS_HEADING
from contextd.app.build.ledger import Entry
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

MAX_SPECIFICS = 80
"""A saved session's list of specifics keeps the most recent this many (a checkpoint's
ledger is bounded by :data:`contextd.app.build.ledger.MAX_LEDGER_ENTRIES` and its share
of the budget instead)."""

GOAL_CHARS = 200
"""The first request and each change of goal are kept up to this many characters (as
user requests are)."""

MAX_GOAL_CHANGES = 5
"""Changes of goal carried forward (the most recent; the first request always stays)."""

ORIGINAL_REQUEST = "Original request"
GOAL_CHANGE = "Goal change"
_GOAL_LINE = re.compile(
    rf"^- (?:{ORIGINAL_REQUEST}|{GOAL_CHANGE}) \(message:(-?\d+)\): .*$", re.MULTILINE
)
_GOAL_LINE_PARTS = re.compile(rf"^- ({ORIGINAL_REQUEST}|{GOAL_CHANGE}) \(message:(-?\d+)\): (.*)$")
GOAL_CHANGE_PATTERN = re.compile(
    r"(?i)\b(?:new (?:goal|task|objective|priority)\b|change of plans?\b"
    r"|the (?:goal|task|plan|priority) is now\b|(?:let'?s|let us|please|we should) "
    r"(?:now )?(?:switch|pivot|move on|change course) to\b|instead,? (?:let'?s|please|we)\b"
    r"|forget (?:that|about (?:that|it|the)|the previous)\b|scratch that\b"
    r"|stop working on\b|from now on\b)"
    r"|新的目标|目标改为|目标改成|改为做|换个任务|新しい目標|目標を変更|代わりに"
)
"""A user message matching this states a change of goal (it is carried forward)."""

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
    specifics ledger (previous ledger first, then new details). ``ledger`` holds the
    entries with their provenance; ``specifics`` their texts (or, given alone, the texts
    of a ledger without provenance). ``added`` counts entries new in this summary,
    ``attempts`` the model calls made (a retry after the quality gate counts)."""

    text: str
    path: SummaryPath
    error: str | None = None
    specifics: tuple[str, ...] = ()
    ledger: tuple[Entry, ...] = ()
    added: int = 0
    attempts: int = 0

    def entries(self) -> tuple[Entry, ...]:
        """The ledger, from ``specifics`` when only those were given."""
        return self.ledger or tuple(Entry(s) for s in self.specifics)


def _result(
    text: str,
    path: SummaryPath,
    error: str | None,
    entries: Sequence[Entry],
    added: int,
    attempts: int = 0,
) -> SummaryResult:
    return SummaryResult(
        text, path, error, tuple(e.text for e in entries), tuple(entries), added, attempts
    )


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
    return "\n".join(transcript_lines(items, max_chars_per_message))


def transcript_lines(items: Sequence[HistoryItem], max_chars_per_message: int) -> list[str]:
    """The lines of :func:`transcript`."""
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
    return lines


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
    """A saved session's specifics: ``previous`` then details new in ``items``,
    deduplicated, the most recent :data:`MAX_SPECIFICS` kept."""
    merged, _ = ledger.merge([Entry(s) for s in previous], ledger.extract(items))
    return [e.text for e in merged][-MAX_SPECIFICS:]


def build_ledger(
    items: Sequence[HistoryItem], previous_summary: str | None
) -> tuple[list[Entry], int, int]:
    """The checkpoint's ledger: the previous summary's, then what ``items`` add. Returns
    it, how many entries are new, and how many the stored bound evicted."""
    previous = ledger.parse(previous_summary)
    merged, evicted = ledger.merge(previous, ledger.extract(items))
    return merged, len(merged) - len(previous) + evicted, evicted


def parse_specifics(summary_text: str | None) -> list[str]:
    """The ledger's texts of a rendered summary (under the last Specifics heading), so an
    update carries it forward."""
    return [e.text for e in ledger.parse(summary_text)]


def strip_specifics(summary_text: str) -> str:
    """The summary without its ledger (the LLM gets the ledger back from code, not from
    its own rewriting of it)."""
    return ledger.strip(summary_text)


def _is_request(item: HistoryItem) -> bool:
    """A user message someone wrote (not a summary, nor an orphan tool output turned into
    user text)."""
    return (
        item.role is Role.USER
        and not item.is_summary
        and bool(item.content.strip())
        and not item.content.startswith("[output of tool call ")
    )


def thread_goal(items: Sequence[HistoryItem], previous_summary: str | None) -> list[str]:
    """The Goal lines of a checkpoint: the thread's first request and its later explicit
    changes of goal (see :data:`GOAL_CHANGE_PATTERN`), each with its message id.

    From the previous checkpoint when it has them (the first request of the thread is
    the one it recorded), plus changes found in ``items``; the latest request alone never
    becomes the goal. The most recent :data:`MAX_GOAL_CHANGES` changes are kept.
    """
    original: str | None = None
    changes: list[str] = []
    for line in (previous_summary or "").splitlines():
        m = _GOAL_LINE_PARTS.match(line)
        if m is None:
            continue
        if m.group(1) == ORIGINAL_REQUEST and original is None:
            original = line
        elif m.group(1) == GOAL_CHANGE:
            changes.append(line)
    for item in items:
        if not _is_request(item):
            continue
        text = _clip(" ".join(item.content.split()), GOAL_CHARS)
        if original is None:
            original = f"- {ORIGINAL_REQUEST} (message:{item.id}): {text}"
        elif GOAL_CHANGE_PATTERN.search(item.content):
            changes.append(f"- {GOAL_CHANGE} (message:{item.id}): {text}")
    lines = [original] if original is not None else []
    return lines + changes[-MAX_GOAL_CHANGES:]


def with_goal(text: str, goal: Sequence[str]) -> str:
    """``text`` with ``goal`` heading its Goal section (goal lines elsewhere in it, such as
    a model's copy, are removed first)."""
    if not goal:
        return text
    body = _GOAL_LINE.sub("", text)
    body = re.sub(r"\n{3,}", "\n\n", body).strip()
    block = "\n".join(goal)
    m = re.search(r"^## Goal[ \t]*$", body, re.MULTILINE)
    if m is None:
        return f"## Goal\n{block}\n\n{body}".rstrip()
    return body[: m.end()] + "\n" + block + body[m.end() :]


def quality_problem(text: str) -> str | None:
    """Why a model's checkpoint is unusable, or ``None``: empty, or missing a section."""
    if not text.strip():
        return "the summary is empty"
    missing = [
        name
        for name in SUMMARY_SECTIONS
        if not re.search(rf"^## {re.escape(name)}[ \t]*$", text, re.MULTILINE)
    ]
    if missing:
        return "the summary misses sections: " + ", ".join(missing)
    return None


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
        entries, added, _ = build_ledger(items, previous_summary)
        return _result(self.text(items, previous_summary), "fallback", None, entries, added)

    def text(self, items: Sequence[HistoryItem], previous_summary: str | None) -> str:
        """The checkpoint's prose; its Goal is the thread's goal (:func:`thread_goal`)."""
        requests = [
            _clip(" ".join(it.content.split()), USER_REQUEST_CHARS)
            for it in items
            if _is_request(it)
        ]
        actions = _agent_actions(items)
        goal = thread_goal(items, previous_summary)
        omitted = len(requests) - self.max_requests
        shown = requests[-self.max_requests :]
        progress = [f"- User asked: {r}" for r in shown]
        if omitted > 0:
            progress.insert(0, f"- ({omitted} earlier requests omitted)")
        if actions:
            progress.append("- Agent actions: " + ", ".join(actions))
        sections = {
            "Goal": "\n".join(goal) or "Unknown (no user request in this span).",
            "Constraints": "None recorded (extractive summary).",
            "Progress": "\n".join(progress) or "None.",
            "Decisions": "None recorded (extractive summary).",
            "Next steps": "Continue from the most recent messages.",
            "Critical context": "None.",
        }
        if previous_summary:
            earlier = _GOAL_LINE.sub("", strip_specifics(previous_summary)).strip()
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
    this call and the fallback is always available.

    A span is sent in chunks of at most ``chunk_chars`` characters of transcript, at most
    ``max_transcript_chars`` in all: so at most ``max_transcript_chars / chunk_chars``
    (8) calls, each asked once more if its answer fails the quality gate. Messages are
    clipped to ``max_chars_per_message``, and shorter (down to
    ``min_chars_per_message``) when the span would exceed the total; only past that are
    the oldest messages after the first request left out."""

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
    max_transcript_chars: int = 800_000
    chunk_chars: int = 100_000
    min_chars_per_message: int = 120


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
        entries, added, evicted = build_ledger(items, previous_summary)
        goal = thread_goal(items, previous_summary)
        attempts = 0
        try:
            running = previous_summary
            for chunk in self.chunks(items):
                text, problem = "", None
                for _ in range(2):  # the quality gate: one more try, then the fallback
                    attempts += 1
                    try:
                        text = self._ask(
                            self.config.system_prompt,
                            self._prompt_for(chunk, running),
                            self.config.max_tokens,
                        )
                    except EmptyAnswerError as exc:
                        problem = str(exc)
                        continue
                    problem = quality_problem(strip_specifics(text))
                    if problem is None:
                        break
                if problem is not None:
                    raise QualityGateError(problem)
                running = with_goal(strip_specifics(text), goal)
            assert running is not None  # items is never empty
            lost = {e.text for e in ledger.parse(previous_summary)} - {e.text for e in entries}
            if len(lost) > evicted:
                raise QualityGateError(f"the ledger lost {len(lost)} entries")
        except Exception as exc:  # any failure means: use the fallback, say why
            text = self.fallback.text(items, previous_summary)
            error = f"{type(exc).__name__}: {exc}"
            return _result(text, "fallback", error[:500], entries, added, attempts)
        return _result(running, "llm", None, entries, added, attempts)

    def chunks(self, items: Sequence[HistoryItem]) -> list[list[str]]:
        """The span's transcript lines in chunks of at most ``chunk_chars`` (a message
        longer than that is a chunk alone, clipped to it), every message represented:
        messages are clipped shorter until the whole fits ``max_transcript_chars``."""
        cfg = self.config
        clip = cfg.max_chars_per_message
        lines = transcript_lines(items, clip)
        while sum(len(x) + 1 for x in lines) > cfg.max_transcript_chars:
            if clip <= cfg.min_chars_per_message:
                lines = _keep_head_and_tail(lines, cfg.max_transcript_chars)
                break
            clip = max(cfg.min_chars_per_message, clip * 2 // 3)
            lines = transcript_lines(items, clip)
        out: list[list[str]] = []
        size = 0
        for line in lines:
            line = _clip(line, cfg.chunk_chars)
            if out and size + len(line) + 1 <= cfg.chunk_chars:
                out[-1].append(line)
                size += len(line) + 1
            else:
                out.append([line])
                size = len(line) + 1
        return out or [[]]

    def prompt(self, items: Sequence[HistoryItem], previous_summary: str | None) -> str:
        """The user message of the first call (create, or update over the previous one)."""
        return self._prompt_for(self.chunks(items)[0], previous_summary)

    def _prompt_for(self, lines: Sequence[str], previous_summary: str | None) -> str:
        conversation = "\n".join(lines)
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
        # A model may emit U+0000; no engine stores it in a text column (PostgreSQL
        # refuses it), and a client could not have sent it, so it never gets further.
        text = "\n".join(parts).replace("\x00", "").strip()
        if not text:
            raise EmptyAnswerError("empty response: no text content")
        return text


class QualityGateError(ValueError):
    """A model's checkpoint failed the quality gate twice."""


class EmptyAnswerError(ValueError):
    """The model answered without any text."""


def _keep_head_and_tail(lines: list[str], limit: int) -> list[str]:
    """The first line (the thread's opening) and the newest lines that fit ``limit``."""
    head, rest = lines[:1], lines[1:]
    budget = limit - sum(len(x) + 1 for x in head) - 40
    tail: list[str] = []
    for line in reversed(rest):
        if budget - len(line) - 1 < 0:
            break
        budget -= len(line) + 1
        tail.append(line)
    omitted = len(rest) - len(tail)
    note = [f"[… {omitted} messages omitted]"] if omitted else []
    return head + note + tail[::-1]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"
