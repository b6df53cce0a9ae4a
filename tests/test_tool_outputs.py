"""ToolOutputService over gRPC, on both engines: every output persisted, pointers by query
and task, relevance order and its fallback, the deterministic query hash, clear, lazy
loads, reads and greps of large results, retries, isolation and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import InProcessServer, db_rows
from contextd.domain.limits import TOOL_OUTPUT_CHUNK_BYTES
from contextd.domain.tool_outputs import hash_query
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc
from contextd.v1 import tool_output_service_pb2 as tpb
from contextd.v1 import tool_output_service_pb2_grpc as tpb_grpc

MiB = 1 << 20


class Tools:
    """ToolOutputService calls with one key (or none)."""

    def __init__(self, channel: grpc.Channel, key: str | None = None) -> None:
        self.stub = tpb_grpc.ToolOutputServiceStub(channel)  # type: ignore[no-untyped-call]
        self.metadata = [("authorization", f"Bearer {key}")] if key else []

    def put(
        self,
        result: bytes | str,
        *,
        agent: str = "a1",
        scope: str = "",
        thread: str = "t1",
        tool: str = "search_code",
        description: str = "",
        args: dict[str, Any] | None = None,
        request_id: str = "",
        **tags: str,
    ) -> tpb.ToolOutputPointer:
        data = result.encode() if isinstance(result, str) else result
        response = self.stub.PutToolOutput(
            tpb.PutToolOutputRequest(
                output=self.new(agent, scope, thread, tool, description, args, **tags),
                result=data,
                request_id=request_id,
            ),
            metadata=self.metadata,
        )
        return response.pointer  # type: ignore[no-any-return]

    @staticmethod
    def new(
        agent: str = "a1",
        scope: str = "",
        thread: str = "t1",
        tool: str = "search_code",
        description: str = "",
        args: dict[str, Any] | None = None,
        **tags: str,
    ) -> tpb.NewToolOutput:
        return tpb.NewToolOutput(
            agent=agent,
            scope=pb.Scope(key=scope) if scope else pb.Scope(),
            thread=thread,
            tool_name=tool,
            tool_description=description,
            args_json=json.dumps(args or {}),
            **tags,
        )

    def stream_put(
        self, pieces: Iterator[bytes], request_id: str = "", **kwargs: Any
    ) -> tpb.ToolOutputPointer:
        def messages() -> Iterator[tpb.StreamPutToolOutputRequest]:
            yield tpb.StreamPutToolOutputRequest(output=self.new(**kwargs), request_id=request_id)
            for piece in pieces:
                yield tpb.StreamPutToolOutputRequest(chunk=piece)

        response = self.stub.StreamPutToolOutput(messages(), metadata=self.metadata)
        return response.pointer  # type: ignore[no-any-return]

    def pointers(
        self, agent: str = "a1", scope: str = "", **fields: str
    ) -> list[tpb.ToolOutputPointer]:
        out: list[tpb.ToolOutputPointer] = []
        token = ""
        while True:
            response = self.stub.ListToolOutputs(
                tpb.ListToolOutputsRequest(
                    filter=self.filter(agent, scope, **fields), page_token=token, page_size=2
                ),
                metadata=self.metadata,
            )
            out.extend(response.pointers)
            token = response.next_page_token
            if not token:
                return out

    @staticmethod
    def filter(agent: str = "a1", scope: str = "", **fields: str) -> tpb.ToolOutputFilter:
        return tpb.ToolOutputFilter(
            agent=agent, scope=pb.Scope(key=scope) if scope else pb.Scope(), **fields
        )

    def get(self, ids: list[str], agent: str = "a1", scope: str = "") -> dict[str, bytes]:
        """Each output's result, joined from the stream (checking offsets and `last`)."""
        results: dict[str, bytearray] = {}
        done: set[str] = set()
        for message in self.stub.GetToolOutputs(
            tpb.GetToolOutputsRequest(
                agent=agent, scope=pb.Scope(key=scope) if scope else pb.Scope(), ids=ids
            ),
            metadata=self.metadata,
        ):
            if message.HasField("pointer"):
                results[message.id] = bytearray()
            assert message.offset == len(results[message.id]) if message.id else True
            if message.id:
                assert len(message.chunk) <= TOOL_OUTPUT_CHUNK_BYTES
                results[message.id] += message.chunk
                if message.last:
                    done.add(message.id)
        assert done == set(results)
        return {k: bytes(v) for k, v in results.items()}

    def select(
        self, query: str, agent: str = "a1", **kwargs: Any
    ) -> tpb.SelectRelevantToolOutputsResponse:
        scope = kwargs.pop("scope", "")
        fields = {
            k: kwargs.pop(k) for k in ("thread", "task_id", "query_id", "tool_name") if k in kwargs
        }
        response: tpb.SelectRelevantToolOutputsResponse = self.stub.SelectRelevantToolOutputs(
            tpb.SelectRelevantToolOutputsRequest(
                query=query, filter=self.filter(agent, scope, **fields), **kwargs
            ),
            metadata=self.metadata,
        )
        return response


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


def _refused(code: grpc.StatusCode, reason: str, call: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if isinstance(result, Iterator):
            list(result)
    assert info.value.code() == code, info.value.details()
    assert _reason(info.value) == reason, info.value.details()


@pytest.fixture
def tools(server: InProcessServer) -> Tools:
    return Tools(server.client.channel)


def _pieces(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


# ---------------------------------------------------------------------- the design's behaviours


def test_every_output_is_persisted_with_a_pointer(tools: Tools, server: InProcessServer) -> None:
    small = tools.put('{"hits": 3}', tool="readFile", args={"path": "/a", "n": 1}, description="d")
    text = tools.put("plain words", tool="readFile", args={"n": 1, "path": "/a"})
    binary = tools.put(b"\x00\x01\xff", tool="readFile")
    assert re.fullmatch(r"to_[0-9a-f]{20}", small.id)
    # {toolName}_{argsHash}_{timestamp}_{counter}_{random}; equal args, equal hash.
    key = re.fullmatch(r"readFile_([0-9a-f]{6})_(\d+)_(\d+)_([0-9a-z]{4})", small.key)
    assert key is not None
    assert text.key.split("_")[1] == key.group(1)
    assert int(key.group(2)) == small.create_time.ToMicroseconds() // 1000
    assert small.args_json == '{"n":1,"path":"/a"}'
    assert (small.kind, text.kind, binary.kind) == (
        tpb.TOOL_OUTPUT_KIND_JSON,
        tpb.TOOL_OUTPUT_KIND_TEXT,
        tpb.TOOL_OUTPUT_KIND_BINARY,
    )
    assert small.size_bytes == 11 and small.token_count == (11 + 3) // 4
    assert small.sha256 == hashlib.sha256(b'{"hits": 3}').hexdigest()
    assert small.stored_inline
    assert [p.id for p in tools.pointers()] == [small.id, text.id, binary.id]
    assert tools.get([small.id, binary.id]) == {
        small.id: b'{"hits": 3}',
        binary.id: b"\x00\x01\xff",
    }
    rows = db_rows(server.running.store, "SELECT count(*) FROM tool_outputs")
    assert rows == [(3,)]


def test_pointers_by_query_task_thread_and_tool(tools: Tools) -> None:
    query_id = tools.stub.HashQuery(tpb.HashQueryRequest(query="fix the login bug")).query_id
    a = tools.put("1", query_id=query_id, task_id="7")
    b = tools.put("2", query_id=query_id, task_id="8", tool="grep", thread="t2")
    c = tools.put("3", task_id="7")
    assert [p.id for p in tools.pointers(query_id=query_id)] == [a.id, b.id]
    assert [p.id for p in tools.pointers(task_id="7")] == [a.id, c.id]
    assert [p.id for p in tools.pointers(thread="t2")] == [b.id]
    assert [p.id for p in tools.pointers(tool_name="grep")] == [b.id]
    assert tools.pointers(query_id="q_0000000000000000") == []
    assert b.task_id == "8" and b.query_id == query_id and not c.HasField("query_id")


def test_the_query_hash_is_deterministic(tools: Tools) -> None:
    first = tools.stub.HashQuery(tpb.HashQueryRequest(query="authentication error")).query_id
    again = tools.stub.HashQuery(tpb.HashQueryRequest(query="authentication error")).query_id
    other = tools.stub.HashQuery(tpb.HashQueryRequest(query="authentication errors")).query_id
    expected = "q_" + hashlib.sha256(b"authentication error").hexdigest()[:16]
    assert first == again == expected == hash_query("authentication error")
    assert other != first
    _refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        tools.stub.HashQuery,
        tpb.HashQueryRequest(query=" "),
    )


def test_keyword_relevance_orders_by_description_overlap_and_falls_back_to_all(
    tools: Tools,
) -> None:
    none = tools.put("x", description="list the files of a directory")
    two = tools.put("y", description="search authentication logs for an error")
    one = tools.put("z", description="read the authentication config")
    keyword = tpb.RELEVANCE_SCORER_KEYWORD
    ranked = tools.select("authentication error", scorer=keyword)
    assert [o.pointer.id for o in ranked.outputs] == [two.id, one.id]
    assert [o.score for o in ranked.outputs] == [2.0, 1.0]
    assert not ranked.fallback
    # Words of two characters or fewer do not count.
    fallback = tools.select("an of", scorer=keyword)
    assert fallback.fallback
    assert [o.pointer.id for o in fallback.outputs] == [none.id, two.id, one.id]
    assert tools.select("nothing matches here", scorer=keyword, k=2).outputs[1].pointer.id == two.id


def test_bm25_relevance_reads_args_and_results_highest_first(tools: Tools) -> None:
    weak = tools.put("a timeout in the scheduler\n" + "filler line\n" * 50, tool="logs")
    strong = tools.put("timeout timeout: database timeout on connect", tool="logs")
    by_args = tools.put("nothing here", tool="readFile", args={"path": "/srv/timeout.cfg"})
    tools.put("unrelated output", tool="ls")
    ranked = tools.select("timeout")
    ids = [o.pointer.id for o in ranked.outputs]
    assert ids[0] == strong.id
    assert set(ids) == {weak.id, strong.id, by_args.id}
    scores = [o.score for o in ranked.outputs]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0
    assert [o.pointer.id for o in tools.select("timeout", k=1).outputs] == [strong.id]
    assert tools.select("zzzz").fallback


def test_delete_clears_pointers_and_stored_results(tools: Tools, server: InProcessServer) -> None:
    big = os.urandom(3 * MiB)  # stored as chunks
    kept = tools.put("keep", thread="t2")
    task = tools.stream_put(_pieces(big, MiB), task_id="9")
    tools.put("small", task_id="9")
    deleted = tools.stub.DeleteToolOutputs(
        tpb.DeleteToolOutputsRequest(filter=tools.filter(task_id="9"))
    )
    assert deleted.deleted_count == 2
    assert [p.id for p in tools.pointers()] == [kept.id]
    assert tools.get([task.id]) == {}
    everything = tools.stub.DeleteToolOutputs(tpb.DeleteToolOutputsRequest(filter=tools.filter()))
    assert everything.deleted_count == 1 and tools.pointers() == []
    store = server.running.store
    if hasattr(store, "_pool"):
        assert db_rows(store, "SELECT count(*) FROM tool_output_chunks") == [(0,)]
    else:
        assert not [p for p in (server.data_dir / "tool_outputs").rglob("*") if p.is_file()]


def _stored_results(server: InProcessServer) -> int:
    """Stored large results: chunk rows on PostgreSQL, files on the embedded engine."""
    store = server.running.store
    if hasattr(store, "_pool"):
        return int(db_rows(store, "SELECT count(DISTINCT output_id) FROM tool_output_chunks")[0][0])
    return len([p for p in (server.data_dir / "tool_outputs").rglob("*") if p.is_file()])


def test_deleting_the_agent_deletes_its_tool_outputs(tools: Tools, server: InProcessServer) -> None:
    client = server.client
    client.append("a1", "hello")
    client.append("a2", "hello")
    big = os.urandom(2 * MiB)
    for scope in ("", "s1"):
        tools.put("small", scope=scope)
        tools.stream_put(_pieces(big, MiB), scope=scope)
    client.append(
        "a1", "x" * 40_000, role=pb.ROLE_TOOL_RESULT, tool_call_id="c1", scope="s1"
    )  # kept aside on its own
    kept = [tools.put("a2's", agent="a2"), tools.stream_put(_pieces(big, MiB), agent="a2")]
    assert len(tools.pointers(scope="s1")) == 3 and _stored_results(server) == 4
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    for scope in ("", "s1"):
        assert tools.pointers(scope=scope) == []
    assert tools.get([kept[0].id, kept[1].id], agent="a2") == {
        kept[0].id: b"a2's",
        kept[1].id: big,
    }
    assert _stored_results(server) == 1  # a2's only
    assert db_rows(server.running.store, "SELECT count(*) FROM tool_outputs") == [(2,)]
    client.append("a1", "hello again")  # a new agent of the same name has none
    assert tools.pointers() == [] and tools.pointers(scope="s1") == []


# ---------------------------------------------------------------------- large results


def test_a_10_mb_output_round_trips_byte_for_byte(tools: Tools, server: InProcessServer) -> None:
    lines = [f"line {i:07d} {'ok' if i % 977 else 'ERROR disk full'}\n" for i in range(400_000)]
    data = "".join(lines).encode()[: 10 * MiB]
    pointer = tools.stream_put(_pieces(data, 300_000), tool="logs")  # pieces of any size
    assert pointer.size_bytes == len(data) and not pointer.stored_inline
    assert pointer.sha256 == hashlib.sha256(data).hexdigest()
    assert pointer.stored_bytes < len(data) // 3  # compressed
    assert tools.get([pointer.id])[pointer.id] == data
    # A part anywhere, without loading the rest.
    middle = tools.stub.ReadToolOutput(
        tpb.ReadToolOutputRequest(agent="a1", id=pointer.id, offset=5 * MiB - 10, length=100)
    )
    assert middle.data == data[5 * MiB - 10 : 5 * MiB + 90] and not middle.eof
    end = tools.stub.ReadToolOutput(
        tpb.ReadToolOutputRequest(agent="a1", id=pointer.id, offset=len(data) - 5)
    )
    assert end.data == data[-5:] and end.eof
    # Grep: literal matches with context, resumable.
    grep = tools.stub.GrepToolOutput(
        tpb.GrepToolOutputRequest(
            agent="a1",
            id=pointer.id,
            pattern="error DISK",
            ignore_case=True,
            context_lines=1,
            max_matches=3,
        )
    )
    assert [m.line_number for m in grep.matches] == [1, 978, 1955]
    assert grep.matches[1].line == "line 0000977 ERROR disk full"
    assert grep.matches[1].before == ["line 0000976 ok"]
    assert grep.matches[1].after == ["line 0000978 ok"]
    assert grep.matches[1].offset == data.index(b"line 0000977")
    more = tools.stub.GrepToolOutput(
        tpb.GrepToolOutputRequest(
            agent="a1",
            id=pointer.id,
            pattern="ERROR",
            max_matches=1,
            offset=grep.next_offset,
            line_number=grep.next_line_number,
        )
    )
    assert [m.line_number for m in more.matches] == [2932]
    # A one-chunk-sized stream and an inline-sized stream are kept the same way.
    small = tools.stream_put(iter([b"abc", b"", b"def"]))
    assert small.stored_inline and tools.get([small.id])[small.id] == b"abcdef"


def test_excerpts_give_head_best_matches_and_tail_within_the_budget(tools: Tools) -> None:
    lines = [f"row {i:06d} nothing to see\n" for i in range(200_000)]
    lines[100_000] = "row 100000 the kernel reported a segfault in module zeta\n"
    data = "".join(lines).encode()
    pointer = tools.stream_put(_pieces(data, MiB), tool="logs", description="server logs")
    ranked = tools.select("segfault zeta", excerpt_tokens=1000)
    (output,) = ranked.outputs
    parts = [e.part for e in output.excerpts]
    assert parts[0] == "head" and parts[-1] == "tail" and "match" in parts
    match = next(e for e in output.excerpts if e.part == "match")
    assert "segfault in module zeta" in match.text
    for e in output.excerpts:
        assert e.id == pointer.id
        assert data[e.offset : e.offset + e.length].decode() == e.text  # the handle reads it
    assert sum(len(e.text) for e in output.excerpts) <= 4 * 1000
    assert output.excerpts[-1].offset + output.excerpts[-1].length == len(data)
    short = tools.put("tiny result about zeta")
    whole = tools.select("tiny zeta", excerpt_tokens=100).outputs[0]
    assert whole.pointer.id == short.id
    assert [(e.part, e.text) for e in whole.excerpts] == [("whole", "tiny result about zeta")]


# ---------------------------------------------------------------------- retries, isolation, input


def test_retries_return_the_first_pointer(tools: Tools) -> None:
    first = tools.put("r", request_id="put-1")
    assert tools.put("r", request_id="put-1") == first
    _refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        tools.put,
        "other",
        request_id="put-1",
    )
    data = os.urandom(2 * MiB + 5)
    streamed = tools.stream_put(_pieces(data, MiB), request_id="put-2")
    assert tools.stream_put(_pieces(data, 700_000), request_id="put-2") == streamed
    _refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        tools.stream_put,
        _pieces(data[:-1], MiB),
        request_id="put-2",
    )
    assert len(tools.pointers()) == 2


def test_no_other_tenant_agent_or_scope_sees_an_output(server: InProcessServer) -> None:
    operator_keys = kpb_grpc.KeyServiceStub(server.client.channel)  # type: ignore[no-untyped-call]
    admin = operator_keys.CreateKey(kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN)).secret
    other = operator_keys.CreateKey(
        kpb.CreateKeyRequest(role=kpb.KEY_ROLE_WRITE, tenant="other"),
        metadata=[("authorization", f"Bearer {admin}")],
    ).secret
    mine, theirs = Tools(server.client.channel, admin), Tools(server.client.channel, other)
    pointer = mine.put("secret timeout text", agent="a1", scope="s1", description="timeout")
    for caller, agent, scope in ((theirs, "a1", "s1"), (mine, "a2", "s1"), (mine, "a1", "s2")):
        assert caller.pointers(agent=agent, scope=scope) == []
        assert caller.get([pointer.id], agent=agent, scope=scope) == {}
        for scorer in (tpb.RELEVANCE_SCORER_BM25, tpb.RELEVANCE_SCORER_KEYWORD):
            assert caller.select("timeout", agent=agent, scope=scope, scorer=scorer).outputs == []
        request = tpb.ReadToolOutputRequest(agent=agent, scope=pb.Scope(key=scope), id=pointer.id)
        _refused(
            grpc.StatusCode.NOT_FOUND,
            "TOOL_OUTPUT_NOT_FOUND",
            caller.stub.ReadToolOutput,
            request,
            metadata=caller.metadata,
        )
        deleted = caller.stub.DeleteToolOutputs(
            tpb.DeleteToolOutputsRequest(filter=caller.filter(agent, scope)),
            metadata=caller.metadata,
        )
        assert deleted.deleted_count == 0
    assert [p.id for p in mine.pointers(agent="a1", scope="s1")] == [pointer.id]
    reader = operator_keys.CreateKey(
        kpb.CreateKeyRequest(role=kpb.KEY_ROLE_READ),
        metadata=[("authorization", f"Bearer {admin}")],
    ).secret
    _refused(
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_TOO_LOW",
        Tools(server.client.channel, reader).put,
        "x",
    )
    assert Tools(server.client.channel, reader).pointers(agent="a1", scope="s1")[0].id == pointer.id


def test_bad_input_is_refused_with_its_field(tools: Tools) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    _refused(bad, "INVALID_ARGUMENT", tools.put, "x", args=None, tool="bad name!")
    request = tpb.PutToolOutputRequest(output=tools.new(), result=b"x")
    request.output.args_json = "[1, 2]"
    _refused(bad, "INVALID_ARGUMENT", tools.stub.PutToolOutput, request)
    _refused(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "TOOL_OUTPUT_TOO_LARGE",
        tools.put,
        b"x" * (4 * MiB + 1),
    )
    _refused(
        bad,
        "TOOL_OUTPUT_STREAM_INVALID",
        tools.stub.StreamPutToolOutput,
        iter([tpb.StreamPutToolOutputRequest(chunk=b"no header")]),
    )
    _refused(
        bad,
        "TOOL_OUTPUT_STREAM_INVALID",
        tools.stub.StreamPutToolOutput,
        iter(
            [
                tpb.StreamPutToolOutputRequest(output=tools.new()),
                tpb.StreamPutToolOutputRequest(chunk=b"x" * (MiB + 1)),
            ]
        ),
    )
    pointer = tools.put("abc\n")
    for field, request_ in (
        ("pattern", tpb.GrepToolOutputRequest(agent="a1", id=pointer.id, pattern="")),
        ("pattern", tpb.GrepToolOutputRequest(agent="a1", id=pointer.id, pattern="x" * 257)),
        (
            "context_lines",
            tpb.GrepToolOutputRequest(agent="a1", id=pointer.id, pattern="a", context_lines=21),
        ),
    ):
        with pytest.raises(grpc.RpcError) as info:
            tools.stub.GrepToolOutput(request_)
        assert info.value.code() == bad and field in (info.value.details() or "")
    _refused(
        bad,
        "INVALID_ARGUMENT",
        tools.stub.ReadToolOutput,
        tpb.ReadToolOutputRequest(agent="a1", id=pointer.id, length=MiB + 1),
    )
    _refused(
        bad,
        "INVALID_ARGUMENT",
        tools.stub.ReadToolOutput,
        tpb.ReadToolOutputRequest(agent="a1", id=pointer.id, offset=5),
    )
    _refused(
        bad,
        "INVALID_ARGUMENT",
        tools.stub.GetToolOutputs,
        tpb.GetToolOutputsRequest(agent="a1", ids=["not-an-id"]),
    )
    _refused(bad, "INVALID_ARGUMENT", tools.select, "q", k=101)
    # Nothing was stored by the refused puts.
    assert [p.id for p in tools.pointers()] == [pointer.id]


def test_the_client_package_covers_every_call(server: InProcessServer) -> None:
    from contextd_client import Client

    with Client(server.client.address) as client:
        query_id = client.hash_query("where is the timeout")
        assert query_id == hash_query("where is the timeout")
        small = client.put_tool_output(
            agent="a1",
            thread="t1",
            tool_name="grep",
            result="a timeout\nok\n",
            args={"q": "timeout"},
            query_id=query_id,
            tool_description="search logs",
        )
        data = b"line\n" * (600_000) + b"the timeout at the end\n"
        big = client.stream_put_tool_output(
            agent="a1", thread="t1", tool_name="cat", pieces=[data[:5], data[5:]], task_id="1"
        )
        assert [p.id for p in client.list_tool_outputs(agent="a1")] == [small.id, big.id]
        assert [p.id for p in client.list_tool_outputs(agent="a1", query_id=query_id)] == [small.id]
        assert client.get_tool_outputs(agent="a1", ids=[big.id])[big.id][1] == data
        assert client.read_tool_output(agent="a1", id=big.id, offset=5, length=4).data == b"line"
        grep = client.grep_tool_output(agent="a1", id=big.id, pattern="timeout")
        assert [m.line_number for m in grep.matches] == [600_001]
        ranked = client.select_relevant_tool_outputs(query="the logs", agent="a1", keyword=True)
        assert [o.pointer.id for o in ranked.outputs] == [small.id]
        assert client.delete_tool_outputs(agent="a1", task_id="1") == 1
        assert [p.id for p in client.list_tool_outputs(agent="a1")] == [small.id]


# ---------------------------------------------------------------------- in the conversation


def test_a_large_tool_result_is_kept_aside_with_a_preview_and_a_handle(
    server: InProcessServer, tools: Tools
) -> None:
    client = server.client
    calls = json.dumps([{"id": "c1", "name": "read_log", "input": {}}])
    client.append("a1", "", role=pb.ROLE_TOOL_USE, tool_calls=calls)
    lines = [f"log line {i:06d}\n" for i in range(10_000)]
    lines[-1] = "FATAL: the error at the very end\n"
    result = "".join(lines)  # 170 KB
    client.append("a1", result, role=pb.ROLE_TOOL_RESULT, tool_call_id="c1")
    message = client.history("a1")[-1]
    assert message.tool_output_id and message.tool_output_size_bytes == len(result)
    assert message.content.startswith("log line 000000\n")
    assert message.content.endswith("FATAL: the error at the very end\n")  # the tail is kept
    assert message.tool_output_id in message.content
    assert len(message.content) < 8000 and message.token_count < len(message.content) // 2
    offset = int(re.search(r"offset=(\d+)", message.content).group(1))  # type: ignore[union-attr]
    assert result.encode()[:offset].decode() in message.content
    more = tools.stub.ReadToolOutput(
        tpb.ReadToolOutputRequest(agent="a1", id=message.tool_output_id, offset=offset, length=16)
    )
    assert more.data == result.encode()[offset : offset + 16]
    assert tools.get([message.tool_output_id])[message.tool_output_id] == result.encode()
    small = client.append("a1", "short result", role=pb.ROLE_TOOL_RESULT, tool_call_id="c1")
    assert small.receipts and not client.history("a1")[-1].tool_output_id


def test_a_tool_result_may_name_a_stored_output(server: InProcessServer, tools: Tools) -> None:
    client = server.client
    stored = tools.put("the stored result", tool="read_log")
    client.append("a1", "", role=pb.ROLE_TOOL_RESULT, tool_output_id=stored.id)
    message = client.history("a1")[-1]
    assert message.content == "the stored result" and message.tool_output_id == stored.id
    assert message.tool_output_size_bytes == stored.size_bytes
    client.append("a1", "my words", role=pb.ROLE_TOOL_RESULT, tool_output_id=stored.id)
    assert client.history("a1")[-1].content == "my words"
    elsewhere = tools.put("x", agent="a2")
    _refused(
        grpc.StatusCode.NOT_FOUND,
        "TOOL_OUTPUT_NOT_FOUND",
        client.append,
        "a1",
        "",
        role=pb.ROLE_TOOL_RESULT,
        tool_output_id=elsewhere.id,
    )
    _refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        client.append,
        "a1",
        "hi",
        role=pb.ROLE_USER,
        tool_output_id=stored.id,
    )


def test_every_handle_in_a_built_context_can_be_read_back(
    server: InProcessServer, tools: Tools
) -> None:
    client = server.client
    read_log = [{"id": "c1", "name": "read_log", "input": {"path": "/var/log/app.log"}}]
    client.append("a1", "what failed?")
    client.append("a1", "", role=pb.ROLE_TOOL_USE, tool_calls=json.dumps(read_log))
    log = "".join(f"log line {i:06d}\n" for i in range(3_000)) + "FATAL: disk full\n"
    client.append("a1", log, role=pb.ROLE_TOOL_RESULT, tool_call_id="c1")  # kept aside
    client.append("a1", "and the files?")
    ls = [{"id": "c2", "name": "ls", "input": {}}]
    grep_call = [{"id": "c3", "name": "grep", "input": {"pattern": "FATAL"}}]
    client.stub.AppendMessages(  # the call and its long result in one append
        pb.AppendMessagesRequest(
            agent="a1",
            thread="t1",
            messages=[
                pb.Message(role=pb.ROLE_TOOL_USE, tool_calls=json.dumps(ls)),
                pb.Message(role=pb.ROLE_TOOL_RESULT, tool_call_id="c2", content="f.txt\n" * 900),
                pb.Message(role=pb.ROLE_TOOL_USE, tool_calls=json.dumps(grep_call)),
                pb.Message(role=pb.ROLE_TOOL_RESULT, tool_call_id="c3", content=log),
            ],
        )
    )
    client.append("a1", "a long question " * 600)  # truncated
    for turn in range(3):
        client.append("a1", f"turn {turn}", f"answer {turn}")
    options = pb.BuildOptions(
        elide_tool_results=True, elide_threshold_chars=2000, max_chars_per_message=4000
    )
    built = client.stub.BuildContext(
        pb.BuildContextRequest(
            agent="a1",
            thread="t1",
            user_message="next?",
            options=options,
            formats=[pb.CONTEXT_FORMAT_TEXT],
        )
    )
    text = "\n".join(m.content for m in built.messages)
    assert built.stats.elided_ids and built.stats.truncated_ids
    # The output kept aside carries the call's tool name and args, not "tool_result".
    (kept,) = tools.pointers(tool_name="read_log")
    assert kept.args_json == '{"path":"/var/log/app.log"}'
    (grepped,) = tools.pointers(tool_name="grep")  # its call came in the same append
    assert grepped.args_json == '{"pattern":"FATAL"}'
    assert f"Full output: tool output {kept.id}" in text
    outputs = set(re.findall(r"to_[0-9a-f]{20}", text))
    message_ids = {int(i) for i in re.findall(r"message:(\d+)", text)}
    assert outputs == {kept.id, grepped.id}
    assert len(message_ids) == 2  # the ls result, the long question
    for output_id in outputs:
        read = tools.stub.ReadToolOutput(tpb.ReadToolOutputRequest(agent="a1", id=output_id))
        assert read.data == log.encode()[: len(read.data)] and read.eof
        grep = tools.stub.GrepToolOutput(
            tpb.GrepToolOutputRequest(agent="a1", id=output_id, pattern="FATAL")
        )
        assert [m.line for m in grep.matches] == ["FATAL: disk full"]
    # message:<id>: ListMessages of the thread with MESSAGE_RANGE_ALL lists it, whole.
    history = {m.id: m for m in client.history("a1")}
    assert message_ids <= set(history)
    assert {history[i].content[:10] for i in message_ids} == {"f.txt\nf.tx", "a long que"}


def test_a_build_adds_the_most_relevant_excerpts_within_the_budget(
    server: InProcessServer, tools: Tools
) -> None:
    client = server.client
    client.append("a1", "the server crashed overnight", "I will look at the logs")
    lines = [f"row {i:06d} nothing to see\n" for i in range(100_000)]
    lines[50_000] = "row 050000 the kernel reported a segfault in module zeta\n"
    data = "".join(lines).encode()
    big = tools.stream_put(
        _pieces(data, MiB),
        tool="read_log",
        args={"path": "/var/log/k.log"},
        description="kernel logs of module zeta",  # its middle is not indexed, this is
    )
    small = tools.put("zeta: the module's config, segfault handler off", tool="cat")
    tools.put("unrelated listing", tool="ls")
    tools.put("segfault in zeta, another scope", scope="s1")

    def build(**options: int) -> pb.BuildContextResponse:
        response: pb.BuildContextResponse = client.stub.BuildContext(
            pb.BuildContextRequest(
                agent="a1",
                thread="t1",
                user_message="why the segfault in zeta?",
                options=pb.BuildOptions(**options),  # type: ignore[arg-type]
                formats=[pb.CONTEXT_FORMAT_TEXT],
            )
        )
        return response

    plain = build()
    assert not plain.tool_output_excerpts and not plain.stats.tool_output_excerpt_ids
    built = build(tool_output_excerpts=2, tool_output_excerpt_tokens=1000)
    stats = built.stats
    assert set(stats.tool_output_excerpt_ids) == {big.id, small.id}
    assert [e.output_id for e in built.tool_output_excerpts] == list(stats.tool_output_excerpt_ids)
    assert stats.tool_output_candidates == 3  # the scope's outputs only
    assert stats.total_tokens <= stats.budget_tokens
    assert stats.status_tokens - plain.stats.status_tokens == stats.tool_output_excerpt_tokens > 0
    assert stats.total_tokens - plain.stats.total_tokens == stats.tool_output_excerpt_tokens
    text = built.renderings[0].content
    # After the window (and before the new message), each labelled with tool, args, handle.
    assert text.index("I will look at the logs") < text.index(big.id) < text.index("why the")
    assert (
        f'<tool_output id="{big.id}" tool="read_log" args=\'{{"path":"/var/log/k.log"}}\'>' in text
    )
    for excerpt in built.tool_output_excerpts:
        assert sum(len(p.text) for p in excerpt.parts) <= 4 * 1000
        for part in excerpt.parts:  # the handle reads each part back
            read = tools.stub.ReadToolOutput(
                tpb.ReadToolOutputRequest(
                    agent="a1", id=excerpt.output_id, offset=part.offset, length=part.length
                )
            )
            assert read.data.decode() == part.text and part.text.rstrip("\n") in text
    big_parts = next(e for e in built.tool_output_excerpts if e.output_id == big.id).parts
    assert any("segfault in module zeta" in p.text for p in big_parts if p.part == "match")
    # A tight budget keeps what fits and lists the rest as left out; the total holds.
    tight = build(
        tool_output_excerpts=2,
        tool_output_excerpt_tokens=1000,
        budget_tokens=plain.stats.total_tokens + 150,
    )
    assert list(tight.stats.tool_output_excerpt_ids) == [small.id]
    assert list(tight.stats.tool_output_excerpts_left_out_ids) == [big.id]
    assert tight.stats.total_tokens <= tight.stats.budget_tokens
    capped = build(tool_output_excerpts=2, tool_output_excerpts_max_tokens=1)
    assert not capped.stats.tool_output_excerpt_ids
    assert len(capped.stats.tool_output_excerpts_left_out_ids) == 2
    with pytest.raises(grpc.RpcError) as info:
        build(tool_output_excerpts=21)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "options.tool_output_excerpts" in (info.value.details() or "")


def test_relevance_stays_current_as_outputs_come_and_go(
    tools: Tools, server: InProcessServer
) -> None:
    """The scope's cached index follows every put and delete, also writes it never saw
    (straight to the store, as another replica's would be)."""
    from contextd.domain.tool_outputs import ToolOutputFilter

    def found(query: str, **fields: str) -> list[str]:
        return [o.pointer.id for o in tools.select(query, k=100, **fields).outputs]

    first = [tools.put(f"alpha result {i}", task_id=f"t{i % 2}") for i in range(4)]
    assert set(found("alpha")) == {p.id for p in first}
    more = tools.put("alpha alpha alpha", thread="t2")
    assert found("alpha")[0] == more.id  # added to the index, and ranked first
    assert found("alpha", thread="t2") == [more.id]
    assert set(found("alpha", task_id="t1")) == {first[1].id, first[3].id}
    tools.stub.DeleteToolOutputs(tpb.DeleteToolOutputsRequest(filter=tools.filter(task_id="t0")))
    assert set(found("alpha")) == {first[1].id, first[3].id, more.id}
    store = server.running.store
    store.delete_tool_outputs(ToolOutputFilter("default", "a1", "", thread="t2"))  # unseen
    assert set(found("alpha")) == {first[1].id, first[3].id}
    beta = tools.put("beta only")
    assert found("beta") == [beta.id] and not tools.select("alpha beta", k=1).fallback
    assert tools.select("gamma").fallback


def test_a_blob_in_a_kept_aside_result_names_its_tool_output(
    server: InProcessServer, tools: Tools
) -> None:
    """The stub of a base64 blob in the preview of a result kept aside names the tool
    output that holds the whole result (ReadToolOutput), not the message, whose stored
    content is only the preview."""
    import base64
    import random

    client = server.client
    shot = [{"id": "c1", "name": "screenshot", "input": {}}]
    client.append("a1", "show me the page")
    client.append("a1", "", role=pb.ROLE_TOOL_USE, tool_calls=json.dumps(shot))
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + random.Random(3).randbytes(60_000)).decode()
    client.append("a1", f"screenshot: {png}", role=pb.ROLE_TOOL_RESULT, tool_call_id="c1")
    built = client.stub.BuildContext(
        pb.BuildContextRequest(agent="a1", thread="t1", formats=[pb.CONTEXT_FORMAT_TEXT])
    )
    (kept,) = tools.pointers(tool_name="screenshot")
    stubs = [line for m in built.messages for line in re.findall(r"\[base64 [^\]]*\]", m.content)]
    assert stubs and all(f"full text: tool output {kept.id}" in s for s in stubs), stubs
    assert "message:" not in "".join(stubs)
