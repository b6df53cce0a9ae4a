"""Type stub for the Rust extension ``contextd._core`` (built from rust_core/ by maturin).

Hand-written; ``python -m mypy.stubtest contextd._core`` checks it against the module.
The one set of docstrings of the core's functions is here (editors and type checkers read
it); :mod:`contextd.core` re-exports them and adds the Python-side names.
"""

from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal, final

from numpy.typing import NDArray
from typing_extensions import Buffer

_Column = Buffer | NDArray[Any]
_EncodingName = Literal["o200k_base", "cl100k_base", "estimate", "chars_div4"]

__all__ = [
    "DEFAULT_MAX_CHARS",
    "ENCODINGS",
    "STOP_WORDS",
    "Bm25Index",
    "InternalError",
    "ModelInfo",
    "RequestFilter",
    "TrimResult",
    "UnknownModelError",
    "__version__",
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

__version__: Final[str]
ENCODINGS: Final[tuple[str, ...]]
DEFAULT_MAX_CHARS: Final[int]
STOP_WORDS: Final[tuple[str, ...]]

class UnknownModelError(KeyError): ...

class InternalError(RuntimeError):
    """A bug in the Rust core (a caught panic), never a verdict on the input."""

def estimate_tokens(text: str) -> int:
    """The character estimate, ``(code points + 3) // 4``: cheap and model-independent."""

def estimate_tokens_batch(texts: list[str]) -> list[int]:
    """:func:`estimate_tokens` for each text, in one call (one crossing into Rust)."""

def decode_append_messages(
    data: bytes, roles: list[Any], new_message: type[Any], fields: list[str]
) -> tuple[list[Any], list[int]]:
    """The messages of a serialized ``contextd.v1.AppendMessagesRequest`` as instances of
    ``new_message`` (a slotted dataclass without ``__post_init__``: they are made as
    ``copy`` makes them, the seven ``fields`` set in the order role, content, tool_calls,
    tool_call_id, external_id, metadata, source_time_us (None)), and the indices of the
    messages to convert one by one (a role outside 1 to 4, a ``tool_output_id`` or a
    ``source_time``), which are None in the list. ``roles[v]`` is the role value for
    role number ``v`` (5 entries). Every other field is skipped, unknown ones included;
    where a field repeats the last one wins. Raises ``ValueError`` for bytes that are
    not such a request (cut short, bad lengths or varints, text that is not UTF-8, proto2
    groups) or arguments of another length."""

def encode_context_messages(
    items: Iterable[Any],
    stamps: dict[int, Any],
    truncated_ids: Sequence[int],
    elided_ids: Sequence[int],
    new_message: tuple[str, int, bool] | None,
) -> bytes:
    """The kept messages of a ``contextd.v1.BuildContextResponse``, serialized as its
    field 4 entries (each ``ContextMessage`` with its key and length), exactly as the
    protobuf runtime writes them: one per item of ``items`` (history items: read from
    their ``id``, ``role``, ``content``, ``tool_calls``, ``tool_call_id``,
    ``token_count`` and ``is_summary``), with ``create_time``, ``source_time`` and
    ``sequence`` from ``stamps[item.id]`` when present (``create_time_us``,
    ``source_time_us`` or None, ``sequence``; microseconds split as ``divmod``),
    ``truncated`` / ``elided`` when the id is listed; then ``new_message``
    (content, token count, truncated) as a user message. Raises ``TypeError`` or
    ``AttributeError`` for items of another shape."""

def encode_packed_int64(field: int, values: _Column) -> bytes:
    """``values`` (a 1-D C-contiguous int64 buffer, read in place) as the packed
    repeated int64 field numbered ``field``: its key, the payload's length and each
    value's varint (a negative one in ten bytes); ``b""`` when empty, as the protobuf
    runtime writes no empty packed field."""

def encode_receipts(
    ids: list[int],
    create_time_us: list[int],
    token_estimates: list[int],
    token_counts: list[int],
    sequences: list[int],
) -> bytes:
    """The serialized ``contextd.v1.AppendMessagesResponse`` holding one ``MessageReceipt``
    per row of the five columns, in order: the protobuf runtime's own bytes for it (zero
    fields omitted, ``create_time`` always present, microseconds split as ``divmod``).
    Raises ``ValueError`` when the columns differ in length."""

def search_vectors(contents: list[str], tool_calls: list[str]) -> list[str | None]:
    """The PostgreSQL search vector literal of each message (its content and tool_calls),
    its words in the order a tsvector keeps them, or None where only the database can
    make it exactly (see ``contextd.adapters.postgres.search_vector``). Raises
    ``ValueError`` when the lists differ in length."""

def count_tokens(text: str, encoding: _EncodingName) -> int:
    """Token count of ``text`` with ``encoding``.

    Raises ``ValueError`` naming the accepted encodings when ``encoding`` is unknown.
    """

def count_tokens_batch(texts: list[str], encoding: _EncodingName) -> list[int]:
    """Token count of each text, in order.

    The strings are borrowed, not copied. Batches of 64 KiB of text or more are counted
    without the GIL and split over all cores; smaller ones are counted holding it. Raises
    ``ValueError`` for an unknown encoding.
    """

def count_tokens_for_model_batch(texts: list[str], model: str) -> list[int]:
    """What each text costs against ``model``'s window: its tokenizer's count times the
    registry's safety margin, rounded up (exact for OpenAI models, conservative for Claude).

    Raises :class:`UnknownModelError` (a ``KeyError``) for a model the registry lacks.
    """

@final
class ModelInfo:
    @property
    def name(self) -> str: ...
    @property
    def context_window(self) -> int: ...
    @property
    def max_output(self) -> int: ...
    @property
    def output_reserve(self) -> int: ...
    @property
    def tokenizer(self) -> str: ...
    @property
    def margin(self) -> float: ...
    @property
    def prompt_budget(self) -> int: ...
    def apply_margin(self, count: int) -> int: ...

def model_info(model: str) -> ModelInfo:
    """Registry entry for ``model``.

    Exact name first, then the longest ``-``-separated registry prefix, so dated ids
    resolve (``claude-sonnet-4-5-20250929`` -> ``claude-sonnet-4-5``); case-insensitive,
    a leading ``provider/`` is ignored. Unknown names raise :class:`UnknownModelError`
    rather than silently using ``"default"``: a typo should not shrink or overflow a
    context. Pass ``"default"`` explicitly for an unlisted model.
    """

def list_models() -> list[str]:
    """Every registry name, sorted (dated ids are resolved by prefix, not listed)."""

@final
class TrimResult:
    @property
    def kept(self) -> list[int]: ...
    @property
    def kept_start(self) -> int | None: ...
    @property
    def truncated(self) -> list[int]: ...
    @property
    def truncated_chars(self) -> list[int]: ...
    @property
    def total_tokens(self) -> int: ...

def trim_to_budget(
    roles: list[int],
    tokens: list[int],
    chars: list[int],
    groups: list[int],
    budget: int,
    max_chars_per_message: int = ...,  # DEFAULT_MAX_CHARS (a Rust constant: no literal)
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

def trim_columns_to_budget(
    roles: _Column,
    tokens: _Column,
    chars: _Column,
    groups: _Column,
    budget: int,
    max_chars_per_message: int = ...,  # DEFAULT_MAX_CHARS
) -> TrimResult:
    """:func:`trim_to_budget` over buffers (uint8 roles, uint64 tokens and chars, int64
    groups; NumPy arrays of a query result qualify), for windows too long to turn into
    Python lists on every build.

    The buffers are read in place, not copied, so a call costs what fits the budget
    whatever the window's length. Each must be one-dimensional, C-contiguous and of exactly
    that item type (``numpy.ascontiguousarray(x, dtype=...)`` makes one), else
    ``BufferError`` (``TypeError`` for an object that is not a buffer); columns of
    different lengths raise ``ValueError``."""

def pair_orphans_columns(
    ids: _Column, roles: _Column, groups: _Column
) -> tuple[list[int], list[int]]:
    """The orphans of a window's tool pairs, as ascending positions: ``(results, calls)``.

    Columns in window order (int64 stored ids, unique; uint8 role codes; int64 tool
    groups: a tool-using message has the group of its own id, a tool_result the id of
    the message that issued its call, -1 none). A *head* is a row whose group is its own
    id and whose role is not tool_result; a tool_result is answered when the head of its
    group comes before it, else it is an orphan; a head is an orphan when no answered
    result names it. One pass over the columns read in place (the buffer rules of
    :func:`trim_columns_to_budget`); columns of different lengths raise ``ValueError``."""

def tokenize(text: str, stop_words: bool = False, cjk_bigrams: bool = False) -> list[str]:
    """The words relevance scoring sees: ``text`` lower-cased, split into maximal runs of
    letters, combining marks and digits (Unicode categories L, M, N), runs of three or
    more characters kept, English :data:`STOP_WORDS` dropped if asked.

    Marks count as letters so Devanagari or decomposed accents stay one word; lower-casing
    comes first because it can change the text (``İ`` -> ``i`` + U+0307).

    With ``cjk_bigrams`` (the terms of a search index), each run of Chinese, Japanese or
    Korean characters inside a word becomes its overlapping pairs of characters
    (``東京都`` -> ``東京``, ``京都``; one character alone is its own term), since those
    scripts put no spaces between words; the rest of such a word follows the word rule.
    """

def snippet(
    text: str,
    query: str,
    max_chars: int = ...,  # 200 (a Rust constant)
    stop_words: bool = False,
    cjk_bigrams: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """A search hit's excerpt and where the query's terms are in it.

    At most ``max_chars`` characters of ``text``: the window with the most distinct query
    terms (then the most matches, then the earliest), starting a little before its first
    match and at a space when one is near; runs of white space become one space and an
    ellipsis (U+2026) marks each cut end. The spans are (start, end) offsets in code points
    of the excerpt, ascending and disjoint, found in the original text with the terms of
    :func:`tokenize` (``stop_words`` and ``cjk_bigrams`` as the index's). At most 1,000
    matches are looked at. Without any match: the head of the text.
    """

def keyword_scores(query: str, texts: list[str], stop_words: bool = False) -> list[int]:
    """Keyword relevance: for each text, how many distinct query words it contains.

    No corpus statistics, so it behaves the same on three messages as on three thousand.
    """

def keyword_select(query: str, texts: list[str], stop_words: bool = False) -> list[int]:
    """Indices of the texts sharing at least one word with the query, in original order.

    When none does (or the query has no words) every index is returned: an empty context
    because the wording missed is worse than an unfiltered one.
    """

@final
class Bm25Index:
    # k1 and b default to 1.2 and 0.75 (Rust constants, so no literal at run time).
    def __new__(
        cls, k1: float = ..., b: float = ..., stop_words: bool = False, cjk_bigrams: bool = False
    ) -> Bm25Index: ...
    def add(self, doc_ids: list[int], texts: list[str]) -> None: ...
    def remove(self, doc_ids: list[int]) -> int: ...
    def search(
        self, query: str, k: int = 10, within: Buffer | NDArray[Any] | None = None
    ) -> tuple[list[int], list[float]]: ...
    def __len__(self) -> int: ...
    def __contains__(self, doc_id: int, /) -> bool: ...
    @property
    def k1(self) -> float: ...
    @property
    def b(self) -> float: ...
    @property
    def stop_words(self) -> bool: ...
    @property
    def cjk_bigrams(self) -> bool: ...
    @property
    def vocabulary_size(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...

@final
class RequestFilter:
    """A Bloom filter of request keys sized for ``capacity`` keys at a 1% false-positive
    rate (double hashing over one fixed 64-bit hash of the key's UTF-8 bytes).

    ``maybe(key)`` False means the key was never added (certain). Any thread may call
    ``maybe`` while another adds: bits only ever gain, and a key's bits are all set when
    its ``add`` or ``add_column`` returns.
    """

    def __new__(cls, capacity: int) -> RequestFilter: ...
    def add(self, key: str) -> None: ...
    def maybe(self, key: str) -> bool: ...
    def add_column(
        self, data: Buffer, offsets: Buffer, large: bool, offset: int, length: int
    ) -> None:
        """Add every value of an Arrow string column given by its buffers: ``data`` (the
        values' bytes), ``offsets`` (int64 when ``large``, else int32) and the array's
        ``offset`` and ``length``. Read in place with the interpreter's lock released, so
        the buffers must not change meanwhile (Arrow buffers never do). Validity is not
        read: a null adds its empty range (at most a false positive). Offsets that do not
        fit the buffers raise ValueError before any bit is set."""

    def to_bytes(self) -> bytes:
        """A copy of the bits (for tests comparing two filters)."""

    @property
    def capacity(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def probes(self) -> int: ...

def extract_specifics(text: str) -> list[str]:
    """Details a summary must keep verbatim, in order of first appearance, deduplicated.

    Error lines from their marker (``panic:``, ``error:``, ``ValueError: ...``, a pytest
    ``FAILED`` line; not code lines that merely mention an error) and exception types;
    commands (shell prompt lines ``$ ...``, inline code in backticks, ``command``-like
    values of tool-call arguments); URLs; ids (git SHAs, UUIDs, ticket and order ids such
    as ``ORD-4471-XK``, issue numbers such as ``#2291``); versions (``v0.18.2``); numbers
    with units and currencies (``€986.31``, ``12 ms``, ``409 passed``); file paths; and
    identifiers. JSON (tool-call arguments, OpenAI's double-encoded ones too) is read
    string by string with escapes decoded. Tool-call ids and base64 or other high-entropy
    blobs are skipped; entries are at most 240 characters (longer paths and URLs are
    skipped, longer lines and commands cut with ``…``).
    """

def extract_specifics_batch(texts: list[str]) -> list[list[tuple[str, str]]]:
    """:func:`extract_specifics` of each text, as ``(kind, text)`` pairs; kind is one of
    ``error``, ``command``, ``url``, ``id``, ``version``, ``number``, ``path``,
    ``identifier``. Large batches run in parallel without the GIL."""
