"""The model registry compiled into the core."""

from __future__ import annotations

import math

import pytest

from contextd import core


def test_lists_current_models_and_default() -> None:
    names = core.list_models()
    assert names == sorted(names)
    for required in (
        "default",
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4.1",
        "o3",
        "gpt-5",
        "claude-sonnet-4-5",
        "claude-opus-4-1",
        "claude-haiku-4-5",
        "claude-3-5-haiku",
    ):
        assert required in names


@pytest.mark.parametrize(
    ("requested", "resolved"),
    [
        ("gpt-4o", "gpt-4o"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
        ("claude-3-5-haiku-latest", "claude-3-5-haiku"),
        ("Claude-Opus-4-1", "claude-opus-4-1"),
        ("anthropic/claude-haiku-4-5", "claude-haiku-4-5"),
        ("gpt-5-chat-latest", "gpt-5-chat"),
    ],
)
def test_dated_and_prefixed_ids_resolve(requested: str, resolved: str) -> None:
    assert core.model_info(requested).name == resolved


def test_every_entry_is_consistent() -> None:
    for name in core.list_models():
        info = core.model_info(name)
        assert info.name == name
        assert 0 < info.output_reserve <= info.max_output <= info.context_window
        assert info.prompt_budget == info.context_window - info.output_reserve
        assert info.tokenizer in ("o200k_base", "cl100k_base", "estimate")
        assert 1.0 <= info.margin <= 4.0
        if name.startswith("claude"):
            assert info.tokenizer == "o200k_base" and info.margin > 1.0
        if name.startswith(("gpt", "o1", "o3", "o4")):
            assert info.margin == 1.0 and info.tokenizer != "estimate"
        assert "ModelInfo(name=" in repr(info)


def test_unknown_model_is_a_key_error_with_a_clear_message() -> None:
    with pytest.raises(core.UnknownModelError, match="unknown model"):
        core.model_info("llama-3-70b")
    with pytest.raises(KeyError):
        core.model_info("gpt-4ox")  # a prefix must end at '-'
    with pytest.raises(KeyError):
        core.count_tokens_for_model_batch(["x"], "nope")


def test_model_counts_apply_the_margin_rounding_up() -> None:
    texts = ["The quick brown fox jumps over the lazy dog."] * 3 + ["", "x" * 1001]
    raw = core.count_tokens_batch(texts, "o200k_base")
    claude = core.model_info("claude-sonnet-4-5")
    expected = [math.ceil(n * round(claude.margin * 1000) / 1000) for n in raw]
    assert core.count_tokens_for_model_batch(texts, "claude-sonnet-4-5") == expected
    assert [claude.apply_margin(n) for n in raw] == expected
    assert claude.apply_margin(100) == 130  # not 131 from 100 * 1.3 in floating point
    assert core.count_tokens_for_model_batch(texts, "gpt-4o") == raw
    assert core.count_tokens_for_model_batch(texts, "default") == core.estimate_tokens_batch(texts)


def test_model_info_is_immutable() -> None:
    info = core.model_info("gpt-4o")
    with pytest.raises(AttributeError):
        info.context_window = 1  # type: ignore[misc]
