"""Choosing the engine: the one place that knows every adapter."""

from __future__ import annotations

from contextd.config import Settings
from contextd.domain.clock import MonotonicClock
from contextd.ports.store import Store


def open_store(settings: Settings, clock: MonotonicClock | None = None) -> Store:
    """The store `settings.store` names: the embedded DuckDB file in the data directory
    by default, or a PostgreSQL database for replicas."""
    if settings.uses_postgres:
        from contextd.adapters.postgres.store import PostgresStore

        return PostgresStore.open(settings.store, clock=clock, pool_size=settings.store_pool_size)
    from contextd.adapters.duckdb.store import Store as DuckDBStore

    return DuckDBStore.open(
        settings.database_path,
        max_group_rows=settings.max_group_rows,
        clock=clock,
        write_timeout_s=settings.write_timeout_seconds,
        memory_limit=settings.store_memory_limit,
        checkpoint_threshold=settings.store_checkpoint_threshold,
        delete_chunk_rows=settings.delete_chunk_rows,
        hot_cache_bytes=settings.hot_cache_bytes,
    )
