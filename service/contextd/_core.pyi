"""Type stub for the Rust extension ``contextd._core`` (built from rust_core/ by maturin).

Hand-written; ``python -m mypy.stubtest contextd._core`` checks it against the module.
Import from :mod:`contextd.core`, the documented facade, rather than from here.
"""

from typing import Any, Final, final

from numpy.typing import NDArray
from typing_extensions import Buffer

_Column = Buffer | NDArray[Any]

__all__ = [
    "DEFAULT_MAX_CHARS",
    "ENCODINGS",
    "STOP_WORDS",
    "Bm25Index",
    "InternalError",
    "ModelInfo",
    "TrimResult",
    "UnknownModelError",
    "__version__",
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

__version__: Final[str]
ENCODINGS: Final[tuple[str, ...]]
DEFAULT_MAX_CHARS: Final[int]
STOP_WORDS: Final[tuple[str, ...]]

class UnknownModelError(KeyError): ...

class InternalError(RuntimeError):
    """A bug in the Rust core (a caught panic), never a verdict on the input."""

def estimate_tokens(text: str) -> int: ...
def estimate_tokens_batch(texts: list[str]) -> list[int]: ...
def count_tokens(text: str, encoding: str) -> int: ...
def count_tokens_batch(texts: list[str], encoding: str) -> list[int]: ...
def count_tokens_for_model_batch(texts: list[str], model: str) -> list[int]: ...

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

def model_info(model: str) -> ModelInfo: ...
def list_models() -> list[str]: ...

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
) -> TrimResult: ...
def trim_columns_to_budget(
    roles: _Column,
    tokens: _Column,
    chars: _Column,
    groups: _Column,
    budget: int,
    max_chars_per_message: int = ...,  # DEFAULT_MAX_CHARS
) -> TrimResult: ...
def tokenize(text: str, stop_words: bool = False) -> list[str]: ...
def keyword_scores(query: str, texts: list[str], stop_words: bool = False) -> list[int]: ...
def keyword_select(query: str, texts: list[str], stop_words: bool = False) -> list[int]: ...

@final
class Bm25Index:
    # k1 and b default to 1.2 and 0.75 (Rust constants, so no literal at run time).
    def __new__(cls, k1: float = ..., b: float = ..., stop_words: bool = False) -> Bm25Index: ...
    def add(self, doc_ids: list[int], texts: list[str]) -> None: ...
    def remove(self, doc_ids: list[int]) -> int: ...
    def search(self, query: str, k: int = 10) -> tuple[list[int], list[float]]: ...
    def __len__(self) -> int: ...
    def __contains__(self, doc_id: int, /) -> bool: ...
    @property
    def k1(self) -> float: ...
    @property
    def b(self) -> float: ...
    @property
    def stop_words(self) -> bool: ...
    @property
    def vocabulary_size(self) -> int: ...

def extract_specifics(text: str) -> list[str]: ...
