"""Per-tenant stored bytes (--tenant-max-bytes): a write that would take a tenant over
its quota is RESOURCE_EXHAUSTED (TENANT_STORAGE_EXHAUSTED) with RetryInfo and writes
nothing; other tenants are not affected; deleting agents and snapshots frees room; the
count comes from the store (a restart, another replica see it). Time is the server's
injected clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import Client, connect
from contextd.adapters.duckdb import schema as duckdb_schema
from contextd.adapters.duckdb.store import Store
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock
from contextd.domain.model import AgentSettings, ContextKey, NewMessage, Role
from contextd.domain.quota import REFRESH_US
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc

LIMIT = 1000
Start = Callable[..., tuple[RunningServer, Client]]


@pytest.fixture
def start(tmp_path: Path, clock: ManualClock, store_url: str) -> Iterator[Start]:
    """Starts servers with a quota of LIMIT bytes on the test's store (stopped at the end)."""
    started: list[tuple[RunningServer, Client]] = []

    def run(data_dir: str = "data", **overrides: object) -> tuple[RunningServer, Client]:
        fields: dict[str, object] = {"store": store_url, "tenant_max_bytes": LIMIT, **overrides}
        settings = Settings(
            addr="127.0.0.1:0",
            data_dir=tmp_path / data_dir,
            **fields,  # type: ignore[arg-type]
        )
        running = create_server(settings, clock=clock)
        started.append((running, connect(f"127.0.0.1:{running.port}")))
        return started[-1]

    yield run
    for running, client in started:
        client.channel.close()
        running.stop(grace=1)


def append(client: Client, text: str, agent: str = "a1", key: str | None = None) -> None:
    metadata = [("authorization", f"Bearer {key}")] if key else []
    client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent=agent,
            thread="t1",
            messages=[pb.Message(role=pb.ROLE_USER, content=text)],
            create_agent_if_missing=True,
        ),
        metadata=metadata,
    )


def refused(call: Callable[[], object]) -> float:
    """Asserts the call is refused for the quota; returns its retry delay in seconds."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    reasons, delays = [], []
    for detail in status.details:
        error, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        if detail.Unpack(error):
            reasons.append(error.reason)
        elif detail.Unpack(retry):
            delays.append(retry.retry_delay.ToMicroseconds() / 1e6)
    assert reasons == ["TENANT_STORAGE_EXHAUSTED"]
    assert "tenant_max_bytes" in (info.value.details() or "")
    return float(delays[0])


def history(client: Client, agent: str = "a1") -> list[str]:
    return client.contents(client.history(agent))


def test_an_append_past_the_quota_is_refused_and_writes_nothing(start: Start) -> None:
    _, client = start()
    append(client, "x" * 600)
    delay = refused(lambda: append(client, "é" * 201))  # 402 bytes: 1,002 in all
    assert delay == REFRESH_US / 1e6
    assert history(client) == ["x" * 600]
    append(client, "y" * 400)  # exactly the quota
    refused(lambda: append(client, "z"))
    assert history(client) == ["x" * 600, "y" * 400]


def test_snapshots_count_and_deletes_free_room(start: Start, clock: ManualClock) -> None:
    _, client = start()
    stub = client.stub
    append(client, "x" * 300)
    saved = stub.SaveSnapshot(pb.SaveSnapshotRequest(agent="a1")).snapshot  # 300 more
    assert saved.size_bytes == 300
    stub.SaveSnapshot(pb.SaveSnapshotRequest(agent="a1"))  # 900 in all
    refused(lambda: stub.SaveSnapshot(pb.SaveSnapshotRequest(agent="a1")))
    refused(lambda: stub.RestoreSnapshot(pb.RestoreSnapshotRequest(agent="a1", id=saved.id)))
    assert len(stub.ListSnapshots(pb.ListSnapshotsRequest(agent="a1")).snapshots) == 2
    assert history(client) == ["x" * 300]
    stub.DeleteSnapshot(pb.DeleteSnapshotRequest(agent="a1", id=saved.id))  # 600 in all
    append(client, "y" * 400)
    refused(lambda: append(client, "z"))
    stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))  # nothing left
    append(client, "w" * 1000, agent="a2")
    assert history(client, "a2") == ["w" * 1000]


def test_a_restore_counts_what_it_appends(start: Start) -> None:
    _, client = start()
    stub = client.stub
    append(client, "x" * 300)
    saved = stub.SaveSnapshot(pb.SaveSnapshotRequest(agent="a1")).snapshot  # 600 in all
    stub.RestoreSnapshot(pb.RestoreSnapshotRequest(agent="a1", id=saved.id))  # 900
    refused(lambda: stub.RestoreSnapshot(pb.RestoreSnapshotRequest(agent="a1", id=saved.id)))
    assert history(client) == ["x" * 300] * 2


def test_each_tenant_has_its_own_quota(start: Start) -> None:
    _, client = start()
    keys = kpb_grpc.KeyServiceStub(client.channel)  # type: ignore[no-untyped-call]
    root = keys.CreateKey(kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN)).secret
    made = {
        tenant: keys.CreateKey(
            kpb.CreateKeyRequest(tenant=tenant, role=kpb.KEY_ROLE_WRITE),
            metadata=[("authorization", f"Bearer {root}")],
        ).secret
        for tenant in ("acme", "globex")
    }
    append(client, "a" * 1000, key=made["acme"])
    refused(lambda: append(client, "a", key=made["acme"]))
    append(client, "g" * 1000, key=made["globex"])  # the same agent name, another tenant
    append(client, "d" * 1000, key=root)


def test_the_count_outlives_a_restart(start: Start) -> None:
    running, client = start()
    append(client, "x" * 900)
    client.channel.close()
    running.stop(grace=1)
    _, again = start()  # the same data directory or database
    refused(lambda: append(again, "y" * 101))
    append(again, "y" * 100)


def test_without_a_quota_nothing_is_refused(start: Start) -> None:
    _, client = start(tenant_max_bytes=0)
    append(client, "x" * 5000)
    assert history(client) == ["x" * 5000]


def test_another_replica_is_seen_within_the_refresh_interval(
    start: Start, clock: ManualClock, postgres_dsn: str
) -> None:
    """Two servers on one database: each checks the tenant's sum it read at most
    REFRESH_US ago plus what it admitted itself, so a tenant may pass its quota by what
    the other admitted meanwhile, and never once the interval is over."""
    _, first = start("one", store=postgres_dsn)
    _, second = start("two", store=postgres_dsn)
    append(second, "s" * 100)  # `second` reads the sum: 0, then admits 100
    append(first, "f" * 800)  # 900 in all
    append(second, "s" * 200)  # `second` still counts 100 + 200: admitted, 1,100 in all
    clock.advance(REFRESH_US)
    refused(lambda: append(second, "s"))
    refused(lambda: append(first, "f"))


@pytest.mark.duckdb_only
def test_migrating_counts_the_bytes_already_stored(tmp_path: Path) -> None:
    """An embedded file from before per-thread byte counters: migrating counts the
    messages the thread counters include, and opening counts the rest with them."""
    path = tmp_path / "db.duckdb"
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
        "applied_time_us BIGINT NOT NULL)"
    )
    for version, statements in duckdb_schema.MIGRATIONS:
        if version >= 13:
            break
        for statement in statements:
            con.execute(statement)
        con.execute("INSERT INTO schema_migrations VALUES (?, 0)", [version])
    con.close()
    store = Store.open(path)
    try:
        # Written through today's store, then the file is taken back to before version 13.
        for text in ("héllo", "x" * 10, "→"):
            store.append(
                ContextKey("acme", "a1", "", "t1"),
                prepare_batch([NewMessage(role=Role.USER, content=text)], "", [()]),
                AgentSettings(),
            )
    finally:
        store.close()
    con = duckdb.connect(str(path))
    con.execute("DELETE FROM schema_migrations WHERE version >= 13")
    con.execute("ALTER TABLE threads DROP COLUMN stored_bytes")
    con.execute("DROP TABLE tool_outputs")  # version 14's
    con.execute("ALTER TABLE threads DROP COLUMN outputs_expired_through_us")  # version 20's
    # The last message is not counted by the thread counters yet (as after a crash).
    con.execute(
        "UPDATE threads SET message_count = 2, last_sequence = 2, "
        "token_estimate = token_estimate - 1"
    )
    con.execute(
        "UPDATE store_state SET value = (SELECT max(id) - 1 FROM messages) "
        "WHERE key = 'thread_counters_through_id'"
    )
    con.close()
    store = Store.open(path)
    try:
        assert store.tenant_stored_bytes("acme") == 6 + 10 + 3
        threads = store.list_threads("acme", "a1", "", None, 10)
        assert [t.message_count for t in threads] == [3]
    finally:
        store.close()
