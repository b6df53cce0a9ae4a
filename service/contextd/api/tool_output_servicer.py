"""The ToolOutputService servicer: proto in, use case, proto out (no rules here)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import grpc

from contextd.api.convert import scope_of, scope_pb, timestamp_pb
from contextd.api.servicer import ContextServicer, _fingerprint
from contextd.api.tenant import caller_tenant
from contextd.app.service import ContextService
from contextd.app.tool_output_reads import Excerpt
from contextd.app.tool_outputs import CHUNK
from contextd.domain.errors import InvalidArgument
from contextd.domain.idempotency import AlreadyDone, RequestRecord, check_request_id, replay
from contextd.domain.limits import TOOL_OUTPUT_MAX_UNARY_BYTES
from contextd.domain.tool_outputs import (
    NewToolOutput,
    ToolOutputFilter,
    ToolOutputPointer,
    hash_query,
)
from contextd.v1 import tool_output_service_pb2 as tpb
from contextd.v1 import tool_output_service_pb2_grpc as tpb_grpc


def pointer_pb(p: ToolOutputPointer) -> tpb.ToolOutputPointer:
    message = tpb.ToolOutputPointer(
        id=p.id,
        key=p.key,
        agent=p.agent,
        scope=scope_pb(p.scope),
        thread=p.thread,
        tool_name=p.tool_name,
        tool_description=p.tool_description,
        args_json=p.args_json,
        size_bytes=p.size_bytes,
        token_count=p.token_count,
        create_time=timestamp_pb(p.create_time_us),
        kind=int(p.kind),  # type: ignore[arg-type]
        stored_inline=p.stored_inline,
        stored_bytes=p.stored_bytes,
        sha256=p.sha256,
    )
    if p.task_id is not None:
        message.task_id = p.task_id
    if p.query_id is not None:
        message.query_id = p.query_id
    return message


def excerpt_pb(e: Excerpt) -> tpb.ToolOutputExcerpt:
    return tpb.ToolOutputExcerpt(
        id=e.output_id, offset=e.offset, length=e.length, text=e.text, part=e.part
    )


def _optional(message: object, name: str) -> str | None:
    return getattr(message, name) if message.HasField(name) else None  # type: ignore[attr-defined]


def filter_of(tenant: str, f: tpb.ToolOutputFilter) -> ToolOutputFilter:
    return ToolOutputFilter(
        tenant=tenant,
        agent=f.agent,
        scope=scope_of(f.scope, "filter.scope"),
        thread=_optional(f, "thread"),
        task_id=_optional(f, "task_id"),
        query_id=_optional(f, "query_id"),
        tool_name=_optional(f, "tool_name"),
    )


def new_output_of(tenant: str, o: tpb.NewToolOutput) -> NewToolOutput:
    return NewToolOutput(
        tenant=tenant,
        agent=o.agent,
        scope=scope_of(o.scope, "output.scope"),
        thread=o.thread,
        tool_name=o.tool_name,
        tool_description=o.tool_description,
        args_json=o.args_json,
        task_id=_optional(o, "task_id"),
        query_id=_optional(o, "query_id"),
    )


def _stream_invalid(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason="TOOL_OUTPUT_STREAM_INVALID", field=field)


class ToolOutputServicer(tpb_grpc.ToolOutputServiceServicer):
    def __init__(self, service: ContextService, requests: ContextServicer) -> None:
        self._service = service
        self._requests = requests  # request ids work as for every write

    def PutToolOutput(
        self, request: tpb.PutToolOutputRequest, context: grpc.ServicerContext
    ) -> tpb.PutToolOutputResponse:
        output = new_output_of(caller_tenant(context), request.output)
        return self._requests.idempotent(
            request,
            context,
            tpb.PutToolOutputResponse,
            lambda p: tpb.PutToolOutputResponse(pointer=pointer_pb(p)),
            lambda record: self._service.put_tool_output(
                output,
                [request.result],
                (lambda _sha: record) if record else None,
                max_bytes=TOOL_OUTPUT_MAX_UNARY_BYTES,
            ),
        )

    def StreamPutToolOutput(
        self, requests: Iterator[tpb.StreamPutToolOutputRequest], context: grpc.ServicerContext
    ) -> tpb.StreamPutToolOutputResponse:
        tenant = caller_tenant(context)
        first = next(requests, None)
        if first is None or not first.HasField("output"):
            raise _stream_invalid("the stream's first message must carry `output`", "output")
        output = new_output_of(tenant, first.output)

        def pieces() -> Iterator[bytes]:
            message: tpb.StreamPutToolOutputRequest | None = first
            while message is not None:
                if len(message.chunk) > CHUNK:
                    raise _stream_invalid(f"a chunk is over {CHUNK:,} bytes", "chunk")
                yield message.chunk
                message = next(requests, None)
                if message is not None and (message.HasField("output") or message.request_id):
                    raise _stream_invalid(
                        "only the stream's first message may carry `output` and `request_id`",
                        "output",
                    )

        def respond(p: ToolOutputPointer) -> tpb.StreamPutToolOutputResponse:
            return tpb.StreamPutToolOutputResponse(pointer=pointer_pb(p))

        if not first.request_id:
            return respond(self._service.put_tool_output(output, pieces()))
        header = tpb.StreamPutToolOutputRequest()
        header.CopyFrom(first)
        header.chunk = b""
        base = _fingerprint(header)

        def record_for(sha: str) -> RequestRecord:
            return RequestRecord(
                tenant=tenant,
                request_id=check_request_id(first.request_id),
                method=first.DESCRIPTOR.full_name,
                fingerprint=f"{base}:{sha}",
                encode=lambda p: respond(p).SerializeToString(),
            )

        found = self._service.remembered(tenant, check_request_id(first.request_id))
        if found is not None:  # a retry: hash what it sends, then answer as the first time
            sha = hashlib.sha256()
            for piece in pieces():
                sha.update(piece)
            payload = replay(record_for(sha.hexdigest()), found)
            return tpb.StreamPutToolOutputResponse.FromString(payload)
        try:
            return respond(self._service.put_tool_output(output, pieces(), record_for))
        except AlreadyDone as done:
            return tpb.StreamPutToolOutputResponse.FromString(done.payload)

    def ListToolOutputs(
        self, request: tpb.ListToolOutputsRequest, context: grpc.ServicerContext
    ) -> tpb.ListToolOutputsResponse:
        page = self._service.list_tool_outputs(
            filter_of(caller_tenant(context), request.filter),
            request.page_size,
            request.page_token,
        )
        return tpb.ListToolOutputsResponse(
            pointers=[pointer_pb(p) for p in page.items], next_page_token=page.next_page_token
        )

    def GetToolOutputs(
        self, request: tpb.GetToolOutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[tpb.GetToolOutputsResponse]:
        tenant = caller_tenant(context)
        scope = scope_of(request.scope)
        found, missing = self._service.find_tool_outputs(
            tenant, request.agent, scope, list(request.ids)
        )
        if not found:
            yield tpb.GetToolOutputsResponse(missing_ids=missing, last=True)
            return
        for n, pointer in enumerate(found):
            offset = 0
            message: tpb.GetToolOutputsResponse | None = tpb.GetToolOutputsResponse(
                pointer=pointer_pb(pointer), id=pointer.id, missing_ids=missing if n == 0 else ()
            )
            # The last piece is held until the whole result has been checked.
            for chunk in self._service.result_chunks(pointer):
                if message is None:
                    message = tpb.GetToolOutputsResponse(id=pointer.id)
                message.chunk, message.offset = chunk, offset
                offset += len(chunk)
                if offset < pointer.size_bytes:
                    yield message
                    message = None
            if message is None:
                message = tpb.GetToolOutputsResponse(id=pointer.id, offset=offset)
            message.last = True
            yield message

    def ReadToolOutput(
        self, request: tpb.ReadToolOutputRequest, context: grpc.ServicerContext
    ) -> tpb.ReadToolOutputResponse:
        pointer, data = self._service.read_tool_output(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.id,
            request.offset,
            request.length,
        )
        return tpb.ReadToolOutputResponse(
            pointer=pointer_pb(pointer),
            data=data,
            offset=request.offset,
            eof=request.offset + len(data) >= pointer.size_bytes,
        )

    def GrepToolOutput(
        self, request: tpb.GrepToolOutputRequest, context: grpc.ServicerContext
    ) -> tpb.GrepToolOutputResponse:
        result = self._service.grep_tool_output(
            caller_tenant(context),
            request.agent,
            scope_of(request.scope),
            request.id,
            request.pattern,
            request.context_lines,
            request.ignore_case,
            request.max_matches,
            request.offset,
            request.line_number,
        )
        return tpb.GrepToolOutputResponse(
            matches=[
                tpb.GrepMatch(
                    line_number=m.line_number,
                    offset=m.offset,
                    line=m.line,
                    before=m.before,
                    after=m.after,
                )
                for m in result.matches
            ],
            next_offset=result.next_offset,
            next_line_number=result.next_line_number,
            scanned_bytes=result.scanned_bytes,
        )

    def DeleteToolOutputs(
        self, request: tpb.DeleteToolOutputsRequest, context: grpc.ServicerContext
    ) -> tpb.DeleteToolOutputsResponse:
        where = filter_of(caller_tenant(context), request.filter)
        return self._requests.idempotent(
            request,
            context,
            tpb.DeleteToolOutputsResponse,
            lambda n: tpb.DeleteToolOutputsResponse(deleted_count=n),
            lambda record: self._service.delete_tool_outputs(where, record),
        )

    def HashQuery(
        self, request: tpb.HashQueryRequest, context: grpc.ServicerContext
    ) -> tpb.HashQueryResponse:
        return tpb.HashQueryResponse(query_id=hash_query(request.query))

    def SelectRelevantToolOutputs(
        self, request: tpb.SelectRelevantToolOutputsRequest, context: grpc.ServicerContext
    ) -> tpb.SelectRelevantToolOutputsResponse:
        if request.scorer not in tpb.RelevanceScorer.values():
            raise InvalidArgument("scorer is not a RelevanceScorer", field="scorer")
        selected, fallback = self._service.select_relevant(
            request.query,
            filter_of(caller_tenant(context), request.filter),
            request.k,
            keyword=request.scorer == tpb.RELEVANCE_SCORER_KEYWORD,
            excerpt_tokens=request.excerpt_tokens,
        )
        return tpb.SelectRelevantToolOutputsResponse(
            outputs=[
                tpb.RelevantToolOutput(
                    pointer=pointer_pb(r.pointer),
                    score=r.score,
                    excerpts=[excerpt_pb(e) for e in r.excerpts],
                )
                for r in selected
            ],
            fallback=fallback,
        )
