"""Seed 000's groups "Message persistence", "Rolling window" and "Clear", over gRPC,
plus the window semantics the foundation issue fixes (boundaries, equal timestamps,
several clears, thread versus agent clears, history outside the window)."""

from __future__ import annotations

import json

from google.protobuf import field_mask_pb2

from conftest import (
    ASSISTANT,
    TOOL_RESULT,
    TOOL_USE,
    USER,
    Client,
    InProcessServer,
    db_rows,
    span,
    ts,
)
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb

MINUTE = 60 * 1_000_000
DAY = 86_400 * 1_000_000


# ----------------------------------------------------------------- message persistence


def test_message_persisted_to_sqlite(server: InProcessServer) -> None:
    # The seed says SQLite; contextd persists to DuckDB. The row must be in the file.
    server.client.append("a1", "remember me")
    rows = db_rows(server.running.store, "SELECT content FROM messages")
    assert rows == [("remember me",)]


def test_message_includes_agent_name_and_thread_id(client: Client) -> None:
    client.append("a1", "in t7", thread="t7")
    [message] = client.window("a1", thread="t7")
    assert (message.agent, message.thread, message.tenant) == ("a1", "t7", "default")


def test_message_includes_timestamp(client: Client, clock: ManualClock) -> None:
    before = clock.now_us()
    receipt = client.append("a1", "when?").receipts[0]
    assert before < receipt.create_time.ToMicroseconds() <= clock.now_us()
    [message] = client.window("a1")
    assert message.create_time == receipt.create_time
    assert not message.HasField("source_time")  # the client gave none


def test_messages_queryable_by_agent(client: Client) -> None:
    client.append("a1", "one", thread="x")
    client.append("a1", "two", thread="y")
    client.append("a2", "other agent", thread="x")
    assert client.contents(client.list_messages("a1")) == ["one", "two"]  # all threads of a1
    assert client.contents(client.list_messages("a2")) == ["other agent"]


def test_all_fields_round_trip(client: Client) -> None:
    calls = json.dumps([{"id": "c1", "name": "grep", "input": {"q": "x"}}])
    client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent="a1",
            thread="t1",
            create_agent_if_missing=True,
            messages=[
                pb.Message(
                    role=TOOL_USE,
                    content="",
                    tool_calls=calls,
                    external_id="discord:42",
                    metadata='{"model": "m"}',
                ),
                pb.Message(role=TOOL_RESULT, content="3 matches", tool_call_id="c1"),
            ],
        )
    )
    use, result = client.window("a1")
    assert (use.role, use.tool_calls, use.external_id, use.metadata) == (
        TOOL_USE,
        calls,
        "discord:42",
        '{"model": "m"}',
    )
    assert (result.role, result.tool_call_id, result.content) == (TOOL_RESULT, "c1", "3 matches")


def test_token_estimate_counts_unicode_scalar_values(client: Client) -> None:
    receipts = client.append("a1", "abcde", "你好世界你", "🙂🙂🙂🙂🙂🙂🙂🙂🙂").receipts
    # (scalar values + 3) // 4, per seed 004 — bytes would give 2, 4 and 9.
    assert [r.token_estimate for r in receipts] == [2, 2, 3]
    assert [m.token_estimate for m in client.window("a1")] == [2, 2, 3]


def test_append_returns_ids_in_request_order(client: Client) -> None:
    receipts = client.append("a1", "a", "b", "c").receipts
    ids = [r.id for r in receipts]
    assert ids == sorted(ids) and len(set(ids)) == 3
    assert [m.id for m in client.window("a1")] == ids


def test_append_to_unknown_agent_creates_it_with_defaults(client: Client) -> None:
    client.append("fresh", "hi")
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="fresh")).agent
    assert agent.rolling_window.ToSeconds() == 86_400
    assert agent.system_prompt == "" and list(agent.docs) == []
    assert agent.last_clear_time == agent.create_time
    # The message that created the agent is inside its window.
    assert client.contents(client.window("fresh")) == ["hi"]


# ----------------------------------------------------------------- rolling window


def test_rolling_window_returns_messages_within_window(client: Client) -> None:
    client.append("a1", "one", "two")
    client.append("a1", "three")
    assert client.contents(client.window("a1")) == ["one", "two", "three"]


def test_rolling_window_excludes_old_messages(client: Client, clock: ManualClock) -> None:
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1", rolling_window=span(10 * MINUTE)))
    )
    client.append("a1", "old")
    clock.advance(10 * MINUTE)
    client.append("a1", "new")
    assert client.contents(client.window("a1")) == ["new"]
    assert client.contents(client.history("a1")) == ["old", "new"]


def test_rolling_window_default_is_one_day(client: Client, clock: ManualClock) -> None:
    agent = client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1"))).agent
    assert agent.rolling_window.ToSeconds() == 86_400
    resp = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1"))
    # window_start_time is the window's age limit; the clear marker is the agent's own.
    assert resp.window_start_time.ToMicroseconds() == clock.now_us() - DAY


def test_rolling_window_configurable(client: Client, clock: ManualClock) -> None:
    client.append("a1", "old")
    clock.advance(10 * MINUTE)
    client.append("a1", "new")
    assert client.contents(client.window("a1")) == ["old", "new"]
    client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", rolling_window=span(5 * MINUTE)),
            update_mask=field_mask_pb2.FieldMask(paths=["rolling_window"]),
        )
    )
    assert client.contents(client.window("a1")) == ["new"]
    stats = client.stub.GetContextStats(pb.GetContextStatsRequest(agent="a1", thread="t1")).stats
    assert stats.rolling_window.ToMicroseconds() == 5 * MINUTE
    assert (stats.window_message_count, stats.total_message_count) == (1, 2)


def test_window_boundaries_are_exclusive(client: Client, clock: ManualClock) -> None:
    """The clear marker bounds commit times: a message appended after a clear is in,
    whatever source_time it carries (even exactly the marker). The age limit bounds a
    message's own time: exactly now - rolling window is out, one microsecond later in."""
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1", rolling_window=span(10 * MINUTE)))
    )
    client.append("a1", "before")
    marker = client.stub.ClearContext(
        pb.ClearContextRequest(agent="a1")
    ).clear_time.ToMicroseconds()
    client.append("a1", "stamped at the marker", source_time=ts(marker))
    limit = marker + MINUTE
    client.append("a1", "at the age limit", source_time=ts(limit))
    client.append("a1", "just inside", source_time=ts(limit + 1))
    assert client.contents(client.window("a1")) == [
        "stamped at the marker",
        "at the age limit",
        "just inside",
    ]
    clock.set(limit + 10 * MINUTE)  # now - rolling window == limit
    resp = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1"))
    assert resp.window_start_time.ToMicroseconds() == limit
    assert client.contents(list(resp.messages)) == ["just inside"]
    assert len(client.history("a1")) == 4


def test_equal_timestamps_keep_insertion_order(client: Client) -> None:
    client.append("a1", "warm-up")
    same = client.append("a1", *[f"m{i}" for i in range(20)]).receipts
    assert len({r.create_time.ToMicroseconds() for r in same}) == 1
    t = same[0].create_time.ToMicroseconds()
    client.append("a1", "imported", source_time=ts(t))  # equal time, appended later
    expected = ["warm-up", *[f"m{i}" for i in range(20)], "imported"]
    assert client.contents(client.window("a1")) == expected
    # Paging through equal timestamps neither skips nor repeats.
    paged = client.list_messages("a1", thread="t1", page_size=3)
    assert client.contents(paged) == expected


def test_history_outside_window_stays_queryable(client: Client) -> None:
    client.append("a1", "first")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    client.append("a1", "second")
    assert client.contents(client.window("a1")) == ["second"]
    assert client.contents(client.history("a1")) == ["first", "second"]


# ----------------------------------------------------------------- clear


def test_clear_advances_last_clear_time(client: Client) -> None:
    created = client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1"))).agent
    marker = client.stub.ClearContext(
        pb.ClearContextRequest(agent="a1", all_scopes=True)
    ).clear_time
    assert marker.ToMicroseconds() > created.last_clear_time.ToMicroseconds()
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent
    assert agent.last_clear_time == marker


def test_clear_excludes_messages_before_clear_time(client: Client) -> None:
    client.append("a1", "a", "b")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    assert client.window("a1") == []


def test_clear_does_not_delete_messages_from_db(server: InProcessServer) -> None:
    server.client.append("a1", "a", "b")
    server.client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    assert db_rows(server.running.store, "SELECT count(*) FROM messages") == [(2,)]


def test_messages_after_clear_are_included(client: Client) -> None:
    client.append("a1", "before")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    client.append("a1", "after")
    assert client.contents(client.window("a1")) == ["after"]


def test_multiple_clears_use_most_recent(client: Client) -> None:
    client.append("a1", "one")
    first = client.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    client.append("a1", "two")
    second = client.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    client.append("a1", "three")
    assert second.ToMicroseconds() > first.ToMicroseconds()
    assert client.contents(client.window("a1")) == ["three"]


def test_agent_clear_applies_to_all_threads_and_new_threads(client: Client) -> None:
    client.append("a1", "x1", thread="x")
    client.append("a1", "y1", thread="y")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    client.append("a1", "z1", thread="z")
    assert client.window("a1", thread="x") == []
    assert client.window("a1", thread="y") == []
    assert client.contents(client.window("a1", thread="z")) == ["z1"]


def test_thread_clear_leaves_other_threads(client: Client) -> None:
    client.append("a1", "x1", thread="x")
    client.append("a1", "y1", thread="y")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="x"))
    client.append("a1", "x2", thread="x")
    assert client.contents(client.window("a1", thread="x")) == ["x2"]
    assert client.contents(client.window("a1", thread="y")) == ["y1"]
    # Listing every thread applies each thread's own marker.
    assert client.contents(client.list_messages("a1")) == ["y1", "x2"]
    threads = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    assert [t.HasField("last_clear_time") for t in threads] == [True, False]


def test_latest_of_thread_and_agent_clear_wins(client: Client) -> None:
    client.append("a1", "x1", thread="x")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="x"))
    client.append("a1", "x2", thread="x")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))  # later agent clear wins
    client.append("a1", "x3", thread="x")
    assert client.contents(client.window("a1", thread="x")) == ["x3"]
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="x"))  # thread wins
    client.append("a1", "x4", thread="x")
    assert client.contents(client.window("a1", thread="x")) == ["x4"]
    stats = client.stub.GetContextStats(pb.GetContextStatsRequest(agent="a1", thread="x")).stats
    assert (stats.window_message_count, stats.total_message_count) == (1, 4)


def test_scopes_are_isolated(client: Client) -> None:
    client.append("a1", "guild-a", scope="guild:1/channel:2/user:3", thread="main")
    client.append("a1", "dm", scope="dm:3", thread="main")
    assert client.contents(
        client.window("a1", thread="main", scope="guild:1/channel:2/user:3")
    ) == ["guild-a"]
    assert client.contents(client.window("a1", thread="main", scope="dm:3")) == ["dm"]
    assert client.window("a1", thread="main") == []  # the default scope holds nothing


# ----------------------------------------------------------------- threads and stats


def test_thread_metadata_kept_current_on_every_append(client: Client) -> None:
    first = client.append("a1", "abcd", thread="t").receipts[0]
    last = client.append("a1", "abcdefgh", "x", thread="t").receipts[-1]
    [thread] = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    assert thread.message_count == 3
    assert thread.token_estimate == 1 + 2 + 1
    assert thread.create_time == first.create_time
    assert thread.last_message_time == last.create_time


def test_list_threads_pages_by_name(client: Client) -> None:
    for name in ["c", "a", "b", "e", "d"]:
        client.append("a1", "m", thread=name)
    names: list[str] = []
    token = ""
    while True:
        resp = client.stub.ListThreads(
            pb.ListThreadsRequest(agent="a1", page_size=2, page_token=token)
        )
        names += [t.thread for t in resp.threads]
        token = resp.next_page_token
        if not token:
            break
    assert names == ["a", "b", "c", "d", "e"]


def test_context_stats_for_agent_and_thread(client: Client, clock: ManualClock) -> None:
    client.append("a1", "abcd", "abcdefgh", thread="x")  # 1 + 2 tokens
    marker = client.stub.ClearContext(pb.ClearContextRequest(agent="a1")).clear_time
    newest = client.append("a1", "abcdefghijkl", thread="y").receipts[0]  # 3 tokens
    stats = client.stub.GetContextStats(pb.GetContextStatsRequest(agent="a1")).stats
    assert (stats.window_message_count, stats.window_token_estimate) == (1, 3)
    assert (stats.total_message_count, stats.total_token_estimate) == (3, 6)
    assert stats.thread_count == 2
    assert stats.newest_message_time == newest.create_time
    assert stats.oldest_message_time.ToMicroseconds() < newest.create_time.ToMicroseconds()
    x = client.stub.GetContextStats(pb.GetContextStatsRequest(agent="a1", thread="x")).stats
    assert (x.window_message_count, x.total_message_count, x.thread_count) == (0, 2, 1)
    assert x.window_start_time.ToMicroseconds() == clock.now_us() - DAY
    assert x.last_clear_time == marker


def test_assistant_messages_are_listed_with_their_role(client: Client) -> None:
    client.append("a1", "q")
    client.append("a1", "a", role=ASSISTANT)
    assert [m.role for m in client.window("a1")] == [USER, ASSISTANT]


def test_a_clear_after_a_future_dated_message_hides_it(client: Client, clock: ManualClock) -> None:
    """A client may date a message slightly ahead of the server's clock (within the
    allowed skew); a clear that follows still hides it: clears compare commit times."""
    ahead = clock.now_us() + MINUTE
    receipt = client.append("a1", "from the future", source_time=ts(ahead)).receipts[0]
    assert receipt.create_time.ToMicroseconds() < ahead  # stamped by the server's clock
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    assert client.window("a1") == []
    client.append("a1", "after the clear")
    assert client.contents(client.window("a1")) == ["after the clear"]
