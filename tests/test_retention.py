"""Retention over gRPC, on both engines: policies on agents (with scope overrides), caps
and expiry as every call sees them, GetContextStats' exists / expires_in, the sweep (run
through the server's own use cases on the test's clock), clears and snapshots.

Each sentence of docs/api.md's *Retention* section names the test here that checks it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import TOOL_RESULT, TOOL_USE, Client, InProcessServer, scope_pb, span
from contextd.app.service import ContextService
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb

SECOND = 1_000_000
HOUR = 3600 * SECOND
DAY = 24 * HOUR
WEEK = 7 * DAY


def _policy(max_messages: int = 0, ttl_us: int = 0, delete_overflow: bool = False) -> Any:
    return pb.RetentionPolicy(
        max_messages=max_messages,
        ttl=span(ttl_us) if ttl_us else None,
        delete_overflow=delete_overflow,
    )


def _create(client: Client, name: str = "bot", **fields: Any) -> pb.Agent:
    agent: pb.Agent = client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name=name, rolling_window=span(WEEK), **fields))
    ).agent
    return agent


def _stats(client: Client, agent: str = "bot", thread: str = "t1", scope: str = "") -> Any:
    return client.stub.GetContextStats(
        pb.GetContextStatsRequest(agent=agent, thread=thread, scope=scope_pb(scope))
    ).stats


def _build(client: Client, agent: str = "bot", thread: str = "t1") -> list[str]:
    built = client.stub.BuildContext(
        pb.BuildContextRequest(agent=agent, thread=thread, user_message="next?")
    )
    return [m.content for m in built.messages][:-1]  # the new user message last


def _service(server: InProcessServer) -> ContextService:
    service = server.running.service
    assert service is not None
    return service


def _bad_fields(call: Callable[[], object]) -> list[str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(error)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR))
    return [v.field for v in bad.field_violations]


def test_the_design_notes_setup_fifteen_messages_for_a_day(
    server: InProcessServer, clock: ManualClock
) -> None:
    """max_messages 15 and ttl 24 h, set on create, shown by GetAgent and by the stats."""
    client = server.client
    _create(client, retention=_policy(15, DAY))
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="bot")).agent
    assert agent.retention.max_messages == 15
    assert agent.retention.ttl.ToMicroseconds() == DAY
    for i in range(20):
        client.append("bot", f"m{i}")
    window = client.contents(client.window("bot"))
    assert window == [f"m{i}" for i in range(5, 20)]
    assert _build(client) == window
    assert len(client.history("bot")) == 20  # without delete_overflow the history stays
    stats = _stats(client)
    assert stats.exists and stats.window_message_count == 15
    assert stats.expires_in.ToMicroseconds() == DAY
    assert stats.retention.max_messages == 15
    clock.advance(HOUR)
    assert _stats(client).expires_in.ToMicroseconds() == DAY - HOUR


def test_an_expired_context_reads_empty_everywhere_at_once(
    server: InProcessServer, clock: ManualClock
) -> None:
    client = server.client
    _create(client, retention=_policy(ttl_us=DAY))
    [receipt] = client.append("bot", "remember me").receipts
    client.append("bot", "other thread", thread="t2")
    clock.set(receipt.create_time.ToMicroseconds() + DAY - 1)
    assert client.contents(client.window("bot")) == ["remember me"]
    clock.set(receipt.create_time.ToMicroseconds() + DAY)
    assert client.window("bot") == []
    assert _build(client) == []
    stats = _stats(client)
    assert not stats.exists and stats.window_message_count == 0
    assert not stats.HasField("expires_in") and not stats.HasField("expire_time")
    assert stats.total_message_count == 1  # stored until the sweep
    # A message after expiry starts the context again, without its past.
    client.append("bot", "fresh start")
    assert client.contents(client.window("bot")) == ["fresh start"]
    assert _build(client) == ["fresh start"]
    assert _stats(client).exists


def test_the_sweep_deletes_expired_contexts_and_records_an_event(
    server: InProcessServer, clock: ManualClock
) -> None:
    client = server.client
    _create(client, retention=_policy(ttl_us=DAY))
    client.append("bot", *[f"m{i}" for i in range(7)])
    clock.advance(DAY)
    client.append("bot", "kept", thread="t2")
    report = _service(server).sweep_retention(chunk_rows=3)
    assert (report.expired_deleted, report.transactions) == (7, 3)
    assert client.history("bot") == []
    assert client.contents(client.history("bot", thread="t2")) == ["kept"]
    [event] = client.stub.ListEvents(
        pb.ListEventsRequest(agent="bot", thread="t1", type="retention.swept")
    ).events
    assert json.loads(event.data)["expired_deleted"] == 7
    assert client.append("bot", "again").receipts[0].sequence == 8


def test_a_cap_never_splits_a_tool_group(server: InProcessServer) -> None:
    client = server.client
    _create(client, retention=_policy(max_messages=2, delete_overflow=True))
    client.append("bot", "question")
    client.append("bot", "", role=TOOL_USE, tool_calls='[{"id": "c1", "name": "ls", "input": {}}]')
    client.append("bot", "files", role=TOOL_RESULT, tool_call_id="c1")
    client.append("bot", "answer")
    # The 2nd newest is a result whose tool_use is older: the group leaves whole.
    assert client.contents(client.window("bot")) == ["answer"]
    assert _build(client) == ["answer"]
    assert _service(server).sweep_retention().overflow_deleted == 3
    assert client.contents(client.history("bot")) == ["answer"]


def test_scope_overrides_and_updates(server: InProcessServer) -> None:
    client = server.client
    _create(
        client,
        retention_overrides=[
            pb.ScopeRetention(scope_pattern="dm:*", policy=_policy(max_messages=1)),
            pb.ScopeRetention(scope_pattern="guild:1/*", policy=_policy(max_messages=2)),
        ],
    )
    channel = "guild:1/channel:2/user:3"
    for scope in ("", "dm:9", channel, "guild:10/channel:2/user:3"):
        client.append("bot", "a", "b", "c", scope=scope)
    sizes = {s: len(client.window("bot", scope=s)) for s in ("", "dm:9", channel)}
    assert sizes == {"": 3, "dm:9": 1, channel: 2}
    assert len(client.window("bot", scope="guild:10/channel:2/user:3")) == 3  # not guild:1
    # An update mask of "retention" alone leaves the overrides.
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="bot", retention=_policy(max_messages=2)),
            update_mask=field_mask_pb2.FieldMask(paths=["retention"]),
        )
    )
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="bot")).agent
    assert agent.retention.max_messages == 2 and len(agent.retention_overrides) == 2
    assert len(client.window("bot")) == 2
    # An update without a mask sets what the request sets; others keep their values.
    client.stub.UpdateAgent(pb.UpdateAgentRequest(agent=pb.Agent(name="bot", model="gpt-4o")))
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="bot")).agent
    assert agent.retention.max_messages == 2 and len(agent.retention_overrides) == 2
    # "retention_overrides" with none given removes them.
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="bot"),
            update_mask=field_mask_pb2.FieldMask(paths=["retention_overrides"]),
        )
    )
    assert len(client.window("bot", scope="dm:9")) == 2


def test_defaults_keep_everything(server: InProcessServer, clock: ManualClock) -> None:
    client = server.client
    agent = _create(client)
    assert not agent.HasField("retention") and not agent.retention_overrides
    client.append("bot", *[f"m{i}" for i in range(40)])
    stats = _stats(client)
    assert stats.exists and stats.window_message_count == 40
    assert not stats.HasField("expires_in") and not stats.HasField("retention")
    clock.advance(30 * DAY)
    assert _service(server).sweep_retention().transactions == 0
    assert len(client.history("bot")) == 40


def test_clears_and_snapshots(server: InProcessServer, clock: ManualClock) -> None:
    client = server.client
    _create(client, retention=_policy(ttl_us=DAY))
    client.append("bot", "before the save")
    saved = client.stub.SaveSnapshot(pb.SaveSnapshotRequest(agent="bot")).snapshot
    client.stub.ClearContext(pb.ClearContextRequest(agent="bot", thread="t1"))
    assert not _stats(client).exists  # a cleared context does not exist either
    clock.advance(DAY)
    _service(server).sweep_retention()
    assert client.history("bot") == []
    # The snapshot outlives the expiry and the sweep; its messages come back fresh.
    restored = client.stub.RestoreSnapshot(pb.RestoreSnapshotRequest(agent="bot", id=saved.id))
    assert restored.restored_count == 1
    assert client.contents(client.window("bot")) == ["before the save"]
    stats = _stats(client)
    assert stats.exists and stats.expires_in.ToMicroseconds() == DAY


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"retention": _policy(max_messages=-1)}, "agent.retention.max_messages"),
        ({"retention": _policy(ttl_us=SECOND // 2)}, "agent.retention.ttl"),
        ({"retention": _policy(delete_overflow=True)}, "agent.retention.delete_overflow"),
        (
            {"retention_overrides": [pb.ScopeRetention(scope_pattern="dm:*x")]},
            "agent.retention_overrides[0].scope_pattern",
        ),
        (
            {
                "retention_overrides": [
                    pb.ScopeRetention(scope_pattern="dm:*"),
                    pb.ScopeRetention(scope_pattern="dm:*"),
                ]
            },
            "agent.retention_overrides[1].scope_pattern",
        ),
        (
            {
                "retention_overrides": [
                    pb.ScopeRetention(scope_pattern="x", policy=_policy(max_messages=2_000_000))
                ]
            },
            "agent.retention_overrides[0].policy.max_messages",
        ),
    ],
)
def test_bad_policies_are_invalid_argument_naming_the_field(
    server: InProcessServer, fields: dict[str, Any], path: str
) -> None:
    client = server.client
    assert _bad_fields(lambda: _create(client, **fields)) == [path]
    _create(client)
    update = pb.UpdateAgentRequest(agent=pb.Agent(name="bot", **fields))
    assert _bad_fields(lambda: client.stub.UpdateAgent(update)) == [path]
