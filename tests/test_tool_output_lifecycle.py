"""Tool outputs under retention and the stored-bytes quota, over gRPC on both engines:
the sweep deletes an expired context's outputs in chunks and says so in its event; stored
outputs count toward the tenant's quota (puts, streamed puts and results kept aside from
appends), and deletes free room. Time is the server's injected clock."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_quota import refused
from test_tool_outputs import MiB, Tools, _pieces, _stored_results

from conftest import InProcessServer, connect, db_rows, span
from contextd.api.server import create_server
from contextd.app.service import ContextService
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import tool_output_service_pb2 as tpb

SECOND = 1_000_000
DAY = 86_400 * SECOND


def _service(server: InProcessServer) -> ContextService:
    service = server.running.service
    assert isinstance(service, ContextService)
    return service


def _create(server: InProcessServer, ttl_us: int) -> None:
    server.client.stub.CreateAgent(
        pb.CreateAgentRequest(
            agent=pb.Agent(
                name="a1",
                rolling_window=span(7 * DAY),
                retention=pb.RetentionPolicy(ttl=span(ttl_us)),
            )
        )
    )


def test_the_sweep_deletes_an_expired_contexts_tool_outputs_in_chunks(
    server: InProcessServer, clock: ManualClock
) -> None:
    client, tools = server.client, Tools(server.client.channel)
    _create(server, DAY)
    client.append("a1", "hello", thread="t1")
    client.append("a1", "hello", thread="t2")
    swept = [tools.put(f"r{i}", thread="t1") for i in range(4)]
    swept.append(tools.stream_put(_pieces(os.urandom(2 * MiB), MiB), thread="t1"))
    other_thread = tools.put("t2's", thread="t2")
    other_scope = tools.put("s1's", thread="t1", scope="s1")
    clock.advance(DAY - SECOND)
    client.append("a1", "still here", thread="t2")  # t2 stays alive
    late = tools.put("put after the messages", thread="t1")  # not yet ttl old
    clock.advance(SECOND)
    report = _service(server).sweep_retention(chunk_rows=2)
    assert report.tool_outputs_deleted == 5 and report.expired_deleted == 1
    assert report.transactions == 1 + 3  # one chunk of messages, three of outputs
    assert [p.id for p in tools.pointers(thread="t1")] == [late.id]
    assert [p.id for p in tools.pointers(thread="t2")] == [other_thread.id]
    assert [p.id for p in tools.pointers(scope="s1")] == [other_scope.id]  # no thread in s1
    assert tools.get([p.id for p in swept]) == {}
    assert _stored_results(server) == 0  # the chunked one's data is gone too
    [event] = client.stub.ListEvents(
        pb.ListEventsRequest(agent="a1", thread="t1", type="retention.swept")
    ).events
    data = json.loads(event.data)
    assert data["tool_outputs_deleted"] == 5 and data["expired_deleted"] == 1
    # The output put after the messages goes once it is ttl old, the context still
    # expired; t2 has expired by then as well.
    clock.advance(DAY)
    assert _service(server).sweep_retention().tool_outputs_deleted == 2
    assert tools.pointers(thread="t1") == [] and tools.pointers(thread="t2") == []
    assert _service(server).sweep_retention().transactions == 0  # nothing left: no writes


def test_an_append_before_expiry_keeps_the_contexts_tool_outputs(
    server: InProcessServer, clock: ManualClock
) -> None:
    client, tools = server.client, Tools(server.client.channel)
    _create(server, DAY)
    client.append("a1", "hello")
    kept = tools.put("r")
    clock.advance(DAY - SECOND)
    client.append("a1", "still here")  # a second before it would expire
    clock.advance(DAY // 2)
    assert _service(server).sweep_retention().tool_outputs_deleted == 0
    assert [p.id for p in tools.pointers()] == [kept.id]


def test_an_append_after_expiry_does_not_bring_back_its_tool_outputs(
    server: InProcessServer, clock: ManualClock
) -> None:
    """Like its messages: the outputs old enough for the sweep when an append restarted
    the context stay gone, whether or not the sweep ran; a younger one stays."""
    client, tools = server.client, Tools(server.client.channel)
    _create(server, DAY)
    client.append("a1", "hello", thread="t1")
    old = tools.put("stored with the first message", thread="t1")
    clock.advance(DAY // 2)
    young = tools.put("stored half a day later", thread="t1")
    clock.advance(DAY // 2 + SECOND)  # expired a second ago; `old` is ttl old, `young` not
    client.append("a1", "back again", thread="t1")  # restarts it before any sweep
    assert [p.id for p in tools.pointers(thread="t1")] == [young.id]
    assert tools.get([old.id, young.id]) == {young.id: b"stored half a day later"}
    report = _service(server).sweep_retention()
    assert report.tool_outputs_deleted == 1 and report.expired_deleted == 1
    assert _service(server).sweep_retention().transactions == 0  # nothing left to delete
    clock.advance(DAY)  # expired again; `young` is now old enough as well
    assert tools.pointers(thread="t1") == []
    assert _service(server).sweep_retention().tool_outputs_deleted == 1


def test_an_expired_contexts_tool_outputs_vanish_from_every_read_before_the_sweep(
    server: InProcessServer, clock: ManualClock
) -> None:
    """From the moment its context expires, an output old enough for the sweep is left
    out of lists, selections and build excerpts, loads list it as missing and reads are
    NOT_FOUND, as the context's messages read empty: no sweep has run."""
    client, tools = server.client, Tools(server.client.channel)
    _create(server, DAY)
    client.append("a1", "hello", thread="t1")
    client.append("a1", "hello", thread="t2")
    old = tools.put("zeta segfault in the kernel log", thread="t1", tool="read_log")
    no_thread = tools.put("zeta segfault, a scope with no messages", thread="t1", scope="s1")
    clock.advance(DAY // 2)
    young = tools.put("zeta segfault seen again", thread="t1", tool="read_log")
    alive = tools.put("zeta segfault in t2", thread="t2", tool="read_log")

    def visible() -> set[str]:
        return {p.id for p in tools.pointers()} | {p.id for p in tools.pointers(scope="s1")}

    def selected() -> set[str]:
        return {r.pointer.id for r in tools.select("zeta segfault", k=10).outputs}

    def excerpted() -> set[str]:
        built = client.stub.BuildContext(
            pb.BuildContextRequest(
                agent="a1",
                thread="t2",
                user_message="why the zeta segfault?",
                options=pb.BuildOptions(tool_output_excerpts=10),
            )
        )
        return set(built.stats.tool_output_excerpt_ids)

    everything = {old.id, no_thread.id, young.id, alive.id}
    clock.advance(DAY // 2 - SECOND)  # t1 expires in a second
    client.append("a1", "t2 goes on", thread="t2")
    assert visible() == everything
    assert selected() == excerpted() == everything - {no_thread.id}
    clock.advance(2 * SECOND)
    assert visible() == everything - {old.id}
    assert selected() == excerpted() == {young.id, alive.id}
    assert tools.get([old.id, young.id]) == {young.id: b"zeta segfault seen again"}
    with pytest.raises(grpc.RpcError) as caught:
        tools.stub.ReadToolOutput(tpb.ReadToolOutputRequest(agent="a1", id=old.id))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as caught:
        tools.stub.GrepToolOutput(tpb.GrepToolOutputRequest(agent="a1", id=old.id, pattern="z"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # The sweep deletes exactly what the reads left out.
    assert _service(server).sweep_retention().tool_outputs_deleted == 1
    assert visible() == everything - {old.id}


LIMIT = 100_000


@pytest.fixture
def quota_server(tmp_path: Path, clock: ManualClock, store_url: str) -> Iterator[InProcessServer]:
    settings = Settings(
        addr="127.0.0.1:0",
        data_dir=tmp_path / "data",
        store=store_url,
        sweep_interval_seconds=0,
        tenant_max_bytes=LIMIT,
    )
    running = create_server(settings, clock=clock)
    client = connect(f"127.0.0.1:{running.port}")
    yield InProcessServer(running, client, settings.data_dir)
    client.channel.close()
    running.stop(grace=1)


def test_tool_outputs_count_toward_the_quota_and_deletes_free_room(
    quota_server: InProcessServer, clock: ManualClock
) -> None:
    server = quota_server
    tools = Tools(server.client.channel)
    tools.put("x" * 60_000)
    refused(lambda: tools.put("y" * 40_001))  # 100,001 in all
    # A streamed put is refused once a piece would pass the quota, and stores nothing.
    refused(lambda: tools.stream_put(_pieces(b"z" * 50_000, 10_000)))
    assert len(tools.pointers()) == 1
    tools.stream_put(_pieces(b"w" * 40_000, 10_000))  # exactly the quota
    refused(lambda: tools.put("v"))
    # A result kept aside from an append counts too (and so is refused).
    refused(
        lambda: server.client.append("a1", "r" * 40_000, role=pb.ROLE_TOOL_RESULT, tool_call_id="c")
    )
    deleted = tools.stub.DeleteToolOutputs(tpb.DeleteToolOutputsRequest(filter=tools.filter()))
    assert deleted.deleted_count == 2
    tools.stream_put(_pieces(b"u" * 100_000, 30_000))  # room again, at once
    rows = db_rows(server.running.store, "SELECT sum(size_bytes) FROM tool_outputs")
    assert int(rows[0][0]) == LIMIT
