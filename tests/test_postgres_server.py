"""The PostgreSQL test server (tests/postgres_server.py): loopback only, isolated databases,
durable commits across a crash, and no process left behind."""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from postgres_server import PG_USER, PostgresError, PostgresServer


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    """A server of this test's own, for crashing and stopping."""
    with PostgresServer() as server:
        yield server


def _alive(pid: int) -> bool:
    """Whether `pid` exists as a process that has not exited (a zombie counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return ") Z " not in stat


def _non_loopback_ip() -> str | None:
    """An address of this machine other than loopback, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.254.254.254", 9))
        except OSError:
            return None
        ip: str = probe.getsockname()[0]
    return None if ip.startswith("127.") else ip


def test_serves_on_loopback_only(postgres: PostgresServer) -> None:
    with psycopg.connect(postgres.dsn) as conn:
        where = conn.execute("SELECT host(inet_server_addr()), inet_server_port()").fetchone()
        settings = {
            name: conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
            for name in ("listen_addresses", "fsync", "synchronous_commit", "max_connections")
        }
    assert where == ("127.0.0.1", postgres.port)
    assert settings == {
        "listen_addresses": ("127.0.0.1",),
        "fsync": ("on",),
        "synchronous_commit": ("on",),
        "max_connections": ("200",),
    }
    ip = _non_loopback_ip()
    if ip is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, postgres.port), timeout=5).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root switches to the postgres user")
def test_runs_as_unprivileged_user_under_root(postgres: PostgresServer) -> None:
    status = Path(f"/proc/{postgres.pid}/status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    real_uid = int(uid_line.split()[1])
    assert real_uid != 0
    assert Path(f"/proc/{postgres.pid}").stat().st_uid == real_uid
    assert pwd.getpwuid(real_uid).pw_name == PG_USER


def test_each_test_database_is_fresh_and_isolated(
    postgres: PostgresServer, postgres_dsn: str
) -> None:
    other_dsn = postgres.create_database("t_isolation_other")
    try:
        with psycopg.connect(postgres_dsn) as conn:
            tables = conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
            ).fetchone()
            assert tables == (0,)
            conn.execute("CREATE TABLE t (v text)")
            conn.execute("INSERT INTO t VALUES ('only here')")
        with psycopg.connect(other_dsn) as conn, pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT v FROM t")
        with psycopg.connect(postgres_dsn) as conn:
            assert conn.execute("SELECT v FROM t").fetchall() == [("only here",)]
    finally:
        postgres.drop_database("t_isolation_other")


def test_committed_row_survives_kill(own_server: PostgresServer) -> None:
    dsn = own_server.create_database("crash")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (v text)")
        conn.execute("INSERT INTO t VALUES ('committed')")
    pending = psycopg.connect(dsn)
    pending.execute("INSERT INTO t VALUES ('in flight')")  # never committed
    processes = own_server.process_ids()
    assert len(processes) > 1  # the postmaster and its background processes

    own_server.kill()
    pending.close()
    assert not own_server.running
    assert [pid for pid in processes if _alive(pid)] == []

    own_server.start()
    with psycopg.connect(own_server.dsn_for("crash")) as conn:
        assert conn.execute("SELECT v FROM t").fetchall() == [("committed",)]
    assert "automatic recovery in progress" in own_server.log_path.read_text()


def test_stop_leaves_no_process_and_restart_moves_off_a_taken_port(
    own_server: PostgresServer,
) -> None:
    dsn = own_server.create_database("kept")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t AS SELECT 1 AS v")
    processes = own_server.process_ids()
    old_port = own_server.port

    own_server.stop()
    assert [pid for pid in processes if _alive(pid)] == []
    assert not (own_server.data_dir / "postmaster.pid").exists()
    assert "database system is shut down" in own_server.log_path.read_text()

    with socket.socket() as squatter:
        # The old port may linger in TIME_WAIT after the stop: reuse it (a listener of
        # ours still makes it taken for the server, which is what is tested).
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", old_port))
        squatter.listen()
        own_server.start()
    assert own_server.port != old_port
    with psycopg.connect(own_server.dsn_for("kept")) as conn:
        assert conn.execute("SELECT v FROM t").fetchall() == [(1,)]

    directory = own_server.directory
    own_server.close()
    assert not directory.exists()


def test_failed_start_reports_the_server_log() -> None:
    server = PostgresServer(shared_buffers="lots")
    with (
        pytest.raises(PostgresError, match=r'invalid value for parameter "shared_buffers"'),
        server,
    ):
        pass
    assert not server.directory.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root needs another user to reach the dir")
def test_unreachable_directory_is_refused_under_root(tmp_path: Path) -> None:
    # pytest's tmp_path sits under a 0700 directory of root's.
    with pytest.raises(PostgresError, match=f"user '{PG_USER}' cannot reach"):
        PostgresServer(tmp_path / "pg").start()
