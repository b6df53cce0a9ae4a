"""The BuildContext response written as bytes (`build_response_bytes`: the kept messages
and the dropped ids by the Rust core, the rest by the protobuf runtime in parts, joined)
is byte for byte the message the servicer built before, one protobuf object per message
and id list, and serialized: for random results (kept messages with and without stamps,
times before the epoch, summaries' negative ids, truncated and elided ids, a new message
or none, dropped ids as a tuple or an IdList with unlisted ids, dropped ranges, every
stats field, renderings, tool output excerpts, docs and status) in both views.

`_reference_response` is the earlier construction, kept here as the specification.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextd import core
from contextd.api.convert import (
    _FORMAT_NAMES,
    MAX_LISTED_DROPPED_IDS,
    build_response,
    build_response_bytes,
    dropped_ids_field,
)
from contextd.api.server import pass_bytes
from contextd.app.build.build_types import BuildResult
from contextd.app.build.excerpts import AddedExcerpts, ExcerptReport
from contextd.app.tool_output_reads import Excerpt
from contextd.domain.context import AssembledContext, BuildStats, HistoryItem, IdList
from contextd.domain.model import AgentDoc, MessageStamp, Role
from contextd.domain.tool_outputs import ToolOutputKind, ToolOutputPointer
from contextd.v1 import context_service_pb2 as pb

INT64 = st.integers(-(2**63), 2**63 - 1)
# Times a Timestamp can carry (year 1 to 9999), in microseconds: before the epoch too.
TIMES = st.integers(-62_135_596_800_000_000, 253_402_300_799_999_999)
SMALL = st.integers(0, 2**40)
TEXT = st.text(max_size=12)


def _reference_response(result: BuildResult, full: bool) -> pb.BuildContextResponse:
    """The response as `build_response` built it before it was written as bytes."""
    ctx = result.context
    s = ctx.stats
    renderings = [
        pb.Rendering(format=_FORMAT_NAMES[name], content=content)  # type: ignore[arg-type]
        for name, content in result.renderings.items()
    ]
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
        rendered_tokens=s.rendered_tokens,
        rendered_format=s.rendered_format,
        status_truncated=s.status_truncated,
        status_dropped=s.status_dropped,
        dropped_ranges=[pb.MessageIdRange(first_id=a, last_id=b) for a, b in s.dropped_ranges],
        ledger_entries=s.ledger_entries,
        ledger_tokens=s.ledger_tokens,
        ledger_added=s.ledger_added,
        ledger_evicted=s.ledger_evicted,
        ledger_in_context=s.ledger_in_context,
        compaction_deferred=s.compaction_deferred,
        summary_attempts=s.summary_attempts,
        tool_output_excerpt_ids=[a.pointer.id for a in result.excerpts.added],
        tool_output_excerpt_tokens=result.excerpts.tokens,
        tool_output_excerpts_left_out_ids=result.excerpts.left_out_ids,
        tool_output_candidates=result.excerpts.candidates,
    )
    excerpts = [
        pb.BuildExcerpt(
            output_id=a.pointer.id,
            tool_name=a.pointer.tool_name,
            args_json=a.pointer.args_json,
            score=a.score,
            parts=[
                pb.BuildExcerptPart(offset=e.offset, length=e.length, text=e.text, part=e.part)
                for e in a.parts
            ],
            tokens=a.tokens,
        )
        for a in result.excerpts.added
    ]
    if not full:
        response = pb.BuildContextResponse(
            stats=stats, renderings=renderings, tool_output_excerpts=excerpts
        )
    else:
        response = pb.BuildContextResponse(
            system_prompt=ctx.system_prompt,
            docs=[pb.AgentDoc(name=d.name, content=d.content) for d in ctx.docs],
            status=ctx.status,
            stats=stats,
            renderings=renderings,
            tool_output_excerpts=excerpts,
        )
        truncated, elided = set(s.truncated_ids), set(s.elided_ids)
        for item in ctx.history:
            stamp = result.stamps.get(item.id)
            message = response.messages.add(
                id=item.id,
                role=int(item.role),
                content=item.content,
                tool_calls=item.tool_calls,
                tool_call_id=item.tool_call_id,
                token_count=item.token_count,
                truncated=item.id in truncated,
                elided=item.id in elided,
                is_summary=item.is_summary,
            )
            if stamp is None:
                continue
            seconds, micros = divmod(stamp.create_time_us, 1_000_000)
            at = message.create_time
            at.seconds, at.nanos = seconds, micros * 1_000
            if stamp.source_time_us is not None:
                seconds, micros = divmod(stamp.source_time_us, 1_000_000)
                at = message.source_time
                at.seconds, at.nanos = seconds, micros * 1_000
            message.sequence = stamp.sequence
        if ctx.new_message is not None:
            response.messages.add(
                role=pb.ROLE_USER,
                content=ctx.new_message,
                token_count=s.new_message_tokens,
                truncated=s.new_message_truncated,
            )
    ids = s.dropped_ids
    listed = (
        ids.newest(MAX_LISTED_DROPPED_IDS).tolist()
        if isinstance(ids, IdList)
        else ids[-MAX_LISTED_DROPPED_IDS:]
    )
    response.stats.dropped_ids.extend(listed)
    return response


@st.composite
def _items(draw: st.DrawFn) -> list[HistoryItem]:
    """Kept messages: stored ids (any int64) and summaries' negative ids, every role."""
    ids = draw(st.lists(INT64 | st.integers(-50, 50), unique=True, max_size=8))
    return [
        HistoryItem(
            id=i,
            role=draw(st.sampled_from(list(Role))),
            content=draw(TEXT),
            tool_calls=draw(st.sampled_from(["", "[]", '[{"id": "c1", "name": "f"}]'])),
            tool_call_id=draw(st.sampled_from(["", "c1", "ü"])),
            token_count=draw(INT64 | SMALL),
            is_summary=draw(st.booleans()),
        )
        for i in ids
    ]


@st.composite
def _dropped(draw: st.DrawFn) -> Any:
    """Dropped ids as a tuple or an IdList (parts, unlisted ids, over the listed limit)."""
    kind = draw(st.sampled_from(["tuple", "idlist", "long"]))
    if kind == "tuple":
        return tuple(draw(st.lists(INT64, max_size=20)))
    if kind == "idlist":
        parts = draw(st.lists(st.lists(INT64, max_size=10), max_size=3))
        return IdList(*[np.asarray(p, dtype=np.int64) for p in parts])
    lo = draw(SMALL)
    cut = draw(st.integers(1, 2 * MAX_LISTED_DROPPED_IDS))
    n = draw(st.sampled_from([MAX_LISTED_DROPPED_IDS, 2 * MAX_LISTED_DROPPED_IDS + 7]))
    whole = np.arange(lo, lo + n, dtype=np.int64)
    unlisted = draw(st.integers(0, max(0, n - MAX_LISTED_DROPPED_IDS)))
    held = whole[unlisted:]
    cut = min(cut, len(held))
    return IdList(held[:cut], held[cut:], unlisted=unlisted)


def _pointer(output_id: str, tool: str, args: str) -> ToolOutputPointer:
    return ToolOutputPointer(
        id=output_id,
        key="k",
        tenant="t",
        agent="a",
        scope="",
        thread="th",
        tool_name=tool,
        tool_description="",
        args_json=args,
        task_id=None,
        query_id=None,
        size_bytes=100,
        token_count=10,
        create_time_us=0,
        kind=ToolOutputKind.TEXT,
        stored_inline=True,
        stored_bytes=100,
        sha256="",
    )


@st.composite
def _excerpts(draw: st.DrawFn) -> ExcerptReport:
    added = tuple(
        AddedExcerpts(
            pointer=_pointer(f"to_{k}", draw(TEXT), draw(st.sampled_from(["", "{}", '{"q": 1}']))),
            score=draw(st.floats(allow_nan=False) | st.just(0.0)),
            parts=tuple(
                Excerpt(
                    f"to_{k}",
                    draw(SMALL),
                    draw(SMALL),
                    draw(TEXT),
                    draw(st.sampled_from(["whole", "head", "match", "tail"])),
                )
                for _ in range(draw(st.integers(0, 3)))
            ),
            tokens=draw(SMALL),
        )
        for k in range(draw(st.integers(0, 2)))
    )
    return ExcerptReport(
        added=added,
        tokens=draw(SMALL),
        left_out_ids=tuple(draw(st.lists(st.sampled_from(["to_x", "to_y"]), max_size=2))),
        candidates=draw(SMALL),
    )


@st.composite
def _results(draw: st.DrawFn) -> BuildResult:
    items = draw(_items())
    ids = [it.id for it in items]
    chosen = st.lists(st.sampled_from(ids), unique=True) if ids else st.just([])
    stamps = {
        i: MessageStamp(draw(TIMES), draw(st.none() | TIMES), draw(INT64 | SMALL))
        for i in draw(chosen)
    }
    if draw(st.booleans()):  # a stamp for an id the context does not keep: never read
        stamps[draw(INT64)] = MessageStamp(0, None, 0)
    stats = BuildStats(
        budget=draw(SMALL),
        system_tokens=draw(SMALL),
        docs_tokens=draw(SMALL),
        status_tokens=draw(SMALL),
        history_tokens=draw(SMALL),  # total_tokens, their sum, must fit an int64
        new_message_tokens=draw(SMALL),
        messages_before=draw(SMALL),
        messages_after=draw(SMALL),
        dropped_ids=draw(_dropped()),
        dropped_ranges=tuple(draw(st.lists(st.tuples(INT64, INT64), max_size=3))),
        truncated_ids=tuple(draw(chosen)) + tuple(draw(st.lists(INT64, max_size=2))),
        elided_ids=tuple(draw(chosen)),
        summarized_range=draw(st.none() | st.tuples(INT64, INT64)),
        summarizer_path=draw(st.sampled_from([None, "llm", "fallback", "reused"])),
        summarizer_error=draw(st.none() | TEXT),
        new_message_truncated=draw(st.booleans()),
        status_dropped=draw(st.booleans()),
        status_truncated=draw(st.booleans()),
        rendered_tokens=draw(SMALL),
        rendered_format=draw(st.sampled_from(["", "openai", "anthropic", "text"])),
        ledger_entries=draw(SMALL),
        ledger_tokens=draw(SMALL),
        ledger_added=draw(SMALL),
        ledger_evicted=draw(SMALL),
        ledger_in_context=draw(SMALL),
        compaction_deferred=draw(st.booleans()),
        summary_attempts=draw(SMALL),
    )
    context = AssembledContext(
        system_prompt=draw(TEXT),
        docs=tuple(AgentDoc(draw(TEXT), draw(TEXT)) for _ in range(draw(st.integers(0, 2)))),
        status=draw(TEXT),
        history=tuple(items),
        new_message=draw(st.none() | TEXT),
        stats=stats,
    )
    formats = draw(st.lists(st.sampled_from(sorted(_FORMAT_NAMES)), unique=True, max_size=3))
    return BuildResult(
        context=context,
        tokenizer=draw(st.sampled_from(["", "o200k_base", "estimate"])),
        strategy=draw(st.sampled_from(["", "newest-first"])),
        summary_id=None,
        stamps=stamps,
        renderings={f: draw(TEXT) for f in formats},
        event=None,
        messages_loaded=draw(SMALL),
        orphaned_ids=tuple(draw(st.lists(INT64, max_size=3))),
        excerpts=draw(_excerpts()),
    )


@settings(max_examples=400, deadline=None)
@given(_results(), st.booleans())
def test_the_response_bytes_are_the_message_built_before(result: BuildResult, full: bool) -> None:
    expected = _reference_response(result, full)
    got = build_response_bytes(result, full)
    assert got == expected.SerializeToString()
    assert build_response(result, full) == expected  # field for field, as clients parse it


def test_the_response_bytes_hold_every_field_of_a_full_build() -> None:
    """Every field the response has is set by the example (so none is left out of the
    joined parts unnoticed), and the bytes still match."""
    item = HistoryItem(7, Role.ASSISTANT, "x", "[]", "c1", 3, True)
    stamps = {7: MessageStamp(-1, 1_700_000_000_000_001, 9)}
    stats = BuildStats(
        budget=100,
        system_tokens=1,
        docs_tokens=2,
        status_tokens=3,
        history_tokens=4,
        new_message_tokens=5,
        messages_before=6,
        messages_after=2,
        dropped_ids=IdList(np.arange(1, 7, dtype=np.int64)),
        dropped_ranges=((1, 6),),
        truncated_ids=(7,),
        elided_ids=(7,),
        summarized_range=(1, 2),
        summarizer_path="llm",
        summarizer_error="e",
        new_message_truncated=True,
        status_dropped=True,
        status_truncated=True,
        rendered_tokens=8,
        rendered_format="openai",
        ledger_entries=1,
        ledger_tokens=2,
        ledger_added=3,
        ledger_evicted=4,
        ledger_in_context=5,
        compaction_deferred=True,
        summary_attempts=6,
    )
    excerpts = ExcerptReport(
        added=(
            AddedExcerpts(
                _pointer("to_1", "grep", "{}"), 0.5, (Excerpt("to_1", 1, 2, "t", "head"),), 4
            ),
        ),
        tokens=4,
        left_out_ids=("to_2",),
        candidates=2,
    )
    context = AssembledContext("sys", (AgentDoc("d", "c"),), "st", (item,), "hi", stats)
    result = BuildResult(
        context, "o200k_base", "s", None, stamps, {"openai": "r"}, None, 9, (3,), excerpts
    )
    for full in (True, False):
        expected = _reference_response(result, full)
        set_fields = {f.name for f, _ in expected.ListFields()}
        assert set_fields == (
            {f.name for f in pb.BuildContextResponse.DESCRIPTOR.fields}
            if full
            else {"stats", "renderings", "tool_output_excerpts"}
        )
        assert {f.name for f, _ in expected.stats.ListFields()} == {
            f.name for f in pb.BuildStats.DESCRIPTOR.fields
        }
        message = expected.messages[0] if full else None
        if message is not None:
            assert {f.name for f, _ in message.ListFields()} == {
                f.name for f in pb.ContextMessage.DESCRIPTOR.fields
            }
        assert build_response_bytes(result, full) == expected.SerializeToString()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(INT64, max_size=40)
    | st.lists(st.integers(0, 2**35), max_size=40)
    | st.integers(0, 2**40).map(lambda lo: list(range(lo, lo + 300)))
)
def test_packed_ids_are_what_the_runtime_writes(ids: list[int]) -> None:
    expected = pb.BuildStats()
    expected.dropped_ids.extend(ids)
    for given_as in (tuple(ids), IdList(np.asarray(ids, dtype=np.int64))):
        got = dropped_ids_field(given_as)
        assert got == expected.SerializeToString()
        assert list(pb.BuildStats.FromString(got).dropped_ids) == ids


def test_the_core_refuses_ids_of_another_shape() -> None:
    with pytest.raises(BufferError):
        core.encode_packed_int64(10, np.arange(4, dtype=np.int32))
    with pytest.raises(BufferError):
        core.encode_packed_int64(10, np.arange(8, dtype=np.int64)[::2])
    with pytest.raises(AttributeError):
        core.encode_context_messages([object()], {}, [], [], None)


def test_a_handler_may_answer_with_bytes_or_a_message() -> None:
    """`pass_bytes` sends bytes as they are and serializes a message as before."""
    response = pb.BuildContextResponse(status="s", stats=pb.BuildStats(budget_tokens=3))
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: response,
        request_deserializer=pb.BuildContextRequest.FromString,
        response_serializer=pb.BuildContextResponse.SerializeToString,
    )
    wrapped = pass_bytes(handler)
    serialize = wrapped.response_serializer
    assert serialize is not None
    assert wrapped.unary_unary is handler.unary_unary
    assert wrapped.request_deserializer is handler.request_deserializer
    assert serialize(response) == response.SerializeToString()
    assert serialize(b"\x1a\x01s") == b"\x1a\x01s"
