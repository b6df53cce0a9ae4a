"""Text with a NUL character (U+0000): PostgreSQL cannot store one in a text column, so
every engine refuses it alike, as INVALID_ARGUMENT naming the field, before anything is
stored; a NUL inside a tool output's result (bytes) is stored and read back whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from test_error_contract import _details, _error
from test_tool_outputs import Tools

from conftest import InProcessServer
from contextd.v1 import context_service_pb2 as pb

NUL = "a\x00b"


def _cases(server: InProcessServer) -> dict[str, tuple[Callable[[], Any], str]]:
    stub = server.client.stub
    tools = Tools(server.client.channel)

    def append(**fields: Any) -> Any:
        fields.setdefault("content", "x")
        return stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent="a1",
                thread="t1",
                messages=[pb.Message(role=pb.ROLE_USER, **fields)],
                create_agent_if_missing=True,
            )
        )

    return {
        "content": (lambda: append(content=NUL), "messages[0].content"),
        "external_id": (lambda: append(external_id=NUL), "messages[0].external_id"),
        "system_prompt": (
            lambda: stub.CreateAgent(
                pb.CreateAgentRequest(agent=pb.Agent(name="a2", system_prompt=NUL))
            ),
            "agent.system_prompt",
        ),
        "doc": (
            lambda: stub.CreateAgent(
                pb.CreateAgentRequest(
                    agent=pb.Agent(name="a3", docs=[pb.AgentDoc(name="d", content=NUL)])
                )
            ),
            "agent.docs[0].content",
        ),
        "status": (
            lambda: stub.SetStatus(
                pb.SetStatusRequest(
                    agent="a1",
                    entry=pb.StatusEntry(
                        key="k", kind=pb.STATUS_KIND_THREAD, state="s", summary=NUL
                    ),
                )
            ),
            "entry.summary",
        ),
        "snapshot": (
            lambda: stub.SaveSnapshot(
                pb.SaveSnapshotRequest(agent="a1", thread="t1", description=NUL)
            ),
            "description",
        ),
        "tool description": (
            lambda: tools.put("r", description=NUL),
            "output.tool_description",
        ),
    }


CASES = ["content", "external_id", "system_prompt", "doc", "status", "snapshot", "tool description"]


@pytest.mark.parametrize("case", CASES)
def test_a_nul_in_text_is_invalid_argument_naming_its_field(
    server: InProcessServer, case: str
) -> None:
    server.client.append("a1", "hello", thread="t1")
    call, field = _cases(server)[case]
    error = _error(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "NUL" in (error.details() or "")
    assert _details(error)["fields"] == [field]


def test_a_nul_in_a_tool_outputs_result_is_kept(server: InProcessServer) -> None:
    tools = Tools(server.client.channel)
    server.client.append("a1", "hello", thread="t1")
    text = "head " * 20_000 + "tail\x00with a nul"  # text kind: no NUL in its first 64 KiB
    pointer = tools.put(text)
    assert tools.get([pointer.id]) == {pointer.id: text.encode()}
    assert [r.pointer.id for r in tools.select("tail nul").outputs] == [pointer.id]
