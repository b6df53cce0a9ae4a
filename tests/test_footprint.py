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

import numpy as np
import pytest

from contextd.adapters.duckdb.store import DEFAULT_MEMORY_LIMIT, Store
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.config import Settings
from contextd.domain.model import AgentSettings, ContextKey, NewMessage, Role

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
