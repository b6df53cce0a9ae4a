"""The structure of a history and checkpoint compaction over it. Pure functions.

Tool pairs
    The Messages and Chat Completions APIs reject a tool_result without its tool_use and
    a tool_use without a result for each of its calls. :func:`repair_tool_pairs` makes a
    window pair-complete once, up front (a stored window can start after a call, or end
    before its results arrive); everything after it (trimming, cutting, eliding) only
    ever keeps or drops whole groups, so the result stays pair-complete.

Compaction
    When the window does not fit, keep the most recent part (at least
    ``keep_recent_messages`` messages and about ``keep_recent_tokens``), cut only where a
    turn may start (never before a tool_result, never inside a tool group, parallel
    results included), and fold everything older into one checkpoint placed at the head.
    A previous checkpoint is reused: only messages newer than the range it covers are
    summarized, with an update prompt over it, so each message is summarized once.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from contextd import core
from contextd.app.build import ledger
from contextd.app.build.handles import full_text_handle
from contextd.app.build.summarizer import SummaryResult, strip_specifics
from contextd.domain.context import (
    HistoryItem,
    TokenCounter,
    ToolCall,
    parse_tool_calls,
    tool_calls_json,
)
from contextd.domain.model import Role

# How much of an orphan result's call arguments its note quotes.
ORPHAN_ARGS_CHARS = 200

_ROLE_CODES = {
    Role.USER: core.ROLE_USER,
    Role.ASSISTANT: core.ROLE_ASSISTANT,
    Role.TOOL_USE: core.ROLE_TOOL_USE,
    Role.TOOL_RESULT: core.ROLE_TOOL_RESULT,
}


_ROLE_OF = operator.attrgetter("role")
_CALLS_OF = operator.attrgetter("tool_calls")
_CHAT_ROLES = frozenset({Role.USER, Role.ASSISTANT})


def chat_only(items: Sequence[HistoryItem]) -> bool:
    """Whether ``items`` hold no tool role and no call (user and plain assistant turns).

    Such items take no part in :func:`repair_tool_pairs`: they issue no call and answer
    none, and it returns them as they are. So taking them out of a history, or appending
    them to it, changes none of its pairs: a history the repair left unchanged stays
    unchanged. A build after an append checks what it left out and what was appended
    this way, instead of repairing its whole window again (`WindowExtension._extended`,
    `compressor.extend_prepared`)."""
    return set(map(_ROLE_OF, items)) <= _CHAT_ROLES and not any(map(_CALLS_OF, items))


def repair_tool_pairs(
    items: Sequence[HistoryItem], outside_calls: Mapping[str, ToolCall] | None = None
) -> tuple[list[HistoryItem], list[int]]:
    """A pair-complete copy of ``items`` and the ids of the items it had to change.

    Rules: call ids are unique over the window (a call reusing an id is unanswered); each
    call takes the first tool_result naming it that comes after it. Unanswered calls are
    removed from their message; a tool-using message left with no call becomes a plain
    assistant message with a note of what it called; a tool_result that answers nothing
    becomes a user message marked as such, naming its call (and the tool and arguments
    when ``outside_calls``, the calls known to lie outside ``items``, has it).

    Why text and not a drop: the orphan's other half is gone from this context (before
    the window, a clear, or folded into a summary; or a call whose results never came),
    but what it says is still evidence the model can use, and as plain user or assistant
    text it is valid in both the Anthropic and the OpenAI renderings (adjacent turns of
    one role merge). Nothing is dropped, so no text is lost.
    """
    if chat_only(items):
        # A chat window (no tool role, no calls): nothing to pair, found without a
        # Python step per item (every build repairs its history, and renders it, more
        # than once); the loop below finds the same.
        return list(items), []
    calls_of: dict[int, list[str]] = {}
    issued: dict[str, int] = {}
    answered: dict[int, set[str]] = {}
    owner_of_result: dict[int, int] = {}
    results = False
    for i, item in enumerate(items):
        if item.role in (Role.TOOL_USE, Role.ASSISTANT):
            calls = parse_tool_calls(item.tool_calls) if item.tool_calls else []
            if not calls and item.role is Role.ASSISTANT:
                continue
            ids: list[str] = []
            for call in calls:
                if call.id and call.id not in issued:
                    issued[call.id] = i
                    ids.append(call.id)
            calls_of[i] = ids
        elif item.role is Role.TOOL_RESULT:
            results = True
            owner = issued.get(item.tool_call_id)
            if owner is not None and item.tool_call_id not in answered.setdefault(owner, set()):
                answered[owner].add(item.tool_call_id)
                owner_of_result[i] = owner
    if not calls_of and not results:
        # No call and no result: nothing to pair (every build repairs its history, and
        # renders it, more than once: this is the common chat window).
        return list(items), []

    out: list[HistoryItem] = []
    repaired: list[int] = []
    for i, item in enumerate(items):
        if i in calls_of:
            done = answered.get(i, set())
            all_calls = parse_tool_calls(item.tool_calls) if item.tool_calls else []
            valid_ids = set(calls_of[i])
            keep = [c for c in all_calls if c.id in valid_ids and c.id in done]
            if keep and len(keep) == len(all_calls):
                out.append(item)
                continue
            repaired.append(item.id)
            if keep:
                out.append(replace(item, tool_calls=tool_calls_json(keep)))
            else:
                note = "; ".join(f"{c.name}({c.arguments_json})" for c in all_calls)
                text = item.content
                if note:
                    text = (text + "\n" if text else "") + f"[called {note} — no result]"
                out.append(replace(item, role=Role.ASSISTANT, content=text, tool_calls=""))
        elif item.role is Role.TOOL_RESULT and i not in owner_of_result:
            repaired.append(item.id)
            out.append(
                replace(
                    item,
                    role=Role.USER,
                    content=orphan_result_note(item.tool_call_id, outside_calls) + item.content,
                    tool_call_id="",
                )
            )
        else:
            out.append(item)
    return out, repaired


def orphan_result_note(call_id: str, outside_calls: Mapping[str, ToolCall] | None) -> str:
    """The line that opens an orphan tool_result turned into user text."""
    call = outside_calls.get(call_id) if outside_calls and call_id else None
    what = ""
    if call is not None:
        args = call.arguments_json
        args = args if len(args) <= ORPHAN_ARGS_CHARS else args[: ORPHAN_ARGS_CHARS - 1] + "…"
        what = f" to {call.name}({args})"
    return f"[output of tool call {call_id or '?'}{what}, whose call is not in the context]\n"


def trim_columns(items: Sequence[HistoryItem]) -> tuple[list[int], list[int]]:
    """The ``roles`` and ``groups`` columns of :func:`contextd.core.trim_to_budget` for
    pair-complete ``items``: a tool-using message and its results share a group id (the
    message's index); an assistant message carrying calls counts as a tool_use."""
    codes = _ROLE_CODES
    roles_in = list(map(_ROLE_OF, items))
    if Role.TOOL_RESULT not in set(roles_in) and not any(map(_CALLS_OF, items)):
        # No call and no result (a chat window; every build asks this more than once),
        # found without a Python step per item.
        return list(map(codes.__getitem__, roles_in)), [-1] * len(items)
    roles: list[int] = []
    groups: list[int] = []
    group_of_call: dict[str, int] = {}
    for i, item in enumerate(items):
        code = _ROLE_CODES[item.role]
        group = -1
        if item.role in (Role.TOOL_USE, Role.ASSISTANT) and item.tool_calls:
            calls = parse_tool_calls(item.tool_calls)
            if calls:
                code, group = core.ROLE_TOOL_USE, i
                for call in calls:
                    group_of_call.setdefault(call.id, i)
        elif item.role is Role.TOOL_RESULT:
            group = group_of_call.get(item.tool_call_id, -1)
        roles.append(code)
        groups.append(group)
    return roles, groups


def valid_cuts(items: Sequence[HistoryItem]) -> list[bool]:
    """``cuts[k]`` is whether ``items[k:]`` may be the kept part: it does not start with a
    tool_result and no tool group has members on both sides. ``len(items) + 1`` entries."""
    roles, groups = trim_columns(items)
    n = len(items)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, g in enumerate(groups):
        if g >= 0:
            first.setdefault(g, i)
            last[g] = i
    inside = [0] * (n + 2)
    for g, lo in first.items():
        inside[lo + 1] += 1
        inside[last[g] + 1] -= 1
    cuts = [True] * (n + 1)
    depth = 0
    for k in range(n + 1):
        depth += inside[k]
        if depth > 0 or (k < n and roles[k] == core.ROLE_TOOL_RESULT):
            cuts[k] = False
    return cuts


def newest_unit_start(items: Sequence[HistoryItem]) -> int:
    """Where the newest turn that may stand alone starts (0 for an empty list)."""
    cuts = valid_cuts(items)
    for k in range(len(items) - 1, -1, -1):
        if cuts[k]:
            return k
    return 0


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """What to fold: ``items[:cut_index]`` (``to_summarize``) go into the checkpoint,
    ``items[cut_index:]`` (``kept``) stay as they are. ``covers`` is the id range the new
    checkpoint will replace, extending the previous checkpoint's range."""

    cut_index: int
    to_summarize: tuple[HistoryItem, ...]
    kept: tuple[HistoryItem, ...]
    previous_summary: HistoryItem | None
    covers: tuple[int, int] | None


def plan_compaction(
    items: Sequence[HistoryItem],
    costs: Sequence[int],
    *,
    previous_summary: HistoryItem | None,
    keep_recent_tokens: int,
    keep_recent_messages: int,
    max_recent_tokens: int,
) -> CompactionPlan:
    """Choose the cut.

    ``items`` are the pair-complete messages newer than ``previous_summary``'s range,
    ``costs`` what each costs once kept. The wanted cut is the latest valid one whose
    suffix holds at least ``keep_recent_messages`` messages and ``keep_recent_tokens``
    tokens; it is moved later if that suffix exceeds ``max_recent_tokens`` (the room left
    beside the summary), but never past the start of the newest turn, which is kept (and
    truncated later if need be) rather than folded away.
    """
    n = len(items)
    cuts = valid_cuts(items)
    want = 0
    acc = 0
    for k in range(n - 1, -1, -1):
        acc += costs[k]
        if n - k >= keep_recent_messages and acc >= keep_recent_tokens:
            want = k
            break
    while want > 0 and not cuts[want]:
        want -= 1
    fit = n
    acc = 0
    for k in range(n - 1, -1, -1):
        acc += costs[k]
        if acc > max_recent_tokens:
            break
        if cuts[k]:
            fit = k
    cut = min(max(want, fit), newest_unit_start(items)) if n else 0
    folded = tuple(items[:cut])
    covers: tuple[int, int] | None = None
    if folded:
        start = folded[0].id
        if previous_summary is not None and previous_summary.summary_of is not None:
            start = previous_summary.summary_of[0]
        covers = (start, folded[-1].id)
    return CompactionPlan(cut, folded, tuple(items[cut:]), previous_summary, covers)


def summary_header(covers: tuple[int, int]) -> str:
    return (
        f"[Context checkpoint: summary of the earlier conversation, "
        f"messages {covers[0]}..{covers[1]}]"
    )


def make_summary_item(
    result: SummaryResult, covers: tuple[int, int], count_tokens: TokenCounter
) -> HistoryItem:
    """The checkpoint as a history item: a user message (the APIs want a user turn first)
    flagged ``is_summary``, with the ledger (entries grouped by source message) under a
    Specifics heading. Its id is ``-covers[1]`` until the caller stores it; its metadata
    says what it replaces."""
    text = ledger.with_ledger(
        summary_header(covers) + "\n\n" + strip_specifics(result.text).strip(),
        result.entries(),
    )
    meta = {"is_summary": True, "summary_of": list(covers), "summarizer": result.path}
    return HistoryItem(
        id=-covers[1],
        role=Role.USER,
        content=text,
        token_count=count_tokens([text])[0],
        is_summary=True,
        metadata=json.dumps(meta, separators=(",", ":")),
        summary_of=covers,
    )


def fold_into_ledger(
    summary: HistoryItem, items: Sequence[HistoryItem], covers: tuple[int, int], count: TokenCounter
) -> tuple[HistoryItem, int]:
    """``summary`` extended over ``items`` without a summarizer: its prose as it is, its
    range to ``covers``, and the specifics of ``items`` merged into its ledger. For a fold
    too small to be worth a new checkpoint: nothing it held is lost, no model is asked.
    Returns the item and how many ledger entries are new."""
    previous = ledger.parse(summary.content)
    merged, evicted = ledger.merge(previous, ledger.extract(items))
    body = summary_body(summary)
    text = ledger.with_ledger(summary_header(covers) + "\n\n" + ledger.strip(body), merged)
    try:
        meta = json.loads(summary.metadata) if summary.metadata else {}
    except ValueError:
        meta = {}
    if not isinstance(meta, dict):
        meta = {}
    meta |= {"is_summary": True, "summary_of": list(covers)}
    item = replace(
        summary,
        content=text,
        token_count=count([text])[0],
        metadata=json.dumps(meta, separators=(",", ":")),
        summary_of=covers,
    )
    return item, len(merged) - len(previous) + evicted


def summary_body(item: HistoryItem) -> str:
    """A checkpoint's text without its header, as the update prompt's previous summary
    (the ledger stays, whole: the entries and reference counts a build kept in the
    metadata go back in, :func:`ledger.restore`; the summarizer carries it forward)."""
    text = ledger.restore(item).content
    if text.startswith("[Context checkpoint:"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return text.strip()


def summary_range(item: HistoryItem) -> tuple[int, int] | None:
    """The id range a summary covers: its field, else its metadata (a stored summary)."""
    if item.summary_of is not None:
        return item.summary_of
    try:
        meta = json.loads(item.metadata) if item.metadata else None
    except ValueError:
        return None
    rng = meta.get("summary_of") if isinstance(meta, dict) else None
    if isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng):
        return (rng[0], rng[1])
    return None


def split_summary(
    history: Sequence[HistoryItem], previous_summary: HistoryItem | None = None
) -> tuple[HistoryItem | None, list[HistoryItem]]:
    """The summary in effect and the messages it does not cover.

    The summary is ``previous_summary`` if given, else the last summary item in
    ``history``; other summary items and messages inside its range are dropped (they are
    what it replaces). A summary without a known range cannot be reused and is ignored.
    """
    summary = previous_summary
    if summary is None:
        for item in reversed(history):
            if item.is_summary:
                summary = item
                break
    covers = summary_range(summary) if summary is not None else None
    if summary is not None and covers is None:
        summary = None
    elif summary is not None and summary.summary_of is None:
        summary = replace(summary, summary_of=covers)
    # A range of ids is a range of the thread's sequence: the store's one writer hands
    # out a thread's ids and sequence numbers in the same (append) order.
    rest = [
        it
        for it in history
        if not it.is_summary and (covers is None or not covers[0] <= it.id <= covers[1])
    ]
    return summary, rest


def elide_tool_results(
    items: Sequence[HistoryItem], *, threshold_chars: int, keep_recent_turns: int
) -> tuple[list[HistoryItem], list[int]]:
    """Replace old, long tool results by a stub; return the new list and elided ids.

    Old means before the ``keep_recent_turns``-th most recent user message (a turn starts
    at a user message); nothing is old when there are fewer turns. The stub names the
    tool (from the matching call), the size, the first line, and the ``message:<id>``
    handle to fetch the full output. The stub keeps ``tool_call_id``, so pairs hold.
    """
    if keep_recent_turns == 0:
        boundary = len(items)
    else:
        users = [i for i, it in enumerate(items) if it.role is Role.USER and not it.is_summary]
        boundary = users[-keep_recent_turns] if len(users) >= keep_recent_turns else 0
    names: dict[str, str] = {}
    out: list[HistoryItem] = []
    elided: list[int] = []
    for i, item in enumerate(items):
        if item.role in (Role.TOOL_USE, Role.ASSISTANT) and item.tool_calls:
            for call in parse_tool_calls(item.tool_calls):
                names.setdefault(call.id, call.name)
        if i < boundary and item.role is Role.TOOL_RESULT and len(item.content) > threshold_chars:
            out.append(replace(item, content=elision_stub(item, names.get(item.tool_call_id))))
            elided.append(item.id)
        else:
            out.append(item)
    return out, elided


# The most characters of specifics an elision stub quotes (errors first).
ELISION_SPECIFICS_CHARS = 400


def elision_stub(item: HistoryItem, tool_name: str | None) -> str:
    """The stub of an elided tool result: tool, size, first line, the output's errors and
    other specifics (up to :data:`ELISION_SPECIFICS_CHARS`; errors are usually at the
    end, which the first line does not show), and the handle of the full output."""
    first = item.content.lstrip().split("\n", 1)[0][:160]
    lines = item.content.count("\n") + 1
    (found,) = core.extract_specifics_batch([item.content])
    ranked = [t for k, t in found if k == "error"] + [
        t for k, t in found if k not in ("error", "identifier")
    ]
    quoted: list[str] = []
    size = 0
    for text in ranked:
        if text in first or size + len(text) > ELISION_SPECIFICS_CHARS:
            continue
        quoted.append(text)
        size += len(text) + 3
    details = f" Details: {' | '.join(quoted)}." if quoted else ""
    return (
        f"[tool result elided: {tool_name or 'unknown tool'} returned "
        f"{len(item.content)} chars in {lines} lines, starting: {first!r}.{details} "
        f"Full output: {full_text_handle(item)}]"
    )
