"""Inputs that panicked in the Rust core, or were most likely to: each must give a clean
result or an ordinary Python exception. A panic left to pyo3 becomes its PanicException, a
``BaseException`` that the gRPC handlers' ``except Exception`` misses; the bindings turn any
panic into :class:`contextd.core.InternalError` instead, and fix the known ones at the source.
"""
# ruff: noqa: RUF001  (the pieces are deliberately look-alike Unicode)

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contextd import _core, core
from core_reference import (
    ASSISTANT,
    TOOL_RESULT,
    USER,
    tiktoken_encoding,
    tokenize_reference,
    trim_reference,
)

U64_MAX = 2**64 - 1
ENCODINGS: tuple[core.EncodingName, ...] = ("o200k_base", "cl100k_base", "estimate", "chars_div4")
T = TypeVar("T")
P = ParamSpec("P")


def clean(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``call(*args, **kwargs)``, failing the test by name if anything but an ``Exception``
    escapes (a PanicException would otherwise show up as a bare error far from its cause)."""
    try:
        return call(*args, **kwargs)
    except Exception:
        raise
    except BaseException as exc:
        pytest.fail(f"{type(exc).__module__}.{type(exc).__name__} escaped: {exc}")


def test_internal_errors_are_ordinary_exceptions() -> None:
    """What a caught panic raises is an ``Exception``, so handlers catch it."""
    assert core.InternalError is _core.InternalError
    assert issubclass(core.InternalError, RuntimeError)
    assert core.InternalError.__module__ == "contextd._core"
    assert "InternalError" in core.__all__
    assert core.ENCODINGS == ENCODINGS


# ----------------------------------------------------------------------------- BM25


@pytest.mark.parametrize("k", [2**40, 2**63, 2**63 + 1, U64_MAX])
def test_search_with_a_huge_k_returns_every_hit(k: int) -> None:
    """``k + 1`` sized the result heap: 2**63 was a capacity-overflow panic."""
    index = core.Bm25Index()
    index.add([1, 2, 3], ["alpha beta", "alpha", "gamma"])
    expected = index.search("alpha", 10)
    assert len(expected[0]) == 2
    assert clean(index.search, "alpha", k) == expected


def test_out_of_range_arguments_are_overflow_errors_and_leave_the_index_usable() -> None:
    index = core.Bm25Index()
    index.add([1], ["alpha"])
    for k in (-1, 2**64):
        with pytest.raises(OverflowError):
            clean(index.search, "alpha", k)
    with pytest.raises(OverflowError):
        clean(index.add, [2**63], ["beta"])
    with pytest.raises(ValueError, match='column "texts" has 2 entries'):
        clean(index.add, [2], ["beta", "gamma"])
    assert (len(index), index.search("alpha")[0]) == (1, [1])


# ----------------------------------------------------------------------------- trimming


def test_costs_near_u64_max_never_add_up_past_the_budget() -> None:
    """Sums saturated at 2**64 - 1, so 2**64 - 1 + 1 tokens "fit" a budget of 2**64 - 1."""
    roles, tokens, chars, groups = [USER, USER], [U64_MAX, 1], [1, 1], [-1, -1]
    listed = clean(core.trim_to_budget, roles, tokens, chars, groups, U64_MAX)
    columns = clean(
        core.trim_columns_to_budget,
        np.array(roles, dtype=np.uint8),
        np.array(tokens, dtype=np.uint64),
        np.array(chars, dtype=np.uint64),
        np.array(groups, dtype=np.int64),
        U64_MAX,
    )
    for r in (listed, columns):
        assert (r.kept, r.total_tokens) == ([1], 1)


EXTREME = st.sampled_from([0, 1, 2, 3, 4000, 2**32, 2**63 - 1, 2**63, U64_MAX - 1, U64_MAX])
U64 = EXTREME | st.integers(0, U64_MAX)


@given(
    messages=st.lists(
        st.tuples(st.sampled_from([USER, ASSISTANT, TOOL_RESULT]), U64, U64, U64), max_size=6
    ),
    budget=U64,
    max_chars=U64,
    with_truncated=st.booleans(),
)
@example(  # two halves of 2**64 "fitted" 2**64 - 1 once the sum saturated
    messages=[(USER, 2**63, 1, 0), (ASSISTANT, 2**63, 1, 0)],
    budget=U64_MAX,
    max_chars=4000,
    with_truncated=False,
)
@example(  # the same through the truncated cost of rule 1
    messages=[(USER, U64_MAX, 5, U64_MAX), (USER, 2, 5, 1)],
    budget=U64_MAX,
    max_chars=4,
    with_truncated=True,
)
@settings(max_examples=500, deadline=None)
def test_extreme_counts_and_budgets_match_the_reference(
    messages: list[tuple[int, int, int, int]], budget: int, max_chars: int, with_truncated: bool
) -> None:
    """The brute-force reference uses Python ints, which never overflow."""
    roles = [m[0] for m in messages]
    tokens = [m[1] for m in messages]
    chars = [m[2] for m in messages]
    truncated = [m[3] for m in messages] if with_truncated else None
    groups = [-1] * len(messages)
    got = clean(core.trim_to_budget, roles, tokens, chars, groups, budget, max_chars, truncated)
    want = trim_reference(roles, tokens, chars, groups, budget, max_chars, truncated)
    assert (got.kept, got.truncated, got.truncated_chars, got.total_tokens) == (
        want.kept,
        want.truncated,
        want.truncated_chars,
        want.total_tokens,
    )
    assert got.total_tokens <= budget


@pytest.mark.parametrize(
    "change",
    [
        {"budget": -1},
        {"budget": 2**64},
        {"max_chars_per_message": -1},
        {"tokens": [-1]},
        {"chars": [2**64]},
        {"roles": [256]},
        {"groups": [2**63]},
        {"truncated_tokens": [-5]},
    ],
    ids=str,
)
def test_ints_out_of_range_are_overflow_errors(change: dict[str, object]) -> None:
    args: dict[str, object] = {
        "roles": [USER],
        "tokens": [1],
        "chars": [1],
        "groups": [-1],
        "budget": 10,
        "max_chars_per_message": 4000,
        "truncated_tokens": None,
    }
    args.update(change)
    with pytest.raises(OverflowError):
        clean(core.trim_to_budget, **args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- text


# ASCII the pretokenizer has fast paths for, next to characters that change its decisions
# (letters, marks, digits and spaces outside ASCII; long s folds to `s` in `'s`; `İ` and `ẞ`
# change length when lower-cased; `ﬃ` is one letter of three when folded), and characters
# of two, three and four UTF-8 bytes on every side of them.
PIECES = [
    "a",
    "Z",
    "7",
    " ",
    "\t",
    "\n",
    "\r\n",
    "'",
    "'s",
    "'LL",
    "/",
    "!",
    "é",
    "\u0301",
    "中",
    "🙂",
    "\u00a0",
    "\u2028",
    "\u3000",
    "ſ",
    "İ",
    "ẞ",
    "ﬃ",
    "ǅ",
    "٣",
    "\u200d",
    "Σ",
]
TEXTS = ["".join(p) for n in (1, 2, 3) for p in itertools.product(PIECES, repeat=n)]


def test_every_text_binding_handles_every_char_boundary() -> None:
    """Every one-, two- and three-piece string, through every binding that reads text."""
    for encoding in ENCODINGS:
        counts = clean(core.count_tokens_batch, TEXTS, encoding)
        assert counts == [clean(core.count_tokens, t, encoding) for t in TEXTS]
        exact = encoding in ("o200k_base", "cl100k_base")
        reference = tiktoken_encoding(encoding) if exact else None
        if reference is not None:
            assert counts == [len(reference.encode(t, disallowed_special=())) for t in TEXTS]
    assert clean(core.count_tokens_for_model_batch, TEXTS, "claude-sonnet-4-5") == [
        core.model_info("claude-sonnet-4-5").apply_margin(n)
        for n in core.count_tokens_batch(TEXTS, "o200k_base")
    ]
    for text in TEXTS:
        assert clean(core.tokenize, text) == tokenize_reference(text)
        for found in clean(core.extract_specifics, text):
            assert found and found in text
        with contextlib.suppress(core.UnknownModelError):
            clean(core.model_info, text)
    scores = clean(core.keyword_scores, "ǅǅǅ éé\u0301 中中中 İİİ", TEXTS)
    assert len(scores) == len(TEXTS) and max(scores) >= 1
    index = core.Bm25Index()
    clean(index.add, list(range(len(TEXTS))), TEXTS)
    assert len(index) == len(TEXTS)
    for piece in PIECES:
        ids, _ = clean(index.search, piece * 3, 2**63)
        words = tokenize_reference(piece * 3)
        assert all(words[0] in tokenize_reference(TEXTS[i]) for i in ids) if words else not ids


def test_large_texts_take_the_detached_path_cleanly() -> None:
    """Above 64 KiB the work runs without the GIL (and in parallel): same results."""
    big = "".join(TEXTS)
    assert len(big.encode()) >= 64 * 1024
    for encoding in ("o200k_base", "cl100k_base"):
        count = clean(core.count_tokens, big, encoding)
        reference = tiktoken_encoding(encoding)
        if reference is not None:
            assert count == len(reference.encode(big, disallowed_special=()))
    words = clean(core.tokenize, big)
    assert words == tokenize_reference(big)
    assert clean(core.keyword_select, words[-1], [big, "nothing"]) == [0]
    assert all(found in big for found in clean(core.extract_specifics, big))
    # Search vectors of 64 KiB of messages (detached) are those made one by one (attached).
    pieces = [big[i : i + 500] for i in range(0, len(big), 500)]
    pieces += [f"Word{i} x{i % 7}: alpha beta-{i} " * 20 for i in range(200)]  # ASCII: made
    vectors = clean(core.search_vectors, pieces, [""] * len(pieces))
    assert vectors == [core.search_vectors([p], [""])[0] for p in pieces]
    assert all(vectors[-200:])


SURROGATE = "ok \ud800 ok"
SURROGATE_CALLS: dict[str, Callable[[], object]] = {
    "estimate_tokens": lambda: core.estimate_tokens(SURROGATE),
    "count_tokens": lambda: core.count_tokens(SURROGATE, "o200k_base"),
    "count_tokens_batch": lambda: core.count_tokens_batch(["x", SURROGATE], "cl100k_base"),
    "count_tokens_for_model_batch": lambda: core.count_tokens_for_model_batch(
        [SURROGATE], "default"
    ),
    "model_info": lambda: core.model_info(SURROGATE),
    "tokenize": lambda: core.tokenize(SURROGATE),
    "keyword_scores/query": lambda: core.keyword_scores(SURROGATE, ["x"]),
    "keyword_scores/texts": lambda: core.keyword_scores("x", [SURROGATE]),
    "keyword_select": lambda: core.keyword_select("x", [SURROGATE]),
    "extract_specifics": lambda: core.extract_specifics(SURROGATE),
    "Bm25Index.search": lambda: core.Bm25Index().search(SURROGATE),
}


@pytest.mark.parametrize("call", SURROGATE_CALLS.values(), ids=SURROGATE_CALLS.keys())
def test_lone_surrogates_are_unicode_errors(call: Callable[[], object]) -> None:
    """A str that is not valid Unicode cannot be read as UTF-8: a ValueError, raised
    before any work starts."""
    with pytest.raises(UnicodeEncodeError):
        clean(call)


def test_a_rejected_add_leaves_the_index_as_it_was() -> None:
    index = core.Bm25Index()
    index.add([1], ["alpha"])
    with pytest.raises(UnicodeEncodeError):
        clean(index.add, [2, 3], ["beta", SURROGATE])
    assert (len(index), 2 in index, index.vocabulary_size) == (1, False, 1)
    # Only the length is read, in code points, so estimates need no UTF-8.
    assert core.estimate_tokens_batch([SURROGATE]) == [(len(SURROGATE) + 3) // 4]


def test_empty_inputs_give_empty_results() -> None:
    for encoding in ENCODINGS:
        assert core.count_tokens("", encoding) == 0
        assert core.count_tokens_batch([], encoding) == []
        assert core.count_tokens_batch([""], encoding) == [0]
    assert core.count_tokens_for_model_batch([], "default") == []
    assert core.estimate_tokens("") == 0
    assert core.estimate_tokens_batch([]) == []
    assert core.tokenize("", stop_words=True) == []
    assert core.keyword_scores("", []) == []
    assert core.keyword_select("", []) == []
    assert core.keyword_select("", ["a"]) == [0]
    assert core.extract_specifics("") == []
    with pytest.raises(core.UnknownModelError):
        core.model_info("")
    index = core.Bm25Index()
    assert index.search("alpha") == ([], [])
    index.add([], [])
    assert (len(index), index.remove([]), index.vocabulary_size) == (0, 0, 0)
    index.add([1], [""])
    assert (len(index), index.search(""), index.search("alpha", 0)) == (1, ([], []), ([], []))
    r = core.trim_to_budget([], [], [], [], 0, 0, [])
    assert (r.kept, r.kept_start, r.total_tokens) == ([], None, 0)


# ----------------------------------------------------------------------------- models


def test_huge_counts_cost_at_least_themselves() -> None:
    """The margin's product saturated before the division: 2**64 - 1 tokens cost 2**64 / 1000."""
    for name in core.list_models():
        info = core.model_info(name)
        milli = round(info.margin * 1000)
        for count in (2**60, 2**63, U64_MAX // 1000 + 1, U64_MAX):
            cost = clean(info.apply_margin, count)
            assert cost == min(-(-count * milli // 1000), U64_MAX), (name, count)
            assert cost >= count
        for bad in (-1, 2**64):
            with pytest.raises(OverflowError):
                clean(info.apply_margin, bad)
