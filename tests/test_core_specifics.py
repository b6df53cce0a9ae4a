"""Specifics extraction: examples and properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from contextd import core


def test_extracts_each_kind_in_order() -> None:
    text = (
        "Edit src/main.rs then run `cargo test --release` (docs: https://docs.rs/regex/.).\n"
        "It took 350 ms and 1.5 GB. HttpServer calls parse_args.\n"
        "ValueError: token budget exceeded\n"
    )
    assert core.extract_specifics(text) == [
        "src/main.rs",
        "cargo test --release",
        "https://docs.rs/regex/",
        "350 ms",
        "1.5 GB",
        "HttpServer",
        "parse_args",
        "ValueError: token budget exceeded",
        "ValueError",
    ]


def test_prose_has_no_specifics() -> None:
    assert core.extract_specifics("Let's talk about lunch and/or dinner tomorrow.") == []


PIECES = [*"abcXYZ_/.~`: 019\n-", "ms", "Error", "failed", "http://", "GB", "\\"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@given(text=st.one_of(TEXT, st.text(max_size=80)))
def test_results_are_unique_substrings(text: str) -> None:
    found = core.extract_specifics(text)
    assert len(found) == len(set(found))
    assert all(s and s in text for s in found)
    assert core.extract_specifics(text) == found
