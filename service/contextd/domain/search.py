"""Search over message history: what a query is, its bounds, and what a hit carries.

Both engines see the same query: the text is cut into terms once, here, by the Rust
core's search tokenizer (words of 3 or more letters or digits, lower-cased; runs of CJK
characters as overlapping pairs of characters, since those scripts put no spaces
between words). A message matches when it holds any term; engines rank differently
(BM25 on the embedded engine, ts_rank_cd on PostgreSQL), so only the order is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

from contextd import core
from contextd.domain.errors import InvalidArgument, ResourceExhausted, Unavailable
from contextd.domain.model import StoredMessage
from contextd.domain.window import WindowSpec

MAX_QUERY_CHARS = 1_024
"""Longest query, in characters (Unicode scalar values)."""

MAX_QUERY_TERMS = 64
"""Distinct terms of a query that are searched (the first ones): each costs a posting
list walk (embedded) or a tsquery branch (PostgreSQL)."""

DEFAULT_K = 10
MAX_K = 100

SNIPPET_CHARS = 200
"""Characters of a message a snippet shows at most (plus an ellipsis at each cut end)."""


def is_cjk_term(term: str) -> bool:
    """Whether a term is a CJK pair (or single character) rather than a word: the
    tokenizer never mixes the two in one term."""
    return bool(term) and core.tokenize(term[0], cjk_bigrams=True) == [term[0]]


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """One search, as the use case hands it to the store."""

    tenant: str
    agent: str
    # The agent's create time: an agent deleted and made again under the same name is
    # another agent, whose history starts empty.
    agent_created_us: int
    scope: str
    thread: str | None  # None: every thread of the scope
    window: WindowSpec | None  # None: the whole history
    text: str
    terms: tuple[str, ...]  # distinct, in query order, at most MAX_QUERY_TERMS
    k: int


@dataclass(frozen=True, slots=True)
class SearchHit:
    message: StoredMessage
    score: float
    snippet: str = ""
    highlights: tuple[tuple[int, int], ...] = ()


def query_terms(text: str) -> tuple[str, ...]:
    """The query's distinct terms, in order; INVALID_ARGUMENT (field `query`) when the
    text is empty, too long, or holds no searchable word."""
    if not text.strip():
        raise InvalidArgument("query must not be empty", field="query")
    if len(text) > MAX_QUERY_CHARS:
        raise InvalidArgument(
            f"query is {len(text):,} characters long; the limit is {MAX_QUERY_CHARS:,}",
            field="query",
        )
    terms = tuple(dict.fromkeys(core.tokenize(text, cjk_bigrams=True)))[:MAX_QUERY_TERMS]
    if not terms:
        raise InvalidArgument(
            "query holds no searchable word (3 or more letters or digits, or Chinese, "
            "Japanese or Korean characters)",
            field="query",
        )
    return terms


def hits_wanted(k: int) -> int:
    """k as asked (0: the default); INVALID_ARGUMENT (field `k`) out of range."""
    if k == 0:
        return DEFAULT_K
    if k < 0 or k > MAX_K:
        raise InvalidArgument(
            f"k must be between 1 and {MAX_K} (0: {DEFAULT_K}); got {k}", field="k"
        )
    return k


def with_snippet(hit: SearchHit, query: str) -> SearchHit:
    """The hit with its snippet: of the content, or of tool_calls when only they match."""
    m = hit.message
    text, spans = core.snippet(m.content, query, SNIPPET_CHARS, cjk_bigrams=True)
    if not spans and m.tool_calls:
        calls, call_spans = core.snippet(m.tool_calls, query, SNIPPET_CHARS, cjk_bigrams=True)
        if call_spans:
            text, spans = calls, call_spans
    return SearchHit(m, hit.score, text, tuple(spans))


def index_too_large(messages: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"this scope holds {messages:,} messages; a search index holds at most {limit:,} "
        "on the embedded engine: search one thread, or use PostgreSQL",
        reason="SEARCH_INDEX_TOO_LARGE",
    )


def search_timeout(seconds: float) -> Unavailable:
    return Unavailable(
        f"the search did not finish within {seconds:g} s; retry, or narrow the query, "
        "thread or range",
        reason="SEARCH_TIMEOUT",
        retry_after_s=1.0,
    )
