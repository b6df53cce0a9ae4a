"""The warm build's cheaper forms compute what the plain forms computed.

A hot thread's build runs the same few steps on the same newest messages again and
again, so several steps take a cheaper form (a positional copy instead of
``dataclasses.replace``, a plain window skipping pair repair, set lookups instead of
``np.isin``, the orphan scan of the window's columns in the Rust core). Each is checked
here against the form it replaced, on random windows.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from test_assembly import History, histories

from contextd.app.build.assembly import _counted
from contextd.app.build.compaction import repair_tool_pairs
from contextd.domain.context import HistoryItem
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
