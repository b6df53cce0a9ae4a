"""Typed scopes: a user in a guild's channel, a user's DMs, or a free-form key; the
default scope is a scope of its own, and no kind falls back to another."""

from __future__ import annotations

import grpc
import pytest

from conftest import Client
from contextd.v1 import context_service_pb2 as pb

CHANNEL = pb.Scope(channel=pb.ChannelScope(guild_id="1", channel_id="2", user_id="3"))
DM = pb.Scope(direct_message=pb.DirectMessageScope(user_id="3"))
KEY = pb.Scope(key="3")
DEFAULT = pb.Scope()


def _append(client: Client, scope: pb.Scope, text: str) -> None:
    client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent="a1",
            scope=scope,
            thread="main",
            messages=[pb.Message(role=pb.ROLE_USER, content=text)],
            create_agent_if_missing=True,
        )
    )


def _window(client: Client, scope: pb.Scope) -> list[str]:
    response = client.stub.ListMessages(
        pb.ListMessagesRequest(agent="a1", scope=scope, thread="main")
    )
    return [m.content for m in response.messages]


def test_look_alike_scopes_never_share_messages(client: Client) -> None:
    for scope, text in ((CHANNEL, "channel"), (DM, "dm"), (KEY, "key"), (DEFAULT, "default")):
        _append(client, scope, text)
    assert _window(client, CHANNEL) == ["channel"]
    assert _window(client, DM) == ["dm"]
    assert _window(client, KEY) == ["key"]
    assert _window(client, DEFAULT) == ["default"]
    # Another user in the same channel, or the same user in another channel: empty.
    other_user = pb.Scope(channel=pb.ChannelScope(guild_id="1", channel_id="2", user_id="4"))
    other_channel = pb.Scope(channel=pb.ChannelScope(guild_id="1", channel_id="9", user_id="3"))
    assert _window(client, other_user) == [] and _window(client, other_channel) == []


def test_messages_report_their_typed_scope(client: Client) -> None:
    _append(client, CHANNEL, "hello")
    _append(client, DM, "psst")
    response = client.stub.ListMessages(
        pb.ListMessagesRequest(agent="a1", scope=CHANNEL, thread="main")
    )
    assert response.messages[0].scope == CHANNEL
    response = client.stub.ListMessages(pb.ListMessagesRequest(agent="a1", scope=DM, thread="main"))
    assert response.messages[0].scope == DM
    threads = client.stub.ListThreads(pb.ListThreadsRequest(agent="a1", scope=DM)).threads
    assert [t.scope for t in threads] == [DM]


@pytest.mark.parametrize(
    ("scope", "field"),
    [
        (pb.Scope(key="guild:1/channel:2/user:3"), "scope.key"),
        (pb.Scope(key="dm:3"), "scope.key"),
        (pb.Scope(key="bad key"), "scope.key"),
        (pb.Scope(channel=pb.ChannelScope(guild_id="1", channel_id="2")), "scope.channel.user_id"),
        (
            pb.Scope(channel=pb.ChannelScope(guild_id="a/b", channel_id="2", user_id="3")),
            "guild_id",
        ),
        (pb.Scope(direct_message=pb.DirectMessageScope(user_id="")), "user_id"),
        (pb.Scope(direct_message=pb.DirectMessageScope(user_id="u" * 65)), "user_id"),
    ],
)
def test_malformed_scopes_are_invalid_argument(client: Client, scope: pb.Scope, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _append(client, scope, "x")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")


def _clear(client: Client, **fields: object) -> None:
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", **fields))  # type: ignore[arg-type]


def test_a_clear_empties_only_the_scope_it_names(client: Client) -> None:
    for scope, text in ((CHANNEL, "channel"), (DM, "dm"), (DEFAULT, "default")):
        _append(client, scope, text)
    _clear(client, scope=CHANNEL)
    assert _window(client, CHANNEL) == []
    assert _window(client, DM) == ["dm"] and _window(client, DEFAULT) == ["default"]
    _clear(client)  # no scope: the default scope, and only it
    assert _window(client, DEFAULT) == [] and _window(client, DM) == ["dm"]
    _append(client, CHANNEL, "after")
    assert _window(client, CHANNEL) == ["after"]


def test_all_scopes_clears_every_scope(client: Client) -> None:
    for scope, text in ((CHANNEL, "channel"), (DM, "dm"), (DEFAULT, "default")):
        _append(client, scope, text)
    _clear(client, all_scopes=True)
    assert _window(client, CHANNEL) == _window(client, DM) == _window(client, DEFAULT) == []
    agent = client.stub.GetAgent(pb.GetAgentRequest(name="a1")).agent
    assert agent.last_clear_time.ToMicroseconds() > 0


@pytest.mark.parametrize(
    ("fields", "field"), [({"scope": DM}, "scope"), ({"thread": "t"}, "thread")]
)
def test_all_scopes_with_a_narrower_target_is_invalid_argument(
    client: Client, fields: dict[str, object], field: str
) -> None:
    _append(client, DM, "dm")
    with pytest.raises(grpc.RpcError) as info:
        _clear(client, all_scopes=True, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")
    assert _window(client, DM) == ["dm"]


def _events(client: Client, scope: pb.Scope, thread: str = "") -> list[pb.Event]:
    response = client.stub.ListEvents(pb.ListEventsRequest(agent="a1", scope=scope, thread=thread))
    return list(response.events)


def test_events_are_listed_per_scope(client: Client) -> None:
    for scope in (DM, CHANNEL):
        for i in range(14):
            _append(client, scope, f"message {i} " + "x" * 400)
        client.stub.CompactContext(
            pb.CompactContextRequest(
                agent="a1",
                scope=scope,
                thread="main",
                options=pb.BuildOptions(keep_recent_tokens=1),
            )
        )
    dm_events, channel_events = _events(client, DM), _events(client, CHANNEL)
    assert len(dm_events) >= 1 and len(channel_events) >= 1
    assert all(e.scope == DM for e in dm_events)
    assert all(e.scope == CHANNEL for e in channel_events)
    assert _events(client, DEFAULT) == []
    assert _events(client, DM, thread="other") == []
