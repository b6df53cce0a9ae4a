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

# The functions are the extension's own, re-exported as they are (no wrapper to keep in
# step); their documentation is in _core.pyi.
from contextd._core import (
    DEFAULT_MAX_CHARS,
    ENCODINGS,
    STOP_WORDS,
    Bm25Index,
    InternalError,
    ModelInfo,
    RequestFilter,
    TrimResult,
    UnknownModelError,
    count_tokens,
    count_tokens_batch,
    count_tokens_for_model_batch,
    decode_append_messages,
    encode_context_messages,
    encode_packed_int64,
    encode_receipts,
    estimate_tokens,
    estimate_tokens_batch,
    extract_specifics,
    extract_specifics_batch,
    keyword_scores,
    keyword_select,
    list_models,
    model_info,
    pair_orphans_columns,
    search_vectors,
    snippet,
    tokenize,
    trim_columns_to_budget,
    trim_to_budget,
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
    "RequestFilter",
    "TrimResult",
    "UnknownModelError",
    "count_tokens",
    "count_tokens_batch",
    "count_tokens_for_model_batch",
    "decode_append_messages",
    "encode_context_messages",
    "encode_packed_int64",
    "encode_receipts",
    "estimate_tokens",
    "estimate_tokens_batch",
    "extract_specifics",
    "extract_specifics_batch",
    "keyword_scores",
    "keyword_select",
    "list_models",
    "model_info",
    "pair_orphans_columns",
    "search_vectors",
    "snippet",
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

Column = Buffer | NDArray[Any]
"""A column that crosses into Rust as one buffer: a NumPy array or any buffer object."""
