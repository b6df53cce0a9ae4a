"""The store's failure modes and bounded waits, over real servers and real DuckDB files.

- DuckDB failures reach clients as UNAVAILABLE or RESOURCE_EXHAUSTED with a reason and,
  where waiting helps, a retry delay; never INTERNAL. The I/O and fatal errors here are
  real: the server process is given a file-size limit (RLIMIT_FSIZE, which even root
  obeys), so DuckDB's writes fail with EFBIG exactly as on a full disk.
- A fatal DuckDB error, or a writer stuck on one job, turns health NOT_SERVING.
- A caller never waits on the writer longer than the write timeout.
- Deleting a large agent lets other writes through, and a restart finishes a deletion
  that a crash interrupted.
- SIGTERM lets received calls finish and refuses later ones with a retryable status.
"""

from __future__ import annotations

import base64
import contextlib
import os
import resource
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import duckdb
import grpc
import pytest
from fake_anthropic import FakeAnthropic
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from conftest import ASSISTANT, USER, Client, InProcessServer, ServerProcess, SpawnServer, connect
from contextd.adapters.duckdb.base import store_error
from contextd.adapters.duckdb.store import Store
from contextd.api.server import SERVICE_NAME, create_server
from contextd.config import Settings
from contextd.domain.errors import StoreBusy, StoreExhausted, StoreUnavailable
from contextd.v1 import context_service_pb2 as pb
from waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ----------------------------------------------------------------------------- helpers


Failure = tuple[grpc.StatusCode, str, float | None]

# Failure modes of the embedded engine: its files, its writer thread, its memory limit.
pytestmark = pytest.mark.duckdb_only


def _failure(call: Callable[[], Any]) -> Failure:
    """The code, ErrorInfo reason and RetryInfo delay (None: none) of a failing call."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return _status_of(info.value)


def _status_of(error: grpc.RpcError) -> Failure:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    reason, delay = "", None
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            error_info = error_details_pb2.ErrorInfo()
            detail.Unpack(error_info)
            reason = error_info.reason
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            delay = retry.retry_delay.ToMicroseconds() / 1e6
    return error.code(), reason, delay


def _health(client: Client) -> set[int]:
    """The health status of the server and of the service (a set: they must agree)."""
    stub = health_pb2_grpc.HealthStub(client.channel)
    return {
        stub.Check(health_pb2.HealthCheckRequest(service=name)).status
        for name in ("", SERVICE_NAME)
    }


def _messages(n: int, prefix: str, size: int = 0) -> list[pb.Message]:
    pad = "x" * size
    return [pb.Message(role=USER, content=f"{prefix}{i}{pad}") for i in range(n)]


def _append(client: Client, agent: str, messages: list[pb.Message], thread: str = "t1") -> Any:
    return client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent=agent, thread=thread, messages=messages, create_agent_if_missing=True
        ),
        timeout=120,
    )


def _fill(client: Client, agent: str, total: int, batch: int = 50_000) -> None:
    """`total` short messages for `agent`, over four threads, in few large appends."""
    for start in range(0, total, batch):
        _append(client, agent, _messages(batch, f"m{start}-"), thread=f"t{start // batch % 4}")


def _wait_for_log(proc: ServerProcess, text: str, count: int = 1) -> None:
    """Wait until the server's log holds `text` (`count` times): the server said it did
    something, which is how a test outside the process learns it happened."""

    def logged() -> bool:
        assert proc.proc is not None and proc.proc.poll() is None, proc.log()[-3000:]
        return proc.log().count(text) >= count

    wait_until(logged, lambda: f"the log holds {text!r} {count} time(s):\n{proc.log()[-3000:]}")


def _random_text(n_bytes: int) -> str:
    """Text DuckDB cannot compress much, so the database file grows with what is stored."""
    return base64.b64encode(os.urandom(n_bytes)).decode()


def _limit_file_size(proc: ServerProcess, limit: int) -> None:
    """Cap the size of every file the server process writes (RLIMIT_FSIZE): a write past
    it fails with EFBIG, a real I/O error (Python ignores the SIGXFSZ that comes with it)."""
    assert proc.proc is not None
    _, hard = resource.prlimit(proc.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(proc.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))


@contextlib.contextmanager
def _server(tmp_path: Path, **settings: Any) -> Iterator[InProcessServer]:
    config = Settings(addr="127.0.0.1:0", data_dir=tmp_path / "data", **settings)
    running = create_server(config)
    client = connect(f"127.0.0.1:{running.port}")
    try:
        yield InProcessServer(running, client, config.data_dir)
    finally:
        client.channel.close()
        running.stop(grace=1)


# ----------------------------------------------------------------------------- DuckDB errors


def test_store_errors_map_real_duckdb_failures(tmp_path: Path) -> None:
    """The translation, on exceptions DuckDB really raised: out of memory (its memory
    limit), a commit whose WAL write failed (the WAL is /dev/full: ENOSPC), an I/O error
    reading a file; a mistake in SQL is a bug and is left alone (INTERNAL)."""
    raised: dict[str, duckdb.Error] = {}
    con = duckdb.connect(str(tmp_path / "x.duckdb"))
    con.execute("CREATE TABLE t (x VARCHAR)")
    con.execute("CHECKPOINT")  # the next commit opens a new WAL
    (tmp_path / "x.duckdb.wal").symlink_to("/dev/full")
    with pytest.raises(duckdb.Error) as info:
        con.execute("INSERT INTO t VALUES ('lost')")
    raised["commit"] = info.value
    con.execute("SET memory_limit = '4MB'")
    with pytest.raises(duckdb.Error) as info:
        con.execute("SELECT list(range(10000000))").fetchall()
    raised["memory"] = info.value
    with pytest.raises(duckdb.Error) as info:
        con.execute(f"SELECT * FROM read_csv('{tmp_path}/missing.csv')").fetchall()
    raised["io"] = info.value
    with pytest.raises(duckdb.Error) as info:
        con.execute("SELECT no_such_column FROM t").fetchall()
    raised["bug"] = info.value
    con.close()

    commit = store_error(raised["commit"])
    assert isinstance(raised["commit"], duckdb.TransactionException)  # how DuckDB says it
    assert isinstance(commit, StoreUnavailable) and commit.reason == "STORE_UNAVAILABLE"
    assert commit.retry_after_s and "nothing of it was saved" in commit.message
    assert str(tmp_path) not in commit.message  # DuckDB's text (server paths) stays in logs
    memory = store_error(raised["memory"])
    assert isinstance(memory, StoreExhausted) and memory.reason == "STORE_RESOURCE_EXHAUSTED"
    assert memory.retry_after_s
    io = store_error(raised["io"])
    assert isinstance(raised["io"], duckdb.IOException)
    assert isinstance(io, StoreUnavailable) and io.retry_after_s
    assert store_error(raised["bug"]) is None


def test_a_disk_write_error_is_unavailable_and_a_retry_succeeds(
    spawn_server: SpawnServer,
) -> None:
    proc = spawn_server()
    client = proc.start()
    client.append("a1", "first")
    files = [*proc.data_dir.iterdir(), proc.log_path]
    _limit_file_size(proc, max(f.stat().st_size for f in files) + 300_000)
    acknowledged = ["first"]
    failure = None
    for i in range(60):  # 100 KB each: the WAL passes the limit within a few appends
        content = f"big {i} " + "y" * 100_000
        try:
            client.append("a1", content)
        except grpc.RpcError as exc:
            failure = _status_of(exc)
            break
        acknowledged.append(content)
    assert failure is not None, "the file-size limit never stopped a write"
    code, reason, delay = failure
    assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
    assert delay is not None and delay > 0  # a retry may succeed
    assert _health(client) == {SERVING}  # an I/O error is not fatal

    _limit_file_size(proc, resource.RLIM_INFINITY)  # the disk has room again
    client.append("a1", content)  # the same write, retried
    acknowledged.append(content)
    assert client.contents(client.history("a1")) == acknowledged
    client.channel.close()
    assert proc.signal(signal.SIGTERM) == 0
    client = spawn_server().start()
    assert client.contents(client.history("a1")) == acknowledged


def test_a_fatal_store_error_turns_health_not_serving(spawn_server: SpawnServer) -> None:
    """DuckDB checkpoints when its WAL passes the checkpoint threshold (16 MB here); if
    writing the database file then fails, it invalidates the database ("Reopen the
    database instance to recover")."""
    first = spawn_server()
    client = first.start()
    for i in range(8):  # ~9.6 MB the database file holds after this server's checkpoint
        client.append("a1", *[_random_text(150_000) for _ in range(8)], thread=f"old{i}")
    client.channel.close()
    assert first.signal(signal.SIGTERM) == 0

    proc = spawn_server(extra_env={"CONTEXTD_STORE_CHECKPOINT_THRESHOLD": "16MB"})
    client = proc.start()
    # Room for the WAL up to its checkpoint threshold and more, not for the checkpoint's
    # new blocks past the 9.6 MB already in the file.
    _limit_file_size(proc, 17_500_000)
    acknowledged: list[str] = []
    failure = None
    for _ in range(150):  # 200 KB each: the WAL reaches 16 MB after about 84 of them
        content = _random_text(150_000)
        try:
            client.append("a1", content)
        except grpc.RpcError as exc:
            failure = _status_of(exc)
            break
        acknowledged.append(content)
    assert failure is not None, "the checkpoint never failed"
    # No retry delay: only a restart helps. Reads fail the same way from now on.
    assert failure == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE", None)
    assert _health(client) == {NOT_SERVING}
    read = _failure(lambda: client.stub.GetAgent(pb.GetAgentRequest(name="a1")))
    assert read == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE", None)
    assert "the store failed fatally" in proc.log()
    assert '"INTERNAL"' not in proc.log()
    client.channel.close()
    assert proc.signal(signal.SIGTERM) == 0

    client = spawn_server().start()  # a restart reopens the database and replays its WAL
    assert _health(client) == {SERVING}
    stored = set(client.contents(client.history("a1")))
    assert set(acknowledged) <= stored


def test_running_out_of_memory_is_resource_exhausted(tmp_path: Path) -> None:
    with _server(tmp_path, store_memory_limit="32MB") as server:
        client = server.client
        client.append("a1", "small")
        # 90 MB in one transaction, which DuckDB holds in memory until its commit.
        huge = [pb.Message(role=USER, content=f"{i}" + "z" * 900_000) for i in range(100)]
        code, reason, delay = _failure(lambda: _append(client, "a1", huge))
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "STORE_RESOURCE_EXHAUSTED")
        assert delay is not None and delay > 0
        assert _health(client) == {SERVING}
        client.append("a1", "still fine")
        assert client.contents(client.history("a1")) == ["small", "still fine"]


# ----------------------------------------------------------------------------- the writer


def test_a_stuck_writer_is_store_busy_and_not_serving_until_it_recovers(
    tmp_path: Path,
) -> None:
    with _server(tmp_path, write_timeout_seconds=1.0) as server:
        client, store = server.client, cast(Store, server.running.store)
        client.append("a1", "before")
        started, release = threading.Event(), threading.Event()

        def stuck(_cur: duckdb.DuckDBPyConnection) -> None:
            started.set()
            release.wait(60)

        def hold_the_writer() -> None:
            with contextlib.suppress(StoreBusy):  # its own wait times out too
                store._write(stuck)

        holder = threading.Thread(target=hold_the_writer)
        holder.start()
        assert started.wait(30)
        # A client deadline far above the write timeout: the answer is the server's own.
        request = pb.AppendMessagesRequest(
            agent="a1", thread="t1", messages=_messages(1, "during"), create_agent_if_missing=True
        )
        code, reason, delay = _failure(lambda: client.stub.AppendMessages(request, timeout=30))
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_BUSY")
        assert delay is not None and delay > 0
        assert _health(client) == {NOT_SERVING}
        assert not store.serving()
        assert client.contents(client.history("a1")) == ["before"]  # reads do not wait

        release.set()
        holder.join(30)
        client.append("a1", "after")
        assert _health(client) == {SERVING}
        # The timed-out append was withdrawn before the writer took it: never written.
        assert client.contents(client.history("a1")) == ["before", "after"]


# ----------------------------------------------------------------------------- deletes


def test_deleting_a_large_agent_lets_other_appends_through(tmp_path: Path) -> None:
    """Removing 200,000 messages used to be one writer job that every other tenant's
    appends queued behind; now each chunk is a job, and appends go between them."""
    with _server(tmp_path, max_batch_messages=50_000, delete_chunk_rows=2_000) as server:
        client = server.client
        _fill(client, "big", 200_000)
        events: list[str] = []  # list.append is atomic: the order things happened in
        done = threading.Event()

        def appender() -> None:
            i = 0
            while not done.is_set():
                client.append("small", f"s{i}")
                events.append("ack")
                i += 1

        worker = threading.Thread(target=appender)
        worker.start()
        wait_until(lambda: events.count("ack") >= 3, "appends are flowing")
        events.append("delete sent")
        response = client.stub.DeleteAgent(pb.DeleteAgentRequest(name="big"), timeout=120)
        events.append("delete done")
        done.set()
        worker.join(60)
        assert response.deleted_message_count == 200_000
        during = events[events.index("delete sent") : events.index("delete done")]
        assert during.count("ack") >= 10, f"only {during.count('ack')} appends got through"
        with pytest.raises(grpc.RpcError) as info:
            client.stub.GetAgent(pb.GetAgentRequest(name="big"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(client.history("small")) == events.count("ack")
        store = cast(Store, server.running.store)
        assert store._cursor().execute("SELECT count(*) FROM messages").fetchall() == [
            (events.count("ack"),)
        ]
        assert store._cursor().execute("SELECT count(*) FROM deleted_contexts").fetchall() == [(0,)]


def test_an_agent_recreated_while_its_old_messages_remain_sees_none_of_them(
    tmp_path: Path,
) -> None:
    """The deletion commits before its messages are removed: a new agent of the same
    name must not see them, then or after a restart, and the restart removes them."""
    with _server(tmp_path) as server:
        client = server.client
        client.append("a1", "old one", "old two", thread="t1")
        client.append("a1", "old three", thread="t2")
        client.stub.SetStatus(
            pb.SetStatusRequest(
                agent="a1",
                entry=pb.StatusEntry(
                    key="k", state="busy", summary="working", kind=pb.STATUS_KIND_PROCESS
                ),
            )
        )
        # The removal is held back (as by a stop), so the old messages stay in the table.
        server.running.store.stop_background_work()
        response = client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
        assert response.deleted_message_count == 3
        client.append("a1", "new", thread="t1")
        assert client.contents(client.history("a1", thread="t1")) == ["new"]
        assert client.history("a1", thread="t2") == []
        threads = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
        assert [(t.thread, t.message_count) for t in threads] == [("t1", 1)]
        assert not client.stub.ListStatus(pb.ListStatusRequest(agent="a1")).entries
        stats = client.stub.GetContextStats(pb.GetContextStatsRequest(agent="a1")).stats
        assert stats.total_message_count == 1
        rows = cast(Store, server.running.store)._cursor().execute("SELECT count(*) FROM messages")
        assert rows.fetchall() == [(4,)]  # the old ones are still there, invisible

    with _server(tmp_path) as server:  # the same data directory
        client = server.client
        client.append("a1", "newer", thread="t1")
        assert client.contents(client.history("a1", thread="t1")) == ["new", "newer"]
        assert client.history("a1", thread="t2") == []
    with duckdb.connect(str(tmp_path / "data" / "contextd.duckdb")) as con:
        assert con.execute("SELECT content FROM messages ORDER BY id").fetchall() == [
            ("new",),
            ("newer",),
        ]
        assert con.execute("SELECT count(*) FROM deleted_contexts").fetchall() == [(0,)]


def test_a_delete_killed_midway_is_finished_by_the_next_start(
    spawn_server: SpawnServer,
) -> None:
    proc = spawn_server(extra_env={"CONTEXTD_MAX_BATCH_MESSAGES": "50000"})
    client = proc.start()
    _fill(client, "big", 200_000)
    client.append("keep", "kept")
    outcome: list[Any] = []

    def delete() -> None:
        try:
            outcome.append(client.stub.DeleteAgent(pb.DeleteAgentRequest(name="big")))
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    deleter = threading.Thread(target=delete)
    deleter.start()
    while True:  # until the deletion has committed (its messages are still being removed)
        try:
            client.stub.GetAgent(pb.GetAgentRequest(name="big"))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
            break
    proc.kill9()
    deleter.join(60)
    assert outcome == [grpc.StatusCode.UNAVAILABLE]  # killed before it could answer
    client.channel.close()

    again = spawn_server()
    client = again.start()
    assert "resuming the removal of deleted agents' messages" in again.log()
    agents = client.stub.ListAgents(pb.ListAgentsRequest()).agents
    assert [a.name for a in agents] == ["keep"]
    client.append("big", "reborn", thread="t0")
    assert client.contents(client.history("big", thread="t0")) == ["reborn"]
    _wait_for_log(again, "removed the rest of deleted agents' messages")
    client.channel.close()
    assert again.signal(signal.SIGTERM) == 0
    with duckdb.connect(str(again.data_dir / "contextd.duckdb")) as con:
        assert con.execute("SELECT content FROM messages ORDER BY id").fetchall() == [
            ("kept",),
            ("reborn",),
        ]
        assert con.execute("SELECT count(*) FROM deleted_contexts").fetchall() == [(0,)]


# ----------------------------------------------------------------------------- shutdown


def test_sigterm_finishes_received_calls_and_refuses_later_ones_cleanly(
    spawn_server: SpawnServer,
) -> None:
    """An 8,000-message append the server has received completes after SIGTERM. A call
    that arrives after the signal is answered UNAVAILABLE (SHUTTING_DOWN, retry): grpc's
    own stop would have ended it CANCELLED, which clients do not retry."""
    with FakeAnthropic() as fake:
        proc = spawn_server(
            extra_env={
                "ANTHROPIC_API_KEY": "test-key",
                "CONTEXTD_ANTHROPIC_BASE_URL": fake.base_url,
                "CONTEXTD_SUMMARY_TIMEOUT_SECONDS": "60",
                "CONTEXTD_LOG_LEVEL": "DEBUG",
            }
        )
        client = proc.start()
        for i in range(30):
            client.append("a1", f"turn {i} " + "w " * 200, role=USER if i % 2 == 0 else ASSISTANT)
        # A summarizing build held at the fake API keeps the drain going as long as the
        # test needs, so the late call surely arrives while the server drains.
        fake.hold()
        outcome: dict[str, Any] = {}

        def run(name: str, call: Callable[[], Any]) -> threading.Thread:
            def target() -> None:
                try:
                    outcome[name] = call()
                except grpc.RpcError as exc:
                    outcome[name] = exc.code()

            thread = threading.Thread(target=target)
            thread.start()
            return thread

        build = run(
            "build",
            lambda: client.stub.BuildContext(
                pb.BuildContextRequest(
                    agent="a1",
                    thread="t1",
                    options=pb.BuildOptions(summarize=True, budget_tokens=2_000),
                )
            ),
        )
        assert fake.arrived.wait(30), "the build never asked for a summary"
        big = run("append", lambda: _append(client, "a1", _messages(8_000, "big "), "big"))
        _wait_for_log(proc, '"call received", "method": "/contextd.v1.ContextService/Append', 31)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        _wait_for_log(proc, "draining calls in flight")

        late = _failure(lambda: client.append("a1", "too late"))
        assert late == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN", 1.0)
        assert _health(client) == {NOT_SERVING}
        fake.release()
        build.join(60)
        big.join(60)
        assert proc.proc.wait(60) == 0
    assert len(outcome["append"].receipts) == 8_000
    assert isinstance(outcome["build"], pb.BuildContextResponse)
    client.channel.close()

    client = spawn_server().start()
    stored = client.contents(client.history("a1", thread="big"))
    assert stored == [f"big {i}" for i in range(8_000)]
    assert "too late" not in client.contents(client.history("a1"))
