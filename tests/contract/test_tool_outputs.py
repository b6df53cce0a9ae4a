"""The tool-output port on every engine: a result is visible whole with its pointer or not
at all; chunks come back as written; reads and deletes never cross tenant, agent or
scope; a restart keeps what was saved."""

from __future__ import annotations

import os

from contextd.domain.clock import ManualClock
from contextd.domain.limits import TOOL_OUTPUT_CHUNK_BYTES
from contextd.domain.tool_outputs import (
    ToolOutputFilter,
    ToolOutputKind,
    ToolOutputPointer,
    new_output_id,
)
from contextd.ports.store import Store

from .conftest import StoreOpener
from .support import START_US

CHUNK = TOOL_OUTPUT_CHUNK_BYTES


def _pointer(
    size: int, inline: bool, *, tenant: str = "default", agent: str = "a1", scope: str = ""
) -> ToolOutputPointer:
    return ToolOutputPointer(
        id=new_output_id(),
        key="k",
        tenant=tenant,
        agent=agent,
        scope=scope,
        thread="t1",
        tool_name="tool",
        tool_description="",
        args_json="{}",
        task_id=None,
        query_id=None,
        size_bytes=size,
        token_count=size // 4,
        create_time_us=START_US,
        kind=ToolOutputKind.BINARY,
        stored_inline=inline,
        stored_bytes=size,
        sha256="0" * 64,
    )


def _save_chunks(store: Store, pointer: ToolOutputPointer, chunks: list[bytes]) -> None:
    upload = store.begin_tool_output_blob(pointer.tenant, pointer.id, compress=True)
    for chunk in chunks:
        upload.write(chunk)
    store.save_tool_output(pointer, None, upload, "index text")


def test_chunks_come_back_as_written_and_survive_a_restart(
    store: Store, store_opener: StoreOpener
) -> None:
    chunks = [os.urandom(CHUNK), b"b" * CHUNK, b"tail"]
    big = _pointer(2 * CHUNK + 4, False)
    _save_chunks(store, big, chunks)
    small = _pointer(3, True)
    store.save_tool_output(small, b"abc", None, "small")
    assert store.read_tool_output_chunks(big, 0, 3) == chunks
    assert store.read_tool_output_chunks(big, 1, 5) == chunks[1:]
    assert store.read_tool_output_chunks(small, 0, 1) == [b"abc"]
    store.close()
    reopened = store_opener(ManualClock(START_US))
    where = ToolOutputFilter("default", "a1", "")
    assert [p.id for p in reopened.list_tool_outputs(where, None, 10)] == sorted([big.id, small.id])
    assert reopened.read_tool_output_chunks(big, 2, 1) == [b"tail"]
    assert [(p.id, t) for p, t in reopened.tool_output_index(where, 1)] in (
        [(big.id, "index text")],
        [(small.id, "small")],
    )


def test_an_aborted_upload_leaves_nothing(store: Store) -> None:
    pointer = _pointer(CHUNK, False)
    upload = store.begin_tool_output_blob("default", pointer.id, compress=False)
    upload.write(b"x" * CHUNK)
    upload.abort()
    upload.abort()  # idempotent
    assert store.find_tool_outputs("default", "a1", "", [pointer.id]) == []
    assert store.list_tool_outputs(ToolOutputFilter("default", "a1", ""), None, 10) == []


def test_reads_and_deletes_stay_in_their_tenant_agent_and_scope(store: Store) -> None:
    mine = _pointer(3, True)
    store.save_tool_output(mine, b"abc", None, "")
    others = [
        _pointer(3, True, tenant="other"),
        _pointer(3, True, agent="a2"),
        _pointer(3, True, scope="s2"),
    ]
    for other in others:
        store.save_tool_output(other, b"xyz", None, "")
        assert store.find_tool_outputs("default", "a1", "", [other.id]) == []
        where = ToolOutputFilter(other.tenant, other.agent, other.scope)
        assert store.find_tool_outputs(other.tenant, other.agent, other.scope, [mine.id]) == []
        assert [p.id for p in store.list_tool_outputs(where, None, 10)] == [other.id]
    assert store.delete_tool_outputs(ToolOutputFilter("default", "a1", "")) == 1
    for other in others:
        found = store.find_tool_outputs(other.tenant, other.agent, other.scope, [other.id])
        assert [p.id for p in found] == [other.id]


def test_the_fingerprint_tells_a_delete_and_a_put_of_the_same_moment_apart(store: Store) -> None:
    """Two replicas may delete one output and put another in the same microsecond: the
    count and the sum of create times stay the same, the ids' random bits do not, so a
    cached relevance index sees that it must be rebuilt."""
    from dataclasses import replace

    from contextd.app.relevance_cache import RelevanceIndexes

    first = _pointer(3, True)
    store.save_tool_output(first, b"abc", None, "zeta kernel segfault")
    where = ToolOutputFilter("default", "a1", "")
    indexes = RelevanceIndexes()
    found = indexes.search(store, where, "zeta segfault", 5)
    assert found is not None and [i for i, _ in found[0]] == [first.id]
    before = store.tool_output_fingerprint("default", "a1", "")
    store.delete_tool_outputs(ToolOutputFilter("default", "a1", "", tool_name="tool"))
    second = replace(_pointer(3, True), create_time_us=first.create_time_us)
    store.save_tool_output(second, b"abc", None, "zeta kernel segfault again")
    after = store.tool_output_fingerprint("default", "a1", "")
    assert after[:2] == before[:2] and after != before
    found = indexes.search(store, where, "zeta segfault", 5)
    assert found is not None and [i for i, _ in found[0]] == [second.id]
