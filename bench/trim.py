"""Benchmark 2: trimming a history to a token budget.

Three ways to keep the newest messages that fit 8,000 tokens, given the same per-message
token counts (exact o200k_base): contextd's trimmer, langchain_core's
``trim_messages(strategy="last")`` with a per-message token counter, and the plain
newest-first loop anyone would write. contextd's row is the service's own path,
``trim_columns_to_budget`` on NumPy columns (uint8 roles, uint64 tokens and chars, int64
groups, as the store's Arrow columns arrive); the same trimmer fed four Python lists
(``trim_to_budget``) is shown too, to make the cost of converting Python ints visible.
The history has no tool calls, because langchain knows no tool groups; on it every
trimmer must keep exactly the same messages (checked; a difference fails the suite).
Building langchain's message objects is timed separately: an application holding its
history as langchain messages pays it once, an application loading history from a store
pays it on every call.

No ``from __future__ import annotations`` here on purpose: langchain decides whether a
token counter is per-message by comparing the first parameter's annotation object with
``BaseMessage``, which a string annotation would fail.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import corpus
from bench.model import Bar, Section
from bench.sizes import Sizes
from bench.stats import fmt_ms, fmt_ratio, median_time, progress, ratio

NO_TRUNCATION = 1 << 30  # max_chars_per_message: langchain does not truncate, so neither do we


# What one chat message costs an OpenAI model besides its content (3 tokens of framing
# and 1 for a "user"/"assistant" role), and what the request costs once (the reply's
# priming): contextd's builds count a request as its provider does (docs/api.md, "Budgets
# that hold"), so a peer doing the same job must count the same way.
OPENAI_PER_MESSAGE = 4
OPENAI_PER_REQUEST = 3


def openai_framed(tokens: Sequence[int], budget: int) -> tuple[list[int], int]:
    """Per-message costs and the history budget under OpenAI's chat accounting."""
    return [t + OPENAI_PER_MESSAGE for t in tokens], budget - OPENAI_PER_REQUEST


def newest_first(tokens: Sequence[int], budget: int) -> int:
    """Index of the oldest kept message of the longest newest suffix within ``budget``."""
    total = 0
    start = len(tokens)
    for i in range(len(tokens) - 1, -1, -1):
        total += tokens[i]
        if total > budget:
            break
        start = i
    return start


def langchain_messages(roles: Sequence[int], contents: Sequence[str]) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage

    return [
        HumanMessage(content=c) if r == corpus.ROLE_USER else AIMessage(content=c)
        for r, c in zip(roles, contents, strict=True)
    ]


def langchain_trim(messages: list[Any], tokens: Sequence[int], budget: int) -> list[Any]:
    """``trim_messages`` with a per-message counter that looks the count up by identity."""
    from langchain_core.messages import BaseMessage, trim_messages

    by_id = {id(m): t for m, t in zip(messages, tokens, strict=True)}

    def count(message: BaseMessage) -> int:
        return by_id[id(message)]

    result: list[Any] = trim_messages(
        messages, max_tokens=budget, token_counter=count, strategy="last"
    )
    return result


def kept_by_langchain(messages: list[Any], kept: list[Any]) -> list[int]:
    index = {id(m): i for i, m in enumerate(messages)}
    return sorted(index[id(m)] for m in kept)


def run(sz: Sizes) -> Section:
    from contextd import core

    n = sz.trim_history
    progress(f"trimming: {n:,}-message history, budget {sz.budget:,}")
    history = corpus.conversation(n, tools=False)
    roles = [m.role for m in history]
    contents = [m.content for m in history]
    tokens = core.count_tokens_batch(contents, "o200k_base")
    chars = [len(c) for c in contents]
    groups = [-1] * n
    budget = sz.budget
    # The service's columns: what WindowLoading._candidates passes (from the store's Arrow table).
    roles_col = np.asarray(roles, dtype=np.uint8)
    tokens_col = np.asarray(tokens, dtype=np.uint64)
    chars_col = np.asarray(chars, dtype=np.uint64)
    groups_col = np.asarray(groups, dtype=np.int64)

    def ours() -> list[int]:
        return core.trim_columns_to_budget(
            np.ascontiguousarray(roles_col),
            np.ascontiguousarray(tokens_col),
            np.ascontiguousarray(chars_col),
            np.ascontiguousarray(groups_col),
            budget,
            NO_TRUNCATION,
        ).kept

    def ours_lists() -> list[int]:
        return core.trim_to_budget(roles, tokens, chars, groups, budget, NO_TRUNCATION).kept

    messages = langchain_messages(roles, contents)
    kept_ours = sorted(ours())
    kept_lists = sorted(ours_lists())
    kept_loop = list(range(newest_first(tokens, budget), n))
    kept_lc = kept_by_langchain(messages, langchain_trim(messages, tokens, budget))
    if not (kept_ours == kept_lists == kept_loop == kept_lc):
        raise AssertionError(
            f"trimmers disagree: contextd (columns) kept {len(kept_ours)} from "
            f"{kept_ours[:1]}, contextd (lists) {len(kept_lists)} from {kept_lists[:1]}, "
            f"loop {len(kept_loop)} from {kept_loop[:1]}, langchain {len(kept_lc)} "
            f"from {kept_lc[:1]}"
        )

    repeat = sz.repeat * 3
    t_ours = median_time(ours, repeat)
    t_lists = median_time(ours_lists, repeat)
    t_loop = median_time(lambda: newest_first(tokens, budget), repeat)
    t_lc = median_time(lambda: langchain_trim(messages, tokens, budget), sz.repeat)
    t_build = median_time(lambda: langchain_messages(roles, contents), sz.repeat, warmup=0)
    rows = [
        [
            "contextd trim_columns_to_budget (NumPy columns, the service's path)",
            fmt_ms(t_ours),
            "1x",
        ],
        [
            "contextd trim_to_budget (four Python lists)",
            fmt_ms(t_lists),
            fmt_ratio(ratio(t_lists, t_ours)),
        ],
        ["plain Python newest-first loop", fmt_ms(t_loop), fmt_ratio(ratio(t_loop, t_ours))],
        ["langchain trim_messages", fmt_ms(t_lc), fmt_ratio(ratio(t_lc, t_ours))],
        [
            "langchain: build the message objects",
            fmt_ms(t_build),
            fmt_ratio(ratio(t_build, t_ours)),
        ],
        [
            "langchain: build + trim",
            fmt_ms(t_build + t_lc),
            fmt_ratio(ratio(t_build + t_lc, t_ours)),
        ],
    ]
    if t_loop < t_ours:
        versus_loop = (
            f"the plain newest-first loop is still {fmt_ratio(ratio(t_ours, t_loop))} faster: "
            "both stop at the budget after a few dozen messages, and the trimmer's fixed cost "
            "(crossing into Rust and checking four NumPy buffers) is about the loop's whole walk"
        )
    else:
        versus_loop = (
            f"it is {fmt_ratio(ratio(t_loop, t_ours))} faster than the plain newest-first loop"
        )
    findings = [
        f"All four kept the same {len(kept_ours):,} newest messages of {n:,} "
        f"({sum(tokens[i] for i in kept_ours):,} tokens of a {budget:,} budget).",
        f"On NumPy columns, as the service calls it, contextd's trim takes {fmt_ms(t_ours)}: "
        f"{fmt_ratio(ratio(t_lc, t_ours))} faster than langchain's trim_messages (whose "
        "binary search re-sums the counts of ever longer prefixes) and "
        f"{fmt_ratio(ratio(t_lists, t_ours))} faster than the same trimmer fed four Python "
        f"lists ({fmt_ms(t_lists)}: taking {4 * n:,} Python ints instead of NumPy buffers "
        f"adds {fmt_ms(max(0.0, t_lists - t_ours))} to the same trim); "
        f"{versus_loop}. Unlike the loop, the trimmer also respects tool groups and "
        "per-message truncation.",
    ]
    return Section(
        key="trim",
        title="2. Trimming to an 8,000-token budget",
        method=__doc__ or "",
        headers=["method", "median", "time / contextd's"],
        rows=rows,
        findings=findings,
        bars=[
            Bar("trim vs langchain trim_messages", ratio(t_lc, t_ours), None),
            Bar("trim (columns) vs trim (lists)", ratio(t_lists, t_ours), None),
            Bar("trim vs plain Python loop", ratio(t_loop, t_ours), None),
        ],
        raw={
            "n": n,
            "kept": len(kept_ours),
            "contextd_s": t_ours,
            "contextd_lists_s": t_lists,
            "loop_s": t_loop,
            "langchain_trim_s": t_lc,
            "langchain_build_s": t_build,
        },
    )
