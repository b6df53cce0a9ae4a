"""Agent CRUD and every bad-input case of the foundation issue, checked by status code."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import USER, Client, InProcessServer, scope_pb, ts
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb


def _error(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


def _code(call: object) -> grpc.StatusCode:
    code: grpc.StatusCode = _error(call).code()
    return code


def _append(
    client: Client, *messages: pb.Message, agent: str = "a1", thread: str = "t1", scope: str = ""
) -> pb.AppendMessagesResponse:
    response: pb.AppendMessagesResponse = client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            messages=list(messages),
            create_agent_if_missing=True,
        )
    )
    return response


def _count(client: Client) -> int:
    return sum(
        t.message_count for t in client.stub.ListThreads(pb.ListThreadsRequest(agent="a1")).threads
    )


# ----------------------------------------------------------------- CRUD


def test_create_get_update_delete_agent(client: Client) -> None:
    created = client.stub.CreateAgent(
        pb.CreateAgentRequest(
            agent=pb.Agent(
                name="writer",
                system_prompt="You write.",
                docs=[pb.AgentDoc(name="style.md", content="Be brief.")],
            )
        )
    ).agent
    assert (created.system_prompt, created.docs[0].content) == ("You write.", "Be brief.")
    assert created.tenant == "default"
    got = client.stub.GetAgent(pb.GetAgentRequest(name="writer")).agent
    assert got == created
    updated = client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(
                name="writer",
                system_prompt="You edit.",
                rolling_window=duration_pb2.Duration(seconds=60),
            ),
            update_mask=field_mask_pb2.FieldMask(paths=["system_prompt"]),
        )
    ).agent
    assert updated.system_prompt == "You edit."
    assert updated.rolling_window.ToSeconds() == 86_400  # not in the mask: unchanged
    assert list(updated.docs) == list(created.docs)
    assert updated.update_time.ToMicroseconds() > created.update_time.ToMicroseconds()
    client.append("writer", "m1", "m2")
    deleted = client.stub.DeleteAgent(pb.DeleteAgentRequest(name="writer"))
    assert deleted.deleted_message_count == 2
    assert (
        _code(lambda: client.stub.GetAgent(pb.GetAgentRequest(name="writer")))
        == grpc.StatusCode.NOT_FOUND
    )
    # Re-creating the name starts from nothing: the history went with the agent.
    client.append("writer", "new life")
    assert client.contents(client.history("writer")) == ["new life"]


def _rich_agent(client: Client) -> pb.Agent:
    agent: pb.Agent = client.stub.CreateAgent(
        pb.CreateAgentRequest(
            agent=pb.Agent(
                name="a1",
                system_prompt="x",
                docs=[pb.AgentDoc(name="d.md", content="doc")],
                rolling_window=duration_pb2.Duration(seconds=600),
                model="gpt-4o",
                build_options=pb.BuildOptions(summarize=True, max_chars_per_message=99),
            )
        )
    ).agent
    return agent


def test_update_without_mask_changes_only_the_fields_set(client: Client) -> None:
    """Updating `model` alone used to wipe the system prompt, docs and window."""
    before = _rich_agent(client)
    after = client.stub.UpdateAgent(
        pb.UpdateAgentRequest(agent=pb.Agent(name="a1", model="gpt-4o-mini"))
    ).agent
    assert after.model == "gpt-4o-mini"
    assert after.system_prompt == "x" and list(after.docs) == list(before.docs)
    assert after.rolling_window.seconds == 600
    assert after.build_options == before.build_options
    # One build option set: only that option changes.
    after = client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", build_options=pb.BuildOptions(truncate=False))
        )
    ).agent
    assert after.build_options == pb.BuildOptions(
        summarize=True, max_chars_per_message=99, truncate=False
    )


def test_update_mask_paths_name_nested_options_and_star(client: Client) -> None:
    _rich_agent(client)
    after = client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", build_options=pb.BuildOptions(summarize=False)),
            update_mask=field_mask_pb2.FieldMask(
                paths=["build_options.summarize", "build_options.max_chars_per_message"]
            ),
        )
    ).agent
    # Named and set: updated; named and unset: back to the default (unset).
    assert after.build_options == pb.BuildOptions(summarize=False)
    assert after.system_prompt == "x"
    after = client.stub.UpdateAgent(
        pb.UpdateAgentRequest(
            agent=pb.Agent(name="a1", system_prompt="y"),
            update_mask=field_mask_pb2.FieldMask(paths=["*"]),
        )
    ).agent
    assert (after.system_prompt, list(after.docs), after.model) == ("y", [], "")
    assert after.rolling_window.seconds == 86_400 and after.build_options == pb.BuildOptions()


def test_etags_guard_updates_and_deletes(client: Client) -> None:
    first = _rich_agent(client)
    assert first.etag
    assert client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent.etag == first.etag
    second = client.stub.UpdateAgent(
        pb.UpdateAgentRequest(agent=pb.Agent(name="a1", system_prompt="y", etag=first.etag))
    ).agent
    assert second.etag != first.etag
    stale = _error(
        lambda: client.stub.UpdateAgent(
            pb.UpdateAgentRequest(agent=pb.Agent(name="a1", system_prompt="z", etag=first.etag))
        )
    )
    assert stale.code() == grpc.StatusCode.ABORTED
    assert client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent.system_prompt == "y"
    stale = _error(
        lambda: client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1", etag=first.etag))
    )
    assert stale.code() == grpc.StatusCode.ABORTED
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1", etag=second.etag))
    assert _code(lambda: client.stub.GetAgent(pb.GetAgentRequest(name="a1"))) == (
        grpc.StatusCode.NOT_FOUND
    )


def test_list_agents_pages(client: Client) -> None:
    for name in ["b", "a", "d", "c"]:
        client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name=name)))
    first = client.stub.ListAgents(pb.ListAgentsRequest(page_size=3))
    assert [a.name for a in first.agents] == ["a", "b", "c"] and first.next_page_token
    second = client.stub.ListAgents(
        pb.ListAgentsRequest(page_size=3, page_token=first.next_page_token)
    )
    assert [a.name for a in second.agents] == ["d"] and second.next_page_token == ""


def test_create_existing_agent_is_already_exists(client: Client) -> None:
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    assert (
        _code(lambda: client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1"))))
        == grpc.StatusCode.ALREADY_EXISTS
    )


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["", "x" * 129, "has space", "-leading", "ünï", "a\nb"])
def test_bad_agent_names_are_invalid_argument(client: Client, name: str) -> None:
    assert (
        _code(lambda: client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name=name))))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        _code(lambda: _append(client, pb.Message(role=USER, content="x"), agent=name))
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_bad_thread_and_scope_names_are_invalid_argument(client: Client) -> None:
    msg = pb.Message(role=USER, content="x")
    assert _code(lambda: _append(client, msg, thread="t" * 200)) == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        _code(lambda: _append(client, msg, scope="bad scope")) == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_longest_name_is_accepted(client: Client) -> None:
    response = _append(client, pb.Message(role=USER, content="x"), agent="a" * 128)
    assert len(response.receipts) == 1
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="a" * 128)).agent
    assert agent.name == "a" * 128


def test_unspecified_and_unknown_roles_are_invalid_argument(client: Client) -> None:
    error = _error(lambda: _append(client, pb.Message(content="no role")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role is required" in (error.details() or "")
    assert (
        _code(lambda: _append(client, pb.Message(role=99, content="x")))  # type: ignore[arg-type]
        == grpc.StatusCode.INVALID_ARGUMENT
    )


@pytest.mark.parametrize("seconds", [0, -5])
def test_non_positive_windows_are_invalid_argument(client: Client, seconds: int) -> None:
    window = duration_pb2.Duration(seconds=seconds)
    assert (
        _code(
            lambda: client.stub.CreateAgent(
                pb.CreateAgentRequest(agent=pb.Agent(name="a1", rolling_window=window))
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a2")))
    assert (
        _code(
            lambda: client.stub.UpdateAgent(
                pb.UpdateAgentRequest(
                    agent=pb.Agent(name="a2", rolling_window=window),
                    update_mask=field_mask_pb2.FieldMask(paths=["rolling_window"]),
                )
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_malformed_json_is_invalid_argument(client: Client) -> None:
    error = _error(lambda: _append(client, pb.Message(role=USER, tool_calls="[{oops")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].tool_calls is not valid JSON" in (error.details() or "")
    assert (
        _code(lambda: _append(client, pb.Message(role=USER, metadata="{")))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        _code(lambda: _append(client, pb.Message(role=USER, metadata="[1, 2]")))
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_message_over_size_limit_is_resource_exhausted(client: Client) -> None:
    error = _error(lambda: _append(client, pb.Message(role=USER, content="x" * (1 << 20) + "y")))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit is 1,048,576 bytes" in (error.details() or "")
    # Multi-byte characters count as their UTF-8 bytes.
    assert (
        _code(lambda: _append(client, pb.Message(role=USER, content="é" * 600_000)))
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    _append(client, pb.Message(role=USER, content="x" * (1 << 20)))  # exactly the limit


def test_rejected_batch_writes_nothing(client: Client) -> None:
    _append(client, pb.Message(role=USER, content="kept"))
    for bad in (
        pb.Message(role=USER, metadata="nope"),
        pb.Message(content="no role"),
        pb.Message(role=USER, content="x" * (2 << 20)),
    ):
        with pytest.raises(grpc.RpcError):
            _append(client, pb.Message(role=USER, content="good"), bad)
    assert client.contents(client.history("a1")) == ["kept"]
    assert _count(client) == 1


def test_empty_batch_is_invalid_argument(client: Client) -> None:
    assert _code(lambda: _append(client)) == grpc.StatusCode.INVALID_ARGUMENT


def test_source_time_more_than_5_minutes_ahead_is_invalid_argument(
    client: Client, clock: ManualClock
) -> None:
    """A source_time may lead the server's clock by 5 minutes (clock skew), not more;
    the error names the message's field and the batch writes nothing."""
    limit = clock.now_us() + 5 * 60 * 1_000_000
    ok = pb.Message(role=USER, content="at the limit", source_time=ts(limit))
    ahead = pb.Message(role=USER, content="beyond", source_time=ts(limit + 1))
    error = _error(lambda: _append(client, ok, ahead))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR))
    assert [v.field for v in bad.field_violations] == ["messages[1].source_time"]
    [receipt] = _append(client, ok).receipts
    assert receipt.create_time.ToMicroseconds() < limit  # kept, and the clock not moved
    assert _count(client) == 1  # the rejected batch wrote nothing


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.GetAgent(pb.GetAgentRequest(name="ghost")),
        lambda s: s.UpdateAgent(pb.UpdateAgentRequest(agent=pb.Agent(name="ghost"))),
        lambda s: s.DeleteAgent(pb.DeleteAgentRequest(name="ghost")),
        lambda s: s.ListMessages(pb.ListMessagesRequest(agent="ghost")),
        lambda s: s.ClearContext(pb.ClearContextRequest(agent="ghost")),
        lambda s: s.ListThreads(pb.ListThreadsRequest(agent="ghost")),
        lambda s: s.GetContextStats(pb.GetContextStatsRequest(agent="ghost")),
    ],
)
def test_unknown_agent_is_not_found(client: Client, call: object) -> None:
    error = _error(lambda: call(client.stub))  # type: ignore[operator]
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "agent 'ghost' does not exist" in (error.details() or "")


def test_unknown_thread_is_not_found(client: Client) -> None:
    _append(client, pb.Message(role=USER, content="x"))
    assert (
        _code(lambda: client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="nope")))
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        _code(
            lambda: client.stub.GetContextStats(
                pb.GetContextStatsRequest(agent="a1", thread="nope")
            )
        )
        == grpc.StatusCode.NOT_FOUND
    )


def test_bad_update_mask_is_invalid_argument(client: Client) -> None:
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    error = _error(
        lambda: client.stub.UpdateAgent(
            pb.UpdateAgentRequest(
                agent=pb.Agent(name="a1"), update_mask=field_mask_pb2.FieldMask(paths=["name"])
            )
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be updated: 'name'" in (error.details() or "")


def test_duplicate_doc_names_are_invalid_argument(client: Client) -> None:
    docs = [pb.AgentDoc(name="a.md", content="1"), pb.AgentDoc(name="a.md", content="2")]
    assert (
        _code(
            lambda: client.stub.CreateAgent(
                pb.CreateAgentRequest(agent=pb.Agent(name="a1", docs=docs))
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_bad_paging_is_invalid_argument(client: Client) -> None:
    _append(client, pb.Message(role=USER, content="x"))
    assert (
        _code(lambda: client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", page_size=-1)))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        _code(
            lambda: client.stub.ListMessages(
                pb.ListMessagesRequest(agent="a1", page_token="garbage!")
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    _append(client, pb.Message(role=USER, content="y"))
    token = client.stub.ListMessages(
        pb.ListMessagesRequest(agent="a1", page_size=1)
    ).next_page_token
    # A token is only valid with the parameters it was issued for.
    assert (
        _code(
            lambda: client.stub.ListMessages(
                pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1, page_token=token)
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_errors_carry_error_info_details(client: Client) -> None:
    error = _error(lambda: client.stub.GetAgent(pb.GetAgentRequest(name="ghost")))
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.domain, info.reason) == ("contextd", "AGENT_NOT_FOUND")


def test_batch_over_limit_is_resource_exhausted(tmp_path: object) -> None:
    from conftest import connect
    from contextd.api.server import create_server
    from contextd.config import Settings

    running = create_server(
        Settings(
            addr="127.0.0.1:0",
            data_dir=tmp_path / "d",  # type: ignore[operator]
            max_batch_messages=3,
        )
    )
    try:
        client = connect(f"127.0.0.1:{running.port}")
        assert (
            _code(lambda: _append(client, *[pb.Message(role=USER, content="x")] * 4))
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        _append(client, *[pb.Message(role=USER, content="x")] * 3)
        client.channel.close()
    finally:
        running.stop(grace=1)


def test_server_survives_bad_input(server: InProcessServer) -> None:
    for _ in range(20):
        with pytest.raises(grpc.RpcError):
            _append(server.client, pb.Message(content="bad"))
    _append(server.client, pb.Message(role=USER, content="still serving"))
    assert server.client.contents(server.client.window("a1")) == ["still serving"]


# ----------------------------------------------------------------- out-of-range values


def test_times_and_durations_out_of_range_are_invalid_argument(client: Client) -> None:
    from google.protobuf import timestamp_pb2

    year_10000 = timestamp_pb2.Timestamp(seconds=253_402_300_800)
    huge = duration_pb2.Duration(seconds=10**15)
    calls = [
        lambda: _append(client, pb.Message(role=USER, content="x", source_time=year_10000)),
        lambda: client.stub.CreateAgent(
            pb.CreateAgentRequest(agent=pb.Agent(name="a2", rolling_window=huge))
        ),
        lambda: client.stub.SetStatus(
            pb.SetStatusRequest(
                agent="a1",
                entry=pb.StatusEntry(key="k", kind=pb.STATUS_KIND_THREAD, state="s", summary="x"),
                ttl=huge,
            )
        ),
        lambda: client.stub.ListEvents(pb.ListEventsRequest(agent="a1", start_time=year_10000)),
    ]
    client.append("a1", "exists")
    for call in calls:
        error = _error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "out of range" in (error.details() or "")
    assert client.contents(client.history("a1")) == ["exists"]  # nothing else written


@pytest.mark.parametrize("position", [[], ["x", "y"], [1.5, 2], [1, 2, 3]])
def test_a_hand_edited_page_token_is_invalid_argument(client: Client, position: list) -> None:  # type: ignore[type-arg]
    import base64
    import json

    for i in range(3):
        client.append("a1", f"m{i}")
    first = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1))
    raw, _, signature = base64.urlsafe_b64decode(first.next_page_token).rpartition(b".")
    body = json.loads(raw)
    body["p"] = position
    forged = base64.urlsafe_b64encode(json.dumps(body).encode() + b"." + signature).decode()
    code = _code(
        lambda: client.stub.ListMessages(
            pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1, page_token=forged)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("agent", "field"),
    [
        (pb.Agent(name="a1", system_prompt="x" * (256 * 1024 + 1)), "agent.system_prompt"),
        (
            pb.Agent(name="a1", docs=[pb.AgentDoc(name=f"d{i}", content="x") for i in range(33)]),
            "agent.docs",
        ),
        (
            pb.Agent(
                name="a1",
                docs=[pb.AgentDoc(name=f"d{i}", content="x" * 300_000) for i in range(4)],
            ),
            "agent.docs",
        ),
    ],
)
def test_oversized_settings_are_resource_exhausted(
    client: Client, agent: pb.Agent, field: str
) -> None:
    """A 20 MiB doc used to be accepted and parsed on every GetAgent and ListAgents."""
    error = _error(lambda: client.stub.CreateAgent(pb.CreateAgentRequest(agent=agent)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert field in (error.details() or "")
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1")))
    error = _error(lambda: client.stub.UpdateAgent(pb.UpdateAgentRequest(agent=agent)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_oversized_user_message_is_resource_exhausted(client: Client) -> None:
    client.append("a1", "hi")
    request = pb.BuildContextRequest(agent="a1", thread="t1", user_message="x" * ((1 << 20) + 1))
    error = _error(lambda: client.stub.BuildContext(request))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "user_message" in (error.details() or "")
