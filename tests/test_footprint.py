"""The embedded engine's memory bounds (docs/operations.md, Memory).

- DuckDB's memory limit defaults to 128 MB (not DuckDB's own 80% of RAM, under which its
  buffer pool keeps every block a long import writes); an empty limit is DuckDB's own.
- The hot cache's accounted bytes bound what its entries really hold: a thread's NumPy
  columns (their capacity) and its newest messages as Python objects, whatever the text.

These inspect the DuckDB engine itself, so they are `duckdb_only`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from contextd.adapters.duckdb.store import DEFAULT_MEMORY_LIMIT, Store
from contextd.app.build.build_types import BuildRequest
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.config import Settings
from contextd.domain.model import AgentSettings, BuildOverrides, ContextKey, NewMessage, Role

pytestmark = pytest.mark.duckdb_only


def _memory_limit(store: Store) -> str:
    row = store._con.execute("SELECT current_setting('memory_limit')").fetchone()
    assert row is not None
    return str(row[0])


def test_the_store_opens_with_a_bounded_memory_limit_by_default(tmp_path: Path) -> None:
    assert Settings().store_memory_limit == DEFAULT_MEMORY_LIMIT == "128MB"
    store = Store.open(tmp_path / "a" / "x.duckdb")
    try:
        assert _memory_limit(store) == "122.0 MiB"  # 128 MB, as DuckDB prints it
    finally:
        store.close()
    store = Store.open(tmp_path / "b" / "x.duckdb", memory_limit="")
    try:
        assert _memory_limit(store) != "122.0 MiB"  # DuckDB's own default
    finally:
        store.close()


def _real_bytes(entry: object) -> int:
    """What a cached thread holds: its columns' arrays (allocated rows) and its newest
    messages as Python objects, with what builds derived from them and keep on them
    (history items, stamps, cost memos, counted copies), each distinct object once ("",
    small ints, None and the shared cost keys are shared)."""
    cols: dict[str, Any] = entry.cols  # type: ignore[attr-defined]
    total: int = sum(int(a.nbytes) for a in cols.values())
    seen: set[int] = set()

    def walk(value: object) -> int:
        if id(value) in seen:
            return 0
        seen.add(id(value))
        size = sys.getsizeof(value)
        if dataclasses.is_dataclass(value):
            size += sum(walk(getattr(value, f.name)) for f in dataclasses.fields(value))
        elif isinstance(value, tuple):
            size += sum(walk(v) for v in value)
        return size

    for m in entry.recent:  # type: ignore[attr-defined]
        total += walk(m)
    return total


@pytest.mark.parametrize("text", ["plain words of a message", "中文的消息内容", "🙂🙃🙂🙃"])
def test_the_hot_cache_accounts_at_least_what_a_large_thread_holds(
    tmp_path: Path, text: str
) -> None:
    """Counting characters undercounted a thread by 1.6x (ASCII) to 2x (emoji): the bound
    of --hot-cache-bytes was not one of memory. Loaded by SQL and extended by appends,
    the accounted bytes are at least the real ones, and not far above."""
    store = Store.open(tmp_path / "x.duckdb")
    try:
        service = ContextService(store, ExtractiveSummarizer())
        service.create_agent("default", "support-bot", AgentSettings(model="gpt-4o"))
        batch = [
            NewMessage(role=Role.USER if i % 2 else Role.ASSISTANT, content=f"{i} {text * 4}")
            for i in range(2_500)
        ]
        service.append_messages("default", "support-bot", "", "session-42", batch)
        key = ContextKey("default", "support-bot", "", "session-42")
        cache = store._hot
        request = BuildRequest(
            "default",
            "support-bot",
            "",
            "session-42",
            overrides=BuildOverrides(budget_tokens=8_000),
        )
        for step in ("loaded", "extended", "extended past the recent limit"):
            if step == "loaded":
                store.context_ref(key)  # a build's first read loads the thread
            else:
                service.append_messages("default", "support-bot", "", "session-42", batch)
            # What builds keep on the messages they load is counted too.
            service.build_context(request)
            entry = cache.entries[("c", "default", "support-bot", "", "session-42")]
            real = _real_bytes(entry)
            assert real <= entry.size() <= 1.5 * real, step
            assert cache.bytes == sum(e.size() for e in cache.entries.values())
        assert entry.n == 7_500 and len(entry.recent) == 4_096  # type: ignore[union-attr]
    finally:
        store.close()
