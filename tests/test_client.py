"""contextd-client (client/) against the real server: every method, paging, errors, request
ids and retries, deadlines, the API key, TLS; its generated code beside the server's in one
process; and its wheel, built from proto/, installed into a fresh venv and used there.

The in-process tests run with the server's own `contextd.v1` loaded too (the server runs in
this process), which is the layout client/codegen.py makes work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from test_tls import Pki, _serve, pki  # noqa: F401  (pki is a fixture used below)

from conftest import ROOT, InProcessServer, SpawnServer, db_rows
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as server_pb
from contextd_client import (
    Aborted,
    AgentDoc,
    AlreadyExists,
    BuildOptions,
    ChannelScope,
    Client,
    ContextdError,
    ContextFormat,
    ContextView,
    DeadlineExceeded,
    DirectMessageScope,
    FailedPrecondition,
    InvalidArgument,
    KeyScope,
    MessageRange,
    NewMessage,
    NotFound,
    RetentionPolicy,
    RetryPolicy,
    Role,
    ScopeRetention,
    StatusKind,
    Unauthenticated,
    Unavailable,
)
from contextd_client.v1 import context_service_pb2 as client_pb

MINUTE_US = 60_000_000


@pytest.fixture
def api(server: InProcessServer) -> Iterator[Client]:
    """The typed client on the in-process server (whichever engine the test runs on)."""
    with Client(server.client.address, timeout=30) as client:
        yield client


def _stored(server: InProcessServer) -> int:
    """How many messages the store holds, read from the store itself (not through the API)."""
    return int(db_rows(server.running.store, "SELECT count(*) FROM messages")[0][0])


def test_generated_code_shares_the_servers_descriptors() -> None:
    """Both copies of the generated code register one file descriptor: the messages are one
    class, so nothing in a shared process can tell them apart or reject either."""
    assert client_pb.DESCRIPTOR is server_pb.DESCRIPTOR
    assert client_pb.Agent is server_pb.Agent  # type: ignore[comparison-overlap]
    assert client_pb.DESCRIPTOR.name == "contextd/v1/context_service.proto"


def test_agents(api: Client) -> None:
    created = api.create_agent(
        name="a1",
        system_prompt="You are terse.",
        docs={"style.md": "short answers"},
        rolling_window=timedelta(hours=2),
        build_options=BuildOptions(truncate=False, max_chars_per_message=500),
    )
    assert created.name == "a1" and created.tenant == "default"
    assert created.docs == (AgentDoc("style.md", "short answers"),)
    assert created.rolling_window == timedelta(hours=2)
    assert created.build_options.truncate is False
    assert created.build_options.summarize is None  # unset stays None, not False
    assert created.create_time is not None and created.create_time.tzinfo is UTC
    assert api.get_agent(name="a1") == created

    # Only what is given changes: one option of build_options, the system prompt cleared.
    updated = api.update_agent(
        name="a1", system_prompt="", build_options=BuildOptions(summarize=True)
    )
    assert updated.system_prompt == ""
    assert updated.build_options.summarize is True
    assert updated.build_options.truncate is False  # untouched
    assert updated.build_options.max_chars_per_message == 500
    assert updated.docs == created.docs and updated.etag != created.etag

    for name in ("a2", "a3", "a4", "a5"):
        api.create_agent(name=name)
    listed = api.list_agents(page_size=2)
    assert [len(p.items) for p in listed.pages()] == [2, 2, 1]
    assert [a.name for a in listed] == ["a1", "a2", "a3", "a4", "a5"]
    resumed = api.list_agents(page_size=2, page_token=listed.first_page.next_page_token)
    assert [a.name for a in resumed] == ["a3", "a4", "a5"]

    with pytest.raises(Aborted) as stale:
        api.delete_agent(name="a1", etag=created.etag)
    assert stale.value.reason == "ETAG_MISMATCH"
    api.append_messages(agent="a1", messages=[NewMessage("user", "hi")])
    assert api.delete_agent(name="a1", etag=updated.etag) == 1
    with pytest.raises(NotFound) as gone:
        api.get_agent(name="a1")
    assert gone.value.reason == "AGENT_NOT_FOUND" and gone.value.code == grpc.StatusCode.NOT_FOUND


def test_append_and_list_messages_page_by_page(api: Client, clock: ManualClock) -> None:
    said = datetime.fromtimestamp(clock.now_us() / 1e6, UTC) - timedelta(minutes=1)
    said = said.replace(microsecond=0)
    calls = [{"id": "c1", "name": "grep", "input": {"q": "x"}}]
    batch = [
        NewMessage(Role.USER, "find x", source_time=said, metadata={"lang": "en"}),
        NewMessage("tool_use", "", tool_calls=calls),
        NewMessage("tool_result", "x at line 3", tool_call_id="c1", external_id="ext-9"),
        *(NewMessage("assistant", f"answer {i}") for i in range(4)),
    ]
    receipts = api.append_messages(
        agent="a1", thread="t1", messages=batch, create_agent_if_missing=True
    )
    assert [r.sequence for r in receipts] == [1, 2, 3, 4, 5, 6, 7]

    listed = api.list_messages(agent="a1", thread="t1", page_size=3)
    assert [len(p.items) for p in listed.pages()] == [3, 3, 1]
    messages = list(listed)
    assert [m.id for m in messages] == [r.id for r in receipts]
    first, tool_use, result = messages[:3]
    assert first.role is Role.USER and first.source_time == said
    assert json.loads(first.metadata) == {"lang": "en"}
    assert tool_use.role is Role.TOOL_USE and json.loads(tool_use.tool_calls) == calls
    assert (result.tool_call_id, result.external_id) == ("c1", "ext-9")
    assert all(m.thread == "t1" and m.scope is None and m.agent == "a1" for m in messages)
    assert messages[-1].create_time == receipts[-1].create_time


def test_scopes_threads_stats_and_clear(api: Client) -> None:
    channel = ChannelScope("g1", "c1", "u1")
    for scope in (channel, DirectMessageScope("u1"), KeyScope("k1"), "k2"):
        api.append_messages(
            agent="a1",
            scope=scope,
            thread="t1",
            messages=[NewMessage("user", f"in {scope}")],
            create_agent_if_missing=True,
        )
    api.append_messages(agent="a1", scope=channel, thread="t2", messages=[NewMessage("user", "b")])
    threads = list(api.list_threads(agent="a1", scope=channel))
    assert [(t.thread, t.message_count, t.scope) for t in threads] == [
        ("t1", 1, channel),
        ("t2", 1, channel),
    ]
    assert [m.content for m in api.list_messages(agent="a1", scope="k2")] == ["in k2"]
    assert list(api.list_messages(agent="a1")) == []  # the default scope is a scope of its own

    stats = api.get_context_stats(agent="a1", scope=channel)
    assert (stats.thread_count, stats.window_message_count, stats.total_message_count) == (2, 2, 2)
    assert stats.rolling_window == timedelta(days=1)

    cleared = api.clear_context(agent="a1", scope=channel, thread="t1")
    assert list(api.list_messages(agent="a1", scope=channel, thread="t1")) == []
    history = list(
        api.list_messages(agent="a1", scope=channel, thread="t1", range=MessageRange.ALL)
    )
    assert [m.content for m in history] == [f"in {channel}"]
    assert api.get_context_stats(agent="a1", scope=channel, thread="t1").last_clear_time == cleared


def test_retention_policies_and_what_stats_say_of_expiry(api: Client, clock: ManualClock) -> None:
    """Retention is set and read back through the typed client, overrides by scope
    pattern included; stats say whether a context exists and when it expires."""
    day = timedelta(hours=24)
    agent = api.create_agent(
        name="bot", retention=RetentionPolicy(max_messages=15, ttl=day), rolling_window=day * 7
    )
    assert agent.retention == RetentionPolicy(max_messages=15, ttl=day)
    assert agent.retention_overrides == ()
    dm_policy = RetentionPolicy(max_messages=5)
    updated = api.update_agent(name="bot", retention_overrides=[ScopeRetention("dm:*", dm_policy)])
    assert updated.retention_overrides == (ScopeRetention("dm:*", dm_policy),)
    assert updated.retention == agent.retention  # not named, not changed
    channel = ChannelScope("g1", "c1", "u1")
    api.append_messages(
        agent="bot", scope=channel, messages=[NewMessage("user", f"m{i}") for i in range(20)]
    )
    stats = api.get_context_stats(agent="bot", scope=channel)
    assert stats.exists and stats.window_message_count == 15
    assert stats.newest_message_time is not None
    assert stats.expire_time == stats.newest_message_time + day  # the newest write + ttl
    assert stats.expires_in is not None and timedelta(0) < stats.expires_in <= day
    assert stats.retention == agent.retention
    clock.advance(int(day.total_seconds() * 1_000_000))
    expired = api.get_context_stats(agent="bot", scope=channel)
    assert not expired.exists and expired.window_message_count == 0
    assert expired.expires_in is None
    assert api.get_context_stats(agent="bot", scope=DirectMessageScope("u1")).retention == (
        dm_policy
    )


def test_build_context(api: Client) -> None:
    api.create_agent(name="a1", system_prompt="You are terse.", docs={"d.md": "doc text"})
    api.append_messages(
        agent="a1",
        messages=[NewMessage("user", "What is 2 + 2?"), NewMessage("assistant", "4")],
    )
    built = api.build_context(
        agent="a1",
        user_message="And 3 + 3?",
        formats=[ContextFormat.ANTHROPIC, ContextFormat.TEXT],
    )
    assert built.system_prompt == "You are terse."
    assert built.docs == (AgentDoc("d.md", "doc text"),)
    assert [(m.role, m.content) for m in built.messages] == [
        (Role.USER, "What is 2 + 2?"),
        (Role.ASSISTANT, "4"),
        (Role.USER, "And 3 + 3?"),
    ]
    assert built.stats.messages_before == 2 and built.stats.total_tokens > 0
    anthropic = json.loads(built.rendering(ContextFormat.ANTHROPIC))
    assert anthropic["messages"][-1]["content"][0]["text"] == "And 3 + 3?"
    assert "User: What is 2 + 2?" in built.rendering("text")
    with pytest.raises(KeyError):
        built.rendering(ContextFormat.OPENAI)

    slim = api.build_context(
        agent="a1", formats=[ContextFormat.OPENAI], view=ContextView.RENDERINGS
    )
    assert slim.messages == () and slim.system_prompt == ""
    assert json.loads(slim.rendering(ContextFormat.OPENAI))[0]["role"] == "system"


def test_compact_context_and_events(api: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)  # the extractive fallback
    api.create_agent(name="a1")
    api.append_messages(agent="a1", thread="t1", messages=[NewMessage("user", "one")])
    with pytest.raises(FailedPrecondition) as nothing:
        api.compact_context(agent="a1", thread="t1")
    assert nothing.value.reason == "NOTHING_TO_COMPACT"

    api.append_messages(
        agent="a1",
        thread="t1",
        messages=[NewMessage("user", f"step {i} " + "words " * 50) for i in range(30)],
    )
    done = api.compact_context(
        agent="a1", thread="t1", options=BuildOptions(keep_recent_tokens=100)
    )
    assert done.summary.is_summary and done.summarizer_path == "fallback"
    assert done.summary.first_summarized_id > 0
    events = list(api.list_events(agent="a1", thread="t1", type="context.compressed"))
    assert len(events) == 1 and events[0].data_json()["summary_id"] == done.summary.id
    assert events[0].create_time is not None
    later = events[0].create_time + timedelta(microseconds=1)
    assert list(api.list_events(agent="a1", start_time=later)) == []


def test_status_entries(api: Client, clock: ManualClock) -> None:
    api.create_agent(name="a1")
    entry = api.set_status(
        agent="a1", key="job-1", kind=StatusKind.PROCESS, state="running", summary="indexing"
    )
    assert (entry.kind, entry.state, entry.expire_time) == (StatusKind.PROCESS, "running", None)
    brief = api.set_status(
        agent="a1", key="job-2", kind=StatusKind.THREAD, summary="brief", ttl=timedelta(minutes=1)
    )
    assert brief.expire_time is not None and brief.update_time is not None
    assert brief.expire_time > brief.update_time
    assert [e.key for e in api.list_status(agent="a1")] == ["job-1", "job-2"]
    clock.advance(2 * MINUTE_US)
    assert [e.key for e in api.list_status(agent="a1")] == ["job-1"]
    assert [e.key for e in api.list_status(agent="a1", include_expired=True)] == [
        "job-1",
        "job-2",
    ]
    assert api.clear_status(agent="a1", key="job-1") == 1
    with pytest.raises(NotFound) as missing:
        api.clear_status(agent="a1", key="job-1")
    assert missing.value.reason == "STATUS_NOT_FOUND"
    assert api.clear_status(agent="a1") == 1


def test_errors_carry_code_reason_and_fields(api: Client) -> None:
    with pytest.raises(InvalidArgument) as bad_name:
        api.create_agent(name="bad name!")
    error = bad_name.value
    assert isinstance(error, ContextdError) and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_ARGUMENT" and error.domain == "contextd"
    assert error.field == "agent.name"
    assert [v.field for v in error.field_violations] == ["agent.name"]
    assert "bad name!" in error.message and str(error).startswith("INVALID_ARGUMENT")

    api.create_agent(name="a1")
    with pytest.raises(AlreadyExists) as exists:
        api.create_agent(name="a1")
    assert exists.value.reason == "AGENT_EXISTS"
    with pytest.raises(InvalidArgument) as token:
        list(api.list_agents(page_token="not-a-token"))
    assert token.value.reason == "INVALID_PAGE_TOKEN"
    with pytest.raises(NotFound) as unknown:  # the list raises at the call, not on iteration
        api.list_messages(agent="nobody")
    assert unknown.value.reason == "AGENT_NOT_FOUND"
    with pytest.raises(InvalidArgument) as unknown_model:
        api.update_agent(name="a1", model="no-such-model")
    assert unknown_model.value.field == "agent.model"
    with pytest.raises(ValueError, match="timezone-aware"):  # refused before it is sent
        api.append_messages(
            agent="a1", messages=[NewMessage("user", "x", source_time=datetime(2024, 1, 1))]
        )
    with pytest.raises(ValueError):
        NewMessage("narrator", "x")


def test_request_ids_make_retries_safe(api: Client, server: InProcessServer) -> None:
    api.create_agent(name="a1")
    first = api.append_messages(
        agent="a1", messages=[NewMessage("user", "once")], request_id="req-1"
    )
    again = api.append_messages(
        agent="a1", messages=[NewMessage("user", "once")], request_id="req-1"
    )
    assert again == first and _stored(server) == 1
    with pytest.raises(InvalidArgument) as reused:
        api.append_messages(agent="a1", messages=[NewMessage("user", "other")], request_id="req-1")
    assert reused.value.reason == "REQUEST_ID_REUSED"
    # Without one, each call makes its own: two identical calls are two appends.
    api.append_messages(agent="a1", messages=[NewMessage("user", "twice")])
    api.append_messages(agent="a1", messages=[NewMessage("user", "twice")])
    assert _stored(server) == 3


class _Failure(grpc.RpcError, grpc.Call):
    """What a client sees when a call fails in transit (e.g. the connection dropped after
    the server committed): a status, here with the details the server would send."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None) -> None:
        self._code, self._message = code, message
        details = []
        if retry_after is not None:
            info = error_details_pb2.RetryInfo(
                retry_delay=duration_pb2.Duration(nanos=int(retry_after * 1e9))
            )
            packed = any_pb2.Any()
            packed.Pack(info)
            details.append(packed)
        status = status_pb2.Status(code=code.value[0], message=message, details=details)
        self._trailing = rpc_status.to_status(status).trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> Any:
        return self._trailing

    def initial_metadata(self) -> Any:
        return ()

    def result(self, timeout: float | None = None) -> Any:
        raise self

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


@dataclass
class _Recorder(grpc.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Sees every attempt (method, request, deadline, metadata) on the way out; `lose` makes
    the first N attempts of a method reach the server but fail on the way back."""

    lose: dict[str, int] = field(default_factory=dict)
    fail_with: tuple[grpc.StatusCode, float | None] = (grpc.StatusCode.UNAVAILABLE, None)
    sent: list[tuple[str, Any, float | None, Any]] = field(default_factory=list)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        self.sent.append((method, request, details.timeout, details.metadata))
        outcome = continuation(details, request)
        if self.lose.get(method, 0) > 0:
            self.lose[method] -= 1  # the call above completed: the server did its work
            return _Failure(self.fail_with[0], "connection lost", self.fail_with[1])
        return outcome


def test_a_lost_response_is_retried_with_the_same_request_id(server: InProcessServer) -> None:
    waits: list[float] = []
    recorder = _Recorder(lose={"AppendMessages": 1}, fail_with=(grpc.StatusCode.UNAVAILABLE, 0.25))
    with Client(
        server.client.address, retry=RetryPolicy(sleep=waits.append), interceptors=[recorder]
    ) as api:
        receipts = api.append_messages(
            agent="a1", messages=[NewMessage("user", "once")], create_agent_if_missing=True
        )
    attempts = [request for method, request, _, _ in recorder.sent if method == "AppendMessages"]
    assert len(attempts) == 2 and waits == [0.25]  # the server's RetryInfo delay
    assert attempts[0].request_id == attempts[1].request_id != ""
    assert _stored(server) == 1  # the first attempt's append, answered again
    assert [m.id for m in server.client.window("a1", thread="main")] == [receipts[0].id]


def test_retries_stop_at_the_policy_and_skip_other_errors(server: InProcessServer) -> None:
    waits: list[float] = []
    recorder = _Recorder(lose={"ListAgents": 5})
    with Client(
        server.client.address, retry=RetryPolicy(sleep=waits.append), interceptors=[recorder]
    ) as api:
        with pytest.raises(Unavailable) as down:
            api.list_agents()
        assert waits == [0.1, 0.2]  # exponential backoff without RetryInfo; 3 attempts
        assert down.value.retry_delay is None and down.value.reason == ""
        with pytest.raises(NotFound):
            api.get_agent(name="nobody")
    assert [m for m, *_ in recorder.sent].count("GetAgent") == 1


RawHandler = Callable[[Any, grpc.ServicerContext], bytes]


@contextmanager
def _bare_server(handlers: dict[str, RawHandler]) -> Iterator[str]:
    """A bare gRPC server answering some ContextService methods with `handlers` (raw
    request bytes in, response bytes out): a stand-in for a server that checks keys, or
    one that does not answer in time."""
    handler = grpc.method_handlers_generic_handler(
        "contextd.v1.ContextService",
        {name: grpc.unary_unary_rpc_method_handler(h) for name, h in handlers.items()},
    )
    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    bare.add_generic_rpc_handlers((handler,))
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        bare.stop(grace=None)


def test_deadlines(server: InProcessServer) -> None:
    recorder = _Recorder()
    with Client(server.client.address, timeout=7.0, interceptors=[recorder]) as api:
        api.list_agents()
        api.list_agents(timeout=2.5)
    with pytest.raises(RuntimeError, match="closed"):  # leaving the block closed it
        api.list_agents()
    (_, _, default, _), (_, _, per_call, _) = recorder.sent
    assert default is not None and 2.5 < default <= 7.0  # the client's default
    assert per_call is not None and 0 < per_call <= 2.5  # the call's own

    released = threading.Event()

    def stalled(request: Any, context: grpc.ServicerContext) -> bytes:
        released.wait(30)  # answers only after the client gave up
        return client_pb.GetAgentResponse().SerializeToString()

    with _bare_server({"GetAgent": stalled}) as address, Client(address) as api:
        try:
            with pytest.raises(DeadlineExceeded) as late:
                api.get_agent(name="a1", timeout=0.2)
        finally:
            released.set()
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_api_key_goes_on_the_wire_as_a_bearer_token(server: InProcessServer) -> None:
    seen: list[dict[str, str]] = []

    def get_agent(request: Any, context: grpc.ServicerContext) -> bytes:
        seen.append({k: str(v) for k, v in context.invocation_metadata()})
        return client_pb.GetAgentResponse(agent=client_pb.Agent(name="a1")).SerializeToString()

    with _bare_server({"GetAgent": get_agent}) as address:
        with Client(address, api_key="sk-1") as keyed:
            assert keyed.get_agent(name="a1").name == "a1"
        with Client(address) as anonymous:
            anonymous.get_agent(name="a1")
    assert seen[0]["authorization"] == "Bearer sk-1"
    assert "authorization" not in seen[1]
    # contextd checks it: a key it never issued is UNAUTHENTICATED, with its reason.
    with (
        Client(server.client.address, api_key="sk-1") as keyed,
        pytest.raises(Unauthenticated) as refused,
    ):
        keyed.create_agent(name="a1")
    assert refused.value.reason == "API_KEY_INVALID"


def test_tls(tmp_path: Path, pki: Pki) -> None:  # noqa: F811  (the fixture imported above)
    running = _serve(tmp_path, tls_cert=str(pki.server.cert_path), tls_key=str(pki.server.key_path))
    try:
        trusted = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert)
        with Client(f"127.0.0.1:{running.port}", tls=trusted) as api:
            assert api.create_agent(name="a1").name == "a1"
        stranger = grpc.ssl_channel_credentials(root_certificates=pki.other_ca.cert)
        with (
            Client(f"127.0.0.1:{running.port}", tls=stranger, retry=RetryPolicy(attempts=1)) as api,
            pytest.raises(Unavailable),
        ):
            api.get_agent(name="a1")
    finally:
        running.stop(grace=1)


_ONE_PROCESS = """
import sys, tempfile
from pathlib import Path
for name in sys.argv[1].split(","):
    __import__(name)
from contextd.api.server import create_server
from contextd.config import Settings
from contextd_client import Client, NewMessage
running = create_server(Settings(addr="127.0.0.1:0", data_dir=Path(tempfile.mkdtemp())))
with Client(f"127.0.0.1:{running.port}") as api:
    api.append_messages(agent="a", messages=[NewMessage("user", "hi")],
                        create_agent_if_missing=True)
    print([m.content for m in api.list_messages(agent="a")])
running.stop(grace=1)
"""


@pytest.mark.parametrize(
    ("first", "implementation"),
    [
        ("contextd_client.v1.context_service_pb2", "upb"),
        ("contextd.v1.context_service_pb2", "upb"),
        ("contextd_client.v1.context_service_pb2", "python"),
    ],
)
def test_client_and_server_load_in_either_order(first: str, implementation: str) -> None:
    """Whichever generated code a process imports first, the other loads beside it and
    calls work, with protobuf's C (upb) and pure-Python descriptor pools alike."""
    both = ["contextd_client.v1.context_service_pb2", "contextd.v1.context_service_pb2"]
    modules = [first, *(m for m in both if m != first)]
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'client/src'}",
        "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": implementation,
    }
    done = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS, ",".join(modules)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['hi']"


def _package_index() -> str:
    """The index pip would use (its configuration, else PyPI)."""
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (configured or "https://pypi.org/simple").rstrip("/")


def _index_reachable(index: str) -> bool:
    try:
        with urllib.request.urlopen(f"{index}/grpcio-status/", timeout=15) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _readme_quick_start() -> str:
    """The Python quick start of the README, as it stands."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Python client", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert '"127.0.0.1:50051"' in block
    return block


_FRESH_CHECKS = """
import importlib.util
from contextd_client import NotFound
assert importlib.util.find_spec("contextd") is None, "the server package must not be needed"
with Client(ADDRESS) as client:
    try:
        client.get_agent(name="nobody")
    except NotFound as e:
        print("reason:", e.reason)
"""


@pytest.mark.duckdb_only  # about packaging, not the engine: once is enough
def test_the_wheel_installs_into_a_fresh_venv_and_talks_to_a_server(
    tmp_path: Path, spawn_server: SpawnServer
) -> None:
    """Build the wheel from client/ and proto/ alone (a copy without any generated code),
    install it with its dependencies from the package index into a new venv, and run the
    quick start there, with nothing of this repository on the path."""
    index = _package_index()
    if not _index_reachable(index):
        pytest.skip(f"the package index {index} is unreachable")
    source = tmp_path / "src"
    shutil.copytree(
        ROOT / "client",
        source / "client",
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*_pb2*"),
    )
    shutil.copytree(ROOT / "proto", source / "proto")
    dist = tmp_path / "dist"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--wheel-dir", str(dist), str(source / "client")),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("contextd_client-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--index-url", index, str(wheel)],
        check=True,
        timeout=300,
    )
    proc = spawn_server()
    proc.start().channel.close()
    script = tmp_path / "quickstart.py"
    address = f"127.0.0.1:{proc.port}"
    quick_start = _readme_quick_start().replace('"127.0.0.1:50051"', "ADDRESS")
    script.write_text(f"ADDRESS = {address!r}\n{quick_start}{_FRESH_CHECKS}")
    done = subprocess.run(
        [python, "-I", str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rendering, *window, reason = done.stdout.splitlines()
    assert json.loads(rendering)["messages"][-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "And 3 + 3?"}],
    }
    assert window == ["1 user What is 2 + 2?", "2 assistant 4"]
    assert reason == "reason: AGENT_NOT_FOUND"
