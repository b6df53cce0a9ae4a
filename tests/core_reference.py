"""Small, obviously-correct Python versions of the Rust core, for the tests to compare with.

Each reference is written for clarity, not speed, and where it can it takes a different
route than the Rust code (brute force over every cut, rebuilding statistics from scratch)
so that a shared misunderstanding is less likely to hide.

It also gets ``tiktoken`` working without a network (:func:`tiktoken_encoding`, which
wraps ``bench.tiktoken_offline``).
"""

from __future__ import annotations

import functools
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.tiktoken_offline import encoding

# ----------------------------------------------------------------------------- tiktoken


@functools.cache
def tiktoken_encoding(name: str) -> Any:
    """``tiktoken.get_encoding(name)`` without network access (see
    ``bench.tiktoken_offline``, the one copy of the offline loader).

    Returns ``None`` (callers skip) only when tiktoken is not installed or no offline copy
    of the encoding can be found and the download fails too.
    """
    try:
        return encoding(name)
    except RuntimeError:
        return None


def estimate(text: str) -> int:
    """Seed 004."""
    return (len(text) + 3) // 4


def chars_div4(text: str) -> int:
    """Seed 002."""
    return len(text) // 4


# ----------------------------------------------------------------------------- trimming

USER, ASSISTANT, TOOL_USE, TOOL_RESULT = 1, 2, 3, 4


@dataclass
class Trim:
    kept: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    truncated_chars: list[int] = field(default_factory=list)
    total_tokens: int = 0


def trim_reference(
    roles: Sequence[int],
    tokens: Sequence[int],
    chars: Sequence[int],
    groups: Sequence[int],
    budget: int,
    max_chars: int = 4000,
    truncated_tokens: Sequence[int] | None = None,
) -> Trim:
    """Brute force: try every start from the oldest and take the first one that is allowed
    (splits no group, is not a tool_result) and fits the budget."""
    n = len(roles)

    def cost(i: int) -> int:
        if chars[i] > max_chars:
            cut = truncated_tokens[i] if truncated_tokens is not None else (max_chars + 3) // 4
            return min(cut, tokens[i])
        return tokens[i]

    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        if g >= 0:
            members.setdefault(g, []).append(i)

    def allowed(start: int) -> bool:
        if roles[start] == TOOL_RESULT:
            return False
        return not any(min(ix) < start <= max(ix) for ix in members.values())

    for start in range(n):
        total = sum(cost(i) for i in range(start, n))
        if allowed(start) and total <= budget:
            kept = list(range(start, n))
            truncated = [i for i in kept if chars[i] > max_chars]
            return Trim(kept, truncated, [max_chars] * len(truncated), total)

    # Nothing fits: the newest message alone, cut to fit, if it may stand alone.
    if n == 0 or budget == 0:
        return Trim()
    i = n - 1
    stands_alone = roles[i] != TOOL_RESULT
    eff_chars = min(chars[i], max_chars)
    c = cost(i)
    if not stands_alone or c == 0:
        return Trim()
    cut = eff_chars * budget // c
    if cut == 0:
        return Trim()
    return Trim([i], [i], [cut], -(-cut * c // eff_chars))


# ----------------------------------------------------------------------------- relevance

MIN_WORD_CHARS = 3
TF_MAX = 65_535  # the Rust index stores term frequencies in 16 bits


def tokenize_reference(
    text: str, stop_words: bool = False, stop: frozenset[str] = frozenset()
) -> list[str]:
    """Lower-case, then split into maximal runs of characters in categories L, M, N."""
    words: list[str] = []
    current: list[str] = []
    for ch in text.lower() + " ":
        if unicodedata.category(ch)[0] in "LMN":
            current.append(ch)
        elif current:
            words.append("".join(current))
            current = []
    return [w for w in words if len(w) >= MIN_WORD_CHARS and not (stop_words and w in stop)]


def keyword_scores_reference(
    query: str, texts: Sequence[str], stop_words: bool, stop: frozenset[str]
) -> list[int]:
    q = set(tokenize_reference(query, stop_words, stop))
    return [len(q & set(tokenize_reference(t, stop_words, stop))) for t in texts]


def keyword_select_reference(
    query: str, texts: Sequence[str], stop_words: bool, stop: frozenset[str]
) -> list[int]:
    scores = keyword_scores_reference(query, texts, stop_words, stop)
    hits = [i for i, s in enumerate(scores) if s > 0]
    return hits or list(range(len(texts)))


class Bm25Reference:
    """BM25 recomputed from scratch on every query from the live documents' word lists."""

    def __init__(
        self,
        k1: float = 1.2,
        b: float = 0.75,
        stop_words: bool = False,
        stop: frozenset[str] = frozenset(),
    ) -> None:
        self.k1, self.b, self.stop_words, self.stop = k1, b, stop_words, stop
        self.docs: dict[int, list[str]] = {}

    def add(self, ids: Sequence[int], texts: Sequence[str]) -> None:
        for doc_id, text in zip(ids, texts, strict=True):
            self.docs.pop(doc_id, None)
            self.docs[doc_id] = tokenize_reference(text, self.stop_words, self.stop)

    def remove(self, ids: Sequence[int]) -> int:
        return sum(self.docs.pop(i, None) is not None for i in ids)

    def scores(self, query: str) -> dict[int, float]:
        n_docs = len(self.docs)
        if n_docs == 0:
            return {}
        avgdl = sum(len(words) for words in self.docs.values()) / n_docs
        out: dict[int, float] = {}
        for term in set(tokenize_reference(query, self.stop_words, self.stop)):
            df = sum(term in words for words in self.docs.values())
            if df == 0:
                continue
            idf = math.log(1 + (n_docs - df + 0.5) / (df + 0.5))
            for doc_id, words in self.docs.items():
                tf = min(words.count(term), TF_MAX)
                if tf:
                    norm = self.k1 * (1 - self.b + self.b * len(words) / avgdl)
                    out[doc_id] = out.get(doc_id, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        return out

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        ranked = sorted(self.scores(query).items(), key=lambda kv: (-kv[1], kv[0]))
        return ranked[:k]
