"""Tool outputs on PostgreSQL: pointers and results in the database, so every replica
reads what any other stored.

A large result goes in as chunk rows (`tool_output_chunks`, one bytea row per chunk of up
to 1 MiB) inside one transaction on one connection, held for the upload; the pointer's
row joins the same transaction and the commit makes both visible at once. A stream that
is cut off (or a server killed mid-put) rolls the transaction back: nothing remains.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from contextd.adapters.blobs.codec import decode_chunk, encode_chunk, unreadable
from contextd.adapters.blobs.rows import (
    POINTER_COLUMNS,
    STORAGE_COLUMNS,
    filter_sql,
    pointer_from_row,
    pointer_values,
)
from contextd.adapters.postgres.base import (
    RETRY_AFTER_S,
    Conn,
    PostgresBase,
    _remembered,
    pay_owed_key_check,
    store_error,
)
from contextd.adapters.postgres.base import (
    first as first_row,
)
from contextd.domain.errors import Unavailable
from contextd.domain.idempotency import AlreadyDone, RequestRecord, replay
from contextd.domain.model import ContextKey
from contextd.domain.tool_outputs import ToolOutputFilter, ToolOutputPointer
from contextd.ports.store import RetainedThread
from contextd.ports.tool_outputs import IndexedOutput


class ChunkUpload:
    """A result being inserted as chunk rows in a transaction of its own connection."""

    def __init__(self, store: ToolOutputsMixin, tenant: str, output_id: str, compress: bool):
        self._store = store
        self.tenant = tenant
        self.output_id = output_id
        self.compress = compress
        self.chunk_lengths: list[int] = []
        self._stored = 0
        self.conn: Conn | None = store._pool.getconn()
        try:  # its transaction confirms a key the call owes a check of, first
            pay_owed_key_check(self.conn)
        except BaseException:
            self.abort()
            raise

    @property
    def stored_bytes(self) -> int:
        return self._stored

    def write(self, chunk: bytes) -> None:
        stored = encode_chunk(chunk, self.compress)
        assert self.conn is not None, "write after the upload ended"
        try:
            self.conn.execute(
                "INSERT INTO tool_output_chunks (tenant, output_id, seq, data) "
                "VALUES (%s, %s, %s, %s)",
                [self.tenant, self.output_id, len(self.chunk_lengths), stored],
            )
        except psycopg.Error as exc:
            self.abort()
            raise store_error(exc) or exc from exc
        self.chunk_lengths.append(len(stored))
        self._stored += len(stored)

    def abort(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
        self._store._pool.putconn(conn)


def _insert_pointer(
    conn: Conn,
    pointer: ToolOutputPointer,
    inline: bytes | None,
    compressed: bool,
    lengths: list[int],
    index_text: str,
) -> None:
    values = [*pointer_values(pointer), inline, compressed, json.dumps(lengths), index_text]
    conn.execute(
        f"INSERT INTO tool_outputs ({POINTER_COLUMNS}, {STORAGE_COLUMNS}) "
        f"VALUES ({', '.join(['%s'] * len(values))})",
        values,
    )


class ToolOutputsMixin(PostgresBase):
    def begin_tool_output_blob(self, tenant: str, output_id: str, compress: bool) -> ChunkUpload:
        if self._closed:
            raise Unavailable(
                "the server is shutting down", reason="SHUTTING_DOWN", retry_after_s=RETRY_AFTER_S
            )
        return ChunkUpload(self, tenant, output_id, compress)

    def save_tool_output(
        self,
        pointer: ToolOutputPointer,
        inline: bytes | None,
        upload: Any,
        index_text: str,
        record: RequestRecord | None = None,
    ) -> ToolOutputPointer:
        if not isinstance(upload, ChunkUpload):

            def insert(conn: Conn) -> ToolOutputPointer:
                _insert_pointer(conn, pointer, inline, False, [], index_text)
                return pointer

            return self._write(insert, record)
        conn = upload.conn
        assert conn is not None, "save after the upload ended"
        try:
            if record is not None:
                found = _remembered(conn, record.tenant, record.request_id)
                if found is not None:
                    raise AlreadyDone(replay(record, found))
            _insert_pointer(conn, pointer, None, upload.compress, upload.chunk_lengths, index_text)
            if record is not None:
                conn.execute(
                    "INSERT INTO request_records (tenant, request_id, method, fingerprint, "
                    "payload, create_time_us) VALUES (%s, %s, %s, %s, %s, %s)",
                    [
                        record.tenant,
                        record.request_id,
                        record.method,
                        record.fingerprint,
                        record.encode(pointer),
                        self.clock.tick(),
                    ],
                )
            conn.commit()
        except pg_errors.UniqueViolation as exc:
            upload.abort()
            if record is None:
                raise
            # A concurrent put under the same request id committed first: answer as it.
            with self._reading() as reader:
                found = _remembered(reader, record.tenant, record.request_id)
            if found is None:
                raise
            raise AlreadyDone(replay(record, found)) from exc
        except BaseException:
            upload.abort()
            raise
        upload.conn = None
        self._pool.putconn(conn)
        return pointer

    def list_tool_outputs(
        self, where: ToolOutputFilter, after: tuple[int, str] | None, limit: int
    ) -> list[ToolOutputPointer]:
        conditions, params = filter_sql(where, "%s")
        if after is not None:
            conditions += " AND (create_time_us, id) > (%s, %s)"
            params += [after[0], after[1]]
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {POINTER_COLUMNS} FROM tool_outputs WHERE {conditions} "
                "ORDER BY create_time_us, id LIMIT %s",
                [*params, limit],
            ).fetchall()
        return [pointer_from_row(r) for r in rows]

    def tool_output_index(
        self, where: ToolOutputFilter, limit: int
    ) -> list[tuple[ToolOutputPointer, str]]:
        conditions, params = filter_sql(where, "%s")
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT * FROM (SELECT {POINTER_COLUMNS}, index_text FROM tool_outputs "
                f"WHERE {conditions} ORDER BY create_time_us DESC, id DESC LIMIT %s) newest "
                "ORDER BY create_time_us, id",
                [*params, limit],
            ).fetchall()
        return [(pointer_from_row(r), str(r[-1])) for r in rows]

    def find_tool_outputs(
        self,
        tenant: str,
        agent: str,
        scope: str,
        ids: Sequence[str],
        expired_through_us: int = 0,
    ) -> list[ToolOutputPointer]:
        if not ids:
            return []
        where, params = filter_sql(
            ToolOutputFilter(tenant, agent, scope, expired_through_us=expired_through_us), "%s"
        )
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {POINTER_COLUMNS} FROM tool_outputs WHERE {where} AND id = ANY(%s)",
                [*params, list(ids)],
            ).fetchall()
        return [pointer_from_row(r) for r in rows]

    def read_tool_output_chunks(
        self, pointer: ToolOutputPointer, first: int, count: int
    ) -> list[bytes]:
        with self._reading() as conn:
            row = first_row(
                conn,
                "SELECT inline_data, compressed, chunk_lengths FROM tool_outputs "
                "WHERE tenant = %s AND id = %s",
                [pointer.tenant, pointer.id],
            )
            if row is None:
                return []  # deleted meanwhile
            if pointer.stored_inline:
                return [bytes(row[0])] if first == 0 and count > 0 else []
            compressed, total = bool(row[1]), len(json.loads(row[2]))
            last = min(total, first + count)
            if first >= last:
                return []
            rows = conn.execute(
                "SELECT seq, data FROM tool_output_chunks WHERE tenant = %s AND "
                "output_id = %s AND seq >= %s AND seq < %s ORDER BY seq",
                [pointer.tenant, pointer.id, first, last],
            ).fetchall()
        if [int(r[0]) for r in rows] != list(range(first, last)):
            raise unreadable(pointer.id, "chunks are missing")
        return [decode_chunk(bytes(r[1]), compressed, pointer.id) for r in rows]

    def delete_tool_outputs(
        self, where: ToolOutputFilter, record: RequestRecord | None = None
    ) -> int:
        conditions, params = filter_sql(where, "%s")

        def delete(conn: Conn) -> int:
            ids = [
                str(r[0])
                for r in conn.execute(
                    f"DELETE FROM tool_outputs WHERE {conditions} RETURNING id", params
                ).fetchall()
            ]
            if ids:
                conn.execute(
                    "DELETE FROM tool_output_chunks WHERE tenant = %s AND output_id = ANY(%s)",
                    [where.tenant, ids],
                )
            return len(ids)

        return self._write(delete, record)

    def delete_expired_tool_outputs(
        self, thread: RetainedThread, cutoff_us: int, limit: int
    ) -> int:
        key = thread.key
        where = "tenant = %s AND agent = %s AND scope = %s AND thread = %s AND create_time_us <= %s"
        params = [key.tenant, key.agent, key.scope, key.thread, cutoff_us]
        # A read first: a sweep visits expired threads again on every pass, and most
        # have no output left to delete (no write transaction for them).
        with self._reading() as conn:
            if first_row(conn, f"SELECT 1 FROM tool_outputs WHERE {where} LIMIT 1", params) is None:
                return 0

        def chunk(conn: Conn) -> int:
            # FOR SHARE: an append (which locks the row FOR UPDATE) waits for this chunk,
            # or this chunk sees the append's newer message time.
            row = first_row(
                conn,
                "SELECT last_message_time_us, outputs_expired_through_us FROM threads "
                "WHERE tenant = %s AND context_id = %s FOR SHARE",
                [key.tenant, thread.context_id],
            )
            if row is None or (int(row[0] or 0) > cutoff_us and cutoff_us > int(row[1])):
                return 0  # gone, or appended to since it was read: alive again
            ids = [
                str(r[0])
                for r in conn.execute(
                    "DELETE FROM tool_outputs WHERE tenant = %s AND id IN (SELECT id FROM "
                    f"tool_outputs WHERE {where} LIMIT %s) RETURNING id",
                    [key.tenant, *params, limit],
                ).fetchall()
            ]
            if ids:
                conn.execute(
                    "DELETE FROM tool_output_chunks WHERE tenant = %s AND output_id = ANY(%s)",
                    [key.tenant, ids],
                )
            return len(ids)

        return self._write(chunk)

    def tool_calls_declaring(self, key: ContextKey, call_id: str) -> str | None:
        with self._reading() as conn:
            row = first_row(
                conn,
                "SELECT m.tool_calls FROM threads t JOIN tool_calls c ON c.tenant = t.tenant "
                "AND c.context_id = t.context_id JOIN messages m ON m.tenant = c.tenant AND "
                "m.id = c.message_id WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s "
                "AND t.thread = %s AND c.call_id = %s",
                [key.tenant, key.agent, key.scope, key.thread, call_id],
            )
        return None if row is None else str(row[0])

    def tool_output_fingerprint(self, tenant: str, agent: str, scope: str) -> tuple[int, int, int]:
        # An index-only range of tool_outputs_by_scope (tenant, agent, scope, time, id).
        with self._reading() as conn:
            row = first_row(
                conn,
                "SELECT count(*), coalesce(sum(create_time_us), 0), "
                "coalesce(sum(hashtext(id)), 0) "
                "FROM tool_outputs "
                "WHERE tenant = %s AND agent = %s AND scope = %s",
                [tenant, agent, scope],
            )
        return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)

    def tool_output_docs(
        self, tenant: str, agent: str, scope: str, after: tuple[int, str] | None, limit: int
    ) -> list[IndexedOutput]:
        position = after or (-1, "")
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT id, create_time_us, thread, task_id, query_id, tool_name, index_text, "
                "hashtext(id) "
                "FROM tool_outputs WHERE tenant = %s AND agent = %s AND scope = %s AND "
                "(create_time_us, id) > (%s, %s) ORDER BY create_time_us, id LIMIT %s",
                [tenant, agent, scope, position[0], position[1], limit],
            ).fetchall()
        return [
            (str(r[0]), int(r[1]), str(r[2]), r[3], r[4], str(r[5]), str(r[6]), int(r[7]))
            for r in rows
        ]
