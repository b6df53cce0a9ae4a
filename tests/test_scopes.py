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
