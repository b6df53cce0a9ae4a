"""The `store` every contract test runs against, once per engine.

Each test gets a fresh, empty store on a `ManualClock` (time moves only when the test
moves it), opened through the engine's own `open`: an embedded DuckDB file in the test's
directory, or a fresh database of the session's PostgreSQL server. `store_opener` opens
the same store again (a restart) on a clock of the test's choosing; everything it opened
is closed at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contextd.domain.clock import ManualClock, MonotonicClock
from contextd.ports.store import Store

from .support import START_US

ENGINES = ("duckdb", "postgres")

StoreOpener = Callable[[MonotonicClock], Store]


@pytest.fixture
def clock() -> ManualClock:
    """A clock far from the machine's: a time the store reports can only have come
    from it."""
    return ManualClock(START_US)


@pytest.fixture(params=ENGINES)
def store_opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreOpener]:
    """Opens this test's store (one DuckDB file, or one PostgreSQL database) on a clock."""
    opened: list[Store] = []
    if request.param == "duckdb":
        from contextd.adapters.duckdb.store import Store as DuckDBStore

        path = tmp_path / "contract.duckdb"

        def open_duckdb(clock: MonotonicClock) -> Store:
            store = DuckDBStore.open(path, clock=clock)
            opened.append(store)
            return store

        yield open_duckdb
    else:
        from contextd.adapters.postgres.store import PostgresStore

        dsn: str = request.getfixturevalue("postgres_dsn")

        def open_postgres(clock: MonotonicClock) -> Store:
            store = PostgresStore.open(dsn, clock=clock, pool_size=4)
            opened.append(store)
            return store

        yield open_postgres
    for store in reversed(opened):
        store.close()


@pytest.fixture
def store(store_opener: StoreOpener, clock: ManualClock) -> Store:
    """A fresh, empty store of one engine on the test's clock (closed by `store_opener`)."""
    return store_opener(clock)
