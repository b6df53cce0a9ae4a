"""Preparing an append: the columns the store keeps beside each message."""

from __future__ import annotations

from collections.abc import Sequence

from contextd import core
from contextd.domain.model import MessageBatch, NewMessage


def prepare_batch(
    messages: Sequence[NewMessage],
    model: str,
    call_ids: Sequence[tuple[str, ...]],
    summarized_ids: tuple[int, int] | None = None,
    restored_from: str = "",
    ttl_us: int = 0,
) -> MessageBatch:
    """What the store keeps beside each message, computed for the whole batch at once:
    the character estimate, the count under `model`'s tokenizer (the estimate without a
    model), the length in characters and the declared tool-call ids; `ttl_us` is the
    thread's retention ttl, passed through (set here rather than by a `replace` after,
    which costs a second dataclass build on every append)."""
    texts = [m.content + m.tool_calls for m in messages]
    estimates = core.estimate_tokens_batch(texts)
    if model:
        counts = core.count_tokens_for_model_batch(texts, model)
        tokenizer = stored_tokenizer(model)
    else:
        counts, tokenizer = estimates, "estimate"
    return MessageBatch(
        messages=messages,
        token_estimates=estimates,
        token_counts=counts,
        tokenizer=tokenizer,
        chars=[len(m.content) for m in messages],
        tool_call_ids=call_ids,
        summarized_ids=summarized_ids,
        restored_from=restored_from,
        ttl_us=ttl_us,
    )


def stored_tokenizer(model: str) -> str:
    """The label stored beside counts made under `model`: its tokenizer and margin
    ("o200k_base", "o200k_base*1.3"). Equal labels mean equal counts for equal texts."""
    info = core.model_info(model)
    return info.tokenizer if info.margin == 1.0 else f"{info.tokenizer}*{info.margin}"
