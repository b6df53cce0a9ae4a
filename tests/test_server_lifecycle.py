"""Seed 000's "Bot restart" group and the server's life cycle, with real processes:
restarts on the same file, SIGTERM/SIGINT drains, kill -9 loses no acknowledged write,
a second server on a held file fails clearly, health and reflection answer."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import Client, SpawnServer
from contextd.v1 import context_service_pb2 as pb
from waiting import wait_until


def test_context_survives_restart_via_sqlite(spawn_server: SpawnServer) -> None:
    first = spawn_server()
    client = first.start()
    client.append("a1", "one", "two", thread="t1")
    client.append("a1", "elsewhere", thread="t2")
    before = client.window("a1")
    client.channel.close()
    assert first.signal(signal.SIGTERM) == 0

    client = spawn_server().start()
    after = client.window("a1")
    assert after == before
    assert client.contents(client.list_messages("a1")) == ["one", "two", "elsewhere"]
    threads = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    assert [(t.thread, t.message_count) for t in threads] == [("t1", 2), ("t2", 1)]
    # New ids and times continue above the old ones.
    receipt = client.append("a1", "three", thread="t1").receipts[0]
    assert receipt.id > max(m.id for m in before)
    assert receipt.create_time.ToMicroseconds() > before[-1].create_time.ToMicroseconds()


def test_clear_time_survives_restart(spawn_server: SpawnServer) -> None:
    first = spawn_server()
    client = first.start()
    client.append("a1", "before", thread="x")
    marker = client.stub.ClearContext(
        pb.ClearContextRequest(agent="a1", all_scopes=True)
    ).clear_time
    client.append("a1", "x-after", thread="x")
    thread_marker = client.stub.ClearContext(
        pb.ClearContextRequest(agent="a1", thread="x")
    ).clear_time
    client.channel.close()
    first.signal(signal.SIGTERM)

    client = spawn_server().start()
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent
    assert agent.last_clear_time == marker
    assert client.window("a1", thread="x") == []
    [thread] = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    assert thread.last_clear_time == thread_marker
    assert client.contents(client.history("a1", thread="x")) == ["before", "x-after"]


def test_sigint_also_shuts_down_cleanly(spawn_server: SpawnServer) -> None:
    proc = spawn_server()
    client = proc.start()
    client.append("a1", "x")
    client.channel.close()
    assert proc.signal(signal.SIGINT) == 0
    assert "contextd stopped" in proc.log()


def test_sigterm_drains_calls_in_flight(spawn_server: SpawnServer) -> None:
    proc = spawn_server()
    client = proc.start()
    acknowledged: list[int] = []
    failures: list[grpc.StatusCode] = []
    stop = threading.Event()

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                client.append("a1", f"w{n}-{i}", thread=f"t{n}")
                acknowledged.append(1)
            except grpc.RpcError as exc:
                failures.append(exc.code())
                return
            i += 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(acknowledged) >= 20, "appends are flowing")  # calls in flight
    assert proc.signal(signal.SIGTERM) == 0
    stop.set()
    for t in threads:
        t.join()
    client.channel.close()
    # Refused calls were refused cleanly (never a half-written batch).
    assert set(failures) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
    client = spawn_server().start()
    stored = len(client.list_messages("a1", range=pb.MESSAGE_RANGE_ALL, page_size=1000))
    assert stored >= len(acknowledged) > 0


def test_kill9_loses_no_acknowledged_write(spawn_server: SpawnServer) -> None:
    proc = spawn_server()
    client = proc.start()
    acknowledged: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set():
            content = f"w{n}-{i}"
            try:
                client.append("a1", content, thread=f"t{n}")
            except grpc.RpcError:
                return
            with lock:
                acknowledged.append(content)
            i += 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(acknowledged) >= 300, "300 appends are acknowledged")
    finally:
        proc.kill9()  # while the writers' calls are in flight
        stop.set()
        for t in threads:
            t.join()
        client.channel.close()

    client = spawn_server().start()
    stored = set(
        client.contents(client.list_messages("a1", range=pb.MESSAGE_RANGE_ALL, page_size=1000))
    )
    missing = set(acknowledged) - stored
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    stats = client.stub.GetContextStats(pb.GetContextStatsRequest(agent="a1")).stats
    assert stats.total_message_count == len(stored)  # thread metadata matches the rows
    # Thread counters were still pending in the killed writer (it flushes them when idle
    # or once a second); the restart recounts them from the rows, each exactly once.
    threads = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    per_thread = {f"t{n}": sum(1 for c in stored if c.startswith(f"w{n}-")) for n in range(8)}
    assert {t.thread: t.message_count for t in threads} == per_thread


@pytest.mark.duckdb_only  # the DuckDB file itself
def test_second_server_on_held_file_fails_clearly(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    spawn_server().start()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextd",
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "in use by another process" in result.stderr
    assert "Traceback" not in result.stderr


def test_health_is_serving(client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "contextd.v1.ContextService"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.duckdb_only  # the DuckDB file itself
def test_flags_override_environment(spawn_server: SpawnServer, tmp_path: Path) -> None:
    # CONTEXTD_DATA_DIR points at one directory, --data-dir at another: the flag wins.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "contextd",
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "flag-dir"),
            "--log-format",
            "json",
        ],
        env={**__import__("os").environ, "CONTEXTD_DATA_DIR": str(tmp_path / "env-dir")},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = ""
        while '"contextd serving"' not in line:
            line = proc.stderr.readline()
            assert line, "server exited before serving"
        assert "flag-dir" in line
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert (tmp_path / "flag-dir" / "contextd.duckdb").exists()
    assert not (tmp_path / "env-dir").exists()


def test_taken_address_fails_clearly(spawn_server: SpawnServer, tmp_path: Path) -> None:
    running = spawn_server()
    running.start()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextd",
            "serve",
            "--addr",
            f"127.0.0.1:{running.port}",
            "--data-dir",
            str(tmp_path / "other"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{running.port}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        (["--workers", "0"], "must be above zero"),
        (["--log-level", "loud"], "invalid choice"),
        (["--store", "mysql://db/contextd"], "neither duckdb nor a postgresql:// URL"),
    ],
)
def test_bad_serve_options_are_one_line_errors(flag: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextd", "serve", *flag],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr


def test_an_unreachable_postgresql_fails_clearly_without_its_password(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextd",
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "data"),
            "--store",
            "postgresql://contextd:s3cret-pw@127.0.0.1:1/contextd",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "cannot connect to the PostgreSQL database 127.0.0.1:1/contextd" in done.stderr
    assert "s3cret-pw" not in done.stderr and "Traceback" not in done.stderr
