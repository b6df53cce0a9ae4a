"""A run that must start clean (an agent run started from a chat) uses a scope of its own,
a key scope naming the run: its first build holds nothing stored of any other scope,
while the chat's scopes keep everything (docs/api.md, *Runs that start clean*)."""

from __future__ import annotations

from conftest import Client
from contextd.v1 import context_service_pb2 as pb

CHAT = pb.Scope(channel=pb.ChannelScope(guild_id="g1", channel_id="c1", user_id="u1"))
DM = pb.Scope(direct_message=pb.DirectMessageScope(user_id="u1"))
RUN = pb.Scope(key="run:7f3a")


def append(client: Client, scope: pb.Scope, thread: str, *texts: str) -> None:
    client.stub.AppendMessages(
        pb.AppendMessagesRequest(
            agent="bot",
            scope=scope,
            thread=thread,
            messages=[pb.Message(role=pb.ROLE_USER, content=t) for t in texts],
            create_agent_if_missing=True,
        )
    )


def build(client: Client, scope: pb.Scope, thread: str = "main") -> pb.BuildContextResponse:
    response: pb.BuildContextResponse = client.stub.BuildContext(
        pb.BuildContextRequest(
            agent="bot",
            scope=scope,
            thread=thread,
            user_message="do the task",
            formats=[pb.CONTEXT_FORMAT_TEXT, pb.CONTEXT_FORMAT_ANTHROPIC],
        )
    )
    return response


def stored(response: pb.BuildContextResponse) -> list[str]:
    """The stored messages of a build (the new user message has no id)."""
    return [m.content for m in response.messages if m.id]


def fill_chat(client: Client) -> None:
    client.stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="bot", system_prompt="You are a bot."))
    )
    append(client, CHAT, "main", "chat secret one", "chat secret two")
    append(client, CHAT, "other", "chat secret three")
    append(client, DM, "main", "dm secret")
    client.stub.SetStatus(
        pb.SetStatusRequest(
            agent="bot",
            scope=CHAT,
            entry=pb.StatusEntry(
                key="deploy", kind=pb.STATUS_KIND_PROCESS, state="running", summary="chat secret"
            ),
        )
    )


def test_a_run_in_a_scope_of_its_own_starts_with_an_empty_context(client: Client) -> None:
    fill_chat(client)
    first = build(client, RUN)
    assert stored(first) == [] and first.status == ""
    assert first.system_prompt == "You are a bot."  # the agent's settings, nothing stored
    assert "secret" not in str(first)
    assert first.stats.messages_before == 0
    append(client, RUN, "main", "run step 1")
    assert stored(build(client, RUN)) == ["run step 1"]
    # The chat's scopes keep their windows, and never see the run.
    chat = client.list_messages("bot", scope=CHAT)
    assert sorted(m.content for m in chat) == [
        "chat secret one",
        "chat secret three",
        "chat secret two",
    ]
    assert [m.content for m in client.list_messages("bot", scope=DM)] == ["dm secret"]
    assert "run step" not in str(build(client, CHAT))


def test_a_new_thread_in_the_chats_scope_is_not_clean(client: Client) -> None:
    """Why a run takes a scope, not just a thread: a build's status preamble names the
    scope's status entries and its other active threads."""
    fill_chat(client)
    fresh_thread = build(client, CHAT, thread="run-7f3a")
    assert stored(fresh_thread) == []
    assert "chat secret" in fresh_thread.status  # the scope's status entry
    assert "other" in fresh_thread.status  # and its other threads' activity


def test_a_run_started_over_is_cleared_once(client: Client) -> None:
    """Starting a run id over: ClearContext of its scope with a request_id; a retried
    clear does not clear again what the run appended since."""
    fill_chat(client)
    append(client, RUN, "main", "first attempt")
    clear = pb.ClearContextRequest(agent="bot", scope=RUN, request_id="run:7f3a/attempt-2")
    client.stub.ClearContext(clear)
    assert stored(build(client, RUN)) == []
    append(client, RUN, "main", "second attempt")
    client.stub.ClearContext(clear)  # a retry of the same clear
    assert stored(build(client, RUN)) == ["second attempt"]
    assert len(client.list_messages("bot", scope=CHAT)) == 3
