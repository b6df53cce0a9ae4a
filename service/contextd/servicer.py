"""The gRPC servicer: proto in, domain call, proto out. No rules live here.

Errors are not handled here either: domain exceptions pass through to
`contextd.grpc_errors`, which maps them to status codes in one place.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from contextd.domain import (
    DEFAULT_ROLLING_WINDOW_US,
    DEFAULT_TENANT,
    Agent,
    AgentDoc,
    AgentSettings,
    ContextStats,
    MessageRange,
    NewMessage,
    Role,
    StoredMessage,
    Thread,
)
from contextd.errors import InvalidArgument
from contextd.service import ContextService
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc


def _timestamp(us: int | None) -> timestamp_pb2.Timestamp | None:
    if us is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromMicroseconds(us)
    return ts


def _duration(us: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMicroseconds(us)
    return d


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
    )


def _settings(agent: pb.Agent) -> AgentSettings:
    window = (
        agent.rolling_window.ToMicroseconds()
        if agent.HasField("rolling_window")
        else DEFAULT_ROLLING_WINDOW_US
    )
    return AgentSettings(
        system_prompt=agent.system_prompt,
        docs=tuple(AgentDoc(d.name, d.content) for d in agent.docs),
        rolling_window_us=window,
        model=agent.model,
    )


def _role(value: int, index: int) -> Role:
    if value == pb.ROLE_UNSPECIFIED:
        raise InvalidArgument(
            f"messages[{index}].role is required (USER, ASSISTANT, TOOL_USE or TOOL_RESULT)",
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
        create_time_us=(
            message.create_time.ToMicroseconds() if message.HasField("create_time") else None
        ),
    )


def _message_pb(m: StoredMessage) -> pb.Message:
    return pb.Message(
        id=m.id,
        tenant=m.tenant,
        agent=m.agent,
        scope=m.scope,
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
    )


def _thread_pb(t: Thread) -> pb.Thread:
    return pb.Thread(
        agent=t.agent,
        scope=t.scope,
        thread=t.thread,
        create_time=_timestamp(t.create_time_us),
        last_message_time=_timestamp(t.last_message_time_us),
        message_count=t.message_count,
        token_estimate=t.token_estimate,
        last_clear_time=_timestamp(t.last_clear_time_us),
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


class ContextServicer(pb_grpc.ContextServiceServicer):
    def __init__(self, service: ContextService) -> None:
        self._service = service

    @staticmethod
    def _tenant(context: grpc.ServicerContext) -> str:
        # Until authentication exists every caller is the default tenant; this is the one
        # place that will read the tenant from the caller's credentials.
        return DEFAULT_TENANT

    def CreateAgent(
        self, request: pb.CreateAgentRequest, context: grpc.ServicerContext
    ) -> pb.CreateAgentResponse:
        agent = self._service.create_agent(
            self._tenant(context), request.agent.name, _settings(request.agent)
        )
        return pb.CreateAgentResponse(agent=_agent_pb(agent))

    def GetAgent(
        self, request: pb.GetAgentRequest, context: grpc.ServicerContext
    ) -> pb.GetAgentResponse:
        return pb.GetAgentResponse(
            agent=_agent_pb(self._service.get_agent(self._tenant(context), request.name))
        )

    def UpdateAgent(
        self, request: pb.UpdateAgentRequest, context: grpc.ServicerContext
    ) -> pb.UpdateAgentResponse:
        agent = self._service.update_agent(
            self._tenant(context),
            request.agent.name,
            _settings(request.agent),
            list(request.update_mask.paths),
        )
        return pb.UpdateAgentResponse(agent=_agent_pb(agent))

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
        deleted = self._service.delete_agent(self._tenant(context), request.name)
        return pb.DeleteAgentResponse(deleted_message_count=deleted)

    def AppendMessages(
        self, request: pb.AppendMessagesRequest, context: grpc.ServicerContext
    ) -> pb.AppendMessagesResponse:
        messages = [_new_message(m, i) for i, m in enumerate(request.messages)]
        receipts = self._service.append_messages(
            self._tenant(context), request.agent, request.scope, request.thread, messages
        )
        return pb.AppendMessagesResponse(
            receipts=[
                pb.MessageReceipt(
                    id=r.id,
                    create_time=_timestamp(r.create_time_us),
                    token_estimate=r.token_estimate,
                    token_count=r.token_count,
                )
                for r in receipts
            ]
        )

    def ListMessages(
        self, request: pb.ListMessagesRequest, context: grpc.ServicerContext
    ) -> pb.ListMessagesResponse:
        page = self._service.list_messages(
            self._tenant(context),
            request.agent,
            request.scope,
            request.thread,
            _range(request.range),
            request.page_size,
            request.page_token,
        )
        return pb.ListMessagesResponse(
            messages=[_message_pb(m) for m in page.messages],
            next_page_token=page.next_page_token,
            window_start_time=_timestamp(page.window_start_us),
        )

    def ClearContext(
        self, request: pb.ClearContextRequest, context: grpc.ServicerContext
    ) -> pb.ClearContextResponse:
        marker = self._service.clear_context(
            self._tenant(context), request.agent, request.scope, request.thread
        )
        return pb.ClearContextResponse(clear_time=_timestamp(marker))

    def ListThreads(
        self, request: pb.ListThreadsRequest, context: grpc.ServicerContext
    ) -> pb.ListThreadsResponse:
        page = self._service.list_threads(
            self._tenant(context),
            request.agent,
            request.scope,
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
            self._tenant(context), request.agent, request.scope, request.thread
        )
        return pb.GetContextStatsResponse(stats=_stats_pb(stats))
