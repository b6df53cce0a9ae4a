"""Rows as both engines store them, to and from domain types.

The engines share one column layout for agents, threads, messages and status entries, so
one set of converters serves both (`contextd.adapters.duckdb`, `contextd.adapters.postgres`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from contextd.domain.access import ApiKey, KeyRole
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import (
    Agent,
    AgentDoc,
    AgentSettings,
    BuildOverrides,
    Role,
    StoredMessage,
    Thread,
)
from contextd.domain.retention import retention_json, retention_of
from contextd.domain.snapshots import SnapshotInfo

AGENT_COLUMNS = (
    "tenant, name, system_prompt, docs_json, rolling_window_us, create_time_us, "
    "update_time_us, last_clear_us, model, settings_json"
)

THREAD_COLUMNS = (
    "tenant, agent, scope, thread, create_time_us, last_message_time_us, message_count, "
    "token_estimate, last_clear_us, last_sequence"
)

MESSAGE_COLUMNS = (
    "id, tenant, agent, scope, thread, role, content, tool_calls, tool_call_id, "
    "external_id, metadata, token_estimate, create_time_us, token_count, group_id, "
    "is_summary, first_summarized_id, last_summarized_id, tokenizer, source_time_us, sequence, "
    "restored_from"
)


def agent_from_row(row: Sequence[Any]) -> Agent:
    docs = tuple(AgentDoc(name=d["name"], content=d["content"]) for d in json.loads(row[3]))
    settings = json.loads(row[9])
    retention, overrides = retention_of(settings)
    return Agent(
        tenant=row[0],
        name=row[1],
        system_prompt=row[2],
        docs=docs,
        rolling_window_us=row[4],
        create_time_us=row[5],
        update_time_us=row[6],
        last_clear_time_us=row[7],
        model=row[8],
        build_options=BuildOverrides(**settings.get("build_options", {})),
        retention=retention,
        retention_overrides=overrides,
    )


def thread_from_row(row: Sequence[Any]) -> Thread:
    return Thread(*row)


def message_from_row(row: Sequence[Any]) -> StoredMessage:
    return StoredMessage(
        id=row[0],
        tenant=row[1],
        agent=row[2],
        scope=row[3],
        thread=row[4],
        role=Role(row[5]),
        content=row[6],
        tool_calls=row[7],
        tool_call_id=row[8],
        external_id=row[9],
        metadata=row[10],
        token_estimate=row[11],
        create_time_us=row[12],
        token_count=row[13],
        group_id=row[14],
        is_summary=bool(row[15]),
        summarized_ids=(row[16], row[17]) if row[15] else None,
        tokenizer=row[18],
        source_time_us=row[19],
        sequence=row[20],
        restored_from=row[21],
    )


def status_from_row(row: Sequence[Any]) -> StatusEntry:
    return StatusEntry(
        key=row[0],
        kind=StatusKind.THREAD if row[1] == 1 else StatusKind.PROCESS,
        state=row[2],
        summary=row[3],
        update_time_us=row[4],
        expire_time_us=row[5],
    )


def settings_json(settings: AgentSettings) -> str:
    """Settings without columns of their own (build options, retention), as one JSON
    object; retention appears only when the agent has some."""
    return json.dumps(
        {
            "build_options": settings.build_options.as_dict(),
            **retention_json(settings.retention, settings.retention_overrides),
        }
    )


def docs_json(docs: Sequence[AgentDoc]) -> str:
    return json.dumps([{"name": d.name, "content": d.content} for d in docs])


def agent_row(tenant: str, name: str, settings: AgentSettings, now_us: int) -> list[Any]:
    """A new agent's row (AGENT_COLUMNS order): its clear marker starts at its creation."""
    return [
        tenant,
        name,
        settings.system_prompt,
        docs_json(settings.docs),
        settings.rolling_window_us,
        now_us,
        now_us,
        now_us,
        settings.model,
        settings_json(settings),
    ]


def status_kind_code(kind: StatusKind) -> int:
    return 1 if kind == StatusKind.THREAD else 2


SNAPSHOT_COLUMNS = (
    "id, tenant, agent, scope, thread, create_time_us, description, summary, message_count, "
    "window_start_us, window_end_us, threads_json, size_bytes"
)


def snapshot_from_row(row: Sequence[Any]) -> SnapshotInfo:
    """A snapshot's metadata from its SNAPSHOT_COLUMNS."""
    return SnapshotInfo(
        id=row[0],
        tenant=row[1],
        agent=row[2],
        scope=row[3],
        thread=row[4],
        create_time_us=row[5],
        description=row[6],
        summary=row[7],
        message_count=row[8],
        window_start_us=row[9],
        window_end_us=row[10],
        threads=tuple(json.loads(row[11])),
        size_bytes=row[12],
    )


KEY_COLUMNS = "key_id, tenant, role, name, create_time_us, revoke_time_us"


def key_from_row(row: Sequence[Any]) -> ApiKey:
    """An API key from its KEY_COLUMNS."""
    return ApiKey(row[0], row[1], KeyRole(row[2]), row[3], row[4], row[5])
