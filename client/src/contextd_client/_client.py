"""`Client`: one method per RPC of contextd.v1 (ContextService and KeyService), over one
gRPC channel.

Every method takes keyword arguments only (names as in the proto), converts its request
from plain values (`_convert`), sends it through `_call`, and returns a frozen dataclass.
`_call` is the one place for what every RPC shares: the API key, the deadline, retries and
errors. Adding a method for a new RPC is therefore a request, a `_call` and a conversion:

    def get_snapshot(self, *, agent: str, id: str, timeout: float | None = None) -> Snapshot:
        request = pb.GetSnapshotRequest(agent=agent, id=id)
        return from_pb(Snapshot, self._call("GetSnapshot", request, pb.GetSnapshotResponse,
                                            timeout).snapshot)

Retries: a call that ends UNAVAILABLE (server down or restarting, store busy, shutting down)
is sent again, up to `RetryPolicy.attempts` times within the call's deadline, after the
server's RetryInfo delay or an exponential backoff. Writes are safe to resend because each
method call makes its request_id once (uuid4, unless given) and every attempt carries it: the
server answers a repeat with the first response and writes nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf import field_mask_pb2
from google.protobuf.message import Message as ProtoMessage

from contextd_client import types as t
from contextd_client._convert import (
    docs_pb,
    duration_pb,
    enum_pb,
    from_pb,
    message_pb,
    option_paths,
    options_pb,
    overrides_pb,
    retention_pb,
    scope_pb,
    time_of,
    timestamp_pb,
)
from contextd_client._tool_outputs import ToolOutputMethods
from contextd_client.errors import ContextdError, Unavailable, from_rpc_error
from contextd_client.v1 import context_service_pb2 as pb
from contextd_client.v1 import key_service_pb2 as kpb

P = TypeVar("P", bound=ProtoMessage)
T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["ContextService"].full_name
KEY_SERVICE = kpb.DESCRIPTOR.services_by_name["KeyService"].full_name


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How calls ending UNAVAILABLE are retried. `attempts` counts the first try (1: never
    retry). The wait is the server's RetryInfo delay when it gives one, else
    initial_backoff * multiplier**retry, at most max_backoff; `sleep` waits (replace it to
    test, or to cooperate with an event loop's thread)."""

    attempts: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def delay(self, retry: int, error: ContextdError) -> float:
        if error.retry_delay is not None:
            return error.retry_delay.total_seconds()
        return min(self.max_backoff, self.initial_backoff * self.multiplier**retry)


def _request_id(given: str | None) -> str:
    return given if given is not None else str(uuid.uuid4())


class Client(ToolOutputMethods):
    """A connection to one contextd server.

    `address` is host:port. `api_key` is sent as `authorization: Bearer <key>` on every
    call. `tls`: None or False for plaintext, True for TLS with the system's roots, or
    grpc.ChannelCredentials (e.g. grpc.ssl_channel_credentials(root_certificates=...,
    private_key=..., certificate_chain=...) for a private CA or mutual TLS). `timeout` is
    each call's default deadline in seconds (None: none); every method takes its own
    `timeout` too. `options` are grpc channel options; `interceptors` grpc client
    interceptors (tracing, logging). Use it as a context manager, or call close().
    """

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        tls: bool | grpc.ChannelCredentials | None = None,
        timeout: float | None = 30.0,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.UnaryUnaryClientInterceptor[Any, Any]] = (),
    ) -> None:
        if tls is None or tls is False:
            channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = grpc.ssl_channel_credentials() if tls is True else tls
            channel = grpc.secure_channel(address, credentials, options=options)
        self._raw_channel = channel
        self.channel: grpc.Channel = (
            grpc.intercept_channel(channel, *interceptors) if interceptors else channel
        )
        self.address = address
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable[Any, Any]] = {}
        self._closed = False

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled, later calls raise RuntimeError."""
        self._closed = True
        self._raw_channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # The one path of every RPC.

    def _call(
        self,
        method: str,
        request: ProtoMessage,
        response_type: type[P],
        timeout: float | None,
        service: str = SERVICE,
    ) -> P:
        """Send `request` to `service`/`method` (ContextService unless named), retrying
        UNAVAILABLE (see the module docstring) within one deadline; failures raise
        ContextdError."""
        if self._closed:
            raise RuntimeError("this contextd Client is closed")
        path = f"/{service}/{method}"
        callable_ = self._callables.get(path)
        if callable_ is None:
            callable_ = self.channel.unary_unary(
                path,
                request_serializer=type(request).SerializeToString,
                response_deserializer=response_type.FromString,
            )
            self._callables[path] = callable_
        budget = self.timeout if timeout is None else timeout
        deadline = None if budget is None else time.monotonic() + budget
        retry = 0
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                response: P = callable_(request, timeout=remaining, metadata=self._metadata)
                return response
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            retry += 1
            if not isinstance(error, Unavailable) or retry >= self.retry.attempts:
                raise error
            wait = self.retry.delay(retry - 1, error)
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise error
            self.retry.sleep(wait)

    def _paged(
        self,
        fetch: Callable[[str], tuple[Iterable[T], str]],
        page_token: str,
    ) -> t.Paged[T]:
        def page(token: str) -> t.Page[T]:
            items, next_token = fetch(token)
            return t.Page(tuple(items), next_token)

        return t.Paged(page(page_token), page)

    # Agents.

    def create_agent(
        self,
        *,
        name: str,
        system_prompt: str = "",
        docs: Sequence[t.AgentDoc] | Mapping[str, str] = (),
        rolling_window: timedelta | None = None,
        model: str = "",
        build_options: t.BuildOptions | None = None,
        retention: t.RetentionPolicy | None = None,
        retention_overrides: Sequence[t.ScopeRetention] = (),
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> t.Agent:
        """Create an agent (rolling window: the server's default, one day, when None;
        retention: keep everything, when None)."""
        agent = pb.Agent(
            name=name,
            system_prompt=system_prompt,
            docs=docs_pb(docs),
            model=model,
            build_options=options_pb(build_options),
            retention_overrides=overrides_pb(retention_overrides),
        )
        if rolling_window is not None:
            agent.rolling_window.CopyFrom(duration_pb(rolling_window))
        if retention is not None:
            agent.retention.CopyFrom(retention_pb(retention))
        request = pb.CreateAgentRequest(agent=agent, request_id=_request_id(request_id))
        return from_pb(
            t.Agent, self._call("CreateAgent", request, pb.CreateAgentResponse, timeout).agent
        )

    def get_agent(self, *, name: str, timeout: float | None = None) -> t.Agent:
        request = pb.GetAgentRequest(name=name)
        return from_pb(t.Agent, self._call("GetAgent", request, pb.GetAgentResponse, timeout).agent)

    def update_agent(
        self,
        *,
        name: str,
        system_prompt: str | None = None,
        docs: Sequence[t.AgentDoc] | Mapping[str, str] | None = None,
        rolling_window: timedelta | None = None,
        model: str | None = None,
        build_options: t.BuildOptions | None = None,
        retention: t.RetentionPolicy | None = None,
        retention_overrides: Sequence[t.ScopeRetention] | None = None,
        etag: str = "",
        update_mask: Sequence[str] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> t.Agent:
        """Change the settings given (not None) and nothing else: "" clears the system
        prompt or the model, () the docs; of `build_options`, only the options set change.
        With `update_mask`, exactly the named fields change (see the proto). `etag`: fail
        with Aborted if the agent changed since it was read."""
        agent = pb.Agent(name=name, etag=etag)
        paths: list[str] = []
        if system_prompt is not None:
            agent.system_prompt = system_prompt
            paths.append("system_prompt")
        if docs is not None:
            agent.docs.extend(docs_pb(docs))
            paths.append("docs")
        if rolling_window is not None:
            agent.rolling_window.CopyFrom(duration_pb(rolling_window))
            paths.append("rolling_window")
        if model is not None:
            agent.model = model
            paths.append("model")
        if build_options is not None:
            agent.build_options.CopyFrom(options_pb(build_options))
            paths += option_paths(build_options)
        if retention is not None:
            agent.retention.CopyFrom(retention_pb(retention))
            paths.append("retention")
        if retention_overrides is not None:
            agent.retention_overrides.extend(overrides_pb(retention_overrides))
            paths.append("retention_overrides")
        mask = field_mask_pb2.FieldMask(
            paths=list(update_mask) if update_mask is not None else paths
        )
        request = pb.UpdateAgentRequest(
            agent=agent, update_mask=mask, request_id=_request_id(request_id)
        )
        return from_pb(
            t.Agent, self._call("UpdateAgent", request, pb.UpdateAgentResponse, timeout).agent
        )

    def list_agents(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> t.Paged[t.Agent]:
        """Every agent, by name, fetched `page_size` at a time (0: the server's default)."""

        def fetch(token: str) -> tuple[Iterable[t.Agent], str]:
            request = pb.ListAgentsRequest(page_size=page_size, page_token=token)
            r = self._call("ListAgents", request, pb.ListAgentsResponse, timeout)
            return (from_pb(t.Agent, a) for a in r.agents), r.next_page_token

        return self._paged(fetch, page_token)

    def delete_agent(
        self,
        *,
        name: str,
        etag: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Delete an agent and everything of it (final); returns how many messages went."""
        request = pb.DeleteAgentRequest(name=name, etag=etag, request_id=_request_id(request_id))
        response = self._call("DeleteAgent", request, pb.DeleteAgentResponse, timeout)
        return response.deleted_message_count

    # Messages and windows.

    def append_messages(
        self,
        *,
        agent: str,
        messages: Iterable[t.NewMessage],
        scope: t.Scope | str | None = None,
        thread: str = "",
        create_agent_if_missing: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> tuple[t.MessageReceipt, ...]:
        """Append a batch to one thread ("main" when empty), all or nothing; returns one
        receipt per message, once the batch is durable."""
        request = pb.AppendMessagesRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            messages=[message_pb(m) for m in messages],
            request_id=_request_id(request_id),
            create_agent_if_missing=create_agent_if_missing,
        )
        response = self._call("AppendMessages", request, pb.AppendMessagesResponse, timeout)
        return tuple(from_pb(t.MessageReceipt, r) for r in response.receipts)

    def list_messages(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        range: t.MessageRange = t.MessageRange.WINDOW,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> t.Paged[t.Message]:
        """The messages of a thread in sequence order (every thread of the scope when
        `thread` is empty): the rolling window, or with MessageRange.ALL the history."""
        wire_range = enum_pb(range, "MESSAGE_RANGE_")

        def fetch(token: str) -> tuple[Iterable[t.Message], str]:
            request = pb.ListMessagesRequest(
                agent=agent,
                scope=scope_pb(scope),
                thread=thread,
                range=wire_range,
                page_size=page_size,
                page_token=token,
            )
            r = self._call("ListMessages", request, pb.ListMessagesResponse, timeout)
            return (from_pb(t.Message, m) for m in r.messages), r.next_page_token

        return self._paged(fetch, page_token)

    def search_messages(
        self,
        *,
        agent: str,
        query: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        range: t.MessageRange = t.MessageRange.WINDOW,
        k: int = 0,
        timeout: float | None = None,
    ) -> t.SearchResults:
        """The k messages (default 10, at most 100) of the scope, or of one thread, that
        best match `query`, best first, each with its score and a snippet: in the rolling
        window, or with MessageRange.ALL in the whole history."""
        request = pb.SearchMessagesRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            range=enum_pb(range, "MESSAGE_RANGE_"),
            query=query,
            k=k,
        )
        response = self._call("SearchMessages", request, pb.SearchMessagesResponse, timeout)
        return from_pb(t.SearchResults, response)

    def clear_context(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        all_scopes: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> datetime:
        """Move the clear marker of a thread, a scope, or (all_scopes) the whole agent to
        now; deletes nothing. Returns the new marker."""
        request = pb.ClearContextRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            all_scopes=all_scopes,
            request_id=_request_id(request_id),
        )
        response = self._call("ClearContext", request, pb.ClearContextResponse, timeout)
        return time_of(response.clear_time)

    def list_threads(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> t.Paged[t.Thread]:
        """The threads of an agent in one scope, by name."""

        def fetch(token: str) -> tuple[Iterable[t.Thread], str]:
            request = pb.ListThreadsRequest(
                agent=agent, scope=scope_pb(scope), page_size=page_size, page_token=token
            )
            r = self._call("ListThreads", request, pb.ListThreadsResponse, timeout)
            return (from_pb(t.Thread, x) for x in r.threads), r.next_page_token

        return self._paged(fetch, page_token)

    def get_context_stats(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        timeout: float | None = None,
    ) -> t.ContextStats:
        """Counts, token estimates and times of one thread, or of every thread of a scope."""
        request = pb.GetContextStatsRequest(agent=agent, scope=scope_pb(scope), thread=thread)
        response = self._call("GetContextStats", request, pb.GetContextStatsResponse, timeout)
        return from_pb(t.ContextStats, response.stats)

    # Contexts.

    def build_context(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        user_message: str = "",
        model: str = "",
        options: t.BuildOptions | None = None,
        formats: Sequence[t.ContextFormat] = (),
        view: t.ContextView = t.ContextView.FULL,
        timeout: float | None = None,
    ) -> t.BuiltContext:
        """The context of one LLM call on a thread's window, within the budget; the new
        `user_message` goes last and is not stored. `formats` asks for renderings."""
        request = pb.BuildContextRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            user_message=user_message,
            model=model,
            options=options_pb(options),
            formats=[enum_pb(f, "CONTEXT_FORMAT_") for f in formats],
            view=enum_pb(view, "CONTEXT_VIEW_"),
        )
        response = self._call("BuildContext", request, pb.BuildContextResponse, timeout)
        return from_pb(t.BuiltContext, response)

    def compact_context(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        options: t.BuildOptions | None = None,
        model: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> t.Compaction:
        """Fold the window's older messages into a stored summary now."""
        request = pb.CompactContextRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            options=options_pb(options),
            model=model,
            request_id=_request_id(request_id),
        )
        response = self._call("CompactContext", request, pb.CompactContextResponse, timeout)
        return from_pb(t.Compaction, response)

    # Status entries and events.

    def set_status(
        self,
        *,
        agent: str,
        key: str,
        kind: t.StatusKind,
        summary: str,
        state: str = "",
        scope: t.Scope | str | None = None,
        expire_time: datetime | None = None,
        ttl: timedelta | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> t.StatusEntry:
        """Create or replace (by key) a status entry; live until cleared, `expire_time`,
        or `ttl` from now."""
        entry = pb.StatusEntry(
            key=key, kind=enum_pb(kind, "STATUS_KIND_"), state=state, summary=summary
        )
        if expire_time is not None:
            entry.expire_time.CopyFrom(timestamp_pb(expire_time))
        request = pb.SetStatusRequest(
            agent=agent, scope=scope_pb(scope), entry=entry, request_id=_request_id(request_id)
        )
        if ttl is not None:
            request.ttl.CopyFrom(duration_pb(ttl))
        response = self._call("SetStatus", request, pb.SetStatusResponse, timeout)
        return from_pb(t.StatusEntry, response.entry)

    def list_status(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        include_expired: bool = False,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> t.Paged[t.StatusEntry]:
        """The status entries of an agent in one scope, by key."""

        def fetch(token: str) -> tuple[Iterable[t.StatusEntry], str]:
            request = pb.ListStatusRequest(
                agent=agent,
                scope=scope_pb(scope),
                include_expired=include_expired,
                page_size=page_size,
                page_token=token,
            )
            r = self._call("ListStatus", request, pb.ListStatusResponse, timeout)
            return (from_pb(t.StatusEntry, e) for e in r.entries), r.next_page_token

        return self._paged(fetch, page_token)

    def clear_status(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        key: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Remove one entry (`key`), or every entry of the scope; returns how many went."""
        request = pb.ClearStatusRequest(
            agent=agent, scope=scope_pb(scope), key=key, request_id=_request_id(request_id)
        )
        return self._call("ClearStatus", request, pb.ClearStatusResponse, timeout).removed_count

    def list_events(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        type: str = "",
        start_time: datetime | None = None,
        end_time: datetime | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> t.Paged[t.Event]:
        """Recorded events of an agent in one scope (one thread, one type, a time range),
        oldest first."""

        def fetch(token: str) -> tuple[Iterable[t.Event], str]:
            request = pb.ListEventsRequest(
                agent=agent,
                scope=scope_pb(scope),
                thread=thread,
                type=type,
                page_size=page_size,
                page_token=token,
            )
            if start_time is not None:
                request.start_time.CopyFrom(timestamp_pb(start_time))
            if end_time is not None:
                request.end_time.CopyFrom(timestamp_pb(end_time))
            r = self._call("ListEvents", request, pb.ListEventsResponse, timeout)
            return (from_pb(t.Event, e) for e in r.events), r.next_page_token

        return self._paged(fetch, page_token)

    # Snapshots.

    def save_snapshot(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str = "",
        description: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> t.Snapshot:
        """Save the window of one thread (every thread of the scope when empty) as a
        snapshot, with a summary; saving does not clear."""
        request = pb.SaveSnapshotRequest(
            agent=agent,
            scope=scope_pb(scope),
            thread=thread,
            description=description,
            request_id=_request_id(request_id),
        )
        response = self._call("SaveSnapshot", request, pb.SaveSnapshotResponse, timeout)
        return from_pb(t.Snapshot, response.snapshot)

    def list_snapshots(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> t.Paged[t.Snapshot]:
        """The snapshots of an agent in one scope, newest first."""

        def fetch(token: str) -> tuple[Iterable[t.Snapshot], str]:
            request = pb.ListSnapshotsRequest(
                agent=agent, scope=scope_pb(scope), page_size=page_size, page_token=token
            )
            r = self._call("ListSnapshots", request, pb.ListSnapshotsResponse, timeout)
            return (from_pb(t.Snapshot, s) for s in r.snapshots), r.next_page_token

        return self._paged(fetch, page_token)

    def get_snapshot(
        self,
        *,
        agent: str,
        id: str,
        scope: t.Scope | str | None = None,
        timeout: float | None = None,
    ) -> t.SnapshotContent:
        """A snapshot with its messages, the agent's settings then, and its specifics."""
        request = pb.GetSnapshotRequest(
            agent=agent, scope=scope_pb(scope), id=id, view=pb.SNAPSHOT_VIEW_FULL
        )
        response = self._call("GetSnapshot", request, pb.GetSnapshotResponse, timeout)
        return from_pb(t.SnapshotContent, response)

    def delete_snapshot(
        self,
        *,
        agent: str,
        id: str,
        scope: t.Scope | str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> None:
        request = pb.DeleteSnapshotRequest(
            agent=agent, scope=scope_pb(scope), id=id, request_id=_request_id(request_id)
        )
        self._call("DeleteSnapshot", request, pb.DeleteSnapshotResponse, timeout)

    def restore_snapshot(
        self,
        *,
        agent: str,
        id: str,
        scope: t.Scope | str | None = None,
        branch_thread: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> t.Restored:
        """Bring a snapshot's messages back into the window (stamped now, marked with the
        snapshot), or into the new thread `branch_thread`."""
        request = pb.RestoreSnapshotRequest(
            agent=agent,
            scope=scope_pb(scope),
            id=id,
            branch_thread=branch_thread,
            request_id=_request_id(request_id),
        )
        response = self._call("RestoreSnapshot", request, pb.RestoreSnapshotResponse, timeout)
        return from_pb(t.Restored, response)

    # API keys (contextd.v1.KeyService; an admin key).

    def create_key(
        self,
        *,
        role: t.KeyRole,
        tenant: str = "",
        name: str = "",
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> tuple[t.ApiKey, str]:
        """A new key and its secret, which is shown only here."""
        request = kpb.CreateKeyRequest(
            tenant=tenant,
            role=enum_pb(role, "KEY_ROLE_"),
            name=name,
            request_id=_request_id(request_id),
        )
        response = self._call(
            "CreateKey", request, kpb.CreateKeyResponse, timeout, service=KEY_SERVICE
        )
        return from_pb(t.ApiKey, response.key), response.secret

    def list_keys(
        self, *, include_revoked: bool = False, timeout: float | None = None
    ) -> t.Paged[t.ApiKey]:
        def fetch(token: str) -> tuple[Iterable[t.ApiKey], str]:
            request = kpb.ListKeysRequest(page_token=token, include_revoked=include_revoked)
            r = self._call("ListKeys", request, kpb.ListKeysResponse, timeout, service=KEY_SERVICE)
            return (from_pb(t.ApiKey, k) for k in r.keys), r.next_page_token

        return self._paged(fetch, "")

    def revoke_key(
        self, *, key_id: str, request_id: str | None = None, timeout: float | None = None
    ) -> t.ApiKey:
        request = kpb.RevokeKeyRequest(key_id=key_id, request_id=_request_id(request_id))
        response = self._call(
            "RevokeKey", request, kpb.RevokeKeyResponse, timeout, service=KEY_SERVICE
        )
        return from_pb(t.ApiKey, response.key)
