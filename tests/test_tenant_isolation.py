"""Tenants never cross, on every RPC: a property test with the admin keys of two tenants.

Tenant A (acmecorp) fills an agent with messages, a status entry, an event, snapshots
keys and tool outputs (inline and chunked), and keeps the ids, page tokens and request
ids it got. Tenant B (globex), whose agent has the same name, then calls every RPC of
ContextService, KeyService and ToolOutputService (streaming ones too) with A's names,
scopes, snapshot ids, key ids, tool output ids, page tokens and request ids (replayed with
the same request, too). Every answer is an error that names nothing of A's (INVALID_ARGUMENT,
NOT_FOUND, ...) or a success that holds nothing of A's (no mark, no tenant name, no id of
A's); and afterwards A's data is exactly as it was. The cases are keyed by RPC name and
checked against the service descriptors: a new RPC without a case fails the test.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import InProcessServer
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc
from contextd.v1 import tool_output_service_pb2 as tpb
from contextd.v1 import tool_output_service_pb2_grpc as tpb_grpc

A_TENANT, B_TENANT = "acmecorp", "globex"
MARK = "ACME-SECRET"
AGENTS = ["shared", "a-only", "b-new"]
SCOPES = [
    pb.Scope(channel=pb.ChannelScope(guild_id="g1", channel_id="c1", user_id="u1")),
    pb.Scope(),
    pb.Scope(direct_message=pb.DirectMessageScope(user_id="u1")),
]
THREADS = ["main", "side", ""]
EXAMPLES_PER_RPC = 4
# Codes an attempt on A's data may end with: none of them tells anything of A's.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
}


SERVICES = (
    (pb.DESCRIPTOR, "ContextService"),
    (kpb.DESCRIPTOR, "KeyService"),
    (tpb.DESCRIPTOR, "ToolOutputService"),
)


def _methods() -> dict[str, descriptor.MethodDescriptor]:
    return {m.name: m for file, service in SERVICES for m in file.services_by_name[service].methods}


class Caller:
    """Calls any RPC by name: a client-streaming one takes a list of requests (sent as a
    stream), a server-streaming one answers with the list of its responses."""

    def __init__(self, channel: grpc.Channel, key: str | None) -> None:
        self.metadata = [("authorization", f"Bearer {key}")] if key else []
        self.stubs = {
            "ContextService": pb_grpc.ContextServiceStub(channel),  # type: ignore[no-untyped-call]
            "KeyService": kpb_grpc.KeyServiceStub(channel),  # type: ignore[no-untyped-call]
            "ToolOutputService": tpb_grpc.ToolOutputServiceStub(channel),  # type: ignore[no-untyped-call]
        }
        self.methods = _methods()

    def __call__(self, method: str, request: Any) -> Any:
        found = self.methods[method]
        call = getattr(self.stubs[found.containing_service.name], method)
        if found.client_streaming:
            requests = request if isinstance(request, list) else [request]
            return call(iter(requests), metadata=self.metadata)
        answer = call(request, metadata=self.metadata)
        return list(answer) if found.server_streaming else answer


@dataclass
class Facts:
    """What tenant A holds and was told: what B must never get."""

    ints: set[int] = field(default_factory=set)  # message and event ids
    # snapshot ids, key ids, secrets, etags, tool output ids and keys
    strings: set[str] = field(default_factory=set)
    snapshots: list[str] = field(default_factory=list)
    key_ids: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # A's tool output ids
    tokens: dict[str, str] = field(default_factory=dict)  # RPC -> a page token of A's
    # A's writes (a client stream as its list of requests)
    requests: dict[str, Any] = field(default_factory=dict)
    before: str = ""  # A's data as A reads it, before B's calls


def _scope_of(i: int) -> pb.Scope:
    return SCOPES[i % len(SCOPES)]


def fill_a(a: Caller, facts: Facts) -> None:
    writes: dict[str, message.Message] = {
        "CreateAgent": pb.CreateAgentRequest(agent=pb.Agent(name="a-only"), request_id="a-1"),
        "AppendMessages": pb.AppendMessagesRequest(
            agent="shared",
            scope=SCOPES[0],
            thread="main",
            messages=[pb.Message(role=pb.ROLE_USER, content="hello")],
            create_agent_if_missing=True,
            request_id="a-2",
        ),
        "SetStatus": pb.SetStatusRequest(
            agent="shared",
            scope=SCOPES[0],
            entry=pb.StatusEntry(
                key="job", kind=pb.STATUS_KIND_PROCESS, state="on", summary=f"{MARK} job"
            ),
            request_id="a-3",
        ),
        "SaveSnapshot": pb.SaveSnapshotRequest(agent="shared", scope=SCOPES[0], request_id="a-4"),
        "ClearStatus": pb.ClearStatusRequest(
            agent="a-only", scope=SCOPES[1], key="", request_id="a-5"
        ),
        "CreateKey": kpb.CreateKeyRequest(role=kpb.KEY_ROLE_READ, name="reader", request_id="a-6"),
    }
    for method, request in writes.items():
        answer = a(method, request)
        facts.requests[method] = request
        if method == "SaveSnapshot":
            facts.snapshots.append(answer.snapshot.id)
        if method == "CreateKey":
            facts.key_ids.append(answer.key.key_id)
            facts.strings.add(answer.secret)
    for i, thread in itertools.product(range(3), ("main", "side")):
        sent = a(
            "AppendMessages",
            pb.AppendMessagesRequest(
                agent="shared",
                scope=_scope_of(i),
                thread=thread,
                messages=[
                    pb.Message(role=pb.ROLE_USER, content=f"{MARK} {i} {thread} {n} " + "x" * 400)
                    for n in range(12)
                ],
            ),
        )
        facts.ints |= {r.id for r in sent.receipts}
    compacted = a(
        "CompactContext",
        pb.CompactContextRequest(
            agent="shared",
            scope=SCOPES[0],
            thread="side",
            options=pb.BuildOptions(keep_recent_tokens=1),
            request_id="a-7",
        ),
    )
    facts.ints.add(compacted.summary.id)
    again = a(
        "CompactContext",
        pb.CompactContextRequest(
            agent="shared",
            scope=SCOPES[0],
            thread="main",
            options=pb.BuildOptions(keep_recent_tokens=1),
        ),
    )
    facts.ints.add(again.summary.id)
    a(
        "SetStatus",
        pb.SetStatusRequest(
            agent="shared",
            scope=SCOPES[0],
            entry=pb.StatusEntry(key="job2", kind=pb.STATUS_KIND_THREAD, state="on", summary=MARK),
        ),
    )
    second = a("SaveSnapshot", pb.SaveSnapshotRequest(agent="shared", scope=SCOPES[0]))
    facts.snapshots.append(second.snapshot.id)
    deleted = pb.DeleteSnapshotRequest(
        agent="shared", scope=SCOPES[0], id=second.snapshot.id, request_id="a-8"
    )
    a("DeleteSnapshot", deleted)
    facts.requests["DeleteSnapshot"] = deleted
    third = a("SaveSnapshot", pb.SaveSnapshotRequest(agent="shared", scope=SCOPES[0]))
    facts.snapshots.append(third.snapshot.id)
    revoked = kpb.RevokeKeyRequest(key_id=facts.key_ids[0], request_id="a-9")
    a("RevokeKey", revoked)
    facts.requests["RevokeKey"] = revoked
    fill_a_tool_outputs(a, facts)
    for name, request in _lists_of_a().items():
        facts.tokens[name] = a(name, request).next_page_token
        assert facts.tokens[name], name
    facts.ints |= {e.id for e in a("ListEvents", pb.ListEventsRequest(agent="shared")).events}
    events = a("ListEvents", pb.ListEventsRequest(agent="shared", scope=SCOPES[0])).events
    facts.ints |= {e.id for e in events}
    for name in ("shared", "a-only"):
        facts.strings.add(a("GetAgent", pb.GetAgentRequest(name=name)).agent.etag)
    facts.strings |= set(facts.snapshots) | set(facts.key_ids) | set(facts.outputs)
    # What B's searches must not find is there to be found (the case can fail).
    found = a(
        "SearchMessages", pb.SearchMessagesRequest(agent="shared", scope=SCOPES[0], query=MARK)
    )
    assert found.hits and MARK in found.hits[0].message.content
    facts.before = a_view(a)


def _output(scope: pb.Scope, tool: str, description: str) -> tpb.NewToolOutput:
    return tpb.NewToolOutput(
        agent="shared",
        scope=scope,
        thread="main",
        tool_name=tool,
        tool_description=description,
        args_json='{"path": "/srv/app.log"}',
        task_id="task-1",
        query_id="q_0123456789abcdef",
    )


# Results of more than the inline threshold (32 KiB) are stored as chunks.
CHUNKED = 40_000


def fill_a_tool_outputs(a: Caller, facts: Facts) -> None:
    """A's tool outputs: inline and chunked, in two scopes; its put, streamed put and
    delete requests (with request ids) are kept for B to replay. Replayed requests carry
    no mark (B's replay stores B's own output, which B may read)."""
    put = tpb.PutToolOutputRequest(
        output=_output(SCOPES[0], "grep", "search logs for errors"),
        result=b"error: disk full\n" * 10,
        request_id="a-10",
    )
    streamed = [
        tpb.StreamPutToolOutputRequest(
            output=_output(SCOPES[0], "cat", "read a log file"), request_id="a-11"
        ),
        tpb.StreamPutToolOutputRequest(chunk=b"log line\n" * (CHUNKED // 9)),
    ]
    doomed = a(
        "PutToolOutput",
        tpb.PutToolOutputRequest(output=_output(SCOPES[1], "tmp", "a scratch output"), result=b"x"),
    )
    deleted = tpb.DeleteToolOutputsRequest(
        filter=tpb.ToolOutputFilter(agent="shared", scope=SCOPES[1], tool_name="tmp"),
        request_id="a-12",
    )
    for method, request in (
        ("PutToolOutput", put),
        ("StreamPutToolOutput", streamed),
        ("DeleteToolOutputs", deleted),
    ):
        answer = a(method, request)
        facts.requests[method] = request
        if method != "DeleteToolOutputs":
            facts.outputs.append(answer.pointer.id)
            facts.strings.add(answer.pointer.key)
    assert not a("ListToolOutputs", tpb.ListToolOutputsRequest(filter=deleted.filter)).pointers
    facts.strings.add(doomed.pointer.key)
    for i, scope in enumerate(SCOPES[:2]):
        marked = f"{MARK} timeout in the scheduler {i}\n".encode()
        inline = a(
            "PutToolOutput",
            tpb.PutToolOutputRequest(
                output=_output(scope, "logs", f"{MARK} scheduler logs"), result=marked
            ),
        )
        chunked = a(
            "StreamPutToolOutput",
            [
                tpb.StreamPutToolOutputRequest(output=_output(scope, "logs", "more logs")),
                *(
                    tpb.StreamPutToolOutputRequest(chunk=marked * (CHUNKED // len(marked) // 4))
                    for _ in range(5)
                ),
            ],
        )
        assert inline.pointer.stored_inline and not chunked.pointer.stored_inline
        for pointer in (inline.pointer, chunked.pointer):
            facts.outputs.append(pointer.id)
            facts.strings.add(pointer.key)


def _lists_of_a() -> dict[str, message.Message]:
    """One request per paged list, whose first page of A's has a next page."""
    return {
        "ListAgents": pb.ListAgentsRequest(page_size=1),
        "ListMessages": pb.ListMessagesRequest(
            agent="shared", scope=SCOPES[0], thread="main", page_size=1
        ),
        "ListThreads": pb.ListThreadsRequest(agent="shared", scope=SCOPES[0], page_size=1),
        "ListStatus": pb.ListStatusRequest(
            agent="shared", scope=SCOPES[0], page_size=1, include_expired=True
        ),
        "ListEvents": pb.ListEventsRequest(agent="shared", scope=SCOPES[0], page_size=1),
        "ListSnapshots": pb.ListSnapshotsRequest(agent="shared", scope=SCOPES[0], page_size=1),
        "ListKeys": kpb.ListKeysRequest(page_size=1, include_revoked=True),
        "ListToolOutputs": tpb.ListToolOutputsRequest(
            filter=tpb.ToolOutputFilter(agent="shared", scope=SCOPES[0]), page_size=1
        ),
    }


def a_view(a: Caller) -> str:
    """Everything A can read, as text: it must not change while B calls."""
    parts = [str(a("ListAgents", pb.ListAgentsRequest()))]
    parts.append(str(a("ListKeys", kpb.ListKeysRequest(include_revoked=True))))
    for name, scope in itertools.product(("shared", "a-only"), SCOPES):
        common: dict[str, Any] = {"agent": name, "scope": scope}
        parts += [
            str(a("ListMessages", pb.ListMessagesRequest(**common, range=pb.MESSAGE_RANGE_ALL))),
            _window(a, pb.ListMessagesRequest(**common)),
            str(a("ListThreads", pb.ListThreadsRequest(**common))),
            str(a("ListStatus", pb.ListStatusRequest(**common, include_expired=True))),
            str(a("ListEvents", pb.ListEventsRequest(**common))),
            str(a("ListSnapshots", pb.ListSnapshotsRequest(**common))),
            _stats(a, pb.GetContextStatsRequest(**common)),
            _outputs(a, tpb.ToolOutputFilter(**common)),
        ]
    return "\n".join(parts)


def _outputs(a: Caller, where: tpb.ToolOutputFilter) -> str:
    """The pointers of a filter and the SHA-256 of each result as loaded."""
    pointers = a("ListToolOutputs", tpb.ListToolOutputsRequest(filter=where)).pointers
    if not pointers:
        return ""
    loaded: dict[str, Any] = {}
    request = tpb.GetToolOutputsRequest(
        agent=where.agent, scope=where.scope, ids=[p.id for p in pointers]
    )
    for piece in a("GetToolOutputs", request):
        loaded.setdefault(piece.id, hashlib.sha256()).update(piece.chunk)
    return str(pointers) + str(sorted((k, v.hexdigest()) for k, v in loaded.items()))


def _get_outputs(ids: list[str], scope: pb.Scope | None = None) -> tpb.GetToolOutputsRequest:
    return tpb.GetToolOutputsRequest(agent="shared", scope=scope or SCOPES[0], ids=ids)


def _window(a: Caller, request: pb.ListMessagesRequest) -> str:
    listed = a("ListMessages", request)
    listed.ClearField("window_start_time")  # now - rolling window: moves with the clock
    return str(listed)


def _stats(a: Caller, request: pb.GetContextStatsRequest) -> str:
    stats = a("GetContextStats", request).stats
    stats.ClearField("window_start_time")  # now - rolling window: moves with the clock
    return str(stats)


# ----------------------------------------------------------------- B's attempts

Draw = Callable[[st.SearchStrategy[Any]], Any]


def _common(draw: Draw, with_thread: bool = True) -> dict[str, Any]:
    found: dict[str, Any] = {"agent": draw(st.sampled_from(AGENTS))}
    found["scope"] = draw(st.sampled_from(SCOPES))
    if with_thread:
        found["thread"] = draw(st.sampled_from(THREADS))
    return found


def _request_id(draw: Draw, facts: Facts, method: str) -> str:
    ids = [(r[0] if isinstance(r, list) else r).request_id for r in facts.requests.values()]
    return str(draw(st.sampled_from(["", *ids])))


def _replay_or(draw: Draw, facts: Facts, method: str, own: Any) -> Any:
    """A's own request of this RPC (same fields, same request_id) or B's."""
    if method in facts.requests and draw(st.booleans()):
        return facts.requests[method]
    return own


def _token(draw: Draw, facts: Facts) -> str:
    return str(draw(st.sampled_from(sorted(facts.tokens.values()))))


def _lists(name: str) -> Callable[[Draw, Facts], message.Message]:
    def case(draw: Draw, facts: Facts) -> message.Message:
        request = _lists_of_a()[name]
        request.page_token = _token(draw, facts)  # type: ignore[attr-defined]
        return request

    return case


def _snapshot_id(draw: Draw, facts: Facts) -> str:
    chosen = draw(st.sampled_from(facts.snapshots))
    return str(draw(st.sampled_from([chosen, chosen.upper(), chosen[:-1]])))


def _output_id(draw: Draw, facts: Facts) -> str:
    chosen = draw(st.sampled_from(facts.outputs))
    return str(draw(st.sampled_from([chosen, chosen[:-1] + ("0" if chosen[-1] != "0" else "1")])))


def _filter(draw: Draw) -> tpb.ToolOutputFilter:
    found = tpb.ToolOutputFilter(**_common(draw, with_thread=False))
    if draw(st.booleans()):
        found.thread = "main"
    if draw(st.booleans()):
        found.tool_name = draw(st.sampled_from(["logs", "grep", "cat"]))
    if draw(st.booleans()):
        found.task_id = "task-1"
    return found


def _stream_put(draw: Draw, facts: Facts) -> list[tpb.StreamPutToolOutputRequest]:
    if draw(st.booleans()):
        return list(facts.requests["StreamPutToolOutput"])
    head = tpb.StreamPutToolOutputRequest(
        output=tpb.NewToolOutput(
            **_common(draw), tool_name="logs", args_json='{"path": "/srv/app.log"}'
        ),
        request_id=_request_id(draw, facts, "StreamPutToolOutput"),
    )
    if not head.output.thread:
        head.output.thread = "main"
    return [head, tpb.StreamPutToolOutputRequest(chunk=b"b's log\n" * (CHUNKED // 8))]


CASES: dict[str, Callable[[Draw, Facts], Any]] = {
    "CreateAgent": lambda d, f: _replay_or(
        d, f, "CreateAgent", pb.CreateAgentRequest(agent=pb.Agent(name=d(st.sampled_from(AGENTS))))
    ),
    "GetAgent": lambda d, f: pb.GetAgentRequest(name=d(st.sampled_from(AGENTS))),
    "UpdateAgent": lambda d, f: pb.UpdateAgentRequest(
        agent=pb.Agent(
            name=d(st.sampled_from(AGENTS)),
            system_prompt="b's prompt",
            etag=d(st.sampled_from(["", *sorted(f.strings)])),
        ),
        request_id=_request_id(d, f, "UpdateAgent"),
    ),
    "ListAgents": _lists("ListAgents"),
    "DeleteAgent": lambda d, f: pb.DeleteAgentRequest(
        name=d(st.sampled_from(AGENTS)), request_id=_request_id(d, f, "DeleteAgent")
    ),
    "AppendMessages": lambda d, f: _replay_or(
        d,
        f,
        "AppendMessages",
        pb.AppendMessagesRequest(
            **_common(d),
            messages=[pb.Message(role=pb.ROLE_USER, content="b's note")],
            create_agent_if_missing=d(st.booleans()),
            request_id=_request_id(d, f, "AppendMessages"),
        ),
    ),
    "ListMessages": lambda d, f: pb.ListMessagesRequest(
        **_common(d),
        range=d(st.sampled_from([pb.MESSAGE_RANGE_WINDOW, pb.MESSAGE_RANGE_ALL])),
        page_size=1,
        page_token=d(st.sampled_from(["", f.tokens["ListMessages"], _token(d, f)])),
    ),
    "ClearContext": lambda d, f: d(
        st.sampled_from(
            [
                pb.ClearContextRequest(**_common(d), request_id=_request_id(d, f, "x")),
                pb.ClearContextRequest(agent="shared", all_scopes=True, request_id="a-7"),
            ]
        )
    ),
    "ListThreads": _lists("ListThreads"),
    "GetContextStats": lambda d, f: pb.GetContextStatsRequest(**_common(d)),
    "BuildContext": lambda d, f: pb.BuildContextRequest(
        **_common(d), user_message="what do you know?", formats=[pb.CONTEXT_FORMAT_TEXT]
    ),
    "CompactContext": lambda d, f: pb.CompactContextRequest(
        **_common(d),
        options=pb.BuildOptions(keep_recent_tokens=1),
        request_id=d(st.sampled_from(["", "a-7"])),
    ),
    "SearchMessages": lambda d, f: pb.SearchMessagesRequest(
        **_common(d),
        query=d(st.sampled_from([MARK, "hello", "x" * 20, "main side"])),
        range=d(st.sampled_from([pb.MESSAGE_RANGE_WINDOW, pb.MESSAGE_RANGE_ALL])),
        k=d(st.sampled_from([0, 1, 100])),
    ),
    "SetStatus": lambda d, f: _replay_or(
        d,
        f,
        "SetStatus",
        pb.SetStatusRequest(
            **_common(d, with_thread=False),
            entry=pb.StatusEntry(key="job", kind=pb.STATUS_KIND_PROCESS, state="b", summary="b"),
        ),
    ),
    "ListStatus": _lists("ListStatus"),
    "ClearStatus": lambda d, f: _replay_or(
        d,
        f,
        "ClearStatus",
        pb.ClearStatusRequest(**_common(d, with_thread=False), key=d(st.sampled_from(["job", ""]))),
    ),
    "ListEvents": _lists("ListEvents"),
    "SaveSnapshot": lambda d, f: _replay_or(
        d, f, "SaveSnapshot", pb.SaveSnapshotRequest(**_common(d))
    ),
    "ListSnapshots": _lists("ListSnapshots"),
    "GetSnapshot": lambda d, f: pb.GetSnapshotRequest(
        **_common(d, with_thread=False),
        id=_snapshot_id(d, f),
        view=d(st.sampled_from([pb.SNAPSHOT_VIEW_BASIC, pb.SNAPSHOT_VIEW_FULL])),
    ),
    "DeleteSnapshot": lambda d, f: _replay_or(
        d,
        f,
        "DeleteSnapshot",
        pb.DeleteSnapshotRequest(**_common(d, with_thread=False), id=_snapshot_id(d, f)),
    ),
    "RestoreSnapshot": lambda d, f: pb.RestoreSnapshotRequest(
        **_common(d, with_thread=False),
        id=_snapshot_id(d, f),
        branch_thread=d(st.sampled_from(["", "branch"])),
        request_id=_request_id(d, f, "RestoreSnapshot"),
    ),
    "CreateKey": lambda d, f: _replay_or(
        d,
        f,
        "CreateKey",
        kpb.CreateKeyRequest(
            tenant=d(st.sampled_from(["", A_TENANT])),
            role=kpb.KEY_ROLE_READ,
            request_id=_request_id(d, f, "CreateKey"),
        ),
    ),
    "ListKeys": _lists("ListKeys"),
    "RevokeKey": lambda d, f: _replay_or(
        d, f, "RevokeKey", kpb.RevokeKeyRequest(key_id=d(st.sampled_from(f.key_ids)))
    ),
    "PutToolOutput": lambda d, f: _replay_or(
        d,
        f,
        "PutToolOutput",
        tpb.PutToolOutputRequest(
            output=tpb.NewToolOutput(
                **_common(d, with_thread=False), thread="main", tool_name="grep"
            ),
            result=b"b's result",
            request_id=_request_id(d, f, "PutToolOutput"),
        ),
    ),
    "StreamPutToolOutput": _stream_put,
    "ListToolOutputs": lambda d, f: d(
        st.sampled_from(
            [
                _lists("ListToolOutputs")(d, f),
                tpb.ListToolOutputsRequest(filter=_filter(d)),
            ]
        )
    ),
    "GetToolOutputs": lambda d, f: tpb.GetToolOutputsRequest(
        **_common(d, with_thread=False),
        ids=d(st.lists(st.sampled_from(f.outputs), min_size=1, max_size=len(f.outputs))),
    ),
    "ReadToolOutput": lambda d, f: tpb.ReadToolOutputRequest(
        **_common(d, with_thread=False),
        id=_output_id(d, f),
        offset=d(st.sampled_from([0, 10])),
    ),
    "GrepToolOutput": lambda d, f: tpb.GrepToolOutputRequest(
        **_common(d, with_thread=False),
        id=_output_id(d, f),
        pattern=d(st.sampled_from([MARK, "timeout", "log"])),
        context_lines=1,
    ),
    "DeleteToolOutputs": lambda d, f: _replay_or(
        d,
        f,
        "DeleteToolOutputs",
        tpb.DeleteToolOutputsRequest(
            filter=_filter(d), request_id=_request_id(d, f, "DeleteToolOutputs")
        ),
    ),
    "HashQuery": lambda d, f: tpb.HashQueryRequest(query=d(st.sampled_from([MARK, "timeout"]))),
    "SelectRelevantToolOutputs": lambda d, f: tpb.SelectRelevantToolOutputsRequest(
        query=d(st.sampled_from([f"{MARK} timeout", "scheduler logs", "zzz"])),
        filter=_filter(d),
        k=d(st.sampled_from([0, 100])),
        scorer=d(st.sampled_from([tpb.RELEVANCE_SCORER_BM25, tpb.RELEVANCE_SCORER_KEYWORD])),
        excerpt_tokens=d(st.sampled_from([0, 2000])),
    ),
}


def every_rpc() -> set[str]:
    return set(_methods())


def test_every_rpc_has_a_case() -> None:
    assert set(CASES) == every_rpc()


def ids_in(answer: message.Message) -> Iterator[int]:
    """Every integer of the answer in a field whose name ends in id or ids."""
    for fd, value in answer.ListFields():
        single = isinstance(value, int | float | str | bytes | message.Message)
        items = [value] if single else list(value)
        if fd.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            for item in items:
                yield from ids_in(item)
        elif fd.name.endswith(("id", "ids")):
            yield from (v for v in items if isinstance(v, int))


def _strings_of(request: Any) -> Iterator[str]:
    """Every string field value of `request` (or of each of a stream's requests), nested
    messages' too."""
    if isinstance(request, list):
        for each in request:
            yield from _strings_of(each)
        return
    for _fd, value in request.ListFields():
        single = isinstance(value, int | float | str | bytes | message.Message)
        items = [value] if single else list(value)
        for item in items:
            if isinstance(item, message.Message):
                yield from _strings_of(item)
            elif isinstance(item, str):
                yield item


def _leaked(facts: Facts, text: str, request: Any) -> list[str]:
    """A's marks and strings in `text`, but for what B's request sent itself (a missing
    id listed back, an id quoted in NOT_FOUND)."""
    # The request's text form escapes quotes (an etag is '"..."'), so its string fields'
    # own values count as sent too.
    sent = str(request) + "\n".join(_strings_of(request))
    found = [s for s in (A_TENANT, *facts.strings) if s in text and s not in sent]
    return [*found, MARK] if MARK in text else found


def attempt(b: Caller, facts: Facts, method: str, request: Any) -> None:
    """B's call: refused without a word of A's, or answered with nothing of A's (every
    message of a streamed answer)."""
    try:
        answer = b(method, request)
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (method, request, error.details())
        said = error.details() or ""
        assert not _leaked(facts, said, request), (method, request, said)
        return
    for each in answer if isinstance(answer, list) else [answer]:
        leaked = _leaked(facts, str(each), request)
        assert not leaked, (method, request, leaked)
        assert not set(ids_in(each)) & facts.ints, (method, request)


@pytest.fixture
def tenants(server: InProcessServer) -> tuple[Caller, Caller, Facts]:
    channel = server.client.channel
    operator = Caller(channel, None)
    root = Caller(
        channel, operator("CreateKey", kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN)).secret
    )
    a, b = (
        Caller(
            channel,
            root("CreateKey", kpb.CreateKeyRequest(tenant=t, role=kpb.KEY_ROLE_ADMIN)).secret,
        )
        for t in (A_TENANT, B_TENANT)
    )
    facts = Facts()
    fill_a(a, facts)
    b(
        "AppendMessages",
        pb.AppendMessagesRequest(
            agent="shared",
            scope=SCOPES[0],
            thread="main",
            messages=[pb.Message(role=pb.ROLE_USER, content="b's own")],
            create_agent_if_missing=True,
        ),
    )
    return a, b, facts


def exercise(b: Caller, facts: Facts, method: str) -> None:
    @settings(
        max_examples=EXAMPLES_PER_RPC,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    def calls(data: st.DataObject) -> None:
        attempt(b, facts, method, CASES[method](data.draw, facts))

    calls()


def test_every_rpc_of_tenant_b_misses_tenant_a(tenants: tuple[Caller, Caller, Facts]) -> None:
    a, b, facts = tenants
    for method in sorted(CASES):  # every RPC, a few draws each
        exercise(b, facts, method)
    assert a_view(a) == facts.before
    for snapshot in facts.snapshots[:1]:
        a("GetSnapshot", pb.GetSnapshotRequest(agent="shared", scope=SCOPES[0], id=snapshot))
    # A still reads its outputs whole (inline and chunked).
    got = a("GetToolOutputs", _get_outputs(facts.outputs[-2:], SCOPES[1]))
    assert sum(len(m.chunk) for m in got) > CHUNKED and got[-1].last
