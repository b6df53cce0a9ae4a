"""The ToolOutputService methods of `Client` (a mixin): tool outputs kept aside.

They return the generated messages of `contextd_client.v1.tool_output_service_pb2`
(ToolOutputPointer, GrepToolOutputResponse, ...), whose fields the proto documents.
Large results go through streams of 1 MiB pieces: `stream_put_tool_output` sends any
iterable of bytes, `iter_tool_outputs` yields each output's pieces as they arrive.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from contextd_client import types as t
from contextd_client._convert import scope_pb
from contextd_client.errors import from_rpc_error
from contextd_client.v1 import tool_output_service_pb2 as tpb

TOOL_OUTPUT_SERVICE = tpb.DESCRIPTOR.services_by_name["ToolOutputService"].full_name
PIECE_BYTES = 1 << 20

P = TypeVar("P")
T = TypeVar("T")


def _filter(
    agent: str,
    scope: t.Scope | str | None,
    thread: str | None,
    task_id: str | None,
    query_id: str | None,
    tool_name: str | None,
) -> tpb.ToolOutputFilter:
    f = tpb.ToolOutputFilter(agent=agent, scope=scope_pb(scope))
    for name, value in (
        ("thread", thread),
        ("task_id", task_id),
        ("query_id", query_id),
        ("tool_name", tool_name),
    ):
        if value is not None:
            setattr(f, name, value)
    return f


def _new_output(
    agent: str,
    thread: str,
    tool_name: str,
    scope: t.Scope | str | None,
    tool_description: str,
    args: dict[str, Any] | str | None,
    task_id: str | None,
    query_id: str | None,
) -> tpb.NewToolOutput:
    output = tpb.NewToolOutput(
        agent=agent,
        scope=scope_pb(scope),
        thread=thread,
        tool_name=tool_name,
        tool_description=tool_description,
        args_json=args if isinstance(args, str) else json.dumps(args or {}),
    )
    if task_id is not None:
        output.task_id = task_id
    if query_id is not None:
        output.query_id = query_id
    return output


class ToolOutputMethods:
    """Mixed into `Client`: one method per ToolOutputService RPC."""

    channel: grpc.Channel
    _metadata: tuple[tuple[str, str], ...]
    timeout: float | None
    _call: Callable[..., Any]
    _paged: Callable[..., Any]

    def _tool_call(
        self, method: str, request: Any, response_type: type[P], timeout: float | None
    ) -> P:
        result: P = self._call(method, request, response_type, timeout, service=TOOL_OUTPUT_SERVICE)
        return result

    def put_tool_output(
        self,
        *,
        agent: str,
        thread: str,
        tool_name: str,
        result: bytes | str,
        scope: t.Scope | str | None = None,
        tool_description: str = "",
        args: dict[str, Any] | str | None = None,
        task_id: str | None = None,
        query_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> tpb.ToolOutputPointer:
        """Store a result of up to 4 MiB sent whole; larger: `stream_put_tool_output`."""
        from contextd_client._client import _request_id

        request = tpb.PutToolOutputRequest(
            output=_new_output(
                agent, thread, tool_name, scope, tool_description, args, task_id, query_id
            ),
            result=result.encode() if isinstance(result, str) else result,
            request_id=_request_id(request_id),
        )
        return self._tool_call("PutToolOutput", request, tpb.PutToolOutputResponse, timeout).pointer

    def stream_put_tool_output(
        self,
        *,
        agent: str,
        thread: str,
        tool_name: str,
        pieces: Iterable[bytes],
        scope: t.Scope | str | None = None,
        tool_description: str = "",
        args: dict[str, Any] | str | None = None,
        task_id: str | None = None,
        query_id: str | None = None,
        request_id: str = "",
        timeout: float | None = None,
    ) -> tpb.ToolOutputPointer:
        """Store a result of any size from `pieces` (re-cut into 1 MiB pieces here). Not
        retried (the pieces may be a one-pass iterator); give a request_id and call again
        with the same bytes to retry safely."""
        output = _new_output(
            agent, thread, tool_name, scope, tool_description, args, task_id, query_id
        )

        def messages() -> Iterator[tpb.StreamPutToolOutputRequest]:
            yield tpb.StreamPutToolOutputRequest(output=output, request_id=request_id)
            for piece in pieces:
                for i in range(0, len(piece), PIECE_BYTES):
                    yield tpb.StreamPutToolOutputRequest(chunk=piece[i : i + PIECE_BYTES])

        call = self.channel.stream_unary(
            f"/{TOOL_OUTPUT_SERVICE}/StreamPutToolOutput",
            request_serializer=tpb.StreamPutToolOutputRequest.SerializeToString,
            response_deserializer=tpb.StreamPutToolOutputResponse.FromString,
        )
        try:
            response: tpb.StreamPutToolOutputResponse = call(
                messages(),
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return response.pointer

    def list_tool_outputs(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str | None = None,
        task_id: str | None = None,
        query_id: str | None = None,
        tool_name: str | None = None,
        timeout: float | None = None,
    ) -> t.Paged[tpb.ToolOutputPointer]:
        """Pointers (never results) matching the filter, oldest first."""
        where = _filter(agent, scope, thread, task_id, query_id, tool_name)

        def fetch(token: str) -> tuple[Iterable[tpb.ToolOutputPointer], str]:
            request = tpb.ListToolOutputsRequest(filter=where, page_token=token)
            r = self._tool_call("ListToolOutputs", request, tpb.ListToolOutputsResponse, timeout)
            return r.pointers, r.next_page_token

        paged: t.Paged[tpb.ToolOutputPointer] = self._paged(fetch, "")
        return paged

    def iter_tool_outputs(
        self,
        *,
        agent: str,
        ids: Iterable[str],
        scope: t.Scope | str | None = None,
        timeout: float | None = None,
    ) -> Iterator[tpb.GetToolOutputsResponse]:
        """GetToolOutputs' stream as it arrives: each output's pointer, then its pieces."""
        call = self.channel.unary_stream(
            f"/{TOOL_OUTPUT_SERVICE}/GetToolOutputs",
            request_serializer=tpb.GetToolOutputsRequest.SerializeToString,
            response_deserializer=tpb.GetToolOutputsResponse.FromString,
        )
        request = tpb.GetToolOutputsRequest(agent=agent, scope=scope_pb(scope), ids=list(ids))
        try:
            yield from call(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def get_tool_outputs(
        self,
        *,
        agent: str,
        ids: Iterable[str],
        scope: t.Scope | str | None = None,
        timeout: float | None = None,
    ) -> dict[str, tuple[tpb.ToolOutputPointer, bytes]]:
        """Each output found, whole, by id (for results that fit in memory)."""
        found: dict[str, tuple[tpb.ToolOutputPointer, bytearray]] = {}
        for message in self.iter_tool_outputs(agent=agent, ids=ids, scope=scope, timeout=timeout):
            if message.HasField("pointer"):
                found[message.id] = (message.pointer, bytearray())
            if message.id:
                found[message.id][1].extend(message.chunk)
        return {k: (p, bytes(data)) for k, (p, data) in found.items()}

    def read_tool_output(
        self,
        *,
        agent: str,
        id: str,
        offset: int = 0,
        length: int = 0,
        scope: t.Scope | str | None = None,
        timeout: float | None = None,
    ) -> tpb.ReadToolOutputResponse:
        request = tpb.ReadToolOutputRequest(
            agent=agent, scope=scope_pb(scope), id=id, offset=offset, length=length
        )
        return self._tool_call("ReadToolOutput", request, tpb.ReadToolOutputResponse, timeout)

    def grep_tool_output(
        self,
        *,
        agent: str,
        id: str,
        pattern: str,
        context_lines: int = 0,
        ignore_case: bool = False,
        max_matches: int = 0,
        offset: int = 0,
        line_number: int = 0,
        scope: t.Scope | str | None = None,
        timeout: float | None = None,
    ) -> tpb.GrepToolOutputResponse:
        request = tpb.GrepToolOutputRequest(
            agent=agent,
            scope=scope_pb(scope),
            id=id,
            pattern=pattern,
            context_lines=context_lines,
            ignore_case=ignore_case,
            max_matches=max_matches,
            offset=offset,
            line_number=line_number,
        )
        return self._tool_call("GrepToolOutput", request, tpb.GrepToolOutputResponse, timeout)

    def delete_tool_outputs(
        self,
        *,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str | None = None,
        task_id: str | None = None,
        query_id: str | None = None,
        tool_name: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Delete the matching outputs (pointers and results); returns how many."""
        from contextd_client._client import _request_id

        request = tpb.DeleteToolOutputsRequest(
            filter=_filter(agent, scope, thread, task_id, query_id, tool_name),
            request_id=_request_id(request_id),
        )
        response = self._tool_call(
            "DeleteToolOutputs", request, tpb.DeleteToolOutputsResponse, timeout
        )
        return int(response.deleted_count)

    def hash_query(self, query: str, *, timeout: float | None = None) -> str:
        request = tpb.HashQueryRequest(query=query)
        return str(self._tool_call("HashQuery", request, tpb.HashQueryResponse, timeout).query_id)

    def select_relevant_tool_outputs(
        self,
        *,
        query: str,
        agent: str,
        scope: t.Scope | str | None = None,
        thread: str | None = None,
        task_id: str | None = None,
        query_id: str | None = None,
        tool_name: str | None = None,
        k: int = 0,
        keyword: bool = False,
        excerpt_tokens: int = 0,
        timeout: float | None = None,
    ) -> tpb.SelectRelevantToolOutputsResponse:
        """The k outputs most relevant to `query` (BM25, or keyword overlap with the tool
        description), highest first, with excerpts when excerpt_tokens > 0."""
        request = tpb.SelectRelevantToolOutputsRequest(
            query=query,
            filter=_filter(agent, scope, thread, task_id, query_id, tool_name),
            k=k,
            scorer=tpb.RELEVANCE_SCORER_KEYWORD if keyword else tpb.RELEVANCE_SCORER_BM25,
            excerpt_tokens=excerpt_tokens,
        )
        return self._tool_call(
            "SelectRelevantToolOutputs", request, tpb.SelectRelevantToolOutputsResponse, timeout
        )
