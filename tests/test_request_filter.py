"""Fresh request ids cost no lookup; every recorded write is still answered from its record.

The embedded engine keeps a Bloom filter of the request keys it recorded
(adapters/duckdb/request_filter.py): "absent" skips the lookup of `request_records`,
"maybe" looks as before. Statements are counted with DuckDB's own query log, on the
store's real connection."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from conftest import USER, SpawnServer
from contextd.adapters.duckdb.journal import DIRECT_ROWS
from contextd.adapters.duckdb.request_filter import MIN_CAPACITY, RequestFilter
from contextd.adapters.duckdb.store import Store
from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock
from contextd.domain.idempotency import (
    CLEANUP_EVERY_US,
    RETENTION_US,
    AlreadyDone,
    RequestRecord,
    record_key,
)
from contextd.domain.model import AgentSettings, ContextKey, MessageBatch, NewMessage, Role
from contextd.ports.store import ThreadFilter
from contextd.v1 import context_service_pb2 as pb

HOUR = 3600.0
KEY = ContextKey("default", "a1", "", "t1")
WHERE = ThreadFilter("default", "a1", "", "t1")


def _batch(*contents: str) -> MessageBatch:
    return prepare_batch([NewMessage(role=Role.USER, content=c) for c in contents], "", [()])


def _record(request_id: str, method: str = "AppendMessages") -> RequestRecord:
    return RequestRecord("default", request_id, method, "fp", lambda r: repr(r).encode())


def _open(path: Path, clock: ManualClock | None = None) -> Store:
    store = Store.open(path, journal_idle_s=HOUR, clock=clock)
    store._con.execute("CALL enable_logging('QueryLog')")
    return store


def _lookups(store: Store) -> int:
    """How many statements so far read request_records by key (DuckDB's query log; the
    pattern is a parameter, so this query does not count itself)."""
    row = (
        store._con.cursor()
        .execute(
            "SELECT count(*) FROM duckdb_logs WHERE type = 'QueryLog' AND message LIKE ?",
            ["SELECT id_key, method, fingerprint, payload FROM request_records%"],
        )
        .fetchone()
    )
    assert row is not None
    return int(row[0])


def _append_as_the_servicer(store: Store, request_id: str, text: str) -> object:
    """What the servicer does for an append with a request id: the fast path, then
    the write (whose writer checks again)."""
    assert store.remembered("default", request_id) is None
    return store.append(KEY, _batch(text), None, _record(request_id))


# ----------------------------------------------------------------- the filter itself


def test_the_filter_never_misses_a_key_and_false_positives_stay_near_one_percent() -> None:
    keys = [f"{uuid.uuid4().hex}\tdefault" for _ in range(20_000)]
    built = RequestFilter(keys, capacity=len(keys))
    added = RequestFilter(capacity=len(keys))
    for key in keys:
        added.add(key)
    # The bulk build (at open, at a rebuild) and the writer's adds set the same bits:
    # a key recorded before a restart is found by the filter built after it.
    assert built.bits() == added.bits()
    assert all(built.maybe(k) for k in keys)
    fresh = sum(built.maybe(f"{uuid.uuid4().hex}\tdefault") for _ in range(20_000))
    assert fresh < 400  # 1% expected at capacity: 200
    assert added.full() and not built.full()


def test_the_arrow_build_sets_the_bits_of_adding_one_by_one() -> None:
    """The build reads Arrow string columns from their buffers (int32 and int64 offsets,
    slices, chunks) and sets the same bits as the writer's one-by-one adds."""
    keys = [f"{uuid.uuid4().hex}\tdefault" for _ in range(3_000)] + ["", "ünïcødé\tdefault"]
    one = RequestFilter(capacity=10_000)
    for key in keys[100:2_500]:
        one.add(key)
    for kind in (pa.string(), pa.large_string()):
        whole = pa.array(["before"] * 7 + keys, type=kind)
        built = RequestFilter(capacity=10_000)
        built.add_arrow(whole.slice(107, 1_000))  # a slice: its offset into the buffers
        built.add_arrow(pa.chunked_array([whole.slice(1_107, 900), whole.slice(2_007, 500)]))
        assert built.bits() == one.bits()
        assert not built.maybe("before") and built.added == 0
    everything = RequestFilter(capacity=10_000)
    everything.add_arrow(pa.array(keys))
    assert all(everything.maybe(k) for k in keys)
    empties = RequestFilter(capacity=10)
    empties.add_arrow(pa.array(["", ""]))  # no data bytes at all
    empties.add_arrow(pa.array([], type=pa.string()))
    assert empties.maybe("") and not empties.maybe("x")


def test_a_malformed_column_is_refused_whole() -> None:
    keys = pa.array(["a", "bb", "ccc"])
    _, offsets, data = keys.buffers()
    bits = RequestFilter(capacity=10)
    with pytest.raises(ValueError):
        bits._bits.add_column(data, offsets, False, 2, 5)  # past the offsets
    with pytest.raises(ValueError):
        bits._bits.add_column(data[:3], offsets, False, 0, 3)  # past the data
    assert bits.bits() == RequestFilter(capacity=10).bits()


def test_the_filter_is_sized_from_the_keys_it_starts_with() -> None:
    assert RequestFilter().capacity == MIN_CAPACITY
    assert RequestFilter().nbytes < 1.3 * MIN_CAPACITY  # about 9.6 bits a key
    assert RequestFilter([str(i) for i in range(10)], capacity=None).capacity == MIN_CAPACITY


# ----------------------------------------------------------------- the store


def test_a_fresh_request_id_runs_no_request_records_lookup(tmp_path: Path) -> None:
    store = _open(tmp_path / "db.duckdb")
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        store.create_agent("default", "a2", AgentSettings(), _record("c1", "CreateAgent"))
        _append_as_the_servicer(store, "r1", "journaled")
        big = _batch(*[f"direct {i}" for i in range(DIRECT_ROWS)])
        store.append(KEY, big, None, _record("r2"))  # committed directly
        assert _lookups(store) == 0
        # A retry does look (so the count above would have seen any lookup).
        with pytest.raises(AlreadyDone):
            store.create_agent("default", "a2", AgentSettings(), _record("c1", "CreateAgent"))
        assert _lookups(store) == 1
        assert store.remembered("default", "r2") is not None
        assert _lookups(store) == 2
    finally:
        store.close()


def test_retries_are_answered_after_the_journal_is_applied(tmp_path: Path) -> None:
    store = _open(tmp_path / "db.duckdb")
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        first = _append_as_the_servicer(store, "r1", "m1")
        assert store._journal_requests  # journaled
        assert [m.content for m in store.list_messages(WHERE, None, None, 100)] == ["m0", "m1"]
        assert not store._journal_requests  # applied: the record is in the table now
        found = store.remembered("default", "r1")
        assert found is not None and found.payload == repr(first).encode()
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, _batch("m1"), None, _record("r1"))
        assert retry.value.payload == repr(first).encode()
    finally:
        store.close()


def test_a_false_positive_only_costs_the_lookup(tmp_path: Path) -> None:
    store = _open(tmp_path / "db.duckdb")
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        tiny = RequestFilter(capacity=1)  # 64 bits: saturated by a few keys
        for i in range(200):
            tiny.add(f"other {i}")
        tiny.added = 0  # not due a rebuild: the test keeps this filter
        store._requests = tiny
        assert tiny.maybe(record_key("default", "r1"))  # a false positive
        first = _append_as_the_servicer(store, "r1", "m1")
        assert _lookups(store) == 2  # the fast path's and the writer's, both empty
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, _batch("m1"), None, _record("r1"))
        assert retry.value.payload == repr(first).encode()
        assert [m.content for m in store.list_messages(WHERE, None, None, 100)] == ["m0", "m1"]
    finally:
        store.close()


def test_a_full_filter_is_rebuilt_without_the_records_cleaned_up(tmp_path: Path) -> None:
    clock = ManualClock(1_700_000_000_000_000)
    store = _open(tmp_path / "db.duckdb", clock)
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        _append_as_the_servicer(store, "old", "m1")
        clock.advance(RETENTION_US + CLEANUP_EVERY_US)
        small = RequestFilter(capacity=1)  # full after one more key
        store._requests = small
        second = _append_as_the_servicer(store, "new", "m2")  # the cleanup pass runs first
        store.append(KEY, _batch("m3"), None)  # the writer started the rebuild before this
        _swapped_in(store, small)
        rebuilt = store._requests
        assert rebuilt is not small and rebuilt.capacity == MIN_CAPACITY
        assert not rebuilt.maybe(record_key("default", "old"))  # removed: shed
        assert rebuilt.maybe(record_key("default", "new"))  # journaled: kept
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, _batch("m2"), None, _record("new"))
        assert retry.value.payload == repr(second).encode()
    finally:
        store.close()


def _swapped_in(store: Store, old: RequestFilter) -> None:
    """Wait for the rebuild `old` started, then let the writer swap it in: it does so
    after the group following the build's end, before it takes the next job."""
    assert old.rebuild is not None
    old.rebuild.join(60)
    store.append(KEY, _batch("after the build"), None)
    store.append(KEY, _batch("after the swap"), None)
    assert store._requests is not old


def test_a_key_recorded_while_the_filter_is_rebuilt_is_in_the_new_one(tmp_path: Path) -> None:
    """The rebuild runs on a thread of its own while the writer goes on: a key recorded
    after the build read the table is noted and added before the swap, so its retry is
    still answered from its record. (The real build, held after its scan until the key
    is recorded: a gate, so the key misses the scan for certain.)"""
    store = _open(tmp_path / "db.duckdb")
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        built, release = threading.Event(), threading.Event()
        build = store._build_request_filter

        def held(journal_keys: list[str]) -> RequestFilter:
            rebuilt = build(journal_keys)
            built.set()
            assert release.wait(60)
            return rebuilt

        store._build_request_filter = held  # type: ignore[method-assign]
        small = RequestFilter(capacity=1)  # full after one more key
        store._requests = small
        _append_as_the_servicer(store, "before", "m1")  # the writer starts the rebuild
        assert built.wait(60)
        during = _append_as_the_servicer(store, "during", "m2")
        assert store._requests is small  # answered while the build is still held
        big = _batch(*[f"direct {i}" for i in range(DIRECT_ROWS)])
        direct = store.append(KEY, big, None, _record("during-direct"))  # committed directly
        release.set()
        _swapped_in(store, small)
        rebuilt = store._requests
        assert rebuilt.capacity == MIN_CAPACITY and rebuilt.rebuild is None
        for request_id in ("before", "during", "during-direct"):
            assert rebuilt.maybe(record_key("default", request_id))
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, _batch("m2"), None, _record("during"))
        assert retry.value.payload == repr(during).encode()
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, big, None, _record("during-direct"))
        assert retry.value.payload == repr(direct).encode()
    finally:
        store.close()


def test_the_filter_is_built_from_the_table_at_open(tmp_path: Path) -> None:
    path = tmp_path / "db.duckdb"
    store = _open(path)
    try:
        store.append(KEY, _batch("m0"), AgentSettings())
        first = _append_as_the_servicer(store, "r1", "m1")
    finally:
        store.close()
    store = _open(path)
    try:
        assert store._requests.maybe(record_key("default", "r1"))
        with pytest.raises(AlreadyDone) as retry:
            store.append(KEY, _batch("m1"), None, _record("r1"))
        assert retry.value.payload == repr(first).encode()
    finally:
        store.close()


# ----------------------------------------------------------------- both engines


def test_every_recorded_write_is_retried_from_its_record_after_a_crash(
    spawn_server: SpawnServer,
) -> None:
    """Each kind of recorded write (a journaled append, a direct one, a call), then a
    SIGKILL: after the restart each retry gets its first response and writes nothing."""
    server = spawn_server()
    client = server.start()
    create = pb.CreateAgentRequest(agent=pb.Agent(name="a1"), request_id="c")
    small = pb.AppendMessagesRequest(
        agent="a1", thread="t1", request_id="small", messages=[pb.Message(role=USER, content="s")]
    )
    large = pb.AppendMessagesRequest(
        agent="a1",
        thread="t1",
        request_id="large",
        messages=[pb.Message(role=USER, content=f"l{i}") for i in range(DIRECT_ROWS)],
    )
    update = pb.UpdateAgentRequest(agent=pb.Agent(name="a1", system_prompt="p"), request_id="u")
    firsts = [
        client.stub.CreateAgent(create),
        client.stub.AppendMessages(large),
        client.stub.AppendMessages(small),  # last: the journal still holds it at the kill
        client.stub.UpdateAgent(update),
    ]
    client.channel.close()
    server.kill9()
    client = spawn_server().start()
    again = [
        client.stub.CreateAgent(create),
        client.stub.AppendMessages(large),
        client.stub.AppendMessages(small),
        client.stub.UpdateAgent(update),
    ]
    assert again == firsts
    assert len(client.history("a1")) == DIRECT_ROWS + 1
    fresh = pb.AppendMessagesRequest(
        agent="a1", thread="t1", request_id="fresh", messages=[pb.Message(role=USER, content="f")]
    )
    client.stub.AppendMessages(fresh)
    assert len(client.history("a1")) == DIRECT_ROWS + 2


def test_duckdb_query_log_counts_cursor_statements() -> None:
    """The counting means of the tests above sees statements of every cursor."""
    con = duckdb.connect()
    con.execute("CALL enable_logging('QueryLog')")
    con.execute("CREATE TABLE request_records (id_key VARCHAR)")
    con.cursor().execute("SELECT id_key FROM request_records").fetchall()
    row = con.execute(
        "SELECT count(*) FROM duckdb_logs WHERE message LIKE ?", ["SELECT id_key FROM%"]
    ).fetchone()
    assert row == (1,)
