"""Budget trimming: the Rust core against a brute-force reference, plus its invariants."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextd import core
from core_reference import ASSISTANT, TOOL_RESULT, TOOL_USE, USER, trim_reference


@dataclass
class Conversation:
    roles: list[int]
    tokens: list[int]
    chars: list[int]
    groups: list[int]
    truncated_tokens: list[int] | None


@st.composite
def conversations(draw: st.DrawFn) -> Conversation:
    """Well-formed histories: each tool group is one head (a tool_use, or an assistant
    turn carrying tool calls) followed, possibly with other messages in between, by zero
    or more results; some orphan results (-1)."""
    roles: list[int] = []
    groups: list[int] = []
    pending: list[int] = []
    used: set[int] = set()
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["user", "assistant", "call", "result", "orphan"]))
        if kind == "call":
            gid = draw(st.integers(0, 10**12).filter(lambda g: g not in used))
            used.add(gid)
            pending.append(gid)
            roles.append(draw(st.sampled_from([TOOL_USE, ASSISTANT])))
            groups.append(gid)
        elif kind == "result" and pending:
            roles.append(TOOL_RESULT)
            groups.append(draw(st.sampled_from(pending)))
        elif kind == "orphan":
            roles.append(TOOL_RESULT)
            groups.append(-1)
        else:
            roles.append(USER if kind == "user" else ASSISTANT)
            groups.append(-1)
    n = len(roles)
    tokens = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    chars = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    truncated = draw(st.none() | st.lists(st.integers(0, 60), min_size=n, max_size=n))
    return Conversation(roles, tokens, chars, groups, truncated)


def _check_invariants(c: Conversation, budget: int, max_chars: int, r: core.TrimResult) -> None:
    n = len(c.roles)
    kept = r.kept
    assert r.total_tokens <= budget
    if kept:
        assert kept == list(range(kept[0], n)), "a contiguous newest suffix"
        assert c.roles[kept[0]] != TOOL_RESULT, "never starts with a tool_result"
    kept_set = set(kept)
    for g in {g for g in c.groups if g >= 0}:
        members = {i for i, x in enumerate(c.groups) if x == g}
        assert members <= kept_set or not (members & kept_set), f"group {g} split"
    assert set(r.truncated) <= kept_set
    assert len(r.truncated) == len(r.truncated_chars)
    assert all(cut <= max_chars for cut in r.truncated_chars)


@settings(max_examples=500, deadline=None)
@given(
    c=conversations(),
    budget=st.integers(0, 600),
    max_chars=st.sampled_from([1, 50, 120, 4000]),
)
def test_matches_reference_and_keeps_invariants(
    c: Conversation, budget: int, max_chars: int
) -> None:
    r = core.trim_to_budget(
        c.roles, c.tokens, c.chars, c.groups, budget, max_chars, c.truncated_tokens
    )
    ref = trim_reference(
        c.roles, c.tokens, c.chars, c.groups, budget, max_chars, c.truncated_tokens
    )
    assert (r.kept, r.truncated, r.truncated_chars, r.total_tokens) == (
        ref.kept,
        ref.truncated,
        ref.truncated_chars,
        ref.total_tokens,
    )
    _check_invariants(c, budget, max_chars, r)
    assert r.kept_start == (r.kept[0] if r.kept else None)
    if c.truncated_tokens is None:  # the columns binding has no truncated_tokens
        cols = core.trim_columns_to_budget(*_arrays(c), budget, max_chars)
        assert (cols.kept, cols.truncated, cols.truncated_chars, cols.total_tokens) == (
            r.kept,
            r.truncated,
            r.truncated_chars,
            r.total_tokens,
        )


def _arrays(
    c: Conversation,
) -> tuple[
    np.ndarray[tuple[int], np.dtype[np.uint8]],
    np.ndarray[tuple[int], np.dtype[np.uint64]],
    np.ndarray[tuple[int], np.dtype[np.uint64]],
    np.ndarray[tuple[int], np.dtype[np.int64]],
]:
    return (
        np.array(c.roles, dtype=np.uint8),
        np.array(c.tokens, dtype=np.uint64),
        np.array(c.chars, dtype=np.uint64),
        np.array(c.groups, dtype=np.int64),
    )


@given(c=conversations(), budget=st.integers(0, 600))
def test_more_budget_never_keeps_less(c: Conversation, budget: int) -> None:
    small = core.trim_to_budget(c.roles, c.tokens, c.chars, c.groups, budget)
    large = core.trim_to_budget(c.roles, c.tokens, c.chars, c.groups, budget + 50)
    if small.kept != [len(c.roles) - 1] or not small.truncated:  # not the cut-to-fit case
        assert set(small.kept) <= set(large.kept)


def test_parallel_results_stay_with_their_call() -> None:
    roles = [USER, TOOL_USE, TOOL_RESULT, TOOL_RESULT, TOOL_RESULT, ASSISTANT]
    groups = [-1, 5, 5, 5, 5, -1]
    tokens = [10, 10, 10, 10, 10, 10]
    chars = [40] * 6
    assert core.trim_to_budget(roles, tokens, chars, groups, 45).kept == [5]
    assert core.trim_to_budget(roles, tokens, chars, groups, 50).kept == [1, 2, 3, 4, 5]


def test_newest_message_too_big_is_cut_not_dropped() -> None:
    r = core.trim_to_budget([USER, USER], [5, 2000], [20, 8000], [-1, -1], 500)
    # 8000 chars is first truncated to 4000 (cost 1000), then cut to fit 500 tokens.
    assert (r.kept, r.truncated, r.truncated_chars, r.total_tokens) == ([1], [1], [2000], 500)


def test_defaults_follow_seed_004() -> None:
    assert core.DEFAULT_MAX_CHARS == 4000
    r = core.trim_to_budget([USER], [5000], [20000], [-1], 10_000)
    assert (r.truncated, r.truncated_chars, r.total_tokens) == ([0], [4000], 1000)
    assert "TrimResult(kept=[0]" in repr(r)


def test_bad_columns_are_value_errors() -> None:
    with pytest.raises(ValueError, match='column "tokens" has 1 entries'):
        core.trim_to_budget([USER, USER], [1], [1, 1], [-1, -1], 10)
    with pytest.raises(ValueError, match="role code 9"):
        core.trim_to_budget([9], [1], [1], [-1], 10)
    with pytest.raises(OverflowError):
        core.trim_to_budget([USER], [-1], [1], [-1], 10)


def test_work_stops_at_the_budget() -> None:
    """A long history costs what is kept: the invalid role at index 0 is never reached."""
    n = 200_000
    roles = [0] + [USER] * (n - 1)
    r = core.trim_to_budget(roles, [1] * n, [4] * n, [-1] * n, 100)
    assert r.kept == list(range(n - 100, n))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 4), st.integers(0, 40), st.integers(0, 200), st.integers(-1, 3)),
        max_size=20,
    ),
    budget=st.integers(0, 300),
)
def test_arbitrary_groups_are_still_safe(
    rows: list[tuple[int, int, int, int]], budget: int
) -> None:
    """Inputs that break the group contract (results before or without their tool_use,
    several tool_uses per group) may keep less, but never break the budget or start
    with a tool_result."""
    roles = [r[0] for r in rows]
    r = core.trim_to_budget(
        roles, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows], budget, 100
    )
    assert r.total_tokens <= budget
    if r.kept:
        assert r.kept == list(range(r.kept[0], len(rows)))
        assert roles[r.kept[0]] != TOOL_RESULT


def _columns(n: int) -> Conversation:
    return Conversation([USER] * n, [1] * n, [4] * n, [-1] * n, None)


def test_columns_are_read_in_place_and_the_walk_stops_at_the_budget() -> None:
    """Read-only arrays work (nothing is written), and, as for lists, the invalid role at
    index 0 of a long window is never reached."""
    roles, tokens, chars, groups = _arrays(_columns(1_000_000))
    roles[0] = 0
    for a in (roles, tokens, chars, groups):
        a.flags.writeable = False
    r = core.trim_columns_to_budget(roles, tokens, chars, groups, 100)
    assert (r.kept_start, len(r.kept), r.total_tokens) == (1_000_000 - 100, 100, 100)
    empty = core.trim_columns_to_budget(*_arrays(_columns(0)), 100)
    assert (empty.kept, empty.kept_start, empty.total_tokens) == ([], None, 0)
    # Any buffer of the right item type qualifies, not only NumPy arrays.
    assert core.trim_columns_to_budget(bytes([USER, USER]), *_arrays(_columns(2))[1:], 5).kept == [
        0,
        1,
    ]


def test_columns_of_the_wrong_type_or_layout_are_rejected() -> None:
    roles, tokens, chars, groups = _arrays(_columns(4))
    with pytest.raises(BufferError, match=r'column "tokens" must be .* of uint64'):
        core.trim_columns_to_budget(roles, tokens.astype(np.int64), chars, groups, 10)
    with pytest.raises(BufferError, match=r'column "roles" must be .* of uint8'):
        core.trim_columns_to_budget(roles.astype(np.uint16), tokens, chars, groups, 10)
    with pytest.raises(BufferError, match=r'column "groups".*non-contiguous'):
        wide = np.zeros(8, dtype=np.int64)
        core.trim_columns_to_budget(roles, tokens, chars, wide[::2], 10)
    with pytest.raises(BufferError, match=r'column "chars".*2 dimensions'):
        core.trim_columns_to_budget(roles, tokens, chars.reshape(2, 2), groups, 10)
    with pytest.raises(TypeError, match='column "roles"'):
        core.trim_columns_to_budget([USER] * 4, tokens, chars, groups, 10)  # type: ignore[arg-type]


def test_columns_of_different_lengths_are_value_errors() -> None:
    roles, tokens, chars, groups = _arrays(_columns(4))
    with pytest.raises(ValueError, match='column "chars" has 3 entries'):
        core.trim_columns_to_budget(roles, tokens, chars[:3], groups, 10)
    with pytest.raises(ValueError, match='column "groups" has 5 entries'):
        core.trim_columns_to_budget(roles, tokens, chars, np.zeros(5, dtype=np.int64), 10)
