"""Snapshots on PostgreSQL: metadata and document in one row, written in one transaction.

Replicas share nothing but the database, so the document lives there too (bytea, TOASTed
out of line): a snapshot saved through one replica is read, restored and deleted through
any other, and there is no file to lose.
"""

from __future__ import annotations

import json
from typing import Any

from contextd.adapters.postgres.base import Conn, PostgresBase, first
from contextd.adapters.rows import SNAPSHOT_COLUMNS, snapshot_from_row
from contextd.domain.errors import DataLoss
from contextd.domain.idempotency import RequestRecord
from contextd.domain.snapshots import SnapshotInfo, snapshot_agent_gone, snapshot_not_found


class SnapshotsMixin(PostgresBase):
    def save_snapshot(
        self,
        info: SnapshotInfo,
        document: bytes,
        agent_created_us: int,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        def insert(conn: Conn) -> SnapshotInfo:
            # The agent the snapshot was read from must still be there (a DeleteAgent
            # between the read and this write would otherwise leave its snapshot behind).
            agent = first(
                conn,
                "SELECT create_time_us FROM agents WHERE tenant = %s AND name = %s FOR KEY SHARE",
                [info.tenant, info.agent],
            )
            if agent is None or agent[0] != agent_created_us:
                raise snapshot_agent_gone(info.agent)
            conn.execute(
                f"INSERT INTO snapshots ({SNAPSHOT_COLUMNS}, document) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                [
                    info.id,
                    info.tenant,
                    info.agent,
                    info.scope,
                    info.thread,
                    info.create_time_us,
                    info.description,
                    info.summary,
                    info.message_count,
                    info.window_start_us,
                    info.window_end_us,
                    json.dumps(list(info.threads)),
                    info.size_bytes,
                    document,
                ],
            )
            return info

        return self._write(insert, record)

    def list_snapshots(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[SnapshotInfo]:
        params: list[Any] = [tenant, agent, scope]
        position = ""
        if after is not None:
            position = "AND (create_time_us, id) < (%s, %s)"
            params += [after[0], after[1]]
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE tenant = %s AND agent = %s "
                f"AND scope = %s {position} ORDER BY create_time_us DESC, id DESC LIMIT %s",
                [*params, limit],
            ).fetchall()
        return [snapshot_from_row(r) for r in rows]

    def get_snapshot(
        self, tenant: str, agent: str, scope: str, snapshot_id: str
    ) -> SnapshotInfo | None:
        with self._reading() as conn:
            row = first(
                conn,
                f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE tenant = %s AND id = %s "
                "AND agent = %s AND scope = %s",
                [tenant, snapshot_id, agent, scope],
            )
        return snapshot_from_row(row) if row else None

    def snapshot_document(self, info: SnapshotInfo) -> bytes:
        with self._reading() as conn:
            row = first(
                conn,
                "SELECT document FROM snapshots WHERE tenant = %s AND id = %s",
                [info.tenant, info.id],
            )
        if row is None:
            raise snapshot_not_found(info.id)  # deleted since its metadata was read
        if row[0] is None:
            raise DataLoss(f"the document of snapshot {info.id!r} is missing")
        return bytes(row[0])

    def delete_snapshot(
        self,
        tenant: str,
        agent: str,
        scope: str,
        snapshot_id: str,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        def delete(conn: Conn) -> SnapshotInfo:
            row = first(
                conn,
                f"DELETE FROM snapshots WHERE tenant = %s AND id = %s AND agent = %s "
                f"AND scope = %s RETURNING {SNAPSHOT_COLUMNS}",
                [tenant, snapshot_id, agent, scope],
            )
            if row is None:
                raise snapshot_not_found(snapshot_id)
            return snapshot_from_row(row)

        return self._write(delete, record)
