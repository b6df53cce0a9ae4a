"""The row layout of a tool output's pointer, the same on both engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contextd.domain.tool_outputs import ToolOutputFilter, ToolOutputKind, ToolOutputPointer

POINTER_COLUMNS = (
    "id, output_key, tenant, agent, scope, thread, tool_name, tool_description, args_json, "
    "task_id, query_id, size_bytes, token_count, create_time_us, kind, stored_inline, "
    "stored_bytes, sha256"
)
# Also stored: inline_data, compressed, chunk_lengths (JSON list), index_text.
STORAGE_COLUMNS = "inline_data, compressed, chunk_lengths, index_text"


def pointer_values(p: ToolOutputPointer) -> list[Any]:
    return [
        p.id,
        p.key,
        p.tenant,
        p.agent,
        p.scope,
        p.thread,
        p.tool_name,
        p.tool_description,
        p.args_json,
        p.task_id,
        p.query_id,
        p.size_bytes,
        p.token_count,
        p.create_time_us,
        int(p.kind),
        p.stored_inline,
        p.stored_bytes,
        p.sha256,
    ]


def pointer_from_row(row: Sequence[Any]) -> ToolOutputPointer:
    return ToolOutputPointer(
        id=str(row[0]),
        key=str(row[1]),
        tenant=str(row[2]),
        agent=str(row[3]),
        scope=str(row[4]),
        thread=str(row[5]),
        tool_name=str(row[6]),
        tool_description=str(row[7]),
        args_json=str(row[8]),
        task_id=None if row[9] is None else str(row[9]),
        query_id=None if row[10] is None else str(row[10]),
        size_bytes=int(row[11]),
        token_count=int(row[12]),
        create_time_us=int(row[13]),
        kind=ToolOutputKind(int(row[14])),
        stored_inline=bool(row[15]),
        stored_bytes=int(row[16]),
        sha256=str(row[17]),
    )


def filter_sql(
    where: ToolOutputFilter, mark: str, threads: str = "threads"
) -> tuple[str, list[Any]]:
    """The WHERE conditions (after tenant, agent and scope) of a filter, with `mark` as
    the driver's placeholder ("?" or "%s") and `threads` the table of the threads' last
    message times (DuckDB reads them live, see its thread_counters.py)."""
    parts = [f"tenant = {mark}", f"agent = {mark}", f"scope = {mark}"]
    params: list[Any] = [where.tenant, where.agent, where.scope]
    for column, value in (
        ("thread", where.thread),
        ("task_id", where.task_id),
        ("query_id", where.query_id),
        ("tool_name", where.tool_name),
    ):
        if value is not None:
            parts.append(f"{column} = {mark}")
            params.append(value)
    if where.expired_through_us:
        parts.append(f"NOT {expired_sql(mark, threads)}")
        params += [where.expired_through_us] * 2
    return " AND ".join(parts), params


def expired_sql(mark: str, threads: str = "threads") -> str:
    """True for a `tool_outputs` row the sweep may delete at a cutoff (now - ttl, given
    twice; only asked with a ttl): its context (the thread row of its tenant, agent,
    scope and thread, one lookup by the threads' unique key) is expired and the output
    is old enough, or it was old enough when an append after expiry restarted the
    context. An output of a thread with no messages has no context to expire."""
    return (
        f"EXISTS (SELECT 1 FROM {threads} t WHERE t.tenant = tool_outputs.tenant AND "
        "t.agent = tool_outputs.agent AND t.scope = tool_outputs.scope AND "
        "t.thread = tool_outputs.thread AND (tool_outputs.create_time_us <= "
        f"t.outputs_expired_through_us OR (tool_outputs.create_time_us <= {mark} AND "
        f"t.last_message_time_us <= {mark})))"
    )


def is_expired(
    create_time_us: int, cutoff_us: int, last_message_time_us: int, outputs_through_us: int
) -> bool:
    """`expired_sql` for one output whose thread row was read (see there)."""
    return create_time_us <= outputs_through_us or (
        create_time_us <= cutoff_us and last_message_time_us <= cutoff_us
    )
