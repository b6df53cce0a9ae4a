"""The gRPC servicer: proto in, domain call, proto out. No rules live here.

Errors are not handled here either: domain exceptions pass through to
`contextd.api.errors`, which maps them to status codes in one place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2, timestamp_pb2
from google.protobuf.message import Message

from contextd.app.build.builder import BuildRequest, BuildResult
from contextd.app.service import ContextService
from contextd.domain import scopes
from contextd.domain.context import HistoryItem, StatusEntry, StatusKind
from contextd.domain.errors import InvalidArgument
from contextd.domain.idempotency import (
    AlreadyDone,
    RequestRecord,
    check_request_id,
    replay,
)
from contextd.domain.model import (
    DEFAULT_ROLLING_WINDOW_US,
    DEFAULT_TENANT,
    Agent,
    AgentDoc,
    AgentSettings,
    BuildOverrides,
    ContextStats,
    Event,
    MessageRange,
    MessageReceipt,
    MessageStamp,
    NewMessage,
    Role,
    StoredMessage,
    Thread,
)
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc


def _timestamp(us: int | None) -> timestamp_pb2.Timestamp | None:
    if us is None:
        return None
    seconds, micros = divmod(us, 1_000_000)  # micros >= 0, as Timestamp requires
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=micros * 1_000)


# google.protobuf.Duration's documented range, which keeps every time sum within int64.
_MAX_DURATION_S = 315_576_000_000


def _micros(value: timestamp_pb2.Timestamp | duration_pb2.Duration, field: str) -> int:
    """A Timestamp or Duration in microseconds; INVALID_ARGUMENT when it is outside what
    protobuf allows or what the store can hold (a signed 64-bit count of microseconds)."""
    try:
        micros = value.ToMicroseconds()  # checks a Timestamp's range, not a Duration's
    except ValueError as exc:
        raise InvalidArgument(f"{field} is out of range: {exc}", field=field) from exc
    if isinstance(value, duration_pb2.Duration) and abs(value.seconds) > _MAX_DURATION_S:
        raise InvalidArgument(
            f"{field} is out of range: at most {_MAX_DURATION_S:,} seconds (10,000 years)",
            field=field,
        )
    return micros


def _duration(us: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMicroseconds(us)
    return d


_OPTION_FIELDS = BuildOverrides.__slots__  # the proto's BuildOptions fields, same names


def _overrides(options: pb.BuildOptions) -> BuildOverrides:
    values = {f: getattr(options, f) for f in _OPTION_FIELDS if options.HasField(f)}
    return BuildOverrides(**values)


def _options_pb(overrides: BuildOverrides | None) -> pb.BuildOptions:
    return pb.BuildOptions(**(overrides.as_dict() if overrides else {}))  # type: ignore[arg-type]


_FORMAT_NAMES: dict[str, int] = {
    "anthropic": pb.CONTEXT_FORMAT_ANTHROPIC,
    "openai": pb.CONTEXT_FORMAT_OPENAI,
    "text": pb.CONTEXT_FORMAT_TEXT,
}
_FORMATS: dict[int, str] = {
    pb.CONTEXT_FORMAT_ANTHROPIC: "anthropic",
    pb.CONTEXT_FORMAT_OPENAI: "openai",
    pb.CONTEXT_FORMAT_TEXT: "text",
}


def _formats(values: Sequence[int]) -> tuple[str, ...]:
    out: list[str] = []
    for i, value in enumerate(values):
        if value not in _FORMATS:
            raise InvalidArgument(
                f"formats[{i}] is {value}; use CONTEXT_FORMAT_ANTHROPIC, CONTEXT_FORMAT_OPENAI "
                "or CONTEXT_FORMAT_TEXT",
                field=f"formats[{i}]",
            )
        if _FORMATS[value] in out:
            raise InvalidArgument(
                f"formats[{i}] repeats {pb.ContextFormat.Name(value)}", field=f"formats[{i}]"
            )
        out.append(_FORMATS[value])
    return tuple(out)


def _view(value: int) -> bool:
    """Whether the response carries the structured context (True) or renderings only."""
    if value in (pb.CONTEXT_VIEW_UNSPECIFIED, pb.CONTEXT_VIEW_FULL):
        return True
    if value == pb.CONTEXT_VIEW_RENDERINGS:
        return False
    raise InvalidArgument(
        f"view {value} is not a known view; use CONTEXT_VIEW_FULL or CONTEXT_VIEW_RENDERINGS",
        field="view",
    )


def _status_pb(entry: StatusEntry) -> pb.StatusEntry:
    return pb.StatusEntry(
        key=entry.key,
        kind=pb.STATUS_KIND_THREAD if entry.kind == StatusKind.THREAD else pb.STATUS_KIND_PROCESS,
        state=entry.state,
        summary=entry.summary,
        update_time=_timestamp(entry.update_time_us or None),
        expire_time=_timestamp(entry.expire_time_us),
    )


def _status_entry(entry: pb.StatusEntry) -> StatusEntry:
    if entry.kind == pb.STATUS_KIND_THREAD:
        kind = StatusKind.THREAD
    elif entry.kind == pb.STATUS_KIND_PROCESS:
        kind = StatusKind.PROCESS
    else:
        raise InvalidArgument(
            "entry.kind is required (STATUS_KIND_THREAD or STATUS_KIND_PROCESS)",
            field="entry.kind",
        )
    return StatusEntry(
        key=entry.key,
        kind=kind,
        state=entry.state,
        summary=entry.summary,
        update_time_us=0,
        expire_time_us=(
            _micros(entry.expire_time, "entry.expire_time")
            if entry.HasField("expire_time")
            else None
        ),
    )


def _scope(scope: pb.Scope, field: str = "scope") -> str:
    """The canonical scope string of a request's typed scope ("" when unset)."""
    kind = scope.WhichOneof("kind")
    if kind is None:
        return scopes.DEFAULT_SCOPE
    if kind == "key":
        return scopes.key_scope(scope.key, field)
    if kind == "channel":
        c = scope.channel
        return scopes.channel_scope(c.guild_id, c.channel_id, c.user_id, field)
    return scopes.direct_message_scope(scope.direct_message.user_id, field)


def _scope_pb(scope: str) -> pb.Scope:
    kind = scopes.parse(scope)
    if isinstance(kind, scopes.ChannelScope):
        return pb.Scope(
            channel=pb.ChannelScope(
                guild_id=kind.guild_id, channel_id=kind.channel_id, user_id=kind.user_id
            )
        )
    if isinstance(kind, scopes.DirectMessageScope):
        return pb.Scope(direct_message=pb.DirectMessageScope(user_id=kind.user_id))
    if isinstance(kind, scopes.KeyScope):
        return pb.Scope(key=kind.key)
    return pb.Scope()


def _event_pb(event: Event) -> pb.Event:
    return pb.Event(
        id=event.id,
        type=event.type,
        agent=event.agent,
        scope=_scope_pb(event.scope),
        thread=event.thread,
        create_time=_timestamp(event.create_time_us),
        data=event.data,
    )


# A build over a million-message window may drop nearly all of it; listing every id would
# make the response larger than a default client accepts.
MAX_LISTED_DROPPED_IDS = 10_000


def _context_message(
    item: HistoryItem, stamp: MessageStamp | None, truncated: set[int], elided: set[int]
) -> pb.ContextMessage:
    return pb.ContextMessage(
        id=item.id,
        role=int(item.role),  # type: ignore[arg-type]
        content=item.content,
        tool_calls=item.tool_calls,
        tool_call_id=item.tool_call_id,
        token_count=item.token_count,
        truncated=item.id in truncated,
        elided=item.id in elided,
        is_summary=item.is_summary,
        create_time=_timestamp(stamp.create_time_us if stamp else None),
        source_time=_timestamp(stamp.source_time_us if stamp else None),
        sequence=stamp.sequence if stamp else 0,
    )


def _build_response(result: BuildResult, full: bool) -> pb.BuildContextResponse:
    ctx = result.context
    s = ctx.stats
    renderings = [
        pb.Rendering(format=_FORMAT_NAMES[name], content=content)  # type: ignore[arg-type]
        for name, content in result.renderings.items()
    ]
    truncated, elided = set(s.truncated_ids), set(s.elided_ids)
    messages = (
        [
            _context_message(item, result.stamps.get(item.id), truncated, elided)
            for item in ctx.history
        ]
        if full
        else []
    )
    if full and ctx.new_message is not None:
        messages.append(
            pb.ContextMessage(
                role=pb.ROLE_USER,
                content=ctx.new_message,
                token_count=s.new_message_tokens,
                truncated=s.new_message_truncated,
            )
        )
    first, last = s.summarized_range or (0, 0)
    stats = pb.BuildStats(
        budget_tokens=s.budget,
        total_tokens=s.total_tokens,
        system_tokens=s.system_tokens,
        docs_tokens=s.docs_tokens,
        status_tokens=s.status_tokens,
        history_tokens=s.history_tokens,
        user_message_tokens=s.new_message_tokens,
        messages_before=s.messages_before,
        messages_after=s.messages_after,
        dropped_ids=s.dropped_ids[-MAX_LISTED_DROPPED_IDS:],
        dropped_count=len(s.dropped_ids),
        truncated_ids=s.truncated_ids,
        elided_ids=s.elided_ids,
        first_summarized_id=first,
        last_summarized_id=last,
        summarizer_path=s.summarizer_path or "",
        summarizer_error=s.summarizer_error or "",
        tokenizer=result.tokenizer,
        strategy=result.strategy,
        user_message_truncated=s.new_message_truncated,
        messages_loaded=result.messages_loaded,
        orphaned_ids=result.orphaned_ids,
    )
    if not full:
        return pb.BuildContextResponse(stats=stats, renderings=renderings)
    return pb.BuildContextResponse(
        system_prompt=ctx.system_prompt,
        docs=[pb.AgentDoc(name=d.name, content=d.content) for d in ctx.docs],
        status=ctx.status,
        messages=messages,
        stats=stats,
        renderings=renderings,
    )


def _agent_pb(agent: Agent) -> pb.Agent:
    return pb.Agent(
        name=agent.name,
        tenant=agent.tenant,
        system_prompt=agent.system_prompt,
        docs=[pb.AgentDoc(name=d.name, content=d.content) for d in agent.docs],
        rolling_window=_duration(agent.rolling_window_us),
        create_time=_timestamp(agent.create_time_us),
        update_time=_timestamp(agent.update_time_us),
        last_clear_time=_timestamp(agent.last_clear_time_us),
        model=agent.model,
        build_options=_options_pb(agent.build_options),
        etag=agent.etag,
    )


def _present_fields(agent: pb.Agent) -> list[str]:
    """The update paths of an UpdateAgent without a mask: the fields the request sets
    (AIP-134), each build option on its own, so an update of `model` alone leaves the
    system prompt, docs, window and every other option as they were."""
    paths = [f for f in ("system_prompt", "model") if getattr(agent, f)]
    if agent.docs:
        paths.append("docs")
    if agent.HasField("rolling_window"):
        paths.append("rolling_window")
    paths += [f"build_options.{f}" for f in _OPTION_FIELDS if agent.build_options.HasField(f)]
    return paths


def _settings(agent: pb.Agent) -> AgentSettings:
    window = (
        _micros(agent.rolling_window, "agent.rolling_window")
        if agent.HasField("rolling_window")
        else DEFAULT_ROLLING_WINDOW_US
    )
    return AgentSettings(
        system_prompt=agent.system_prompt,
        docs=tuple(AgentDoc(d.name, d.content) for d in agent.docs),
        rolling_window_us=window,
        model=agent.model,
        build_options=_overrides(agent.build_options),
    )


def _role(value: int, index: int) -> Role:
    if value == pb.ROLE_UNSPECIFIED:
        raise InvalidArgument(
            f"messages[{index}].role is required (ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL_USE "
            "or ROLE_TOOL_RESULT)",
            field=f"messages[{index}].role",
        )
    try:
        return Role(value)
    except ValueError as exc:
        raise InvalidArgument(
            f"messages[{index}].role {value} is not a known role", field=f"messages[{index}].role"
        ) from exc


def _new_message(message: pb.Message, index: int) -> NewMessage:
    return NewMessage(
        role=_role(message.role, index),
        content=message.content,
        tool_calls=message.tool_calls,
        tool_call_id=message.tool_call_id,
        external_id=message.external_id,
        metadata=message.metadata,
        source_time_us=(
            _micros(message.source_time, f"messages[{index}].source_time")
            if message.HasField("source_time")
            else None
        ),
    )


def _message_pb(m: StoredMessage) -> pb.Message:
    return pb.Message(
        id=m.id,
        tenant=m.tenant,
        agent=m.agent,
        scope=_scope_pb(m.scope),
        thread=m.thread,
        role=int(m.role),  # type: ignore[arg-type]
        content=m.content,
        tool_calls=m.tool_calls,
        tool_call_id=m.tool_call_id,
        external_id=m.external_id,
        metadata=m.metadata,
        token_estimate=m.token_estimate,
        create_time=_timestamp(m.create_time_us),
        token_count=m.token_count,
        is_summary=m.is_summary,
        first_summarized_id=m.summarized_ids[0] if m.summarized_ids else 0,
        last_summarized_id=m.summarized_ids[1] if m.summarized_ids else 0,
        source_time=_timestamp(m.source_time_us),
        sequence=m.sequence,
    )


def _thread_pb(t: Thread) -> pb.Thread:
    return pb.Thread(
        agent=t.agent,
        scope=_scope_pb(t.scope),
        thread=t.thread,
        create_time=_timestamp(t.create_time_us),
        last_message_time=_timestamp(t.last_message_time_us),
        message_count=t.message_count,
        token_estimate=t.token_estimate,
        last_clear_time=_timestamp(t.last_clear_time_us),
        last_sequence=t.last_sequence,
    )


def _stats_pb(s: ContextStats) -> pb.ContextStats:
    return pb.ContextStats(
        window_start_time=_timestamp(s.window_start_time_us),
        last_clear_time=_timestamp(s.last_clear_time_us),
        window_message_count=s.window_message_count,
        window_token_estimate=s.window_token_estimate,
        total_message_count=s.total_message_count,
        total_token_estimate=s.total_token_estimate,
        oldest_message_time=_timestamp(s.oldest_message_time_us),
        newest_message_time=_timestamp(s.newest_message_time_us),
        rolling_window=_duration(s.rolling_window_us),
        thread_count=s.thread_count,
    )


def _range(value: int) -> MessageRange:
    if value in (pb.MESSAGE_RANGE_UNSPECIFIED, pb.MESSAGE_RANGE_WINDOW):
        return MessageRange.WINDOW
    if value == pb.MESSAGE_RANGE_ALL:
        return MessageRange.ALL
    raise InvalidArgument(f"range {value} is not a known message range", field="range")


def _receipts_pb(receipts: Sequence[MessageReceipt]) -> pb.AppendMessagesResponse:
    return pb.AppendMessagesResponse(
        receipts=[
            pb.MessageReceipt(
                id=r.id,
                create_time=_timestamp(r.create_time_us),
                token_estimate=r.token_estimate,
                token_count=r.token_count,
                sequence=r.sequence,
            )
            for r in receipts
        ]
    )


R = TypeVar("R", bound=Message)


def _unset_encoder(result: object) -> bytes:
    raise AssertionError("a request record was stored before its encoder was set")


def _fingerprint(request: Message) -> str:
    """A request's identity apart from its request_id, for spotting a reused id."""
    copy = type(request)()
    copy.CopyFrom(request)
    copy.request_id = ""  # type: ignore[attr-defined]
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


class ContextServicer(pb_grpc.ContextServiceServicer):
    def __init__(self, service: ContextService) -> None:
        self._service = service

    @staticmethod
    def _tenant(context: grpc.ServicerContext) -> str:
        # Until authentication exists every caller is the default tenant; this is the one
        # place that will read the tenant from the caller's credentials.
        return DEFAULT_TENANT

    def _record(self, request: Message, context: grpc.ServicerContext) -> RequestRecord | None:
        request_id: str = request.request_id  # type: ignore[attr-defined]
        if not request_id:
            return None
        return RequestRecord(
            tenant=self._tenant(context),
            request_id=check_request_id(request_id),
            method=request.DESCRIPTOR.full_name,
            fingerprint=_fingerprint(request),
            encode=_unset_encoder,
        )

    def _idempotent(
        self,
        request: Message,
        context: grpc.ServicerContext,
        response_type: type[R],
        to_response: Callable[[Any], R],
        write: Callable[[RequestRecord | None], Any],
    ) -> R:
        """Run a write; with a request_id, a retry returns the first call's response.

        The stored payload is the serialized response, written in the write's own
        transaction; a retry is answered from it (here when it is already recorded, or
        by the store when two attempts race) without writing anything.
        """
        record = self._record(request, context)
        if record is None:
            return to_response(write(None))
        found = self._service.remembered(record.tenant, record.request_id)
        if found is not None:
            return response_type.FromString(replay(record, found))
        record = record.with_encoder(lambda result: to_response(result).SerializeToString())
        try:
            return to_response(write(record))
        except AlreadyDone as done:
            return response_type.FromString(done.payload)

    def CreateAgent(
        self, request: pb.CreateAgentRequest, context: grpc.ServicerContext
    ) -> pb.CreateAgentResponse:
        tenant, settings = self._tenant(context), _settings(request.agent)
        return self._idempotent(
            request,
            context,
            pb.CreateAgentResponse,
            lambda agent: pb.CreateAgentResponse(agent=_agent_pb(agent)),
            lambda record: self._service.create_agent(tenant, request.agent.name, settings, record),
        )

    def GetAgent(
        self, request: pb.GetAgentRequest, context: grpc.ServicerContext
    ) -> pb.GetAgentResponse:
        return pb.GetAgentResponse(
            agent=_agent_pb(self._service.get_agent(self._tenant(context), request.name))
        )

    def UpdateAgent(
        self, request: pb.UpdateAgentRequest, context: grpc.ServicerContext
    ) -> pb.UpdateAgentResponse:
        paths = list(request.update_mask.paths) or _present_fields(request.agent)
        tenant, settings = self._tenant(context), _settings(request.agent)
        return self._idempotent(
            request,
            context,
            pb.UpdateAgentResponse,
            lambda agent: pb.UpdateAgentResponse(agent=_agent_pb(agent)),
            lambda record: self._service.update_agent(
                tenant, request.agent.name, settings, paths, request.agent.etag, record
            ),
        )

    def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.ServicerContext
    ) -> pb.ListAgentsResponse:
        page = self._service.list_agents(
            self._tenant(context), request.page_size, request.page_token
        )
        return pb.ListAgentsResponse(
            agents=[_agent_pb(a) for a in page.items], next_page_token=page.next_page_token
        )

    def DeleteAgent(
        self, request: pb.DeleteAgentRequest, context: grpc.ServicerContext
    ) -> pb.DeleteAgentResponse:
        tenant = self._tenant(context)
        return self._idempotent(
            request,
            context,
            pb.DeleteAgentResponse,
            lambda deleted: pb.DeleteAgentResponse(deleted_message_count=deleted),
            lambda record: self._service.delete_agent(tenant, request.name, request.etag, record),
        )

    def AppendMessages(
        self, request: pb.AppendMessagesRequest, context: grpc.ServicerContext
    ) -> pb.AppendMessagesResponse:
        messages = [_new_message(m, i) for i, m in enumerate(request.messages)]
        tenant, scope = self._tenant(context), _scope(request.scope)
        return self._idempotent(
            request,
            context,
            pb.AppendMessagesResponse,
            _receipts_pb,
            lambda record: self._service.append_messages(
                tenant,
                request.agent,
                scope,
                request.thread,
                messages,
                request.create_agent_if_missing,
                record,
            ),
        )

    def ListMessages(
        self, request: pb.ListMessagesRequest, context: grpc.ServicerContext
    ) -> pb.ListMessagesResponse:
        page = self._service.list_messages(
            self._tenant(context),
            request.agent,
            _scope(request.scope),
            request.thread,
            _range(request.range),
            request.page_size,
            request.page_token,
        )
        return pb.ListMessagesResponse(
            messages=[_message_pb(m) for m in page.messages],
            next_page_token=page.next_page_token,
            window_start_time=_timestamp(page.window.age_after_us if page.window else None),
        )

    def ClearContext(
        self, request: pb.ClearContextRequest, context: grpc.ServicerContext
    ) -> pb.ClearContextResponse:
        tenant, scope = self._tenant(context), _scope(request.scope)
        return self._idempotent(
            request,
            context,
            pb.ClearContextResponse,
            lambda marker: pb.ClearContextResponse(clear_time=_timestamp(marker)),
            lambda record: self._service.clear_context(
                tenant, request.agent, scope, request.thread, request.all_scopes, record
            ),
        )

    def ListThreads(
        self, request: pb.ListThreadsRequest, context: grpc.ServicerContext
    ) -> pb.ListThreadsResponse:
        page = self._service.list_threads(
            self._tenant(context),
            request.agent,
            _scope(request.scope),
            request.page_size,
            request.page_token,
        )
        return pb.ListThreadsResponse(
            threads=[_thread_pb(t) for t in page.items], next_page_token=page.next_page_token
        )

    def GetContextStats(
        self, request: pb.GetContextStatsRequest, context: grpc.ServicerContext
    ) -> pb.GetContextStatsResponse:
        stats = self._service.context_stats(
            self._tenant(context), request.agent, _scope(request.scope), request.thread
        )
        return pb.GetContextStatsResponse(stats=_stats_pb(stats))

    def BuildContext(
        self, request: pb.BuildContextRequest, context: grpc.ServicerContext
    ) -> pb.BuildContextResponse:
        full = _view(request.view)
        result = self._service.build_context(
            BuildRequest(
                tenant=self._tenant(context),
                agent=request.agent,
                scope=_scope(request.scope),
                thread=request.thread,
                user_message=request.user_message,
                model=request.model,
                overrides=_overrides(request.options),
                formats=_formats(request.formats),
            )
        )
        return _build_response(result, full)

    def CompactContext(
        self, request: pb.CompactContextRequest, context: grpc.ServicerContext
    ) -> pb.CompactContextResponse:
        # Compaction remembers its summary rather than a response (see service.py), so
        # its retries are answered there, before the summarizer runs again.
        result = self._service.compact_context(
            self._tenant(context),
            request.agent,
            _scope(request.scope),
            request.thread,
            request.model,
            _overrides(request.options),
            self._record(request, context),
        )
        return pb.CompactContextResponse(
            summary=_message_pb(result.summary),
            summarizer_path=result.path,
            summarizer_error=result.error or "",
        )

    def SetStatus(
        self, request: pb.SetStatusRequest, context: grpc.ServicerContext
    ) -> pb.SetStatusResponse:
        tenant, scope, entry = self._tenant(context), _scope(request.scope), request.entry
        ttl = _micros(request.ttl, "ttl") if request.HasField("ttl") else None
        return self._idempotent(
            request,
            context,
            pb.SetStatusResponse,
            lambda stored: pb.SetStatusResponse(entry=_status_pb(stored)),
            lambda record: self._service.set_status(
                tenant, request.agent, scope, _status_entry(entry), ttl, record
            ),
        )

    def ListStatus(
        self, request: pb.ListStatusRequest, context: grpc.ServicerContext
    ) -> pb.ListStatusResponse:
        page = self._service.list_status(
            self._tenant(context),
            request.agent,
            _scope(request.scope),
            request.include_expired,
            request.page_size,
            request.page_token,
        )
        return pb.ListStatusResponse(
            entries=[_status_pb(e) for e in page.items], next_page_token=page.next_page_token
        )

    def ClearStatus(
        self, request: pb.ClearStatusRequest, context: grpc.ServicerContext
    ) -> pb.ClearStatusResponse:
        tenant, scope = self._tenant(context), _scope(request.scope)
        return self._idempotent(
            request,
            context,
            pb.ClearStatusResponse,
            lambda removed: pb.ClearStatusResponse(removed_count=removed),
            lambda record: self._service.clear_status(
                tenant, request.agent, scope, request.key, record
            ),
        )

    def ListEvents(
        self, request: pb.ListEventsRequest, context: grpc.ServicerContext
    ) -> pb.ListEventsResponse:
        page = self._service.list_events(
            self._tenant(context),
            request.agent,
            _scope(request.scope),
            request.thread,
            request.type,
            _micros(request.start_time, "start_time") if request.HasField("start_time") else None,
            _micros(request.end_time, "end_time") if request.HasField("end_time") else None,
            request.page_size,
            request.page_token,
        )
        return pb.ListEventsResponse(
            events=[_event_pb(e) for e in page.items], next_page_token=page.next_page_token
        )
