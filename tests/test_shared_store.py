"""Two servers on one PostgreSQL database behave as one service.

In-process servers with their own clocks (one behind the other), so each rule that must
not depend on which replica answers is checked quickly and without sleeps: cached models,
deletes, clears and commit times across replicas. (tests/test_replicas.py runs real
processes, with kill -9.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import field_mask_pb2

from conftest import Client, connect
from contextd import core
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock, wall_clock_us
from contextd.v1 import context_service_pb2 as pb

MINUTE = 60 * 1_000_000


@pytest.fixture
def replicas(tmp_path: Path, postgres_dsn: str) -> Iterator[tuple[Client, Client]]:
    """Replica A on the real time, replica B a minute behind it (clocks drift)."""
    now = wall_clock_us()
    running: list[RunningServer] = []
    clients: list[Client] = []
    for name, start in (("a", now), ("b", now - MINUTE)):
        settings = Settings(addr="127.0.0.1:0", data_dir=tmp_path / name, store=postgres_dsn)
        server = create_server(settings, clock=ManualClock(start))
        running.append(server)
        clients.append(connect(f"127.0.0.1:{server.port}"))
    yield clients[0], clients[1]
    for client in clients:
        client.channel.close()
    for server in running:
        server.stop(grace=1)


def test_a_model_changed_through_one_replica_counts_on_the_other(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    a.append("a1", "hello world")  # A now knows a1's model: none (estimates)
    b.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", model="gpt-4o"),
            update_mask=field_mask_pb2.FieldMask(paths=["model"]),
        )
    )
    text = "def parse_args(argv): return {'x': 1}"
    receipt = a.append("a1", text).receipts[0]
    assert receipt.token_count == core.count_tokens(text, "o200k_base")
    assert receipt.token_count != core.estimate_tokens(text)


def test_commit_times_of_a_thread_never_go_back_across_replicas(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    first = a.append("a1", "from A").receipts[0]
    second = b.append("a1", "from B, whose clock is a minute behind").receipts[0]
    assert second.create_time.ToMicroseconds() > first.create_time.ToMicroseconds()
    assert second.sequence == first.sequence + 1
    assert [m.content for m in a.window("a1")] == [
        "from A",
        "from B, whose clock is a minute behind",
    ]


def test_a_clear_through_a_lagging_replica_hides_what_was_before_it(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    a.append("a1", "before", thread="t1")
    a.append("a1", "other thread", thread="t2")
    b.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    assert a.window("a1", thread="t1") == []
    assert [m.content for m in a.window("a1", thread="t2")] == ["other thread"]
    b.append("a1", "after", thread="t1")
    assert [m.content for m in a.window("a1", thread="t1")] == ["after"]
    # The agent-wide clear too, though B's clock is behind every stored time.
    b.stub.ClearContext(pb.ClearContextRequest(agent="a1", all_scopes=True))
    assert a.window("a1", thread="t1") == [] and a.window("a1", thread="t2") == []
    a.append("a1", "new", thread="t2")
    assert [m.content for m in b.window("a1", thread="t2")] == ["new"]


def test_a_delete_through_one_replica_is_final_for_the_other(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    a.append("a1", "old")
    b.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    with pytest.raises(grpc.RpcError) as info:
        a.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1", thread="t1", messages=[pb.Message(role=pb.ROLE_USER, content="x")]
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    a.append("a1", "fresh")  # create_agent_if_missing: a new, empty agent
    assert [m.content for m in b.history("a1")] == ["fresh"]
    assert b.history("a1")[0].sequence == 1


def test_a_page_token_from_one_replica_is_honoured_by_the_other(
    replicas: tuple[Client, Client],
) -> None:
    a, b = replicas
    a.append("a1", "m1", "m2", "m3")
    first = a.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1", page_size=2))
    rest = b.stub.ListMessages(
        pb.ListMessagesRequest(
            agent="a1", thread="t1", page_size=2, page_token=first.next_page_token
        )
    )
    assert [m.content for m in first.messages] + [m.content for m in rest.messages] == [
        "m1",
        "m2",
        "m3",
    ]
