"""Time, order and ids (docs/api.md, "Time, order and the rolling window"), over the real
server and a real DuckDB file, on an injected clock.

The server stamps every message with its own commit time; a client's `source_time` is
kept, decides the message's age for the window, and never moves the server's clock or
the order. A thread's messages are numbered 1, 2, 3, ... in append order. Ids are never
reused. Every reader of a window applies one definition of it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from google.protobuf import field_mask_pb2

from conftest import Client, SpawnServer, connect, span, ts
from contextd.api.server import create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.domain.window import WindowSpec, window_spec
from contextd.v1 import context_service_pb2 as pb

SECOND = 1_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
DAY = 24 * HOUR


def _build(client: Client, thread: str = "t1", agent: str = "a1") -> pb.BuildContextResponse:
    response: pb.BuildContextResponse = client.stub.BuildContext(
        pb.BuildContextRequest(agent=agent, thread=thread)
    )
    return response


def _stats(client: Client, thread: str = "t1", agent: str = "a1") -> pb.ContextStats:
    stats: pb.ContextStats = client.stub.GetContextStats(
        pb.GetContextStatsRequest(agent=agent, thread=thread)
    ).stats
    return stats


def _every_reader(client: Client, thread: str = "t1") -> dict[str, list[str]]:
    """The window of a thread as each reader sees it: ListMessages of the thread and of
    all threads, BuildContext, and GetContextStats (its count, as a list of that many)."""
    built = [m.content for m in _build(client, thread).messages]
    everything = client.list_messages("a1")
    return {
        "thread": client.contents(client.window("a1", thread=thread)),
        "all threads": [m.content for m in everything if m.thread == thread],
        "build": built,
        "stats": ["?"] * _stats(client, thread).window_message_count,
    }


def _assert_every_reader_sees(client: Client, expected: list[str], thread: str = "t1") -> None:
    seen = _every_reader(client, thread)
    assert seen["thread"] == seen["all threads"] == seen["build"] == expected, seen
    assert len(seen["stats"]) == len(expected)


# ----------------------------------------------------------------- the window's definition


@pytest.mark.parametrize(
    ("create", "source", "inside"),
    [
        (101, None, True),  # committed after the clear, own time recent
        (100, None, False),  # committed at the marker: cleared
        (101, 50, True),  # source before the clear: the clear compares commits only
        (101, 10, False),  # source at the age limit: too old
        (101, 11, True),  # one microsecond later: inside
        (99, 150, False),  # committed before the clear, whatever its source says
    ],
)
def test_the_window_predicate(create: int, source: int | None, inside: bool) -> None:
    window = window_spec(now_us=1_010, rolling_window_us=1_000, agent_clear_us=100)
    assert window == WindowSpec(clear_after_us=100, age_after_us=10)
    assert window.holds(create, source) is inside


def test_a_threads_own_clear_applies_when_it_is_later() -> None:
    agent = WindowSpec(clear_after_us=100, age_after_us=10)
    assert agent.with_thread_clear(None) == agent
    assert agent.with_thread_clear(50) == agent
    assert agent.with_thread_clear(200) == WindowSpec(200, 10)


# ----------------------------------------------------------------- client times


def test_a_message_stamped_before_the_agents_creation_is_in_every_context(
    client: Client,
) -> None:
    """Its source_time is a second before the agent existed; it was appended after, so
    it is in the window of every reader (it used to be acknowledged and never seen)."""
    agent = client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1"))).agent
    early = ts(agent.create_time.ToMicroseconds() - SECOND)
    receipt = client.append("a1", "said before", source_time=early).receipts[0]
    assert receipt.create_time.ToMicroseconds() > agent.create_time.ToMicroseconds()
    _assert_every_reader_sees(client, ["said before"])
    [message] = client.window("a1")
    assert message.source_time == early and message.create_time == receipt.create_time
    [built] = _build(client).messages
    assert (built.source_time, built.create_time, built.sequence) == (
        early,
        receipt.create_time,
        1,
    )
    client.append("a1", "elsewhere", thread="t2")
    assert "- t1: 1 messages" in _build(client, "t2").status  # the status preamble's view


def test_a_message_stamped_before_a_clear_and_appended_after_it_is_in_the_window(
    client: Client,
) -> None:
    client.append("a1", "old")
    marker = client.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    client.append("a1", "late report", source_time=ts(marker.ToMicroseconds() - SECOND))
    _assert_every_reader_sees(client, ["late report"])
    thread_marker = client.stub.ClearContext(
        pb.ClearContextRequest(agent="a1", thread="t1")
    ).clear_time
    client.append("a1", "later report", source_time=ts(thread_marker.ToMicroseconds() - 1))
    _assert_every_reader_sees(client, ["later report"])


def test_a_client_clock_ahead_moves_nothing(client: Client, clock: ManualClock) -> None:
    """One client's clock 4 minutes ahead (within the allowed skew): its message keeps
    that source_time, but other agents' commits and clear markers stay on the server's
    clock, and a correctly stamped message appended after a clear is in the window (all
    of it used to move 4 minutes into the future, hiding that message)."""
    now = clock.now_us()
    ahead = ts(now + 4 * MINUTE)
    fast = client.append("a1", "fast clock", source_time=ahead).receipts[0]
    other = client.append("a2", "other agent").receipts[0]
    assert fast.create_time.ToMicroseconds() - now < SECOND
    assert other.create_time.ToMicroseconds() - now < SECOND
    marker = client.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    assert marker.ToMicroseconds() - now < SECOND
    client.append("a1", "on time", source_time=ts(clock.now_us()))
    _assert_every_reader_sees(client, ["on time"])
    [stored] = [m for m in client.history("a1") if m.content == "fast clock"]
    assert stored.source_time == ahead


def test_imported_history_older_than_the_window_is_history_only(
    client: Client, clock: ManualClock
) -> None:
    """History imported in order with its old source times is stored and listed with
    MESSAGE_RANGE_ALL, in append order; only what is younger than the rolling window
    (here one hour) is in the window, for every reader and for the status preamble."""
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1", rolling_window=span(HOUR)))
    )
    now = clock.now_us()
    imported = [
        pb.Message(role=pb.ROLE_USER, content=f"day {d}", source_time=ts(now - d * DAY))
        for d in (3, 2, 1)
    ]
    imported.append(pb.Message(role=pb.ROLE_USER, content="recent", source_time=ts(now - MINUTE)))
    client.stub.AppendMessages(pb.AppendMessagesRequest(agent="a1", thread="t1", messages=imported))
    client.append("a1", "old only", thread="t3", source_time=ts(now - DAY))
    _assert_every_reader_sees(client, ["recent"])
    history = client.history("a1")
    assert client.contents(history) == ["day 3", "day 2", "day 1", "recent"]
    assert [m.sequence for m in history] == [1, 2, 3, 4]
    stats = _stats(client)
    assert (stats.window_message_count, stats.total_message_count) == (1, 4)
    assert _stats(client, "t3").window_message_count == 0
    client.append("a1", "hello", thread="t2")
    status = _build(client, "t2").status
    assert "- t1: 1 messages" in status and "t3" not in status  # t3 has nothing inside
    clock.advance(HOUR)
    _assert_every_reader_sees(client, [])


# ----------------------------------------------------------------- order


def test_threads_are_numbered_in_append_order(client: Client) -> None:
    first = client.append("a1", "a", "b", "c").receipts
    other = client.append("a1", "x", thread="t2").receipts
    later = client.append("a1", "d").receipts
    assert [r.sequence for r in first] == [1, 2, 3]
    assert [r.sequence for r in other] == [1]
    assert [r.sequence for r in later] == [4]
    assert len({r.create_time.ToMicroseconds() for r in first}) == 1  # one commit time
    assert later[0].create_time.ToMicroseconds() > first[0].create_time.ToMicroseconds()
    assert [m.sequence for m in client.window("a1")] == [1, 2, 3, 4]
    assert [m.sequence for m in _build(client).messages] == [1, 2, 3, 4]
    threads = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    assert [(t.thread, t.last_sequence) for t in threads] == [("t1", 4), ("t2", 1)]


def test_source_times_never_change_the_order(client: Client, clock: ManualClock) -> None:
    """A thread is read in append order whatever its source times say; every thread of
    an agent together is read by commit time."""
    now = clock.now_us()
    client.append("a1", "second said, first sent", source_time=ts(now - 1 * MINUTE))
    client.append("a1", "first said, sent later", source_time=ts(now - 2 * MINUTE))
    client.append("a1", "other thread", thread="t2", source_time=ts(now - 3 * MINUTE))
    client.append("a1", "no source time")
    expected = ["second said, first sent", "first said, sent later", "no source time"]
    assert client.contents(client.window("a1")) == expected
    assert client.contents(client.list_messages("a1", thread="t1", page_size=1)) == expected
    assert [m.content for m in _build(client).messages] == expected
    assert client.contents(client.list_messages("a1")) == [
        *expected[:2],
        "other thread",
        expected[2],
    ]
    assert client.contents(client.list_messages("a1", page_size=1)) == client.contents(
        client.list_messages("a1")
    )


def test_a_summary_takes_the_next_number(client: Client) -> None:
    for i in range(30):
        client.append("a1", f"m{i} " + "words " * 50)
    summary = client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=100)
        )
    ).summary
    assert summary.is_summary and summary.sequence == 31
    after = client.append("a1", "after the summary").receipts[0]
    assert after.sequence == 32
    built = _build(client).messages
    assert built[0].is_summary and built[0].sequence == 31
    assert built[-1].content == "after the summary" and built[-1].sequence == 32
    sequences = [m.sequence for m in built[1:]]
    assert sequences == sorted(sequences)


# ----------------------------------------------------------------- paging


def test_paging_keeps_the_first_pages_window(client: Client, clock: ManualClock) -> None:
    """A window listing's token pins the first page's age limit and agent clear marker:
    later pages see that window even after a clear or as time passes."""
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1", rolling_window=span(10 * MINUTE)))
    )
    client.append("a1", "m0", "m1", "m2", "m3")
    first = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1", page_size=2))
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", all_scopes=True))
    clock.advance(10 * MINUTE)
    assert client.window("a1") == []
    rest = client.stub.ListMessages(
        pb.ListMessagesRequest(
            agent="a1", thread="t1", page_size=2, page_token=first.next_page_token
        )
    )
    assert client.contents([*first.messages, *rest.messages]) == ["m0", "m1", "m2", "m3"]
    assert rest.window_start_time == first.window_start_time


# ----------------------------------------------------------------- the clock and ids


def test_the_clock_starts_above_stored_times_after_a_restart(tmp_path: Path) -> None:
    """A server restarted on a wall clock an hour behind still stamps every write after
    everything stored, so a message appended after the last clear stays in the window."""
    settings = Settings(addr="127.0.0.1:0", data_dir=tmp_path / "data")
    start = 1_900_000_000 * SECOND
    running = create_server(settings, clock=ManualClock(start))
    client = connect(f"127.0.0.1:{running.port}")
    client.append("a1", "before")
    marker = client.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    client.channel.close()
    running.stop(grace=1)

    running = create_server(settings, clock=ManualClock(start - HOUR))
    client = connect(f"127.0.0.1:{running.port}")
    try:
        receipt = client.append("a1", "after").receipts[0]
        assert receipt.create_time.ToMicroseconds() > marker.ToMicroseconds()
        assert client.contents(client.window("a1")) == ["after"]
    finally:
        client.channel.close()
        running.stop(grace=1)


def test_ids_are_never_reused_after_delete_and_restart(spawn_server: SpawnServer) -> None:
    proc = spawn_server()
    client = proc.start()
    issued = [r.id for r in client.append("a1", "one", "two", "three").receipts]
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    client.channel.close()
    proc.kill9()  # no clean shutdown: the mark was committed with the append

    client = spawn_server().start()
    fresh = [r.id for r in client.append("a1", "again").receipts]
    assert min(fresh) > max(issued)
    assert client.contents(client.history("a1")) == ["again"]
    client.channel.close()


def test_ids_continue_above_the_mark_after_a_clean_restart(spawn_server: SpawnServer) -> None:
    proc = spawn_server()
    client = proc.start()
    issued = [r.id for r in client.append("a1", "one", "two").receipts]
    client.append("b1", "kept")
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    client.channel.close()
    assert proc.signal(signal.SIGTERM) == 0
    client = spawn_server().start()
    fresh = client.append("a1", "again").receipts[0]
    assert fresh.id > max(issued) and fresh.sequence == 1
    client.channel.close()


def test_update_of_the_rolling_window_applies_to_source_times(
    client: Client, clock: ManualClock
) -> None:
    """Shrinking the window ages messages out by their own time."""
    now = clock.now_us()
    client.append("a1", "an hour ago", source_time=ts(now - HOUR))
    client.append("a1", "a minute ago", source_time=ts(now - MINUTE))
    assert client.contents(client.window("a1")) == ["an hour ago", "a minute ago"]
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", rolling_window=span(30 * MINUTE)),
            update_mask=field_mask_pb2.FieldMask(paths=["rolling_window"]),
        )
    )
    _assert_every_reader_sees(client, ["a minute ago"])
