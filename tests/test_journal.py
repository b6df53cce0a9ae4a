"""The embedded engine's append journal (docs/operations.md, Durability): small appends are
durable in the journal when acknowledged and reach the tables later, many groups at once.

Crashes are real: a child process appends and then kills itself (SIGKILL), and the test
opens what it left. Stores under test wait an hour before applying the journal on their
own, so only the test's reads and writes apply it (no sleeps)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import duckdb
import grpc
import pytest

from conftest import SpawnServer
from contextd.adapters.duckdb.journal import _GROUP, _HEADER, MAGIC, JournalFile, journal_path
from contextd.adapters.duckdb.store import Store
from contextd.app.build.build_types import BuildRequest
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.keys import LOCAL_OPERATOR
from contextd.app.service import ContextService
from contextd.domain.access import KeyRole
from contextd.domain.batches import prepare_batch
from contextd.domain.errors import StoreUnavailable, Unauthenticated
from contextd.domain.idempotency import AlreadyDone, RequestRecord
from contextd.domain.model import (
    AgentSettings,
    ContextKey,
    MessageBatch,
    MessageRange,
    NewMessage,
    Role,
)
from contextd.ports.store import ThreadFilter
from contextd.v1 import context_service_pb2 as pb

HOUR = 3600.0
KEY = ContextKey("default", "a1", "", "t1")
WHERE = ThreadFilter("default", "a1", "", "t1")


def _batch(*contents: str) -> MessageBatch:
    return prepare_batch([NewMessage(role=Role.USER, content=c) for c in contents], "", [()])


def _open(path: Path) -> Store:
    return Store.open(path, journal_idle_s=HOUR)


def _contents(store: Store) -> list[tuple[str, int]]:
    return [(m.content, m.sequence) for m in store.list_messages(WHERE, None, None, 100)]


def _pending(store: Store) -> bool:
    return store._journal_group > store._journal_applied


_PRELUDE = """
import os, shutil, signal
from pathlib import Path
from contextd.adapters.duckdb.store import Store
from contextd.adapters.duckdb.journal import journal_path
from contextd.domain.batches import prepare_batch
from contextd.domain.model import AgentSettings, ContextKey, NewMessage, Role
from contextd.ports.store import ThreadFilter
def batch(text):
    return prepare_batch([NewMessage(role=Role.USER, content=text)], "", [()])
key = ContextKey("default", "a1", "", "t1")
"""


def _crash_after(path: Path, script: str) -> None:
    """Run `script` in a child with `store` open on `path`, then SIGKILL the child."""
    opened = f"path = Path({str(path)!r})\nstore = Store.open(path, journal_idle_s={HOUR})\n"
    code = _PRELUDE + opened + script + "\nos.kill(os.getpid(), signal.SIGKILL)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


APPEND_FOUR = """
store.append(key, batch("m0"), AgentSettings())  # creates the agent: committed directly
for text in ("m1", "m2", "m3"):
    store.append(key, batch(text), None)  # journaled, acknowledged, not applied
assert store._journal_group == store._journal_applied + 3
"""


def test_acknowledged_journaled_appends_survive_a_crash_once(tmp_path: Path) -> None:
    path = tmp_path / "db.duckdb"
    _crash_after(path, APPEND_FOUR)
    assert len(JournalFile(journal_path(path)).records()) == 3  # left unapplied
    store = _open(path)
    try:
        assert _contents(store) == [("m0", 1), ("m1", 2), ("m2", 3), ("m3", 4)]
        assert store._journal is not None and store._journal.size == 0  # applied, emptied
        [receipt] = store.append(KEY, _batch("m4"), None)
        assert receipt.sequence == 5
        assert receipt.id > max(m.id for m in store.list_messages(WHERE, None, None, 4))
    finally:
        store.close()
    assert journal_path(path).stat().st_size == 0  # a clean close leaves no record


def test_an_emptied_journal_is_written_again_in_place(tmp_path: Path) -> None:
    """After an apply the next records go to the start of the file, over the applied ones,
    without growing it (a synchronous write that grows a file also syncs its size); a
    crash then replays only the newest run, never what is left of the older one behind
    it, whether that reads as records or not."""
    path = tmp_path / "db.duckdb"
    _crash_after(
        path,
        APPEND_FOUR
        + """
size = journal_path(path).stat().st_size
store.list_messages(ThreadFilter("default", "a1", "", "t1"), None, None, 10)  # applies 1-3
assert store._journal.size == 0
store.append(key, batch("m4"), None)  # group 4, over group 1's record
assert journal_path(path).stat().st_size == size
""",
    )
    # Groups 2 and 3 still follow as whole records when group 4's is as long as group 1's.
    assert [n for n, _ in JournalFile(journal_path(path)).records()] == [4]
    store = _open(path)
    try:
        assert _contents(store) == [("m0", 1), ("m1", 2), ("m2", 3), ("m3", 4), ("m4", 5)]
    finally:
        store.close()


def test_a_journal_write_is_on_disk_when_it_returns(tmp_path: Path) -> None:
    """Callers are answered as soon as their group's record is written, with no sync
    call after it: the file must be open for synchronous writes (O_DSYNC), or an
    acknowledged append could be lost in a power cut. Also a journal reopened from a
    previous run."""
    path = tmp_path / "db.duckdb"
    for _ in range(2):
        store = _open(path)
        try:
            journal = store._journal
            assert journal is not None
            assert fcntl.fcntl(journal._fd, fcntl.F_GETFL) & os.O_DSYNC == os.O_DSYNC
            store.append(KEY, _batch("m"), AgentSettings())
            store.append(KEY, _batch("journaled"), None)
            assert len(journal.records()) == 1  # it wrote the record it synced
        finally:
            store.close()


@pytest.mark.parametrize("damage", ["torn", "checksum"])
def test_a_torn_or_damaged_last_record_is_ignored(tmp_path: Path, damage: str) -> None:
    """A record whose write never completed was never acknowledged: it is left out, the
    records before it are applied."""
    path = tmp_path / "db.duckdb"
    _crash_after(path, APPEND_FOUR)
    jpath = journal_path(path)
    data = bytearray(jpath.read_bytes())
    if damage == "torn":
        data = data[:-7]
    else:
        data[-3] ^= 0xFF
    jpath.write_bytes(bytes(data))
    store = _open(path)
    try:
        assert _contents(store) == [("m0", 1), ("m1", 2), ("m2", 3)]
        [receipt] = store.append(KEY, _batch("m3 again"), None)
        assert receipt.sequence == 4
    finally:
        store.close()


def test_records_applied_before_a_crash_are_not_applied_twice(tmp_path: Path) -> None:
    """A crash after the apply's commit and before the journal was emptied leaves
    records the tables hold: the applied mark skips them; later ones are applied."""
    path = tmp_path / "db.duckdb"
    saved = tmp_path / "saved.journal"
    _crash_after(
        path,
        APPEND_FOUR
        + f"""
shutil.copy(journal_path(path), {str(saved)!r})  # records of groups 1-3
store.list_messages(ThreadFilter("default", "a1", "", "t1"), None, None, 10)  # applies
assert store._journal.size == 0
store.append(key, batch("m4"), None)  # group 4, journaled
""",
    )
    jpath = journal_path(path)
    # As if the journal had been emptied by cutting the file, and that never reached the
    # disk: groups 1-3 again before group 4.
    [group4] = JournalFile(jpath).records()
    jpath.write_bytes(saved.read_bytes() + _record_bytes(*group4))
    assert [n for n, _ in JournalFile(jpath).records()] == [1, 2, 3, 4]
    store = _open(path)
    try:
        assert _contents(store) == [("m0", 1), ("m1", 2), ("m2", 3), ("m3", 4), ("m4", 5)]
    finally:
        store.close()


def _record_bytes(group: int, payload: bytes) -> bytes:
    """One journal record as `JournalFile.append` writes it."""
    crc = zlib.crc32(payload, zlib.crc32(_GROUP.pack(group)))
    return _HEADER.pack(MAGIC, len(payload), crc, group) + payload


def _record(request_id: str) -> RequestRecord:
    return RequestRecord("default", request_id, "AppendMessages", "fp", lambda r: repr(r).encode())


def test_a_retry_of_a_journaled_append_gets_its_first_receipts(tmp_path: Path) -> None:
    store = _open(tmp_path / "db.duckdb")
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        first = store.append(KEY, _batch("m1"), None, _record("r1"))
        assert _pending(store)
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, _batch("m1"), None, _record("r1"))
        assert retry.value.payload == repr(first).encode()
        assert _pending(store)  # answered from the journal's records, not the table
        found = store.remembered("default", "r1")  # the servicer's fast path
        assert found is not None and found.payload == repr(first).encode()
        assert _pending(store)  # it did not wait for the journal's apply
        assert _contents(store) == [("m0", 1), ("m1", 2)]  # the read applied it
        with pytest.raises(AlreadyDone) as again:
            store.append(KEY, _batch("m1"), None, _record("r1"))
        assert again.value.payload == repr(first).encode()
        assert _contents(store) == [("m0", 1), ("m1", 2)]
    finally:
        store.close()


def test_every_read_sees_every_acknowledged_append(tmp_path: Path) -> None:
    """Each read below comes right after an append the journal holds; each sees it."""
    store = _open(tmp_path / "db.duckdb")
    service = ContextService(store, ExtractiveSummarizer())
    msg = [NewMessage(role=Role.USER, content="the zebra crossing")]
    try:
        service.append_messages("default", "a1", "", "t1", msg, create_agent=True)
        n = 1

        def appended() -> None:
            nonlocal n
            service.append_messages("default", "a1", "", "t1", msg)
            n += 1
            assert _pending(store)

        appended()
        built = service.build_context(BuildRequest("default", "a1", "", "t1"))  # cold
        assert len(built.stamps) == n
        appended()
        assert len(store.list_messages(WHERE, None, None, 100)) == n
        appended()
        [thread] = service.list_threads("default", "a1", "", 10, "").items
        assert thread.message_count == n
        appended()
        found = service.search_messages("default", "a1", "", "t1", MessageRange.ALL, "zebra", 50)
        assert len(found.hits) == n
        appended()
        info = service.save_snapshot("default", "a1", "", "t1", "")
        assert info.message_count == n
        appended()
        stats = service.context_stats("default", "a1", "", "t1")
        assert stats.total_message_count == n
    finally:
        store.close()


def test_a_failed_apply_keeps_the_journal_and_reads_fail_unavailable(tmp_path: Path) -> None:
    """A sequence number taken behind the writer's back (as only a bug could) makes the
    apply fail: nothing is dropped, reads are UNAVAILABLE instead of stale, and once the
    obstacle is gone the journal applies."""
    path = tmp_path / "db.duckdb"
    store = _open(path)
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        store.append(KEY, _batch("m1"), None)  # journaled as sequence 2
        store._con.cursor().execute(
            "INSERT INTO messages BY NAME SELECT * EXCLUDE (content) "
            "REPLACE (id + 1000 AS id, 2 AS sequence) FROM messages"
        )
        with pytest.raises(StoreUnavailable, match="journal"):
            store.list_messages(WHERE, None, None, 10)
        with pytest.raises(StoreUnavailable, match="journal"):
            store.get_agent("default", "a1")  # no answer from memory either
        assert len(JournalFile(journal_path(path)).records()) == 1
        # The journal stays bounded: once full, appends fail too instead of piling up.
        for i in range(8):  # 8 x 255 messages, each group journaled
            store.append(KEY, _batch(*[f"b{i}-{j}" for j in range(255)]), None)
        with pytest.raises(StoreUnavailable, match="journal"):
            store.append(KEY, _batch("past the bound"), None)
        assert len(JournalFile(journal_path(path)).records()) == 9
        store._con.cursor().execute("DELETE FROM messages WHERE id > 1000")
        rows = store.list_messages(WHERE, None, None, 5_000)
        assert [m.sequence for m in rows] == list(range(1, 2 + 8 * 255 + 1))
        assert [m.content for m in rows[:3]] == ["m0", "m1", "b0-0"]
        assert store._journal is not None and store._journal.size == 0
    finally:
        store.close()


def test_kill9_during_single_appends_keeps_every_acknowledged_message_once(
    spawn_server: SpawnServer,
) -> None:
    """Four callers append one message at a time; the server is killed mid-stream.
    Each thread then holds its acknowledged messages in order, each once, plus at most
    the one in flight at the kill."""
    proc = spawn_server()
    client = proc.start()
    acknowledged: dict[int, list[str]] = {k: [] for k in range(4)}
    enough = threading.Event()
    lock = threading.Lock()

    def writer(k: int) -> None:
        i = 0
        while True:
            text = f"w{k}-{i}"
            request = pb.AppendMessagesRequest(
                agent="a1",
                thread=f"t{k}",
                messages=[pb.Message(role=pb.ROLE_USER, content=text)],
                create_agent_if_missing=True,
            )
            try:
                client.stub.AppendMessages(request, timeout=10)
            except grpc.RpcError:
                return
            acknowledged[k].append(text)
            i += 1
            with lock:
                if sum(len(v) for v in acknowledged.values()) >= 400:
                    enough.set()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    assert enough.wait(60), "the appends never got going"
    proc.kill9()
    for t in threads:
        t.join()
    client.channel.close()

    restarted = spawn_server()
    client = restarted.start()
    for k in range(4):
        stored = client.contents(client.history("a1", thread=f"t{k}"))
        acked = acknowledged[k]
        assert stored[: len(acked)] == acked, k
        assert len(stored) in (len(acked), len(acked) + 1), (k, len(acked), len(stored))
        assert len(set(stored)) == len(stored)
    client.channel.close()
    restarted.stop()
    if proc.extra_env.get("CONTEXTD_STORE") is None:  # a clean stop leaves no record
        assert os.path.getsize(proc.data_dir / "contextd.duckdb.journal") == 0


def test_a_start_whose_journal_cannot_be_applied_stops_and_keeps_it(tmp_path: Path) -> None:
    """The journal holds acknowledged appends: a start that cannot apply it fails with a
    clear error and leaves the file; once the obstacle is gone the next start applies it."""
    path = tmp_path / "db.duckdb"
    _crash_after(
        path,
        """
store.append(key, batch("m0"), AgentSettings())
store.append(key, batch("m1"), None)  # journaled as sequence 2
store._con.cursor().execute(
    "INSERT INTO messages BY NAME SELECT * EXCLUDE (content) "
    "REPLACE (id + 1000 AS id, 2 AS sequence) FROM messages"
)
""",
    )
    with pytest.raises(StoreUnavailable, match=r"journal .* could not be applied"):
        _open(path)
    assert len(JournalFile(journal_path(path)).records()) == 1
    con = duckdb.connect(str(path))  # the failed start let go of the file
    con.execute("DELETE FROM messages WHERE id > 1000")
    con.close()
    store = _open(path)
    try:
        assert _contents(store) == [("m0", 1), ("m1", 2)]
    finally:
        store.close()


def test_a_call_s_key_is_found_without_applying_the_journal(tmp_path: Path) -> None:
    """Every call with an API key finds its key. A read of the file first applies the
    journal (the read barrier), so a key read from the file on every call made every
    keyed append apply the journal; keys found are kept in memory (adapters/duckdb/
    access.py), and a revocation still refuses the key from the next call on."""
    store = _open(tmp_path / "d.duckdb")
    try:
        service = ContextService(store, ExtractiveSummarizer())
        key, token = service.create_key(LOCAL_OPERATOR, "default", KeyRole.WRITE, "w")
        assert service.authenticate(token).key_id == key.key_id
        message = [NewMessage(role=Role.USER, content="hello")]
        service.append_messages("default", "a1", "", "t1", message, create_agent=True)
        service.append_messages("default", "a1", "", "t1", message)  # journaled
        assert _pending(store)
        assert service.authenticate(token).key_id == key.key_id
        assert _pending(store)  # the key's look-up applied nothing
        service.revoke_key(LOCAL_OPERATOR, key.key_id)
        with pytest.raises(Unauthenticated):
            service.authenticate(token)
    finally:
        store.close()
