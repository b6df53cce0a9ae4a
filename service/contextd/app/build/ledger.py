"""The specifics ledger: the verbatim evidence a checkpoint carries beside its prose.

Summaries keep conclusions and lose evidence (paths, commands, ids, amounts, errors), so
every checkpoint ends with a ledger of those strings, found by
:func:`contextd.core.extract_specifics_batch` in the messages it folds. Each entry keeps
the id of the message it came from (its provenance: ``message:<id>`` fetches the source)
and how many messages mentioned it (its references). Rendered under the Specifics
heading and a line saying how to read it, one line per source message: its id once,
then its entries separated by :data:`SEPARATOR` (the provenance is most of a ledger's
cost when messages bring one or two new entries each: ``[message:12]`` on a line of its
own and a dash per entry cost about 7 tokens an entry, this about 2; the id is followed
by a space, not a colon, which was a token of its own on every line, and lines with the
colon, the earlier form, still read). An entry that
contains the separator gets a line of its own under a ``[message:<id>]`` line, the older
form, which is still read. A repeat shows its count, ``(x3)``, except in a build's
context, where the counts are kept in the summary's metadata (:data:`REFS_KEY`)::

    ## Specifics
    (each line: the id of the message it comes from, then its details; fetch a me…
    12 src/api/orders.py · pytest -x -q (x3)
    15 ORD-1234-QX · €12.50

Ledgers merge across compactions: old entries first, in order, none lost, a repeat adds
to an entry's references instead of a duplicate line. A ledger is bounded twice: at most
:data:`MAX_LEDGER_ENTRIES` entries stored (the least referenced go first), and, in a
build, at most its share of the budget (:func:`ledger_share`: a quarter, up to 85% for
windows many times the budget); past that the entries with the fewest references per
token go first (the room keeps the most mentions; an error line's count
:data:`ERROR_WEIGHT` times), the oldest first among equals, and the
build reports how many went; they are held in the summary's metadata (:data:`HELD_KEY`),
not forgotten. The ledger also takes the room the recent messages leave when that is
more than its share. In a build, an entry that a message kept whole in the
context holds verbatim is left out of the ledger (the evidence is in the context
anyway) and held in the summary's metadata (:data:`HELD_KEY`) with its provenance and
references; the next build puts it back (:func:`restore`) before it merges or fits.
Pure functions.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from contextd import core
from contextd.app.build.memo import Memo
from contextd.domain.context import HistoryItem, TokenCounter
from contextd.domain.model import Role

SPECIFICS_HEADING = "## Specifics"
LEGEND = (
    "(each line: the id of the message it comes from, then its details; "
    "fetch a message with message:<id>)"
)

MAX_LEDGER_ENTRIES = 2_000
"""The most entries a stored ledger keeps (bounds the work of every later merge)."""

LEDGER_SHARE = 0.25
"""The share of a build's history budget the ledger may take; past it, entries go."""

MAX_LEDGER_SHARE = 0.85
"""The share a ledger may take when the window is :data:`LONG_WINDOW` or more times the
budget (see :func:`ledger_share`); the recent part keeps at least the other 15%."""

SHORT_WINDOW = 4
"""How many times the budget a window is up to which the ledger takes its usual share."""

LONG_WINDOW = 40
"""How many times the budget a window is when the ledger may take its largest share."""


def ledger_share(window_tokens: int, budget: int) -> float:
    """The share of the history budget the ledger may take: a quarter while the window is
    at most :data:`SHORT_WINDOW` (4) times the budget, then growing with the logarithm of
    its length, 0.6 more for each tenfold (0.55 at about 12.6 times), to
    :data:`MAX_LEDGER_SHARE` (0.85) at :data:`LONG_WINDOW` (40) times. The longer the
    window, the more of it the summary stands for (at 40 times, all but the last two or
    three per cent), and the more evidence there is to keep. The share is a cap: the
    reserve grows only to what the fold's entries need, and the recent part still keeps
    what truncation keeps under the budget less that reserve. On the quality bench's long
    transcripts at 8,000 tokens, the earlier curve (three quarters at 64 times) kept 91.6%
    of the folded specifics beside a median of 83 recent messages, this one 95.3% beside
    63 (docs/benchmarks.md, section 7)."""
    if budget <= 0 or window_tokens <= SHORT_WINDOW * budget:
        return LEDGER_SHARE
    ratio = min(window_tokens / budget, float(LONG_WINDOW))
    growth = math.log(ratio / SHORT_WINDOW) / math.log(LONG_WINDOW / SHORT_WINDOW)
    return LEDGER_SHARE + (MAX_LEDGER_SHARE - LEDGER_SHARE) * growth


# Identifiers are specifics in what people and the agent write, but in tool output (a
# file's source, a log) every word of code is one: there they are noise.
_IDENTIFIER = "identifier"

HELD_KEY = "ledger_held"
"""The summary's metadata key for the entries a build left out, because messages the
context kept whole hold them or because its room could not show them (evicted):
``[[text, source, references], ...]``. Not rendered; the next build puts them back
(:func:`restore`) before it merges or fits, so an entry's provenance and references
survive the builds it spends in the recent part or out of the room, and a build with more
room, or a new mention, shows it again with every mention counted (a stored ledger is
still bounded by :data:`MAX_LEDGER_ENTRIES`)."""

REFS_KEY = "ledger_refs"
"""The summary's metadata key for the reference counts of its ledger's entries (those
above 1, by text): a build renders the ledger without them (about a fifth of its tokens)
and :func:`restore` puts them back, so eviction still knows what is mentioned most."""

SEPARATOR = " · "
"""Between the entries of one source's line (rare in paths, commands, ids and errors)."""

_SOURCE = re.compile(r"^\[message:(-?\d+)\]$")
_INLINE = re.compile(r"^(-?\d+):? (.+)$")
_ENTRY = re.compile(r"^(.*?)(?: \(x(\d+)\))?$")


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
    in_context: int = 0


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
            texts.append(_without_stubs(item.content))
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


# A blob's stub (blobs.stub): its sizes are the build's words, not the conversation's
# evidence, and the handle is the message's own id; the ledger's line names it anyway.
_STUB = re.compile(
    r"\[[^\[\]\n]{1,80}, [\d,]+ chars, about [\d,]+ bytes, omitted; full text: [^\]\s]+\]"
)


def _without_stubs(text: str) -> str:
    return _STUB.sub(" ", text) if "omitted; full text:" in text else text


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


def eviction_order(entries: Sequence[Entry], costs: Sequence[int] | None = None) -> list[int]:
    """Indices of ``entries`` in the order they go: least referenced first, oldest first
    among equals (``entries`` is oldest first). With ``costs`` (each entry's tokens), the
    fewest references per token first, an error line's references counting
    :data:`ERROR_WEIGHT` times (:func:`is_error`): the room keeps the most mentions it
    can, and the errors, long and mostly mentioned once, are not the first to go."""
    if costs is None:
        return sorted(range(len(entries)), key=lambda i: (entries[i].refs, i))
    weights = [ERROR_WEIGHT if is_error(e.text) else 1.0 for e in entries]
    return sorted(
        range(len(entries)), key=lambda i: (weights[i] * entries[i].refs / max(1, costs[i]), i)
    )


ERROR_WEIGHT = 2.5
"""How many mentions an error line's one mention is worth when the room is shared: what
failed and how is what an agent most needs to go on, and an error line costs two to three
times a path's tokens for its one mention (on the quality bench's long transcripts at
8,000 tokens, 2.5 keeps more than 90% of the errors and of every other category)."""

# The extractor's error markers (rust_core/src/specifics.rs), at the start of an entry:
# an error entry starts at its marker.
_ERROR_START = re.compile(
    r"(?:panic: |thread '[^'\n]{0,80}' panicked at |(?:fatal|FATAL)(?: error)?: "
    r"|(?:error|Error|ERROR)(?:\[[A-Z]?\d+\])?: |ERROR[ \t]|(?:FAILED|FAIL:?)[ \t]"
    r"|[Ff]ailed to |(?:[A-Za-z_]\w*\.)*[A-Z][A-Za-z0-9]*"
    r"(?:(?:Error|Exception|Exit|Interrupt|Warning|Fault): |(?:Error|Exception)$))"
)


def is_error(text: str) -> bool:
    """Whether the entry ``text`` is an error line or an exception type (it starts with
    one of the extractor's error markers)."""
    return _ERROR_START.match(text) is not None


def _entry_text(entry: Entry, counts: bool = True) -> str:
    return entry.text + (f" (x{entry.refs})" if counts and entry.refs > 1 else "")


def _inline(entry: Entry) -> bool:
    """Whether ``entry`` may share its source's line (it cannot be split wrongly)."""
    return bool(entry.source) and SEPARATOR.strip() not in entry.text and "\n" not in entry.text


def _groups(entries: Sequence[Entry]) -> list[list[Entry]]:
    """Runs of consecutive entries with one source."""
    out: list[list[Entry]] = []
    for entry in entries:
        if out and out[-1][0].source == entry.source:
            out[-1].append(entry)
        else:
            out.append([entry])
    return out


def render(entries: Sequence[Entry], *, counts: bool = True) -> str:
    """The ledger section (empty when there are no entries); without ``counts``, no
    reference counts (a build's ledger keeps them in the summary's metadata)."""
    if not entries:
        return ""
    lines = [SPECIFICS_HEADING, LEGEND]
    for group in _groups(entries):
        source = group[0].source
        if all(_inline(e) for e in group):
            texts = (_entry_text(e, counts) for e in group)
            lines.append(f"{source} " + SEPARATOR.join(texts))
            continue
        lines.append(f"[message:{source}]")  # the line form: one entry a line
        lines.extend(f"- {_entry_text(e, counts)}" for e in group)
    return "\n".join(lines)


def parse(summary_text: str | None) -> list[Entry]:
    """The ledger of a rendered summary (under its last Specifics heading), in both forms."""
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
        elif m := _INLINE.match(line):
            source = 0  # a line that names its source holds its entries: none follow
            at_source = int(m.group(1))
            out.extend(_parse_entry(part, at_source) for part in m.group(2).split(SEPARATOR))
        elif line.startswith("- "):
            out.append(_parse_entry(line[2:], source))
        elif line.startswith("#"):
            break
    return out


def _parse_entry(text: str, source: int) -> Entry:
    m = _ENTRY.match(text)
    assert m is not None  # the pattern matches every string
    return Entry(m.group(1), source, int(m.group(2) or 1))


def strip(summary_text: str) -> str:
    """The summary without its ledger."""
    at = summary_text.rfind(SPECIFICS_HEADING)
    return summary_text[:at].rstrip() if at >= 0 else summary_text


def fit(
    entries: Sequence[Entry], max_tokens: int, count: TokenCounter, *, counts: bool = True
) -> tuple[list[Entry], int]:
    """The entries whose rendering (with or without ``counts``) costs at most
    ``max_tokens`` (about: entries are counted one by one, a separator each), evicting in
    :func:`eviction_order`; and how many were evicted."""
    kept, evicted, _, _ = _fit(entries, max_tokens, count, counts)
    return kept, evicted


@dataclass(frozen=True, slots=True)
class _Estimate:
    """What :func:`_fit` priced: the eviction order, each entry's cost (its text and a
    separator) and each source's (its line's id)."""

    order: list[int]
    line_costs: list[int]
    header_cost: dict[int, int]


def _fit(
    entries: Sequence[Entry], max_tokens: int, count: TokenCounter, counts: bool = True
) -> tuple[list[Entry], int, int, _Estimate]:
    """:func:`fit`, the estimated cost of what it kept, and the estimate's parts."""
    if not entries:
        return [], 0, 0, _Estimate([], [], {})
    texts = [" " + _entry_text(e, counts) for e in entries]
    sources = sorted({e.source for e in entries})
    heading = f"{SPECIFICS_HEADING}\n{LEGEND}"
    # A counter may frame each text as a message: that framing is paid once, not by each.
    # It is what an empty text costs, or a one-token text less one when that is less (a
    # build's counter renders an empty message with a placeholder).
    *counted, empty, one = count([*texts, heading, *(f"{s}" for s in sources), "", "x"])
    framing = max(0, min(empty, one - 1))
    costs = [max(0, c - framing) for c in counted]
    costs[len(texts)] += framing
    line_costs = [c + 1 for c in costs[: len(texts)]]  # the separator or the "-"
    header_cost = {s: c + 1 for s, c in zip(sources, costs[len(texts) + 1 :], strict=True)}
    total = sum(line_costs) + costs[len(texts)] + sum(header_cost.values())
    order = eviction_order(entries, line_costs)
    estimate = _Estimate(order, line_costs, header_cost)
    if total <= max_tokens:
        return list(entries), 0, total, estimate
    left = {s: 0 for s in sources}
    for e in entries:
        left[e.source] += 1
    gone: set[int] = set()
    for i in order:
        if total <= max_tokens:
            break
        gone.add(i)
        total -= line_costs[i]
        source = entries[i].source
        left[source] -= 1
        if not left[source]:  # its line is gone, and its provenance with it
            total -= header_cost[source]
    return [e for i, e in enumerate(entries) if i not in gone], len(gone), total, estimate


def _fill(
    entries: Sequence[Entry],
    room: int,
    count: TokenCounter,
    estimate: _Estimate,
    guess: tuple[list[Entry], str, int],
) -> tuple[list[Entry], str, int]:
    """The most entries, kept in the estimate's eviction order, whose rendering without
    counts measures at most ``room`` tokens (a separating line included), starting from
    ``guess`` (what the estimate kept: its entries, text and measured tokens). A search
    over how many are kept that aims each probe by the estimate scaled to the last
    measure (the ledger's cost is about proportional to its estimate: two or three
    probes), halving the range after four. Returns the entries (in their order), their
    text and its tokens."""
    keep_order = estimate.order[::-1]  # the last to go first
    # The estimated cost of keeping the first k of keep_order (each source's id once).
    cumulative = [0]
    seen: set[int] = set()
    for i in keep_order:
        source = entries[i].source
        extra = estimate.header_cost.get(source, 0) if source not in seen else 0
        seen.add(source)
        cumulative.append(cumulative[-1] + estimate.line_costs[i] + extra)

    def measure(k: int) -> tuple[list[Entry], str, int]:
        kept = [entries[i] for i in sorted(keep_order[:k])]
        text = render(kept, counts=False)
        return kept, text, count([text])[0] + 1 if kept else 0

    lo, hi = 0, len(entries)
    best: tuple[list[Entry], str, int] = ([], "", 0)
    k0 = len(guess[0])
    if guess[2] <= room:
        lo, best = k0, guess
    else:
        hi = k0 - 1
    ratio = guess[2] / cumulative[k0] if k0 and cumulative[k0] else 1.0
    probes = 0
    while lo < hi:
        if probes < 4 and ratio > 0:
            aim = bisect.bisect_right(cumulative, room / ratio) - 1
            k = min(hi, max(lo + 1, aim))
        else:
            k = (lo + hi + 1) // 2
        found = measure(k)
        probes += 1
        if cumulative[k]:
            ratio = found[2] / cumulative[k]
        if found[2] <= room:
            lo, best = k, found
        else:
            hi = k - 1
    return best


def need(
    summary: HistoryItem | None,
    items: Sequence[HistoryItem],
    count: TokenCounter,
    leave_out: Sequence[str] = (),
) -> int:
    """About what the ledger of a summary folding ``items`` into ``summary`` costs, the
    entries ``leave_out`` (texts the context keeps whole) hold left out, none evicted:
    what the ledger could use, for sizing the room it gets."""
    entries, _ = merge(parse(summary.content) if summary is not None else [], extract(items))
    present = in_context(entries, leave_out)
    entries = [e for e in entries if e.text not in present]
    return count([render(entries)])[0] if entries else 0


# What the extractor names in a kept message's text, by text: a hot thread's builds see
# the same newest messages again (see memo.py).
_FOUND: Memo[str, tuple[str, ...]] = Memo(8_192)


def _specifics_of(texts: Sequence[str]) -> list[tuple[str, ...]]:
    """The specifics' texts in each of ``texts``; the ones not remembered are extracted
    in one batch call."""
    found = {t: _FOUND.peek(t) for t in texts}
    missing = [t for t, names in found.items() if names is None]
    if missing:
        for text, pairs in zip(missing, core.extract_specifics_batch(missing), strict=True):
            found[text] = names = tuple(name for _, name in pairs)
            _FOUND.put(text, names)
    return [found[t] or () for t in texts]


def in_context(entries: Sequence[Entry], texts: Sequence[str]) -> set[str]:
    """The texts of ``entries`` that ``texts`` (what the context holds whole besides the
    summary) contain verbatim. The extractor names the candidates and the text each is
    in (one linear pass, not entries x texts scans); each is then confirmed verbatim in
    that text (the extractor decodes JSON strings and cuts long lines: not every string
    it names is a substring)."""
    if not entries or not texts:
        return set()
    where: dict[str, int] = {}
    for k, names in enumerate(_specifics_of(texts)):
        for text in names:
            where.setdefault(text, k)
    found: set[str] = set()
    for entry in entries:
        at = where.get(entry.text)
        if at is not None and entry.text in texts[at]:
            found.add(entry.text)
    return found


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
    leave_out: Collection[str] = (),
) -> tuple[HistoryItem, LedgerStats]:
    """The summary ``item`` within ``max_item_tokens``, its ledger within
    ``max_ledger_tokens`` and at least half of the item's room: the evidence outranks the
    prose, so the prose is cut (from its end: the header and the Goal come first) before
    the ledger gives up more than that. Entries whose text is in ``leave_out`` (what the
    messages the context keeps whole hold, :func:`in_context`) are left out first. Its
    token count is exact."""
    entries = parse(item.content)
    if not entries:
        return item, LedgerStats()
    before = len(entries)
    if leave_out:
        entries = [e for e in entries if e.text not in leave_out]
    body = strip(item.content)
    body_t = count([body])[0]
    room = max(0, min(max_ledger_tokens, max(max_item_tokens - body_t, max_item_tokens // 2)))
    kept, evicted, _, estimate = _fit(entries, room, count, False)
    ledger_text = render(kept, counts=False)
    ledger_t = count([ledger_text])[0] + 1 if kept else 0
    if ledger_t > room or (evicted and ledger_t < room):
        # Entries were counted one by one (an estimate: a counter may round each text up,
        # a line's framing is shared): measure the whole instead, so the ledger fills its
        # room and never takes the prose's share of it.
        guess = (kept, ledger_text, ledger_t)
        kept, ledger_text, ledger_t = _fill(entries, room, count, estimate, guess)
        evicted = len(entries) - len(kept)
    if body_t + ledger_t > max_item_tokens:
        body = _cut_prose(body, max(0, max_item_tokens - ledger_t), count)
    content = f"{body}\n\n{ledger_text}" if ledger_text else body
    total = count([content])[0]
    stats = LedgerStats(len(kept), ledger_t, added, evicted, before - len(entries))
    shown = {e.text for e in kept}
    # Held: what the kept messages hold, and what this build's room could not show (a
    # later build, with more room or a new mention, shows it again with all its mentions).
    held = [e for e in parse(item.content) if e.text not in shown]
    metadata = _stash(item, held, {e.text: e.refs for e in kept if e.refs > 1})
    return replace(item, content=content, token_count=total, metadata=metadata), stats


def _meta(item: HistoryItem) -> dict[str, object]:
    try:
        meta = json.loads(item.metadata) if item.metadata else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _stash(item: HistoryItem, held: Sequence[Entry], refs: dict[str, int]) -> str:
    """``item``'s metadata with :data:`HELD_KEY` set to ``held`` and :data:`REFS_KEY` to
    ``refs`` (each removed when empty)."""
    meta = _meta(item)
    if not held and not refs and HELD_KEY not in meta and REFS_KEY not in meta:
        return item.metadata
    meta.pop(HELD_KEY, None)
    meta.pop(REFS_KEY, None)
    if held:
        meta[HELD_KEY] = [[e.text, e.source, e.refs] for e in held]
    if refs:
        meta[REFS_KEY] = refs
    return json.dumps(meta, ensure_ascii=False, separators=(",", ":"))


COVERED_KEY = "covered_tokens"
"""The summary's metadata key for what the messages it stands for cost when they were
folded (so a build knows how long its window is, :func:`ledger_share`)."""


def covered_tokens(item: HistoryItem) -> int:
    """What the messages ``item`` (a summary) stands for cost (0: not known)."""
    value = _meta(item).get(COVERED_KEY)
    return value if isinstance(value, int) and value > 0 else 0


def with_covered_tokens(item: HistoryItem, tokens: int) -> HistoryItem:
    """``item`` with :data:`COVERED_KEY` set to ``tokens``."""
    meta = _meta(item)
    meta[COVERED_KEY] = tokens
    return replace(item, metadata=json.dumps(meta, ensure_ascii=False, separators=(",", ":")))


def restore(item: HistoryItem) -> HistoryItem:
    """``item`` (a stored summary) with the entries a build held out (:data:`HELD_KEY`)
    back in its ledger, each among the entries of its neighbouring sources; the key gone.
    Its reference counts (:data:`REFS_KEY`) go back on the entries too. ``token_count``
    is left as it was (what the summary costs as stored)."""
    meta = _meta(item)
    if HELD_KEY not in meta and REFS_KEY not in meta:
        return item
    raw = meta.pop(HELD_KEY, None)
    counted = meta.pop(REFS_KEY, None)
    refs = (
        {k: v for k, v in counted.items() if isinstance(v, int) and v > 1}
        if isinstance(counted, dict)
        else {}
    )
    held: list[Entry] = []
    for row in raw if isinstance(raw, list) else []:
        if (
            isinstance(row, list)
            and len(row) == 3
            and isinstance(row[0], str)
            and isinstance(row[1], int)
            and isinstance(row[2], int)
        ):
            held.append(Entry(row[0], row[1], max(1, row[2])))
    shown = [replace(e, refs=max(e.refs, refs.get(e.text, 1))) for e in parse(item.content)]
    merged, _ = merge(shown, held)
    merged.sort(key=lambda e: e.source)  # stable: in source order, as they were made
    metadata = json.dumps(meta, ensure_ascii=False, separators=(",", ":")) if meta else ""
    return replace(item, content=with_ledger(item.content, merged), metadata=metadata)


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
