"""A build of a hot thread, which reuses what earlier builds derived from its messages,
builds exactly what a build that derives everything afresh builds.

The embedded engine's hot cache keeps a thread's newest messages as objects, each with
its history item and stamp (`contextd.domain.context.derived`), and assembly keeps on
those items their cost under the build's model and the copy counted at it
(`HistoryItem.cost_memo`). A differential test: the same random histories (turns of
random lengths, tool turns answered at once, later or never, stray results, clears,
compactions, time passing out of the rolling window) written into two DuckDB stores, one
with the hot cache and one without (every read by SQL, every object made anew); after
every few steps each thread is built with random options, models and renderings on
both, the hot store twice (cold memos, then warm). Every answer must be the same: the
context, the renderings, the stats, the stamps, the orphans, the loaded count; and the
protobuf response, byte for byte.

The assembly-level test does the same on random windows without a store: items that keep
their costs, assembled three times, give what items that do not keep them give.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_assembly import History, histories
from test_window_tail import _history_step

from contextd.adapters.duckdb.store import Store
from contextd.api.convert import (
    MAX_LISTED_DROPPED_IDS,
    build_response,
    dropped_ids_field,
    timestamp_pb,
)
from contextd.app.build import compaction
from contextd.app.build.assembly import BudgetTooSmallError, assemble
from contextd.app.build.build_types import BuildRequest, BuildResult
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.context import (
    NOT_COUNTED,
    AssembledContext,
    BuildStats,
    HistoryItem,
    IdList,
    StrategyOptions,
    estimate_counter,
)
from contextd.domain.model import AgentSettings, BuildOverrides, MessageStamp, NewMessage, Role
from contextd.v1 import context_service_pb2 as pb

pytestmark = pytest.mark.duckdb_only

TENANT, AGENT = "default", "a1"
THREADS = ("t1", "t2")
HOUR_US = 3_600 * 1_000_000
START_US = 1_700_000_000_000_000
FORMATS = [(), ("openai",), ("anthropic",), ("text",), ("openai", "anthropic"), ("text", "openai")]


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    hot = Store.open(tmp_path / "hot" / "x.duckdb", clock=ManualClock(START_US))
    cold = Store.open(
        tmp_path / "cold" / "x.duckdb", clock=ManualClock(START_US), hot_cache_bytes=0
    )
    yield hot, cold
    hot.close()
    cold.close()


def _same(new: BuildResult, old: BuildResult) -> None:
    assert new.context == old.context
    assert new.renderings == old.renderings
    assert new.stamps == old.stamps
    assert new.orphaned_ids == old.orphaned_ids
    assert new.messages_loaded == old.messages_loaded
    for full in (True, False):
        assert build_response(new, full).SerializeToString(deterministic=True) == build_response(
            old, full
        ).SerializeToString(deterministic=True)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tools", [0.0, 0.15])
def test_a_hot_build_builds_what_a_build_from_sql_builds(
    stores: tuple[Store, Store], seed: int, tools: float
) -> None:
    services = [ContextService(s, ExtractiveSummarizer()) for s in stores]
    for service in services:
        service.create_agent(TENANT, AGENT, AgentSettings(rolling_window_us=2 * HOUR_US))
    rngs = [random.Random(seed), random.Random(seed)]
    calls: list[list[str]] = [[], []]
    pick = random.Random(seed + 100)
    builds = warm = 0
    for step in range(100):
        for service, store, rng, pending in zip(services, stores, rngs, calls, strict=True):
            clock = store.clock
            assert isinstance(clock, ManualClock)
            _history_step(service, clock, rng, tools, pending)
        if pick.random() < 0.08:  # a message carrying a blob a build stubs
            blob = base64.b64encode(random.Random(step).randbytes(600)).decode()
            for service in services:
                service.append_messages(
                    TENANT,
                    AGENT,
                    "",
                    THREADS[step % 2],
                    [NewMessage(role=Role.USER, content=f"see data:image/png;base64,{blob} ok")],
                )
        if step % 4:
            continue
        for thread in THREADS:
            request = BuildRequest(
                TENANT,
                AGENT,
                "",
                thread,
                model=pick.choice(["", "claude-3-5-sonnet", "gpt-4o-mini"]),
                formats=pick.choice(FORMATS),
                overrides=BuildOverrides(
                    budget_tokens=pick.choice([60, 120, 400, 1_500, 6_000]),
                    truncate=pick.random() < 0.5,
                    max_chars_per_message=pick.choice([None, 300]),
                    elide_tool_results=pick.random() < 0.5,
                    elide_threshold_chars=200,
                ),
            )
            try:
                old = services[1].build_context(request)
            except Exception as exc:  # no thread yet, or a budget below the prompt
                assert type(exc).__name__ in ("NotFound", "InvalidArgument"), exc
                with pytest.raises(type(exc)):
                    services[0].build_context(request)
                continue
            for _ in range(2):  # the first may make the memos, the second uses them
                _same(services[0].build_context(request), old)
            builds += 1
        warm += 1
    assert builds > 20 and warm
    # The hot store kept its messages' derived items, and builds kept costs on them.
    entries = [e for e in stores[0]._hot.entries.values() if hasattr(e, "recent")]
    kept = [m.derived for e in entries for m in e.recent]
    assert kept and all(d is not None for d in kept)
    assert any(d[0].cost_memo not in (None, NOT_COUNTED) for d in kept)  # type: ignore[index]


def _keeping(items: list[HistoryItem]) -> list[HistoryItem]:
    """Copies of ``items`` that keep their costs, as the hot cache's are."""
    out = [replace(it) for it in items]
    for it in out:
        object.__setattr__(it, "cost_memo", NOT_COUNTED)
    return out


def _assembled(
    history: list[HistoryItem], budget: int, options: StrategyOptions, formats: tuple[str, ...]
) -> AssembledContext | str:
    try:
        return assemble(
            system_prompt="be brief",
            budget=budget,
            count_tokens=estimate_counter,
            history=history,
            options=options,
            formats=formats,
            cost_key="estimate" if history and history[0].cost_memo is not None else None,
        )
    except BudgetTooSmallError as exc:
        return str(exc)


@settings(max_examples=150, deadline=None)
@given(
    histories(),
    st.sampled_from(FORMATS),
    st.integers(20, 4_000),
    st.booleans(),
    st.booleans(),
)
def test_items_that_keep_their_costs_assemble_what_items_that_do_not_assemble(
    history: History,
    formats: tuple[str, ...],
    budget: int,
    truncate: bool,
    elide: bool,
) -> None:
    options = StrategyOptions(truncate=truncate, max_chars_per_message=80, elide_tool_results=elide)
    plain = _assembled(list(history.items), budget, options, formats)
    keeping = _keeping(list(history.items))
    for _ in range(3):
        assert _assembled(keeping, budget, options, formats) == plain


def test_a_response_lists_the_newest_held_dropped_ids() -> None:
    """Past the unlisted (counted, not read) ids and over several parts, as slicing."""
    parts = [np.arange(100, 6_000, dtype=np.int64), np.arange(7_000, 13_000, dtype=np.int64)]
    for unlisted in (0, 50):
        ids = IdList(*parts, unlisted=unlisted)
        got = pb.BuildStats.FromString(dropped_ids_field(ids))
        assert tuple(got.dropped_ids) == ids[-MAX_LISTED_DROPPED_IDS:]
    few = IdList(np.arange(3, dtype=np.int64), unlisted=7)  # fewer held than listed
    with pytest.raises(ValueError):
        few[-MAX_LISTED_DROPPED_IDS:]
    with pytest.raises(ValueError):
        dropped_ids_field(few)


def _reference_message(
    item: HistoryItem, stamp: MessageStamp | None, truncated: set[int], elided: set[int]
) -> pb.ContextMessage:
    """A kept message as the response made it before it was made in place."""
    return pb.ContextMessage(
        id=item.id,
        role=int(item.role),  # type: ignore[arg-type]
        content=item.content,
        tool_calls=item.tool_calls,
        tool_call_id=item.tool_call_id,
        token_count=item.token_count,
        truncated=item.id in truncated,
        elided=item.id in elided,
        is_summary=item.is_summary,
        create_time=timestamp_pb(stamp.create_time_us if stamp else None),
        source_time=timestamp_pb(stamp.source_time_us if stamp else None),
        sequence=stamp.sequence if stamp else 0,
    )


@settings(max_examples=150, deadline=None)
@given(
    histories(),
    st.data(),
    st.none() | st.text(min_size=1, max_size=10),
)
def test_the_response_messages_are_made_as_before(
    history: History, data: st.DataObject, new_message: str | None
) -> None:
    items = list(history.items)
    ids = [it.id for it in items]
    times = st.integers(0, 2**40)
    stamped = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    stamps = {
        i: MessageStamp(data.draw(times), data.draw(st.none() | times), data.draw(times))
        for i in stamped
    }
    truncated = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    elided = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    stats = BuildStats(budget=100, truncated_ids=tuple(truncated), elided_ids=tuple(elided))
    context = AssembledContext("sys", (), "", tuple(items), new_message, stats)
    result = BuildResult(context, "o200k_base", "", None, stamps, {}, None, len(items))
    got = build_response(result, True)
    expected = [
        _reference_message(it, stamps.get(it.id), set(truncated), set(elided)) for it in items
    ]
    if new_message is not None:
        expected.append(
            pb.ContextMessage(
                role=pb.ROLE_USER, content=new_message, token_count=0, truncated=False
            )
        )
    assert [m.SerializeToString() for m in got.messages] == [
        m.SerializeToString() for m in expected
    ]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.builds(
            HistoryItem,
            id=st.integers(1, 50),
            role=st.sampled_from(list(Role)),
            content=st.text(max_size=5),
            tool_calls=st.sampled_from(["", "[]", "not json", '[{"id": "c1", "name": "f"}]']),
            tool_call_id=st.sampled_from(["", "c1", "c2"]),
        ),
        max_size=12,
    )
)
def test_the_chat_window_shortcut_of_pair_repair_repairs_what_the_loop_does(
    items: list[HistoryItem],
) -> None:
    """Checking roles and calls without a Python step per item finds what the loop finds."""
    fast = compaction.repair_tool_pairs(items)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compaction, "_CHAT_ROLES", frozenset())  # never a chat window
        assert compaction.repair_tool_pairs(items) == fast
