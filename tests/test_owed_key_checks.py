"""PostgreSQL: AppendMessages and BuildContext admitted before their key is confirmed.

A replica that found a key active admits it again at once, and a call without a key is
admitted as the local operator, without a look-up of its own (domain/access.py
`owed_key_check`); the call's write checks, in its own transaction or statement, that the
key is still active (or that no key is), a build's snapshot reads the check with its
first statement, and a call that did neither is checked before it is answered. These
tests run two replicas over one database: a key revoked (or created) through one is
refused by the other from its next call on, whichever way that call goes (the
one-statement append, the transaction, a tool result stored aside, a refusal of the
input, a retry answered from its record, a build), and nothing of a refused call is
written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from test_pg_build_reads import HOT_BUILD_ROUND_TRIPS
from test_postgres_append import _traced

from conftest import Client, connect
from contextd.adapters.postgres.store import PostgresStore
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock, wall_clock_us
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc


@dataclass
class Replica:
    running: RunningServer
    client: Client

    @property
    def store(self) -> PostgresStore:
        store = self.running.store
        assert isinstance(store, PostgresStore)
        return store


class Caller:
    """Stubs of one replica that send one key (or none) with every call."""

    def __init__(self, replica: Replica, key: str | None) -> None:
        self.metadata = [("authorization", f"Bearer {key}")] if key else []
        channel = replica.client.channel
        self.context = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        self.keys = kpb_grpc.KeyServiceStub(channel)  # type: ignore[no-untyped-call]

    def append(
        self, text: str, thread: str = "t", request_id: str = "", **message: Any
    ) -> pb.AppendMessagesResponse:
        response: pb.AppendMessagesResponse = self.context.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a",
                thread=thread,
                request_id=request_id,
                create_agent_if_missing=True,
                messages=[
                    pb.Message(role=message.pop("role", pb.ROLE_USER), content=text, **message)
                ],
            ),
            metadata=self.metadata,
        )
        return response

    def contents(self, thread: str = "t") -> list[str]:
        response = self.context.ListMessages(
            pb.ListMessagesRequest(agent="a", thread=thread, range=pb.MESSAGE_RANGE_ALL),
            metadata=self.metadata,
        )
        return [m.content for m in response.messages]

    def create_key(self, role: int) -> kpb.CreateKeyResponse:
        response: kpb.CreateKeyResponse = self.keys.CreateKey(
            kpb.CreateKeyRequest(role=role),  # type: ignore[arg-type]
            metadata=self.metadata,
        )
        return response

    def revoke(self, key_id: str) -> None:
        self.keys.RevokeKey(kpb.RevokeKeyRequest(key_id=key_id), metadata=self.metadata)


def _serve(postgres_dsn: str, data_dir: Path) -> Replica:
    running = create_server(
        Settings(
            addr="127.0.0.1:0",
            data_dir=data_dir,
            store=postgres_dsn,
            sweep_interval_seconds=0,
            store_pool_size=1,
        ),
        clock=ManualClock(wall_clock_us()),
    )
    return Replica(running, connect(f"127.0.0.1:{running.port}"))


@pytest.fixture
def replicas(postgres_dsn: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    one = _serve(postgres_dsn, tmp_path / "one")
    two = _serve(postgres_dsn, tmp_path / "two")
    try:
        yield one, two
    finally:
        for replica in (one, two):
            replica.client.channel.close()
            replica.running.stop(grace=1)


def _unauthenticated(call: Callable[[], object]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    reasons = []
    for detail in status.details:
        found = error_details_pb2.ErrorInfo()
        if detail.Unpack(found):
            reasons.append(found.reason)
    assert reasons == ["API_KEY_INVALID"]


def _keys(one: Replica) -> tuple[Caller, kpb.CreateKeyResponse]:
    """An admin caller of replica one, and a writer key (made by that admin)."""
    admin = Caller(one, Caller(one, None).create_key(kpb.KEY_ROLE_ADMIN).secret)
    return admin, admin.create_key(kpb.KEY_ROLE_WRITE)


def _tool_call(call_id: str) -> dict[str, Any]:
    return {
        "role": pb.ROLE_TOOL_USE,
        "tool_calls": json.dumps([{"id": call_id, "name": "read_log", "input": {}}]),
    }


# How each kind of append reaches the store (the thread "t" exists beforehand).
APPENDS: dict[str, Callable[[Caller], object]] = {
    # The one-message append to an existing thread: its one statement checks the key.
    "one statement": lambda c: c.append("refused"),
    # A new thread: the one statement checks it (and writes nothing, as the thread is
    # missing) before the transaction would create the thread.
    "new thread": lambda c: c.append("refused", thread="new"),
    # Two messages: the append's transaction checks it first.
    "transaction": lambda c: c.context.AppendMessages(
        pb.AppendMessagesRequest(
            agent="a",
            thread="t",
            messages=[pb.Message(role=pb.ROLE_USER, content=t) for t in ("re", "fused")],
        ),
        metadata=c.metadata,
    ),
    # A result over the inline threshold: stored aside before the append, in a
    # transaction of its own that checks it first.
    "stored aside": lambda c: c.append("y" * 40_000, role=pb.ROLE_TOOL_RESULT, tool_call_id="c1"),
    # Refused for its input before anything is written: checked before it is answered.
    "bad input": lambda c: c.append("refused", thread="x" * 1000),
    # A retry answered from its record by the one statement: the key is checked first.
    "retry": lambda c: c.append("kept", request_id="r-1"),
}


@pytest.mark.parametrize("path", list(APPENDS))
def test_a_key_revoked_through_one_replica_is_refused_by_the_other_from_its_next_call(
    replicas: tuple[Replica, Replica], path: str, caplog: pytest.LogCaptureFixture
) -> None:
    one, two = replicas
    admin, created = _keys(one)
    writer = Caller(two, created.secret)
    writer.append("kept", request_id="r-1")  # replica two now knows the key as active
    writer.append("", **_tool_call("c1"))
    assert writer.contents() == ["kept", ""]
    admin.revoke(created.key.key_id)
    with caplog.at_level(logging.INFO, logger="contextd.app.keys"):
        _unauthenticated(lambda: APPENDS[path](writer))
    refusals = [r for r in caplog.records if "revoked API key refused" in r.getMessage()]
    assert [getattr(r, "key_id", None) for r in refusals] == [created.key.key_id]
    reader = Caller(one, admin.create_key(kpb.KEY_ROLE_READ).secret)
    assert reader.contents() == ["kept", ""]  # nothing of the refused call was written
    assert reader.contents(thread="new") == []
    with one.store._pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM tool_outputs").fetchone()
    assert row is not None and row[0] == 0
    _unauthenticated(lambda: writer.append("again"))  # and so on, every call


@pytest.mark.parametrize("path", list(APPENDS))
def test_a_key_created_through_one_replica_ends_the_other_s_calls_without_a_key(
    replicas: tuple[Replica, Replica], path: str
) -> None:
    one, two = replicas
    keyless = Caller(two, None)
    keyless.append("kept", request_id="r-1")
    keyless.append("", **_tool_call("c1"))
    admin = Caller(one, Caller(one, None).create_key(kpb.KEY_ROLE_ADMIN).secret)
    _unauthenticated(lambda: APPENDS[path](keyless))
    assert admin.contents() == ["kept", ""]
    assert admin.contents(thread="new") == []
    with one.store._pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM tool_outputs").fetchone()
    assert row is not None and row[0] == 0


def test_a_revoked_key_below_the_role_is_unauthenticated_not_denied(
    replicas: tuple[Replica, Replica],
) -> None:
    """A key admitted from memory with a role too low is confirmed before it is told
    so: a revoked key learns nothing more than that it is refused."""
    one, two = replicas
    admin = Caller(one, Caller(one, None).create_key(kpb.KEY_ROLE_ADMIN).secret)
    created = admin.create_key(kpb.KEY_ROLE_READ)
    admin.append("hello")
    reader = Caller(two, created.secret)
    assert reader.contents() == ["hello"]  # replica two now knows the key as active
    with pytest.raises(grpc.RpcError) as denied:
        reader.append("no")
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    admin.revoke(created.key.key_id)
    _unauthenticated(lambda: reader.append("no"))


def test_an_append_with_a_key_the_replica_knows_is_one_round_trip(
    replicas: tuple[Replica, Replica], tmp_path: Path
) -> None:
    """The key's look-up is made once per replica: after it, an append to an existing
    thread is its one statement, which checks the key too."""
    one, two = replicas
    _, created = _keys(one)
    writer = Caller(two, created.secret)
    writer.append("first")
    writer.append("second")  # the agent's model and settings are cached now
    with _traced(two.store, tmp_path / "trace") as trips:
        writer.append("third")
        writer.append("fourth")
    assert [trip[-1] for trip in trips] == ["Sync"] * 2, trips
    assert all(trip[0] == 'Parse "WITH' for trip in trips), trips
    assert writer.contents() == ["first", "second", "third", "fourth"]


def test_a_wrong_secret_for_a_known_key_is_refused(replicas: tuple[Replica, Replica]) -> None:
    """What a replica remembers of a key is its secret's hash: another secret with the
    same key id is looked up, and refused, like any unknown key."""
    one, two = replicas
    _, created = _keys(one)
    Caller(two, created.secret).append("first")
    key_id = created.key.key_id
    forged = f"ctxd_{key_id}_{'A' * 43}"
    assert forged != created.secret
    _unauthenticated(lambda: Caller(two, forged).append("forged"))


def _build(caller: Caller, agent: str = "a") -> pb.BuildContextResponse:
    response: pb.BuildContextResponse = caller.context.BuildContext(
        pb.BuildContextRequest(agent=agent, thread="t", model="claude-sonnet-4"),
        metadata=caller.metadata,
    )
    return response


# How a build reaches the store: its snapshot (the check is read with it), or not at all
# (refused before: checked after the handler).
BUILDS: dict[str, Callable[[Caller], object]] = {
    "snapshot": _build,
    "refused before": lambda c: _build(c, agent="no such agent"),
}


@pytest.mark.parametrize("path", list(BUILDS))
def test_a_build_with_a_key_revoked_through_another_replica_is_refused(
    replicas: tuple[Replica, Replica], path: str
) -> None:
    one, two = replicas
    admin, created = _keys(one)
    writer = Caller(two, created.secret)
    writer.append("hello")
    assert [m.content for m in _build(writer).messages][-1:] == ["hello"]
    admin.revoke(created.key.key_id)
    _unauthenticated(lambda: BUILDS[path](writer))


@pytest.mark.parametrize("path", list(BUILDS))
def test_a_build_without_a_key_is_refused_once_another_replica_made_one(
    replicas: tuple[Replica, Replica], path: str
) -> None:
    one, two = replicas
    keyless = Caller(two, None)
    keyless.append("hello")
    assert [m.content for m in _build(keyless).messages][-1:] == ["hello"]
    Caller(one, None).create_key(kpb.KEY_ROLE_ADMIN)
    _unauthenticated(lambda: BUILDS[path](keyless))


def test_a_build_with_a_key_the_replica_knows_makes_no_round_trip_for_it(
    replicas: tuple[Replica, Replica], tmp_path: Path
) -> None:
    """The check travels with the snapshot's first statement: a BuildContext call makes
    as many round trips as the build alone (the pipeline's reads, then its COMMIT)."""
    one, two = replicas
    _, created = _keys(one)
    writer = Caller(two, created.secret)
    writer.append("hello")
    _build(writer)
    _build(writer)  # the thread is hot now
    with _traced(two.store, tmp_path / "trace") as trips:
        _build(writer)
    assert len(trips) == HOT_BUILD_ROUND_TRIPS, trips
    sent = [line for line in (tmp_path / "trace").read_text().splitlines() if line[:1] == "F"]
    assert sum("api_keys" in line for line in sent) == 1  # the check, in the first trip


def _clear(caller: Caller) -> None:
    caller.context.ClearContext(
        pb.ClearContextRequest(agent="a", thread="t"), metadata=caller.metadata
    )


@pytest.mark.parametrize("cleared", [False, True], ids=["hot", "run-again"])
def test_a_hot_build_with_a_key_revoked_through_another_replica_is_refused(
    replicas: tuple[Replica, Replica], tmp_path: Path, cleared: bool
) -> None:
    """A hot build's snapshot ends with the reads sent ahead, the key's check among
    them (one round trip): a key revoked through another replica is refused with
    nothing answered; and so it is when the build needs another read and runs again in
    a second snapshot (the thread cleared elsewhere), which reads the check again."""
    one, two = replicas
    admin, created = _keys(one)
    writer = Caller(two, created.secret)
    writer.append("hello")
    for _ in range(2):
        assert [m.content for m in _build(writer).messages][-1:] == ["hello"]
    if cleared:
        _clear(admin)
    admin.revoke(created.key.key_id)
    trace = tmp_path / "trace"
    with _traced(two.store, trace) as trips:
        _unauthenticated(lambda: _build(writer))
    sent = [line for line in trace.read_text().splitlines() if line[:1] == "F"]
    snapshots = sum("BEGIN ISOLATION LEVEL REPEATABLE READ" in line for line in sent)
    assert sum("api_keys" in line for line in sent) == snapshots
    if cleared:
        assert snapshots == 2 and len(trips) > HOT_BUILD_ROUND_TRIPS, trips
    else:
        assert snapshots == 1 and len(trips) == HOT_BUILD_ROUND_TRIPS, trips
