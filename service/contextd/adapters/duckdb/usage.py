"""A tenant's stored bytes on DuckDB: its threads' byte counters (pending counts added,
see thread_counters.py) plus its snapshots' and tool outputs' sizes. One row per thread
and per output is read, never a message."""

from __future__ import annotations

from contextd.adapters.duckdb.base import _LIVE_THREADS, DuckDBBase


class UsageMixin(DuckDBBase):
    def tenant_stored_bytes(self, tenant: str) -> int:
        cur = self._cursor(live=True)
        while True:
            generation, pending = self._pending.snapshot()
            contextd_pending = pending  # noqa: F841 - scanned by the query below
            row = cur.execute(
                _LIVE_THREADS + "SELECT (SELECT coalesce(sum(stored_bytes), 0) FROM live_threads "
                "WHERE tenant = ?) + (SELECT coalesce(sum(size_bytes), 0) FROM snapshots "
                "WHERE tenant = ?) + (SELECT coalesce(sum(size_bytes), 0) FROM tool_outputs "
                "WHERE tenant = ?)",
                [tenant, tenant, tenant],
            ).fetchone()
            if self._pending.unchanged_since(generation):
                return int(row[0]) if row else 0
