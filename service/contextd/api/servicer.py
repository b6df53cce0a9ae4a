"""The gRPC servicer: proto in, domain call, proto out. No rules live here.

Errors are not handled here either: domain exceptions pass through to
`contextd.api.errors`, which maps them to status codes in one place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from contextd.api.convert import (
    agent_pb,
    build_response_bytes,
    event_pb,
    formats_of,
    message_pb,
    micros,
    new_messages_of_request,
    overrides_of,
    present_fields,
    range_of,
    receipt_pb,
    receipts_pb,
    scope_of,
    search_hit_pb,
    settings_of,
    snapshot_pb,
    snapshot_response,
    snapshot_view_of,
    stats_pb,
    status_entry_of,
    status_pb,
    thread_pb,
    timestamp_pb,
    view_of,
)
from contextd.api.tenant import caller_tenant
from contextd.app.build.build_types import BuildRequest
from contextd.app.service import ContextService
from contextd.app.snapshots import RestoreResult
from contextd.domain.access import KeyRefused
from contextd.domain.errors import ContextdError
from contextd.domain.idempotency import (
    AlreadyDone,
    RequestRecord,
    check_request_id,
    replay,
)
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc

R = TypeVar("R", bound=Message)


def _unset_encoder(result: object) -> bytes:
    raise AssertionError("a request record was stored before its encoder was set")


def _fingerprint(request: Message) -> str:
    """A request's identity apart from its request_id, for spotting a reused id: the
    hash of its deterministic encoding with the id cleared (the same bytes as ever, so
    records stored by earlier versions still match). The id is cleared on the request
    itself and put back, rather than on a copy: the request is this call's own, and a
    copy of a large batch costs as much as its encoding."""
    request_id: str = request.request_id  # type: ignore[attr-defined]
    request.request_id = ""  # type: ignore[attr-defined]
    try:
        return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
    finally:
        request.request_id = request_id  # type: ignore[attr-defined]


class ContextServicer(pb_grpc.ContextServiceServicer):
    def __init__(self, service: ContextService) -> None:
        self._service = service

    def _record(self, request: Message, context: grpc.ServicerContext) -> RequestRecord | None:
        request_id: str = request.request_id  # type: ignore[attr-defined]
        if not request_id:
            return None
        return RequestRecord(
            tenant=caller_tenant(context),
            request_id=check_request_id(request_id),
            method=request.DESCRIPTOR.full_name,
            fingerprint=_fingerprint(request),
            encode=_unset_encoder,
        )

    def idempotent(
        self,
        request: Message,
        context: grpc.ServicerContext,
        response_type: type[R],
        to_response: Callable[[Any], R],
        write: Callable[[RequestRecord | None], Any],
        *,
        look_up_first: bool = True,
    ) -> R:
        """Run a write; with a request_id, a retry returns the first call's response.

        The stored payload is the serialized response (or the result it is built from),
        written in the write's own transaction; a retry is answered from it (here when it
        is already recorded, or by the store when two attempts race) without writing
        anything.

        `look_up_first=False`: the write itself reads the request id's record before it
        writes anything (the PostgreSQL append does, in its one statement), so the
        look-up here would only cost a round trip. A write that fails before the store
        answers (the agent deleted since, a quota now full) still replays a recorded
        first response: the record is looked up then.
        """
        record = self._record(request, context)
        if record is None:
            return to_response(write(None))
        # The store encodes the response to record it; the response built for that is the
        # one returned when the write's result is the object it was built from (else it is
        # built again), so a call with a request id builds its response once.
        built: list[tuple[object, R]] = []

        def encode(result: object) -> bytes:
            response = to_response(result)
            built.append((result, response))
            return response.SerializeToString()

        record = record.with_encoder(encode)
        if look_up_first:
            found = self._service.remembered(record.tenant, record.request_id)
            if found is not None:
                return response_type.FromString(replay(record, found))
        try:
            result = write(record)
        except AlreadyDone as done:
            return response_type.FromString(done.payload)
        except KeyRefused:  # a refused caller is answered nothing recorded either
            raise
        except ContextdError:
            if look_up_first:
                raise
            found = self._service.remembered(record.tenant, record.request_id)
            if found is None:
                raise
            return response_type.FromString(replay(record, found))
        if built and built[-1][0] is result:
            return built[-1][1]
        return to_response(result)

    def CreateAgent(
        self, request: pb.CreateAgentRequest, context: grpc.ServicerContext
    ) -> pb.CreateAgentResponse:
        tenant, settings = caller_tenant(context), settings_of(request.agent)
        return self.idempotent(
            request,
            context,
            pb.CreateAgentResponse,
            lambda agent: pb.CreateAgentResponse(agent=agent_pb(agent)),
            lambda record: self._service.create_agent(tenant, request.agent.name, settings, record),
        )

    def GetAgent(
        self, request: pb.GetAgentRequest, context: grpc.ServicerContext
    ) -> pb.GetAgentResponse:
        return pb.GetAgentResponse(
            agent=agent_pb(self._service.get_agent(caller_tenant(context), request.name))
        )

    def UpdateAgent(
        self, request: pb.UpdateAgentRequest, context: grpc.ServicerContext
    ) -> pb.UpdateAgentResponse:
        paths = list(request.update_mask.paths) or present_fields(request.agent)
        tenant, settings = caller_tenant(context), settings_of(request.agent)
        return self.idempotent(
            request,
            context,
            pb.UpdateAgentResponse,
            lambda agent: pb.UpdateAgentResponse(agent=agent_pb(agent)),
            lambda record: self._service.update_agent(
                tenant, request.agent.name, settings, paths, request.agent.etag, record
            ),
        )

    def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.ServicerContext
    ) -> pb.ListAgentsResponse:
        page = self._service.list_agents(
            caller_tenant(context), request.page_size, request.page_token
        )
        return pb.ListAgentsResponse(
            agents=[agent_pb(a) for a in page.items], next_page_token=page.next_page_token
        )

    def DeleteAgent(
        self, request: pb.DeleteAgentRequest, context: grpc.ServicerContext
    ) -> pb.DeleteAgentResponse:
        tenant = caller_tenant(context)
        return self.idempotent(
            request,
            context,
            pb.DeleteAgentResponse,
            lambda deleted: pb.DeleteAgentResponse(deleted_message_count=deleted),
            lambda record: self._service.delete_agent(tenant, request.name, request.etag, record),
        )

    def AppendMessages(
        self, request: pb.AppendMessagesRequest, context: grpc.ServicerContext
    ) -> pb.AppendMessagesResponse:
        messages = new_messages_of_request(request)
        tenant, scope = caller_tenant(context), scope_of(request.scope)
        return self.idempotent(
            request,
            context,
            pb.AppendMessagesResponse,
            receipts_pb,
            lambda record: self._service.append_messages(
                tenant,
                request.agent,
                scope,
                request.thread,
                messages,
                request.create_agent_if_missing,
                record,
            ),
            look_up_first=not self._service.append_answers_retries(messages),
        )

    def ListMessages(
        self, request: pb.ListMessagesRequest, context: grpc.ServicerContext
    ) -> pb.ListMessagesResponse:
        page = self._service.list_messages(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.thread,
            range_of(request.range),
            request.page_size,
            request.page_token,
        )
        return pb.ListMessagesResponse(
            messages=[message_pb(m) for m in page.messages],
            next_page_token=page.next_page_token,
            window_start_time=timestamp_pb(page.window.age_after_us if page.window else None),
        )

    def ClearContext(
        self, request: pb.ClearContextRequest, context: grpc.ServicerContext
    ) -> pb.ClearContextResponse:
        tenant, scope = caller_tenant(context), scope_of(request.scope)
        return self.idempotent(
            request,
            context,
            pb.ClearContextResponse,
            lambda marker: pb.ClearContextResponse(clear_time=timestamp_pb(marker)),
            lambda record: self._service.clear_context(
                tenant, request.agent, scope, request.thread, request.all_scopes, record
            ),
        )

    def ListThreads(
        self, request: pb.ListThreadsRequest, context: grpc.ServicerContext
    ) -> pb.ListThreadsResponse:
        page = self._service.list_threads(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.page_size,
            request.page_token,
        )
        return pb.ListThreadsResponse(
            threads=[thread_pb(t) for t in page.items], next_page_token=page.next_page_token
        )

    def GetContextStats(
        self, request: pb.GetContextStatsRequest, context: grpc.ServicerContext
    ) -> pb.GetContextStatsResponse:
        stats = self._service.context_stats(
            caller_tenant(context), request.agent, scope_of(request.scope), request.thread
        )
        return pb.GetContextStatsResponse(stats=stats_pb(stats))

    def BuildContext(self, request: pb.BuildContextRequest, context: grpc.ServicerContext) -> bytes:
        """The serialized BuildContextResponse: the server sends bytes as they are
        (`contextd.api.server.pass_bytes`; see `build_response_bytes` for why)."""
        full = view_of(request.view)
        result = self._service.build_context(
            BuildRequest(
                tenant=caller_tenant(context),
                agent=request.agent,
                scope=scope_of(request.scope),
                thread=request.thread,
                user_message=request.user_message,
                model=request.model,
                overrides=overrides_of(request.options),
                formats=formats_of(request.formats),
            )
        )
        return build_response_bytes(result, full)

    def CompactContext(
        self, request: pb.CompactContextRequest, context: grpc.ServicerContext
    ) -> pb.CompactContextResponse:
        # Compaction remembers its summary rather than a response (see service.py), so
        # its retries are answered there, before the summarizer runs again.
        result = self._service.compact_context(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.thread,
            request.model,
            overrides_of(request.options),
            self._record(request, context),
        )
        return pb.CompactContextResponse(
            summary=message_pb(result.summary),
            summarizer_path=result.path,
            summarizer_error=result.error or "",
        )

    def SetStatus(
        self, request: pb.SetStatusRequest, context: grpc.ServicerContext
    ) -> pb.SetStatusResponse:
        tenant, scope, entry = caller_tenant(context), scope_of(request.scope), request.entry
        ttl = micros(request.ttl, "ttl") if request.HasField("ttl") else None
        return self.idempotent(
            request,
            context,
            pb.SetStatusResponse,
            lambda stored: pb.SetStatusResponse(entry=status_pb(stored)),
            lambda record: self._service.set_status(
                tenant, request.agent, scope, status_entry_of(entry), ttl, record
            ),
        )

    def ListStatus(
        self, request: pb.ListStatusRequest, context: grpc.ServicerContext
    ) -> pb.ListStatusResponse:
        page = self._service.list_status(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.include_expired,
            request.page_size,
            request.page_token,
        )
        return pb.ListStatusResponse(
            entries=[status_pb(e) for e in page.items], next_page_token=page.next_page_token
        )

    def ClearStatus(
        self, request: pb.ClearStatusRequest, context: grpc.ServicerContext
    ) -> pb.ClearStatusResponse:
        tenant, scope = caller_tenant(context), scope_of(request.scope)
        return self.idempotent(
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
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.thread,
            request.type,
            micros(request.start_time, "start_time") if request.HasField("start_time") else None,
            micros(request.end_time, "end_time") if request.HasField("end_time") else None,
            request.page_size,
            request.page_token,
        )
        return pb.ListEventsResponse(
            events=[event_pb(e) for e in page.items], next_page_token=page.next_page_token
        )

    def SaveSnapshot(
        self, request: pb.SaveSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.SaveSnapshotResponse:
        tenant, scope = caller_tenant(context), scope_of(request.scope)
        return self.idempotent(
            request,
            context,
            pb.SaveSnapshotResponse,
            lambda info: pb.SaveSnapshotResponse(snapshot=snapshot_pb(info)),
            lambda record: self._service.save_snapshot(
                tenant, request.agent, scope, request.thread, request.description, record
            ),
        )

    def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> pb.ListSnapshotsResponse:
        page = self._service.list_snapshots(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.page_size,
            request.page_token,
        )
        return pb.ListSnapshotsResponse(
            snapshots=[snapshot_pb(s) for s in page.items], next_page_token=page.next_page_token
        )

    def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.GetSnapshotResponse:
        full = snapshot_view_of(request.view)
        info, contents = self._service.get_snapshot(
            caller_tenant(context), request.agent, scope_of(request.scope), request.id, full
        )
        return snapshot_response(info, contents)

    def DeleteSnapshot(
        self, request: pb.DeleteSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.DeleteSnapshotResponse:
        tenant, scope = caller_tenant(context), scope_of(request.scope)
        return self.idempotent(
            request,
            context,
            pb.DeleteSnapshotResponse,
            lambda info: pb.DeleteSnapshotResponse(snapshot=snapshot_pb(info)),
            lambda record: self._service.delete_snapshot(
                tenant, request.agent, scope, request.id, record
            ),
        )

    def RestoreSnapshot(
        self, request: pb.RestoreSnapshotRequest, context: grpc.ServicerContext
    ) -> pb.RestoreSnapshotResponse:
        tenant, scope = caller_tenant(context), scope_of(request.scope)

        def response(result: RestoreResult) -> pb.RestoreSnapshotResponse:
            return pb.RestoreSnapshotResponse(
                restored_count=result.count,
                threads=result.threads,
                receipts=[receipt_pb(r) for r in result.receipts],
            )

        return self.idempotent(
            request,
            context,
            pb.RestoreSnapshotResponse,
            response,
            lambda record: self._service.restore_snapshot(
                tenant, request.agent, scope, request.id, request.branch_thread, record
            ),
        )

    def SearchMessages(
        self, request: pb.SearchMessagesRequest, context: grpc.ServicerContext
    ) -> pb.SearchMessagesResponse:
        result = self._service.search_messages(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.thread,
            range_of(request.range),
            request.query,
            request.k,
        )
        return pb.SearchMessagesResponse(
            hits=[search_hit_pb(h) for h in result.hits],
            window_start_time=timestamp_pb(result.window.age_after_us if result.window else None),
        )
