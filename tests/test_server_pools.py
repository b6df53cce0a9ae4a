"""How the server spends its threads: AppendMessages on a pool of its own, and the
scheduling policy of a served process.

An append must never wait for a thread a slow call holds (a summary through the LLM, a
long search), and a burst of appends must not take the threads reads need; grpcio runs
a method on the pool its handler names (`experimental_thread_pool`), so these tests also
fail if a grpcio release stops honouring it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_anthropic import FakeAnthropic

from conftest import USER, Client, SpawnServer, connect, summary_in_flight
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


def _serve(
    tmp_path: Path, store_url: str, fake: FakeAnthropic, clock: ManualClock, append_workers: int
) -> tuple[RunningServer, Client]:
    settings = Settings(
        addr="127.0.0.1:0",
        data_dir=tmp_path / "data",
        store=store_url,
        anthropic_base_url=fake.base_url,
        summary_timeout_seconds=60.0,
        sweep_interval_seconds=0,
        workers=1,
        append_workers=append_workers,
    )
    server = create_server(settings, clock=clock)
    return server, connect(f"127.0.0.1:{server.port}")


def test_an_append_is_served_while_a_summary_holds_every_other_thread(
    tmp_path: Path,
    fake: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    clock: ManualClock,
    store_url: str,
) -> None:
    """One handler thread for everything but appends, held by a build waiting on the
    LLM: an append still completes (on the appends' own thread) before the summary is
    released, and the build then completes too."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    server, client = _serve(tmp_path, store_url, fake, clock, append_workers=1)
    try:
        client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
        with summary_in_flight(client, fake, "## Goal\nkeep going") as outcome:
            # The server's one other thread waits on the LLM; a bounded deadline turns a
            # wait for it into DEADLINE_EXCEEDED rather than a hang.
            appended = client.stub.AppendMessages(
                pb.AppendMessagesRequest(
                    agent="a1", thread="t2", messages=[pb.Message(role=USER, content="still here")]
                ),
                timeout=20,
            )
            assert len(appended.receipts) == 1
            assert not outcome  # the summary was still held
        assert any(m.is_summary for m in outcome["response"].messages)
    finally:
        client.channel.close()
        server.stop(grace=1)


def test_zero_append_workers_serve_appends_on_the_server_pool(
    tmp_path: Path, fake: FakeAnthropic, clock: ManualClock, store_url: str
) -> None:
    """`--append-workers 0`: no pool of their own; appends are served all the same."""
    server, client = _serve(tmp_path, store_url, fake, clock, append_workers=0)
    try:
        assert server.append_workers is None
        client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
        assert len(client.append("a1", "one", "two").receipts) == 2
    finally:
        client.channel.close()
        server.stop(grace=1)


def _policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(task)) for task in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(sys.platform != "linux", reason="Linux scheduling policies")
@pytest.mark.parametrize(
    ("env", "policy", "named"),
    [({}, "SCHED_BATCH", "batch"), ({"CONTEXTD_SCHEDULING": "normal"}, "SCHED_OTHER", "normal")],
    ids=["default-batch", "normal"],
)
def test_a_served_process_runs_every_thread_under_its_scheduling_policy(
    spawn_server: SpawnServer, env: dict[str, str], policy: str, named: str
) -> None:
    """Every thread, those started after serving began too (handler threads start on
    the first calls), runs under the policy, and the serving line names it."""
    process = spawn_server(extra_env=env)
    client = process.start()
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    client.append("a1", "hello")
    client.stub.BuildContext(pb.BuildContextRequest(agent="a1", thread="t1"))
    assert process.proc is not None
    assert _policies(process.proc.pid) == {getattr(os, policy)}
    assert f'"scheduling": "{named}"' in process.log()
    client.channel.close()
    assert process.signal(15) == 0
