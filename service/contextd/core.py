"""Typed facade over the Rust core (``contextd._core``).

The service imports the core through this module only, so the extension's surface is
stated in one place with the reasons behind it. Everything here is a pure function or an
immutable value. Texts are borrowed from the Python strings, not copied. Calls whose input
exceeds 64 KiB of text release the GIL while they work, so gRPC handler threads keep
running, and big batches are spread over all cores; smaller calls run holding the GIL,
which costs less than releasing it and taking it back.

Token counting
    ``o200k_base`` and ``cl100k_base`` are OpenAI's public BPEs, compiled into the
    extension (no download at run time) and equal to ``tiktoken`` token for token.
    ``estimate`` is the character estimate ``(chars + 3) // 4`` and ``chars_div4`` the plain
    ``chars // 4``, both counting Unicode code points. Anthropic's tokenizer is not public:
    the model registry counts Claude with ``o200k_base`` times a safety margin (see
    ``rust_core/data/models.toml`` for the figures and why).

Relevance
    :func:`tokenize` is the keyword rule made Unicode-aware (lower case, runs of letters,
    marks and digits, longer than two characters, optional English stop words).
    :func:`keyword_scores` / :func:`keyword_select` are the keyword-overlap filter;
    :class:`Bm25Index` is an incremental BM25 index meant for one index per conversation
    store, up to millions of messages.

Trimming
    :func:`trim_to_budget` takes the conversation as flat columns (one list per field) and
    returns flat index lists, so a 10,000-message history costs a few list conversions
    instead of 10,000 Python objects each way. See its docstring for the rules.

Errors
    Bad arguments raise ``ValueError`` (``UnknownModelError``, a ``KeyError``, for a model
    the registry lacks; ``OverflowError`` for an int that does not fit, e.g. a negative
    count). A bug in the core raises :class:`InternalError`, a ``RuntimeError``: a Rust
    panic is caught before it reaches Python, so it never surfaces as pyo3's
    ``PanicException``, a ``BaseException`` that ``except Exception`` would miss.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from numpy.typing import NDArray
from typing_extensions import Buffer

from contextd import _core
from contextd._core import (
    DEFAULT_MAX_CHARS,
    ENCODINGS,
    STOP_WORDS,
    Bm25Index,
    InternalError,
    ModelInfo,
    TrimResult,
    UnknownModelError,
)

__all__ = [
    "DEFAULT_MAX_CHARS",
    "ENCODINGS",
    "ROLE_ASSISTANT",
    "ROLE_TOOL_RESULT",
    "ROLE_TOOL_USE",
    "ROLE_USER",
    "STOP_WORDS",
    "Bm25Index",
    "EncodingName",
    "InternalError",
    "ModelInfo",
    "TrimResult",
    "UnknownModelError",
    "count_tokens",
    "count_tokens_batch",
    "count_tokens_for_model_batch",
    "estimate_tokens",
    "estimate_tokens_batch",
    "extract_specifics",
    "keyword_scores",
    "keyword_select",
    "list_models",
    "model_info",
    "tokenize",
    "trim_columns_to_budget",
    "trim_to_budget",
]

# Bm25Index is re-exported as is; its docstring (from the Rust doc comment) explains the
# parameters, the scoring formula, removal and thread-safety.

EncodingName = Literal["o200k_base", "cl100k_base", "estimate", "chars_div4"]
"""The encodings :func:`count_tokens` accepts (also at run time as :data:`ENCODINGS`)."""

# Role codes of the trimming columns. Small integers keep the columns flat lists of ints.
ROLE_USER: Final = 1
ROLE_ASSISTANT: Final = 2
ROLE_TOOL_USE: Final = 3
"""An assistant message that calls tools; its group id ties it to its results."""
ROLE_TOOL_RESULT: Final = 4
"""A tool's answer; never the first kept message (the APIs reject a result without its call)."""


def estimate_tokens(text: str) -> int:
    """The character estimate, ``(code points + 3) // 4``: cheap and model-independent."""
    return _core.estimate_tokens(text)


def estimate_tokens_batch(texts: list[str]) -> list[int]:
    """:func:`estimate_tokens` for each text, in one call (one crossing into Rust)."""
    return _core.estimate_tokens_batch(texts)


def count_tokens(text: str, encoding: EncodingName) -> int:
    """Token count of ``text`` with ``encoding``.

    Raises ``ValueError`` naming the accepted encodings when ``encoding`` is unknown.
    """
    return _core.count_tokens(text, encoding)


def count_tokens_batch(texts: list[str], encoding: EncodingName) -> list[int]:
    """Token count of each text, in order.

    The strings are borrowed, not copied. Batches of 64 KiB of text or more are counted
    without the GIL and split over all cores; smaller ones are counted holding it. Raises
    ``ValueError`` for an unknown encoding.
    """
    return _core.count_tokens_batch(texts, encoding)


def count_tokens_for_model_batch(texts: list[str], model: str) -> list[int]:
    """What each text costs against ``model``'s window: its tokenizer's count times the
    registry's safety margin, rounded up (exact for OpenAI models, conservative for Claude).

    Raises :class:`UnknownModelError` (a ``KeyError``) for a model the registry lacks.
    """
    return _core.count_tokens_for_model_batch(texts, model)


def model_info(model: str) -> ModelInfo:
    """Registry entry for ``model``.

    Exact name first, then the longest ``-``-separated registry prefix, so dated ids
    resolve (``claude-sonnet-4-5-20250929`` -> ``claude-sonnet-4-5``); case-insensitive,
    a leading ``provider/`` is ignored. Unknown names raise :class:`UnknownModelError`
    rather than silently using ``"default"``: a typo should not shrink or overflow a
    context. Pass ``"default"`` explicitly for an unlisted model.
    """
    return _core.model_info(model)


def list_models() -> list[str]:
    """Every registry name, sorted (dated ids are resolved by prefix, not listed)."""
    return _core.list_models()


def trim_to_budget(
    roles: list[int],
    tokens: list[int],
    chars: list[int],
    groups: list[int],
    budget: int,
    max_chars_per_message: int = DEFAULT_MAX_CHARS,
    truncated_tokens: list[int] | None = None,
) -> TrimResult:
    """Choose the newest messages that fit ``budget`` tokens.

    One entry per message in each column, oldest first: ``roles`` (``ROLE_*`` codes),
    ``tokens`` (the message's token count), ``chars`` (its length in code points) and
    ``groups`` (a tool group id >= 0 shared by a tool_use message and all of its
    tool_results, derived by the caller from tool_call ids; ``-1`` for none). A group's
    tool_use must come before its results.

    Rules: a message longer than ``max_chars_per_message`` is truncated to it and then
    costs ``truncated_tokens[i]`` if given, else ``(max_chars_per_message + 3) // 4``;
    the kept messages are one contiguous newest suffix; it never splits a tool group
    (parallel results included) and never starts with a tool_result; its total never
    exceeds ``budget``. If not even the newest message fits alone (and it may stand
    alone), it is kept, listed in ``truncated`` with the character count to cut it to,
    in proportion to its own tokens per character.

    The walk stops at the first message that breaks the budget, so it costs what fits
    the budget, not the history's length; converting the lists into Rust still costs one
    pass over each (use :func:`trim_columns_to_budget` to avoid that on long histories).
    ``kept_start`` is ``kept[0]`` (``None`` when nothing is kept) without building the list.
    Raises ``ValueError`` when the columns differ in length or a walked role is invalid.
    """
    return _core.trim_to_budget(
        roles, tokens, chars, groups, budget, max_chars_per_message, truncated_tokens
    )


Column = Buffer | NDArray[Any]
"""A column that crosses into Rust as one buffer: a NumPy array or any buffer object."""


def trim_columns_to_budget(
    roles: Column,
    tokens: Column,
    chars: Column,
    groups: Column,
    budget: int,
    max_chars_per_message: int = DEFAULT_MAX_CHARS,
) -> TrimResult:
    """:func:`trim_to_budget` over buffers (uint8 roles, uint64 tokens and chars, int64
    groups; NumPy arrays of a query result qualify), for windows too long to turn into
    Python lists on every build.

    The buffers are read in place, not copied, so a call costs what fits the budget
    whatever the window's length. Each must be one-dimensional, C-contiguous and of exactly
    that item type (``numpy.ascontiguousarray(x, dtype=...)`` makes one), else
    ``BufferError`` (``TypeError`` for an object that is not a buffer); columns of
    different lengths raise ``ValueError``."""
    return _core.trim_columns_to_budget(roles, tokens, chars, groups, budget, max_chars_per_message)


def tokenize(text: str, stop_words: bool = False) -> list[str]:
    """The words relevance scoring sees: ``text`` lower-cased, split into maximal runs of
    letters, combining marks and digits (Unicode categories L, M, N), runs of three or
    more characters kept, English :data:`STOP_WORDS` dropped if asked.

    Marks count as letters so Devanagari or decomposed accents stay one word; lower-casing
    comes first because it can change the text (``İ`` -> ``i`` + U+0307).
    """
    return _core.tokenize(text, stop_words)


def keyword_scores(query: str, texts: list[str], stop_words: bool = False) -> list[int]:
    """Keyword relevance: for each text, how many distinct query words it contains.

    No corpus statistics, so it behaves the same on three messages as on three thousand.
    """
    return _core.keyword_scores(query, texts, stop_words)


def keyword_select(query: str, texts: list[str], stop_words: bool = False) -> list[int]:
    """Indices of the texts sharing at least one word with the query, in original order.

    When none does (or the query has no words) every index is returned: an empty context
    because the wording missed is worse than an unfiltered one.
    """
    return _core.keyword_select(query, texts, stop_words)


def extract_specifics(text: str) -> list[str]:
    """Details a summary must keep verbatim, in order of first appearance, deduplicated.

    URLs, inline code in backticks (usually shell commands), file paths, numbers with
    units (``350 ms``, ``1.5 GB``), identifiers (CamelCase, camelCase, snake_case, words
    with digits such as ``sha256``) and whole error lines (containing ``Error``,
    ``Exception``, ``Traceback`` or ``failed``; cut at 300 characters). A match inside a
    more specific one (an identifier inside a path) is not repeated. Summaries tend to keep
    the gist and lose exactly these, which an agent needs to carry on.
    """
    return _core.extract_specifics(text)
