"""Tenants never cross, on every RPC: a property test with the admin keys of two tenants.

Tenant A (acmecorp) fills an agent with messages, a status entry, an event, snapshots
and keys, and keeps the ids, page tokens and request ids it got. Tenant B (globex), whose
agent has the same name, then calls every RPC of ContextService and KeyService with A's
names, scopes, snapshot ids, key ids, page tokens and request ids (replayed with the same
request, too). Every answer is an error that names nothing of A's (INVALID_ARGUMENT,
NOT_FOUND, ...) or a success that holds nothing of A's (no mark, no tenant name, no id of
A's); and afterwards A's data is exactly as it was. The cases are keyed by RPC name and
checked against the service descriptors: a new RPC without a case fails the test.
"""

from __future__ import annotations

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


class Caller:
    def __init__(self, channel: grpc.Channel, key: str | None) -> None:
        self.metadata = [("authorization", f"Bearer {key}")] if key else []
        self.context = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        self.keys = kpb_grpc.KeyServiceStub(channel)  # type: ignore[no-untyped-call]

    def __call__(self, method: str, request: message.Message) -> Any:
        stub = self.keys if isinstance(request, _KEY_REQUESTS) else self.context
        return getattr(stub, method)(request, metadata=self.metadata)


_KEY_REQUESTS = (kpb.CreateKeyRequest, kpb.ListKeysRequest, kpb.RevokeKeyRequest)


@dataclass
class Facts:
    """What tenant A holds and was told: what B must never get."""

    ints: set[int] = field(default_factory=set)  # message and event ids
    strings: set[str] = field(default_factory=set)  # snapshot ids, key ids, secrets, etags
    snapshots: list[str] = field(default_factory=list)
    key_ids: list[str] = field(default_factory=list)
    tokens: dict[str, str] = field(default_factory=dict)  # RPC -> a page token of A's
    requests: dict[str, message.Message] = field(default_factory=dict)  # A's writes
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
    for name, request in _lists_of_a().items():
        facts.tokens[name] = a(name, request).next_page_token
        assert facts.tokens[name], name
    facts.ints |= {e.id for e in a("ListEvents", pb.ListEventsRequest(agent="shared")).events}
    events = a("ListEvents", pb.ListEventsRequest(agent="shared", scope=SCOPES[0])).events
    facts.ints |= {e.id for e in events}
    for name in ("shared", "a-only"):
        facts.strings.add(a("GetAgent", pb.GetAgentRequest(name=name)).agent.etag)
    facts.strings |= set(facts.snapshots) | set(facts.key_ids)
    # What B's searches must not find is there to be found (the case can fail).
    found = a(
        "SearchMessages", pb.SearchMessagesRequest(agent="shared", scope=SCOPES[0], query=MARK)
    )
    assert found.hits and MARK in found.hits[0].message.content
    facts.before = a_view(a)


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
        ]
    return "\n".join(parts)


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
    return str(draw(st.sampled_from(["", *(r.request_id for r in facts.requests.values())])))  # type: ignore[attr-defined]


def _replay_or(draw: Draw, facts: Facts, method: str, own: message.Message) -> message.Message:
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


CASES: dict[str, Callable[[Draw, Facts], message.Message]] = {
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
}


def every_rpc() -> set[str]:
    names: set[str] = set()
    for file, service in ((pb.DESCRIPTOR, "ContextService"), (kpb.DESCRIPTOR, "KeyService")):
        names |= {m.name for m in file.services_by_name[service].methods}
    return names


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


def attempt(b: Caller, facts: Facts, method: str, request: message.Message) -> None:
    """B's call: refused without a word of A's, or answered with nothing of A's."""
    try:
        answer = b(method, request)
    except grpc.RpcError as error:
        assert error.code() in REFUSALS, (method, request, error.details())
        said = error.details() or ""
        assert MARK not in said and A_TENANT not in said, (method, request, said)
        return
    text = str(answer)
    leaked = [s for s in (MARK, A_TENANT, *facts.strings) if s in text]
    assert not leaked, (method, request, leaked)
    assert not set(ids_in(answer)) & facts.ints, (method, request)


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
