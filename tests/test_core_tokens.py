"""Token counts from the Rust core against tiktoken (exact) and the seeds' formulas."""
# ruff: noqa: RUF001  (the corpus is deliberately full of look-alike Unicode)

from __future__ import annotations

import base64
import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import corpus
from contextd import core
from core_reference import chars_div4, estimate, tiktoken_encoding

EXACT = ("o200k_base", "cl100k_base")


def _rng_text(seed: int) -> str:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFG\n\t.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`0123456789"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 3000)))


CODE = '''
def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    a, b = 0, 1
    out: list[int] = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out

if __name__ == "__main__":
    print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
'''

CORPUS: list[str] = [
    "",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's a dog's life, isn't it? They'll say we'd've done it. I'M SHOUTING'S",
    CODE,
    'fn main() {\n    println!("{}", 1 + 2);\n}\n',
    json.dumps(
        {"tool": "read_file", "args": {"path": "/etc/hosts", "lines": [1, 2, 3]}, "ok": True},
        indent=2,
    ),
    base64.b64encode(bytes(range(256)) * 8).decode(),
    "你好，世界！这是一个用于测试分词器的中文句子。",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
    "Здравствуй, мир! Ελληνικά κείμενα. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया",
    "emoji 🙂🙃👩‍👩‍👧‍👦 🇫🇷 👍🏽 🧑‍💻 ✨✨✨",
    "a" * 5000,
    "ab" * 3000,
    " " * 1000,
    "\n" * 500,
    "\t \n \r\n  \u00a0 \u3000 word   \n\n\n   end  ",
    "x" + " " * 37 + "y\n\n  \n",
    "1234567890 3.14159 -42 1e10 0xDEADBEEF 100,000,000",
    "<|endoftext|> special tokens are plain text here <|fim_prefix|>",
    "Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ and ﬁ ligatures, e\u0301 combining, Å vs A\u030a",
    "https://example.com/path?q=1&r=two#frag /usr/local/bin/python3 C:\\Windows\\System32",
    "\ufeffBOM and \u200b zero width \u200d joiners",
    *(_rng_text(s) for s in range(20)),
]


@pytest.fixture(scope="module", params=EXACT)
def tiktoken_enc(request: pytest.FixtureRequest) -> tuple[str, Any]:
    name: str = request.param
    enc = tiktoken_encoding(name)
    if enc is None:
        pytest.skip(
            "tiktoken is not installed, or its encodings could not be found offline (the "
            "bpe-openai crate's data/ via `cargo metadata`) nor downloaded"
        )
    return name, enc


def test_exact_counts_equal_tiktoken_on_corpus(tiktoken_enc: tuple[str, Any]) -> None:
    name, enc = tiktoken_enc
    expected = [len(enc.encode_ordinary(t)) for t in CORPUS]
    assert core.count_tokens_batch(CORPUS, name) == expected  # type: ignore[arg-type]
    for text, n in zip(CORPUS, expected, strict=True):
        assert core.count_tokens(text, name) == n, text[:80]  # type: ignore[arg-type]


def test_large_batch_takes_the_parallel_path_and_still_matches(
    tiktoken_enc: tuple[str, Any],
) -> None:
    name, enc = tiktoken_enc
    texts = CORPUS * 20  # well above the 64 KiB parallel threshold
    assert sum(len(t.encode()) for t in texts) > 64 * 1024
    expected = [len(enc.encode_ordinary(t)) for t in texts]
    assert core.count_tokens_batch(texts, name) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", corpus.TEXT_CLASSES)
def test_exact_counts_equal_tiktoken_on_every_text_class(
    tiktoken_enc: tuple[str, Any], kind: str
) -> None:
    """The benchmark's classes (prose, code, JSON, CJK, emoji, base64, logs), new text per
    seed: counted once (the memo of short pieces cold for these pieces) and again (warm),
    one by one and as a batch large enough for the thread pool."""
    name, enc = tiktoken_enc
    for seed in (101, 102):
        texts = corpus.class_texts(kind, 70_000, seed=seed)
        expected = [len(enc.encode_ordinary(t)) for t in texts]
        for _ in range(2):
            assert core.count_tokens_batch(texts, name) == expected  # type: ignore[arg-type]
        for text, n in zip(texts[:40], expected, strict=False):
            assert core.count_tokens(text, name) == n, text[:80]  # type: ignore[arg-type]


# Random Unicode, plus a small alphabet that piles up the pre-tokenizer's edge cases:
# whitespace runs before words, contractions, digit runs, punctuation, case changes.
TRICKY = st.text(
    alphabet=" \n\t\r\u00a0\u3000\u0085\u2028aZé'’sſSLlrRe1234٣².,!?/_-"
    "你日ひカ한🙂\u200d\ufe0f\u0301ʰǅ",
    max_size=200,
)


@settings(max_examples=600, deadline=None)
@given(text=st.one_of(st.text(max_size=400), TRICKY))
def test_exact_counts_equal_tiktoken_on_random_text(text: str) -> None:
    for name in EXACT:
        enc = tiktoken_encoding(name)
        if enc is None:
            pytest.skip("tiktoken unavailable offline")
        assert core.count_tokens(text, name) == len(enc.encode_ordinary(text))  # type: ignore[arg-type]


def _cjk_runs(seed: int) -> list[str]:
    """Long runs of letters without spaces (each one pretokenizer piece, cut by the core
    where no token spans a char boundary), mixing frequent and rare Han, kana, Hangul,
    accented Latin, marks, emoji and ASCII, with runs of every length across the
    merge loop's and the memo's limits."""
    rng = random.Random(seed)
    common = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去"
    kana = "あいうえおかきくけこさしすせそたちつてとなにぬねのアイウエオカキクケコサシスセソーッャ"
    pools = [
        lambda: rng.choice(common),
        lambda: rng.choice(kana),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),
        lambda: chr(rng.randint(0xAC00, 0xD7A3)),
        lambda: rng.choice("éüñßøÅ\u0301\u0308ʰ"),
        lambda: rng.choice("abcXYZ"),
        lambda: rng.choice("🙂🚀👍\u200d"),
    ]
    out = []
    for length in (*range(1, 40), 60, 100, 200, 500):
        weights = [rng.random() for _ in pools]
        out.append("".join(rng.choices(pools, weights)[0]() for _ in range(length)))
    out += [c * n for c in "的ア한畐é🙂" for n in (2, 5, 17, 64)]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_exact_counts_equal_tiktoken_on_long_letter_runs(
    tiktoken_enc: tuple[str, Any], seed: int
) -> None:
    name, enc = tiktoken_enc
    texts = _cjk_runs(seed)
    texts.append("，".join(texts[:30]) + "。")
    expected = [len(enc.encode_ordinary(t)) for t in texts]
    assert core.count_tokens_batch(texts, name) == expected  # type: ignore[arg-type]


CJK = st.text(
    alphabet="的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下日本語"
    "あいうえおかきくけこアイウエオカキクケコーッャ한국어문장있습니다畐鬱龘，。、！？「」 1a",
    min_size=1,
    max_size=300,
)


@settings(max_examples=400, deadline=None)
@given(text=CJK)
def test_exact_counts_equal_tiktoken_on_random_cjk(text: str) -> None:
    for name in EXACT:
        enc = tiktoken_encoding(name)
        if enc is None:
            pytest.skip("tiktoken unavailable offline")
        assert core.count_tokens(text, name) == len(enc.encode_ordinary(text))  # type: ignore[arg-type]


@given(texts=st.lists(st.text(max_size=50), max_size=20))
def test_estimators_match_the_seeds(texts: list[str]) -> None:
    assert core.count_tokens_batch(texts, "estimate") == [estimate(t) for t in texts]
    assert core.count_tokens_batch(texts, "chars_div4") == [chars_div4(t) for t in texts]
    assert core.estimate_tokens_batch(texts) == [estimate(t) for t in texts]
    assert [core.estimate_tokens(t) for t in texts] == [estimate(t) for t in texts]


def test_known_counts_without_tiktoken() -> None:
    assert core.count_tokens("hello world", "o200k_base") == 2
    assert core.count_tokens("你好，世界", "o200k_base") == 3
    assert core.count_tokens("你好，世界", "cl100k_base") == 6


@pytest.mark.parametrize("bad", ["", "p50k_base", "O200K_BASE", "gpt-4o"])
def test_unknown_encoding_is_a_value_error_naming_the_choices(bad: str) -> None:
    with pytest.raises(ValueError, match="expected one of: o200k_base, cl100k_base"):
        core.count_tokens_batch(["x"], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown encoding"):
        core.count_tokens("x", bad)  # type: ignore[arg-type]


def test_encodings_constant_lists_every_accepted_name() -> None:
    assert core.ENCODINGS == ("o200k_base", "cl100k_base", "estimate", "chars_div4")
    for name in core.ENCODINGS:
        # mypy narrows ENCODINGS to the literal tuple after the assert above.
        assert core.count_tokens_batch(["abc def"], name) == [core.count_tokens("abc def", name)]


def test_batch_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        core.count_tokens_batch(["ok", 3], "estimate")  # type: ignore[list-item]
