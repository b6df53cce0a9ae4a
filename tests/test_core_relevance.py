"""Tokenizer, keyword overlap and BM25 from the Rust core against pure-Python references."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextd import core
from core_reference import (
    Bm25Reference,
    keyword_scores_reference,
    keyword_select_reference,
    tokenize_reference,
)

STOP = frozenset(core.STOP_WORDS)

# Characters Python's Unicode database knows (unassigned and surrogates excluded), so the
# reference and Rust (whose tables may be a newer Unicode version) agree on categories.
ANY_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=120)
WORDS = [
    "rust", "Rust", "RUST", "python", "the", "and", "a", "is", "of", "tokenizer", "bm25",
    "café", "cafe\u0301", "naïve", "日本語", "東京", "nämlich", "ΟΔΟΣ", "İstanbul", "x1", "id_42",
    "grpc", "context", "window", "budget", "über", "straße", "ǅemal",
]  # fmt: skip
WORDY_TEXT = st.lists(st.sampled_from(WORDS), max_size=12).map(lambda ws: " ".join(ws))
SEPARATED = st.lists(
    st.tuples(st.sampled_from(WORDS), st.sampled_from([" ", ", ", "\n", "-", "_", "/", "."])),
    max_size=12,
).map(lambda pairs: "".join(w + sep for w, sep in pairs))
TEXT = st.one_of(ANY_TEXT, WORDY_TEXT, SEPARATED)


def test_stop_words_are_sorted_and_long() -> None:
    assert list(core.STOP_WORDS) == sorted(set(core.STOP_WORDS))
    assert all(len(w) >= 3 for w in core.STOP_WORDS)
    assert {"the", "and", "with", "about"} <= STOP


@settings(max_examples=400, deadline=None)
@given(text=TEXT, stop_words=st.booleans())
def test_tokenize_matches_reference(text: str, stop_words: bool) -> None:
    assert core.tokenize(text, stop_words) == tokenize_reference(text, stop_words, STOP)


def test_tokenize_examples() -> None:
    assert core.tokenize("The CAT sat on a mat_file-2024") == [
        "the", "cat", "sat", "mat", "file", "2024",
    ]  # fmt: skip
    assert core.tokenize("The CAT sat on a mat", stop_words=True) == ["cat", "sat", "mat"]
    assert core.tokenize("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]


@settings(max_examples=200, deadline=None)
@given(query=TEXT, texts=st.lists(TEXT, max_size=8), stop_words=st.booleans())
def test_keyword_overlap_matches_reference(query: str, texts: list[str], stop_words: bool) -> None:
    assert core.keyword_scores(query, texts, stop_words) == keyword_scores_reference(
        query, texts, stop_words, STOP
    )
    assert core.keyword_select(query, texts, stop_words) == keyword_select_reference(
        query, texts, stop_words, STOP
    )


def test_keyword_select_returns_everything_when_nothing_matches() -> None:
    texts = ["alpha beta", "gamma", ""]
    assert core.keyword_select("delta", texts) == [0, 1, 2]
    assert core.keyword_select("", texts) == [0, 1, 2]
    assert core.keyword_select("gamma alpha", texts) == [0, 1]
    assert core.keyword_scores("alpha alpha beta", texts) == [2, 0, 0]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


# One step of an index's life: add a batch, or remove some ids.
Op = tuple[str, list[int], list[str]]
ops = st.lists(
    st.one_of(
        st.lists(st.tuples(st.integers(-5, 30), TEXT), max_size=10).map(
            lambda docs: ("add", [d[0] for d in docs], [d[1] for d in docs])
        ),
        st.lists(st.integers(-5, 30), max_size=8).map(lambda ids: ("remove", ids, [])),
    ),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(
    history=ops,
    queries=st.lists(TEXT, min_size=1, max_size=4),
    k=st.integers(1, 12),
    k1=st.sampled_from([1.2, 0.0, 2.0]),
    b=st.sampled_from([0.75, 0.0, 1.0]),
    stop_words=st.booleans(),
)
def test_bm25_matches_reference(
    history: list[Op], queries: list[str], k: int, k1: float, b: float, stop_words: bool
) -> None:
    index = core.Bm25Index(k1, b, stop_words)
    ref = Bm25Reference(k1, b, stop_words, STOP)
    for kind, ids, texts in history:
        if kind == "add":
            index.add(ids, texts)
            ref.add(ids, texts)
        else:
            assert index.remove(ids) == ref.remove(ids)
    assert len(index) == len(ref.docs)
    assert all(i in index for i in ref.docs)
    for query in queries:
        expected = ref.scores(query)
        ids, scores = index.search(query, len(ref.docs) + 1)
        assert sorted(ids) == sorted(expected)
        for i, s in zip(ids, scores, strict=True):
            assert _close(s, expected[i]), (i, s, expected[i])
        # Ranked best first, ties by ascending id.
        assert all(
            (scores[j] > scores[j + 1]) or (scores[j] == scores[j + 1] and ids[j] < ids[j + 1])
            for j in range(len(ids) - 1)
        )
        top_ids, top_scores = index.search(query, k)
        assert top_ids == ids[:k] and top_scores == scores[:k]
        ref_top = ref.search(query, k)
        assert len(top_ids) == len(ref_top)
        for s, (_, rs) in zip(top_scores, ref_top, strict=True):
            assert _close(s, rs)


def test_bm25_known_values() -> None:
    index = core.Bm25Index()
    index.add([10, 20, 30], ["rust borrow checker rust", "python garbage", "rust and python"])
    ids, scores = index.search("rust", 5)
    assert ids == [10, 30]
    n, df, avgdl = 3, 2, 9 / 3
    idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
    expected_10 = idf * 2 * 2.2 / (2 + 1.2 * (0.25 + 0.75 * 4 / avgdl))
    assert _close(scores[0], expected_10)
    assert index.search("rust", 0) == ([], [])
    assert index.search("unknown words", 5) == ([], [])


def test_bm25_replace_remove_and_properties() -> None:
    index = core.Bm25Index(k1=1.5, b=0.5, stop_words=True)
    assert (index.k1, index.b, index.stop_words) == (1.5, 0.5, True)
    index.add([1, 2], ["the cat", "the dog"])
    assert index.search("the", 5) == ([], [])  # stop word
    index.add([1], ["a bird"])
    assert len(index) == 2 and index.search("cat", 5) == ([], [])
    assert index.remove([1, 1, 99]) == 1
    assert len(index) == 1 and 1 not in index and 2 in index
    assert index.vocabulary_size >= 2
    assert repr(index) == "Bm25Index(k1=1.5, b=0.5, stop_words=True, len=1)"


def test_bm25_defaults_are_the_okapi_values() -> None:
    index = core.Bm25Index()
    assert (index.k1, index.b, index.stop_words, len(index), index.vocabulary_size) == (
        1.2,
        0.75,
        False,
        0,
        0,
    )
    assert repr(index) == "Bm25Index(k1=1.2, b=0.75, stop_words=False, len=0)"


def test_bm25_replacing_documents_keeps_results() -> None:
    """Replacing every document many times (compaction runs on add too) changes nothing
    a fresh index would answer differently."""
    index = core.Bm25Index()
    ids = list(range(50))
    for round_ in range(8):
        texts = [f"doc{i} topic{i % 7} round{round_}" for i in ids]
        index.add(ids, texts)
        fresh = core.Bm25Index()
        fresh.add(ids, texts)
        assert len(index) == 50 and index.vocabulary_size >= fresh.vocabulary_size
        for q in ["topic3", f"round{round_}", "round0 doc7"]:
            assert index.search(q, 60) == fresh.search(q, 60)


def test_bm25_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k1"):
        core.Bm25Index(k1=-1.0)
    with pytest.raises(ValueError, match="b must be"):
        core.Bm25Index(b=2.0)
    index = core.Bm25Index()
    with pytest.raises(ValueError, match="texts"):
        index.add([1, 2], ["only one"])
    with pytest.raises(OverflowError):
        index.add([2**63], ["too big an id"])


def test_bm25_large_batch_uses_parallel_path_consistently() -> None:
    texts = [f"message {i} about topic{i % 17} and word{i % 5}" for i in range(2000)]
    batch = core.Bm25Index()
    batch.add(list(range(2000)), texts)
    one_by_one = core.Bm25Index()
    for i, t in enumerate(texts[:100]):
        one_by_one.add([i], [t])
    one_by_one.add(list(range(100, 2000)), texts[100:])
    for q in ["topic3 word1", "message", "about 1999"]:
        assert batch.search(q, 20) == one_by_one.search(q, 20)


def test_bm25_is_safe_to_share_between_threads() -> None:
    index = core.Bm25Index()
    stop = threading.Event()

    def writer(start: int) -> None:
        for j in range(20):
            base = start + j * 50
            index.add(list(range(base, base + 50)), [f"doc {i} text{i % 9}" for i in range(50)])

    def reader() -> int:
        n = 0
        while not stop.is_set():
            ids, scores = index.search("text3 doc", 10)
            assert len(ids) == len(scores) <= 10
            n += 1
        return n

    with ThreadPoolExecutor(max_workers=4) as pool:
        readers = [pool.submit(reader) for _ in range(2)]
        writers = [pool.submit(writer, s) for s in (0, 100_000)]
        for w in writers:
            w.result()
        stop.set()
        assert all(r.result() > 0 for r in readers)
    assert len(index) == 2000


def test_bm25_getters_wait_for_a_long_add_without_the_gil() -> None:
    """While an add holds the write lock (GIL released), len() waits for it detached, so
    other Python threads keep running instead of the whole interpreter freezing."""
    texts = [f"message {i} about topic{i % 97} and word{i % 13} " * 4 for i in range(200_000)]
    index = core.Bm25Index()
    done = threading.Event()
    ticks = 0

    def counter() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    def add_all() -> None:
        index.add(list(range(len(texts))), texts)
        done.set()

    adder = threading.Thread(target=add_all)
    ticker = threading.Thread(target=counter)
    adder.start()
    ticker.start()
    blocked = []
    while not done.is_set():
        before, started = ticks, time.perf_counter()
        size = len(index)
        elapsed, progressed = time.perf_counter() - started, ticks - before
        assert size in (0, len(texts))  # never half a batch
        if elapsed > 0.2:  # it waited for the add (not just a slow scheduler)
            blocked.append(progressed)
    adder.join()
    ticker.join()
    assert all(p > 0 for p in blocked), blocked
