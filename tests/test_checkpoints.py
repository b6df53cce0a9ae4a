"""When the embedded engine checkpoints (adapters/duckdb/checkpoints.py).

- A commit checkpoints only once the WAL reaches the store's checkpoint threshold, 256 MB
  by default (`--store-checkpoint-threshold`; empty: DuckDB's own 16 MB), so a burst of
  appends does not wait for checkpoints.
- The writer checkpoints on its own once it has been idle: the WAL of a burst is folded
  into the file, and every message of the burst is still there, also after a reopen.
- A server killed (kill -9) in the middle of a burst whose WAL is past DuckDB's default
  threshold, with no checkpoint since, keeps every acknowledged message: they are
  replayed from the WAL.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc
import pytest

from conftest import SpawnServer
from contextd.adapters.duckdb.checkpoints import (
    DEFAULT_CHECKPOINT_THRESHOLD,
    IDLE_CHECKPOINT_BYTES,
    wal_bytes,
    wal_path,
)
from contextd.adapters.duckdb.store import Store
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.config import Settings
from contextd.domain.model import NewMessage, Role
from contextd.v1 import context_service_pb2 as pb
from waiting import wait_until

pytestmark = pytest.mark.duckdb_only  # the DuckDB file and its WAL themselves

TEXT = "a message long enough that a few thousand of them fill megabytes of WAL " * 12


def _setting(store: Store, name: str) -> str:
    row = store._con.execute(f"SELECT current_setting('{name}')").fetchone()
    assert row is not None
    return str(row[0])


def test_the_store_checkpoints_at_256mb_of_wal_by_default(tmp_path: Path) -> None:
    assert Settings().store_checkpoint_threshold == DEFAULT_CHECKPOINT_THRESHOLD == "256MB"
    store = Store.open(tmp_path / "a" / "x.duckdb")
    try:
        assert _setting(store, "checkpoint_threshold") == "244.1 MiB"  # 256 MB, as DuckDB says
    finally:
        store.close()
    store = Store.open(tmp_path / "b" / "x.duckdb", checkpoint_threshold="")
    try:
        assert _setting(store, "checkpoint_threshold") == "16.0 MiB"  # DuckDB's own
    finally:
        store.close()


def test_an_idle_writer_checkpoints_the_wal_of_a_burst(tmp_path: Path) -> None:
    path = tmp_path / "x.duckdb"
    store = Store.open(path)
    service = ContextService(store, ExtractiveSummarizer())
    batch = [NewMessage(role=Role.USER, content=f"{i} {TEXT}") for i in range(1_000)]
    n = 0
    # A burst: calls back to back, so the writer is never idle long enough to checkpoint.
    while wal_bytes(wal_path(path)) < IDLE_CHECKPOINT_BYTES:
        service.append_messages("default", "bot", "", "t", batch, create_agent=True)
        n += len(batch)
        assert n <= 50_000, "the WAL never grew past the idle checkpoint's size"
    # Then idle: the writer folds the WAL into the file on its own.
    wait_until(
        lambda: wal_bytes(wal_path(path)) < IDLE_CHECKPOINT_BYTES,
        "the idle writer checkpoints the WAL",
    )
    row = store._con.execute("SELECT count(*) FROM messages").fetchone()
    assert row is not None and row[0] == n
    store.close()
    store = Store.open(path)
    try:
        sql = "SELECT count(*), count(DISTINCT sequence) FROM messages"
        row = store._con.execute(sql).fetchone()
        assert row == (n, n)
    finally:
        store.close()


def test_kill9_during_a_burst_past_the_old_threshold_loses_nothing_acknowledged(
    spawn_server: SpawnServer,
) -> None:
    """DuckDB's default threshold would have checkpointed this WAL (16 MB) several times;
    here nothing checkpoints it before the kill, and every acknowledged batch is back."""
    proc = spawn_server()
    client = proc.start()
    acknowledged: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    wal = wal_path(proc.data_dir / "contextd.duckdb")

    def writer(k: int) -> None:
        i = 0
        while not stop.is_set():
            first = f"w{k}-{i}"
            request = pb.AppendMessagesRequest(
                agent="a1",
                thread=f"t{k}",
                messages=[
                    pb.Message(role=pb.ROLE_USER, content=f"{first}/{j} {TEXT}") for j in range(500)
                ],
                create_agent_if_missing=True,
            )
            try:
                client.stub.AppendMessages(request)
            except grpc.RpcError:
                return
            with lock:
                acknowledged.append(first)
            i += 1

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(
            lambda: wal_bytes(wal) > 20 << 20,
            "the WAL passes 20 MB (it does not if a checkpoint runs during the burst)",
        )
    finally:
        proc.kill9()
        stop.set()
        for t in threads:
            t.join()
        client.channel.close()

    # Each thread's batches commit in order, whole: its count is that of its
    # acknowledged batches, plus at most the one in flight at the kill (never a part).
    client = spawn_server().start()
    counts = {
        t.thread: t.message_count
        for t in client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    }
    for k in range(3):
        acked = sum(1 for a in acknowledged if a.startswith(f"w{k}-"))
        assert counts.get(f"t{k}", 0) in (500 * acked, 500 * (acked + 1)), (k, acked, counts)
    newest = client.list_messages("a1", thread="t0")[-1].content
    assert newest.endswith(TEXT)


def _burst_past_the_idle_size(service: ContextService, path: Path) -> int:
    """Append batches back to back until the WAL is worth an idle checkpoint."""
    batch = [NewMessage(role=Role.USER, content=f"{i} {TEXT}") for i in range(1_000)]
    n = 0
    while wal_bytes(wal_path(path)) < IDLE_CHECKPOINT_BYTES:
        service.append_messages("default", "bot", "", "t", batch, create_agent=True)
        n += len(batch)
        assert n <= 50_000, "the WAL never grew past the idle checkpoint's size"
    return n


def test_a_read_running_after_a_burst_does_not_hold_off_the_idle_checkpoint(
    tmp_path: Path,
) -> None:
    """A search streaming its index build right after a burst: the idle writer's flush of
    the thread counters (an UPDATE) used to commit during that read, and DuckDB then
    refused every checkpoint until the read ended. The checkpoint now comes first."""
    path = tmp_path / "x.duckdb"
    store = Store.open(path)
    service = ContextService(store, ExtractiveSummarizer())
    n = _burst_past_the_idle_size(service, path)
    reading = store._con.cursor()
    try:
        reader = reading.sql("SELECT id, content FROM messages").to_arrow_reader(100)
        first = reader.read_next_batch()  # the read is running, paused mid-stream
        assert first.num_rows == 100
        wait_until(
            lambda: wal_bytes(wal_path(path)) < IDLE_CHECKPOINT_BYTES,
            "the idle writer checkpoints the WAL",
        )
        rest = sum(b.num_rows for b in reader)
        assert first.num_rows + rest == n  # the read saw its snapshot whole
        # The counters were flushed after the checkpoint.
        wait_until(lambda: not len(store._pending), "the pending counters are flushed")
    finally:
        reading.close()
        store.close()


def test_a_checkpoint_refused_for_running_reads_logs_one_line_and_succeeds_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An update committed while a read runs makes DuckDB refuse checkpoints until the
    read ends: an expected refusal, logged in one line without a traceback, and retried
    soon enough that the checkpoint follows the read's end."""
    caplog.set_level(logging.INFO, logger="contextd")
    path = tmp_path / "x.duckdb"
    store = Store.open(path)
    service = ContextService(store, ExtractiveSummarizer())
    reading = store._con.cursor()
    try:
        _burst_past_the_idle_size(service, path)
        # Keep the writer from checkpointing until the read runs and the update is in.
        store._next_checkpoint_at = time.monotonic() + 3600
        reader = reading.sql("SELECT id, content FROM messages").to_arrow_reader(100)
        reader.read_next_batch()
        store._write(
            lambda cur: cur.execute(
                "UPDATE store_state SET value = value WHERE key = 'thread_counters_through_id'"
            )
        )
        store._next_checkpoint_at = 0.0

        def deferred() -> bool:
            return any("idle checkpoint deferred" in r.getMessage() for r in caplog.records)

        wait_until(deferred, "the idle checkpoint is deferred while a read holds the WAL")
        assert wal_bytes(wal_path(path)) >= IDLE_CHECKPOINT_BYTES  # refused, as expected
        for _ in reader:  # the read ends
            pass
        reader.close()
        wait_until(
            lambda: wal_bytes(wal_path(path)) < IDLE_CHECKPOINT_BYTES,
            "the idle writer checkpoints the WAL",
        )
        failures = [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
        assert not failures, [(r.getMessage(), r.exc_info) for r in failures]
    finally:
        reading.close()
        store.close()
