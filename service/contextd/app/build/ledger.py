"""The specifics ledger: the verbatim evidence a checkpoint carries beside its prose.

Summaries keep conclusions and lose evidence (paths, commands, ids, amounts, errors), so
every checkpoint ends with a ledger of those strings, found by
:func:`contextd.core.extract_specifics_batch` in the messages it folds. Each entry keeps
the id of the message it came from (its provenance: ``message:<id>`` fetches the source)
and how many messages mentioned it (its references). Rendered under the Specifics
heading, grouped by source::

    ## Specifics
    [message:12]
    - src/api/orders.py
    - pytest -x -q (x3)

Ledgers merge across compactions: old entries first, in order, none lost, a repeat adds
to an entry's references instead of a duplicate line. A ledger is bounded twice: at most
:data:`MAX_LEDGER_ENTRIES` entries stored, and, in a build, at most its share of the
budget; past either bound the least-referenced entries go first, the oldest first among
equals, and the build reports how many went. Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from contextd import core
from contextd.domain.context import HistoryItem, TokenCounter
from contextd.domain.model import Role

SPECIFICS_HEADING = "## Specifics"

MAX_LEDGER_ENTRIES = 2_000
"""The most entries a stored ledger keeps (bounds the work of every later merge)."""

LEDGER_SHARE = 0.25
"""The share of a build's history budget the ledger may take; past it, entries go."""

# Identifiers are specifics in what people and the agent write, but in tool output (a
# file's source, a log) every word of code is one: there they are noise.
_IDENTIFIER = "identifier"

_SOURCE = re.compile(r"^\[message:(-?\d+)\]$")
_ENTRY = re.compile(r"^- (.*?)(?: \(x(\d+)\))?$")


@dataclass(frozen=True, slots=True)
class Entry:
    """One verbatim detail, the message it came from (0: unknown) and how many messages
    mentioned it."""

    text: str
    source: int = 0
    refs: int = 1


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """What a build did with the ledger of the summary in its context."""

    entries: int = 0
    tokens: int = 0
    added: int = 0
    evicted: int = 0


def extract(items: Sequence[HistoryItem]) -> list[Entry]:
    """The entries of ``items`` (oldest first), each with the id of the first message that
    has it and the number of messages that do. Summary items are skipped (their ledger is
    carried by :func:`merge`), and so are identifiers in tool output and call arguments."""
    texts: list[str] = []
    owners: list[tuple[int, bool]] = []  # (item index, identifiers wanted)
    for i, item in enumerate(items):
        if item.is_summary:
            continue
        prose = item.role in (Role.USER, Role.ASSISTANT)
        if item.content:
            texts.append(item.content)
            owners.append((i, prose))
        if item.tool_calls:
            texts.append(item.tool_calls)
            owners.append((i, False))
    found = core.extract_specifics_batch(texts) if texts else []
    order: dict[str, Entry] = {}
    seen_in: dict[str, int] = {}
    for (i, identifiers), pairs in zip(owners, found, strict=True):
        for kind, text in pairs:
            if kind == _IDENTIFIER and not identifiers:
                continue
            if seen_in.get(text) == i:
                continue  # one message references an entry once
            seen_in[text] = i
            old = order.get(text)
            order[text] = (
                Entry(text, items[i].id) if old is None else replace(old, refs=old.refs + 1)
            )
    return list(order.values())


def merge(previous: Sequence[Entry], new: Iterable[Entry]) -> tuple[list[Entry], int]:
    """``previous`` then what is new in ``new``; a repeat adds its references to the old
    entry. Returns the ledger and how many entries the stored bound evicted."""
    merged: dict[str, Entry] = {}
    for entry in previous:
        old = merged.get(entry.text)
        merged[entry.text] = entry if old is None else replace(old, refs=old.refs + entry.refs)
    for entry in new:
        old = merged.get(entry.text)
        merged[entry.text] = entry if old is None else replace(old, refs=old.refs + entry.refs)
    entries = list(merged.values())
    if len(entries) <= MAX_LEDGER_ENTRIES:
        return entries, 0
    drop = set(eviction_order(entries)[: len(entries) - MAX_LEDGER_ENTRIES])
    return [e for i, e in enumerate(entries) if i not in drop], len(drop)


def eviction_order(entries: Sequence[Entry]) -> list[int]:
    """Indices of ``entries`` in the order they go: least referenced first, oldest first
    among equals (``entries`` is oldest first)."""
    return sorted(range(len(entries)), key=lambda i: (entries[i].refs, i))


def render(entries: Sequence[Entry]) -> str:
    """The ledger section (empty when there are no entries)."""
    if not entries:
        return ""
    lines = [SPECIFICS_HEADING]
    source: int | None = None
    for entry in entries:
        if entry.source != source:
            source = entry.source
            if source:
                lines.append(f"[message:{source}]")
        suffix = f" (x{entry.refs})" if entry.refs > 1 else ""
        lines.append(f"- {entry.text}{suffix}")
    return "\n".join(lines)


def parse(summary_text: str | None) -> list[Entry]:
    """The ledger of a rendered summary (under its last Specifics heading)."""
    if not summary_text:
        return []
    at = summary_text.rfind(SPECIFICS_HEADING)
    if at < 0:
        return []
    out: list[Entry] = []
    source = 0
    for line in summary_text[at + len(SPECIFICS_HEADING) :].splitlines():
        if m := _SOURCE.match(line):
            source = int(m.group(1))
        elif line.startswith("- "):
            m = _ENTRY.match(line)
            assert m is not None  # the pattern matches every "- " line
            out.append(Entry(m.group(1), source, int(m.group(2) or 1)))
        elif line.startswith("#"):
            break
    return out


def strip(summary_text: str) -> str:
    """The summary without its ledger."""
    at = summary_text.rfind(SPECIFICS_HEADING)
    return summary_text[:at].rstrip() if at >= 0 else summary_text


def fit(entries: Sequence[Entry], max_tokens: int, count: TokenCounter) -> tuple[list[Entry], int]:
    """The entries whose rendering costs at most ``max_tokens`` (about: lines are counted
    one by one), evicting in :func:`eviction_order`; and how many were evicted."""
    if not entries:
        return [], 0
    lines = [f"- {e.text}" + (f" (x{e.refs})" if e.refs > 1 else "") for e in entries]
    sources = sorted({e.source for e in entries})
    costs = count([*lines, SPECIFICS_HEADING, *(f"[message:{s}]" for s in sources)])
    line_costs = costs[: len(lines)]
    total = sum(costs) + len(lines) + len(sources)  # a newline each, at most a token
    if total <= max_tokens:
        return list(entries), 0
    header_cost = dict(zip(sources, costs[len(lines) + 1 :], strict=True))
    left = {s: 0 for s in sources}
    for e in entries:
        left[e.source] += 1
    gone: set[int] = set()
    for i in eviction_order(entries):
        if total <= max_tokens:
            break
        gone.add(i)
        total -= line_costs[i] + 1
        source = entries[i].source
        left[source] -= 1
        if not left[source]:  # its group is gone, and the group's header with it
            total -= header_cost[source] + 1
    return [e for i, e in enumerate(entries) if i not in gone], len(gone)


def with_ledger(summary_text: str, entries: Sequence[Entry]) -> str:
    """``summary_text`` with its ledger replaced by ``entries``."""
    body = strip(summary_text)
    ledger = render(entries)
    return f"{body}\n\n{ledger}" if ledger else body


def fit_item(
    item: HistoryItem,
    *,
    max_item_tokens: int,
    max_ledger_tokens: int,
    count: TokenCounter,
    added: int = 0,
) -> tuple[HistoryItem, LedgerStats]:
    """The summary ``item`` within ``max_item_tokens``, its ledger within
    ``max_ledger_tokens`` and at least half of the item's room: the evidence outranks the
    prose, so the prose is cut (from its end: the header and the Goal come first) before
    the ledger gives up more than that. Its token count is exact."""
    entries = parse(item.content)
    if not entries:
        return item, LedgerStats()
    body = strip(item.content)
    body_t = count([body])[0]
    room = max(0, min(max_ledger_tokens, max(max_item_tokens - body_t, max_item_tokens // 2)))
    kept, evicted = fit(entries, room, count)
    ledger_text = render(kept)
    ledger_t = count([ledger_text])[0] + 1 if kept else 0
    while kept and ledger_t > room:  # lines were counted one by one: trim to the whole
        kept, more = fit(kept, max(0, room - (ledger_t - room)), count)
        evicted += more
        ledger_text = render(kept)
        ledger_t = count([ledger_text])[0] + 1 if kept else 0
        if not more:
            break
    if body_t + ledger_t > max_item_tokens:
        body = _cut_prose(body, max(0, max_item_tokens - ledger_t), count)
    content = f"{body}\n\n{ledger_text}" if ledger_text else body
    total = count([content])[0]
    stats = LedgerStats(len(kept), ledger_t, added, evicted)
    return replace(item, content=content, token_count=total), stats


PROSE_CUT_NOTE = "\n[… the rest of this summary was cut to fit]"


def _cut_prose(body: str, max_tokens: int, count: TokenCounter) -> str:
    """The longest head of ``body`` (whole lines where possible) costing at most
    ``max_tokens`` with a note saying it was cut (binary search over characters)."""
    lo, hi, best = 0, len(body), ""
    while lo <= hi:
        mid = (lo + hi) // 2
        cut = body[:mid]
        if "\n" in cut and mid < len(body):
            cut = cut[: cut.rfind("\n")]
        candidate = cut + PROSE_CUT_NOTE
        if count([candidate])[0] + 2 <= max_tokens:
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best or body[:0]
