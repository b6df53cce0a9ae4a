"""The warm build's cheaper forms compute what the plain forms computed.

A hot thread's build runs the same few steps on the same newest messages again and
again, so several steps take a cheaper form (a positional copy instead of
``dataclasses.replace``, a plain window skipping pair repair, set lookups instead of
``np.isin``, the orphan scan of the window's columns in the Rust core). Each is checked
here against the form it replaced, on random windows.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_assembly import History, histories

from contextd import core
from contextd.app.build.compaction import repair_tool_pairs, trim_columns
from contextd.app.build.render import (
    OPENAI_REPLY_TOKENS,
    openai_item_tokens,
    openai_message,
    openai_tokens,
    rendered_tokens,
    to_openai,
    wire_order,
)
from contextd.app.build.trimming import _counted
from contextd.app.build.window_loading import _repair_pair_columns
from contextd.domain.context import (
    AssembledContext,
    BuildStats,
    HistoryItem,
    IdList,
    estimate_counter,
    parse_tool_calls,
)
from contextd.domain.model import Role


@given(
    st.builds(
        HistoryItem,
        id=st.integers(-5, 10**12),
        role=st.sampled_from(list(Role)),
        content=st.text(max_size=20),
        tool_calls=st.text(max_size=5),
        tool_call_id=st.text(max_size=5),
        token_count=st.integers(0, 10**6),
        is_summary=st.booleans(),
        metadata=st.text(max_size=5),
        summary_of=st.none() | st.tuples(st.integers(1, 99), st.integers(100, 999)),
    ),
    st.integers(0, 10**6),
)
def test_counted_is_replace_of_the_token_count(item: HistoryItem, tokens: int) -> None:
    assert _counted(item, tokens) == replace(item, token_count=tokens)


@settings(max_examples=200, deadline=None)
@given(histories())
def test_repair_of_a_window_without_tools_changes_nothing(history: History) -> None:
    plain = [
        replace(it, role=Role.USER if it.role is Role.TOOL_RESULT else it.role, tool_calls="")
        for it in history.items
        if it.role is not Role.TOOL_USE
    ]
    out, repaired = repair_tool_pairs(plain)
    assert out == plain and repaired == []
    assert out is not plain  # a copy: callers may extend it


@settings(max_examples=200, deadline=None)
@given(histories())
def test_repair_is_idempotent_on_any_window(history: History) -> None:
    once, _ = repair_tool_pairs(history.items)
    twice, repaired = repair_tool_pairs(once)
    assert twice == once and repaired == []


def _numpy_repair_pair_columns(
    ids: npt.NDArray[np.int64], roles: npt.NDArray[np.uint8], groups: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The builder's orphan repair as it was (NumPy passes over the window, a mask)."""
    result = int(Role.TOOL_RESULT)
    result_at = np.flatnonzero(roles == result)
    grouped = np.flatnonzero(groups >= 0)
    head_at = grouped[(groups[grouped] == ids[grouped]) & (roles[grouped] != result)]
    answered_at = heard_at = np.empty(0, dtype=np.intp)
    if len(head_at) and len(result_at):
        order = np.argsort(ids[head_at], kind="stable")
        head_ids, heads = ids[head_at][order], head_at[order]
        wanted = groups[result_at]
        at = np.minimum(np.searchsorted(head_ids, wanted), len(head_ids) - 1)
        ok = (head_ids[at] == wanted) & (heads[at] < result_at)
        answered_at, heard_at = result_at[ok], heads[at[ok]]
    orphan_results = np.setdiff1d(result_at, answered_at, assume_unique=True)
    orphan_calls = np.setdiff1d(head_at, heard_at)
    orphans = np.zeros(len(ids), dtype=bool)
    if not len(orphan_results) and not len(orphan_calls):
        return roles, groups, orphans
    orphans[orphan_results] = True
    orphans[orphan_calls] = True
    roles = roles.copy()
    roles[orphan_results] = int(Role.USER)
    roles[orphan_calls] = int(Role.ASSISTANT)
    groups = groups.copy()
    groups[orphans] = -1
    return roles, groups, orphans


@st.composite
def window_columns(
    draw: st.DrawFn,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """A window's (ids, roles, groups) as the store gives them, orphans of every kind
    included: results of calls before the window or after them, of no group, calls
    never answered; long runs of plain rows between (the Rust scan skips blocks)."""
    n = draw(st.integers(0, 400))
    first = draw(st.integers(1, 10**9))
    steps = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    ids = first + np.cumsum(np.asarray(steps, dtype=np.int64)) if n else np.empty(0, np.int64)
    roles = np.full(n, int(Role.USER), dtype=np.uint8)
    groups = np.full(n, -1, dtype=np.int64)
    tool_rows = draw(st.lists(st.integers(0, max(0, n - 1)), max_size=n // 3 + 1)) if n else []
    for i in tool_rows:
        kind = draw(st.sampled_from(["head", "head", "result", "result", "stray", "member"]))
        if kind == "head":
            roles[i] = draw(st.sampled_from([int(Role.TOOL_USE), int(Role.ASSISTANT)]))
            groups[i] = ids[i]
        elif kind == "result":
            roles[i] = int(Role.TOOL_RESULT)
            groups[i] = ids[draw(st.integers(0, n - 1))]
        elif kind == "stray":
            roles[i] = int(Role.TOOL_RESULT)
            groups[i] = draw(st.sampled_from([-1, first - 5, int(ids[-1]) + 7]))
        else:
            roles[i] = int(Role.ASSISTANT)
            groups[i] = ids[draw(st.integers(0, n - 1))]
    return ids, roles, groups


@settings(max_examples=300, deadline=None)
@given(window_columns())
def test_the_rust_orphan_scan_repairs_what_the_numpy_passes_did(
    columns: tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8], npt.NDArray[np.int64]],
) -> None:
    ids, roles, groups = columns
    old_roles, old_groups, old_mask = _numpy_repair_pair_columns(ids, roles, groups)
    new_roles, new_groups, orphan_at = _repair_pair_columns(ids, roles, groups)
    assert np.array_equal(new_roles, old_roles)
    assert np.array_equal(new_groups, old_groups)
    assert orphan_at.tolist() == np.flatnonzero(old_mask).tolist()
    assert roles is new_roles or not np.shares_memory(roles, new_roles)  # inputs untouched


def test_the_orphan_scan_rejects_columns_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        core.pair_orphans_columns(
            np.arange(3, dtype=np.int64), np.ones(2, dtype=np.uint8), np.zeros(3, dtype=np.int64)
        )


def _wire_order_reference(history: list[HistoryItem]) -> list[HistoryItem]:
    """render.wire_order as it was, without the early return for windows with no result."""
    items, _ = repair_tool_pairs(history)
    roles, groups = trim_columns(items)
    results: dict[int, list[HistoryItem]] = {}
    for i, item in enumerate(items):
        if roles[i] == core.ROLE_TOOL_RESULT and groups[i] >= 0:
            results.setdefault(groups[i], []).append(item)
    out: list[HistoryItem] = []
    for i, item in enumerate(items):
        if roles[i] == core.ROLE_TOOL_RESULT and groups[i] >= 0:
            continue
        out.append(item)
        if roles[i] == core.ROLE_TOOL_USE:
            out.extend(results.get(i, []))
    return out


@settings(max_examples=200, deadline=None)
@given(histories(), st.booleans())
def test_wire_order_is_what_it_was(history: History, drop_results: bool) -> None:
    items = [it for it in history.items if not (drop_results and it.role is Role.TOOL_RESULT)]
    assert wire_order(items) == _wire_order_reference(items)


@settings(max_examples=200, deadline=None)
@given(histories())
def test_openai_item_costs_are_the_rendered_messages_costs(history: History) -> None:
    items = history.items
    expected = openai_tokens([openai_message(it) for it in items], estimate_counter)
    assert openai_item_tokens(items, estimate_counter) == expected


@settings(max_examples=200, deadline=None)
@given(
    histories(),
    st.sampled_from(["", "You are terse."]),
    st.sampled_from(["", "Status as of now:\n- nothing"]),
    st.sampled_from([None, "and now?"]),
)
def test_the_openai_rendered_count_is_the_count_of_the_rendering(
    history: History, system: str, status: str, new: str | None
) -> None:
    ctx = AssembledContext(system, (), status, tuple(history.items), new, BuildStats(budget=0))
    expected = sum(openai_tokens(to_openai(ctx), estimate_counter)) + OPENAI_REPLY_TOKENS
    assert rendered_tokens("openai", ctx, estimate_counter) == expected


@given(
    st.lists(st.lists(st.integers(-(2**40), 2**40), max_size=12), max_size=5),
    st.integers(-40, 40) | st.none(),
    st.integers(-40, 40) | st.none(),
    st.sampled_from([None, 1, 2, -1]),
)
def test_a_slice_of_an_id_list_reads_only_its_parts_and_is_the_plain_slice(
    parts: list[list[int]], start: int | None, stop: int | None, step: int | None
) -> None:
    flat = [i for part in parts for i in part]
    ids = IdList(*[np.asarray(p, dtype=np.int64) for p in parts])
    assert ids[start:stop:step] == tuple(flat[start:stop:step])
    assert list(ids) == flat  # joined afterwards, the same
    assert ids[start:stop:step] == tuple(flat[start:stop:step])


def _trim_columns_reference(items: list[HistoryItem]) -> tuple[list[int], list[int]]:
    """compaction.trim_columns as it was, without the early return for plain windows."""
    codes = {
        Role.USER: core.ROLE_USER,
        Role.ASSISTANT: core.ROLE_ASSISTANT,
        Role.TOOL_USE: core.ROLE_TOOL_USE,
        Role.TOOL_RESULT: core.ROLE_TOOL_RESULT,
    }
    roles: list[int] = []
    groups: list[int] = []
    group_of_call: dict[str, int] = {}
    for i, item in enumerate(items):
        code = codes[item.role]
        group = -1
        if item.role in (Role.TOOL_USE, Role.ASSISTANT) and item.tool_calls:
            calls = parse_tool_calls(item.tool_calls)
            if calls:
                code, group = core.ROLE_TOOL_USE, i
                for call in calls:
                    group_of_call.setdefault(call.id, i)
        elif item.role is Role.TOOL_RESULT:
            group = group_of_call.get(item.tool_call_id, -1)
        roles.append(code)
        groups.append(group)
    return roles, groups


@settings(max_examples=200, deadline=None)
@given(histories(), st.booleans())
def test_trim_columns_are_what_they_were(history: History, plain: bool) -> None:
    items = history.items
    if plain:
        items = [
            replace(it, tool_calls="", role=Role.USER if it.role is Role.TOOL_RESULT else it.role)
            for it in items
        ]
    assert trim_columns(items) == _trim_columns_reference(items)
