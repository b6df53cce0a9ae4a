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

import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_assembly import History, histories
from test_window_tail import _history_step

from contextd.adapters.duckdb.store import Store
from contextd.api.convert import build_response
from contextd.app.build.assembly import BudgetTooSmallError, assemble
from contextd.app.build.builder import BuildRequest, BuildResult
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.domain.context import (
    NOT_COUNTED,
    AssembledContext,
    HistoryItem,
    StrategyOptions,
    estimate_counter,
)
from contextd.domain.model import AgentSettings, BuildOverrides

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
