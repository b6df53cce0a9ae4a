"""Tool outputs on the embedded engine: pointers in DuckDB, large results as files.

A large result is written, a chunk at a time, to a temporary file under the data
directory (`tool_outputs/<tenant, percent-encoded>/.<id>.chunks.tmp`), never through the
writer's queue; once whole it is fsynced and renamed to `<id>.chunks` (and the directory
fsynced), and only then is the pointer's row committed (through the writer: one small
row). So a crash at any moment leaves either a visible output with its whole file, or
no row at all: a temporary file or a file without a row, which the next open removes.
A delete removes the rows, then the files. The row records each chunk's stored length
(`chunk_lengths`), so any chunk is read with one seek.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb

from contextd.adapters.blobs.codec import decode_chunk, encode_chunk, unreadable
from contextd.adapters.blobs.rows import (
    POINTER_COLUMNS,
    STORAGE_COLUMNS,
    filter_sql,
    is_expired,
    pointer_from_row,
    pointer_values,
)
from contextd.adapters.duckdb.base import (
    NOTHING,
    RETRY_AFTER_S,
    DuckDBBase,
    _first,
    _scope_key,
    log,
)
from contextd.adapters.duckdb.files import fsync_dir, remove_stray_files
from contextd.domain.errors import StoreBusy, StoreUnavailable
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import ContextKey
from contextd.domain.tool_outputs import ToolOutputFilter, ToolOutputPointer
from contextd.ports.store import RetainedThread
from contextd.ports.tool_outputs import IndexedOutput

TOOL_OUTPUTS_DIR = "tool_outputs"
_SUFFIX = ".chunks"
_TEMPORARY = ".chunks.tmp"


def _io_failed(what: str) -> StoreUnavailable:
    return StoreUnavailable(
        f"the store could not {what} a tool output's result (I/O error); retry later",
        retry_after_s=RETRY_AFTER_S,
    )


class FileUpload:
    """A result being written to its temporary file (see the module's docstring)."""

    def __init__(self, data_dir: Path, tenant: str, output_id: str, compress: bool) -> None:
        self.relative = f"{TOOL_OUTPUTS_DIR}/{quote(tenant, safe='')}/{output_id}{_SUFFIX}"
        self.path = data_dir / self.relative
        self.temporary = self.path.with_name(f".{output_id}{_TEMPORARY}")
        self.compress = compress
        self.chunk_lengths: list[int] = []
        self._stored = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out: Any = open(self.temporary, "wb")  # noqa: SIM115 (closed in finish/abort)
        except OSError as exc:
            raise _io_failed("write") from exc

    @property
    def stored_bytes(self) -> int:
        return self._stored

    def write(self, chunk: bytes) -> None:
        stored = encode_chunk(chunk, self.compress)
        try:
            self._out.write(stored)
        except OSError as exc:
            self.abort()
            raise _io_failed("write") from exc
        self.chunk_lengths.append(len(stored))
        self._stored += len(stored)

    def finish(self) -> None:
        """Make the file durable under its final name (not yet visible: no row)."""
        try:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
            os.replace(self.temporary, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            self.abort()
            raise _io_failed("write") from exc

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._out.close()
        for path in (self.temporary, self.path):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


class ToolOutputsMixin(DuckDBBase):
    def begin_tool_output_blob(self, tenant: str, output_id: str, compress: bool) -> FileUpload:
        return FileUpload(self._data_dir, tenant, output_id, compress)

    def save_tool_output(
        self,
        pointer: ToolOutputPointer,
        inline: bytes | None,
        upload: Any,
        index_text: str,
        record: RequestRecord | None = None,
    ) -> ToolOutputPointer:
        file = upload if isinstance(upload, FileUpload) else None
        if file is not None:
            file.finish()
        values = [
            *pointer_values(pointer),
            inline,
            file.compress if file else False,
            json.dumps(file.chunk_lengths if file else []),
            index_text,
            _scope_key(pointer.tenant, pointer.agent, pointer.scope),
            file.relative if file else None,
        ]

        def insert(cur: duckdb.DuckDBPyConnection) -> ToolOutputPointer:
            cur.execute(
                f"INSERT INTO tool_outputs ({POINTER_COLUMNS}, {STORAGE_COLUMNS}, scope_key, "
                f"path) VALUES ({', '.join('?' * len(values))})",
                values,
            )
            return pointer

        try:
            return self._write(insert, record, NOTHING)  # tool outputs are not cached
        except StoreBusy:
            raise  # the row may still commit: keep the file (an open removes it if not)
        except BaseException:
            if file is not None:
                file.abort()
            raise

    def list_tool_outputs(
        self, where: ToolOutputFilter, after: tuple[int, str] | None, limit: int
    ) -> list[ToolOutputPointer]:
        conditions, params = self._filter(where)
        if after is not None:
            conditions += " AND (create_time_us > ? OR (create_time_us = ? AND id > ?))"
            params += [after[0], after[0], after[1]]
        rows = self._select(
            where,
            f"SELECT {POINTER_COLUMNS} FROM tool_outputs WHERE {conditions} "
            "ORDER BY create_time_us, id LIMIT ?",
            [*params, limit],
        )
        return [pointer_from_row(r) for r in rows]

    def tool_output_index(
        self, where: ToolOutputFilter, limit: int
    ) -> list[tuple[ToolOutputPointer, str]]:
        conditions, params = self._filter(where)
        rows = self._select(
            where,
            f"SELECT * FROM (SELECT {POINTER_COLUMNS}, index_text FROM tool_outputs "
            f"WHERE {conditions} ORDER BY create_time_us DESC, id DESC LIMIT ?) "
            "ORDER BY create_time_us, id",
            [*params, limit],
        )
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
        # By id alone, which DuckDB answers from the primary key's index (with more
        # conditions it scans the table: 10 ms at 100,000 outputs); the tenant, agent and
        # scope are then checked on the rows found.
        rows = (
            self._cursor()
            .execute(f"SELECT {POINTER_COLUMNS} FROM tool_outputs WHERE id = ANY(?)", [list(ids)])
            .fetchall()
        )
        found = [pointer_from_row(r) for r in rows]
        found = [p for p in found if (p.tenant, p.agent, p.scope) == (tenant, agent, scope)]
        if not expired_through_us or not found:
            return found
        # The threads' rows in a second lookup (a condition on them in the query above
        # would make DuckDB scan tool_outputs).
        threads = {
            str(r[0]): (int(r[1]), int(r[2]))
            for r in self._thread_rows(
                "SELECT thread, last_message_time_us, outputs_expired_through_us "
                "FROM live_threads WHERE tenant = ? AND agent = ? AND scope = ? AND "
                "thread = ANY(?)",
                [tenant, agent, scope, sorted({p.thread for p in found})],
            )
        }
        return [
            p
            for p in found
            if p.thread not in threads
            or not is_expired(p.create_time_us, expired_through_us, *threads[p.thread])
        ]

    def read_tool_output_chunks(
        self, pointer: ToolOutputPointer, first: int, count: int
    ) -> list[bytes]:
        row = _first(
            self._cursor().execute(
                "SELECT inline_data, compressed, chunk_lengths, path FROM tool_outputs "
                "WHERE id = ? AND tenant = ?",
                [pointer.id, pointer.tenant],
            )
        )
        if row is None:
            return []  # deleted meanwhile
        if pointer.stored_inline:
            return [bytes(row[0])] if first == 0 and count > 0 else []
        compressed, lengths, relative = bool(row[1]), json.loads(row[2]), str(row[3])
        last = min(len(lengths), first + count)
        if first >= last:
            return []
        start = sum(lengths[:first])
        try:
            with open(self._data_dir / relative, "rb") as src:
                src.seek(start)
                chunks = []
                for length in lengths[first:last]:
                    stored = src.read(length)
                    if len(stored) != length:
                        raise unreadable(pointer.id, "its file is shorter than stored")
                    chunks.append(decode_chunk(stored, compressed, pointer.id))
                return chunks
        except FileNotFoundError as exc:
            raise unreadable(pointer.id, f"{relative} under the data directory is missing") from exc
        except OSError as exc:
            log.error("reading a tool output failed", extra={"detail": str(exc)[:300]})
            raise _io_failed("read") from exc

    def delete_tool_outputs(
        self, where: ToolOutputFilter, record: RequestRecord | None = None
    ) -> int:
        conditions, params = self._filter(where)

        def delete(cur: duckdb.DuckDBPyConnection) -> tuple[int, list[str]]:
            rows = cur.execute(
                f"SELECT path FROM tool_outputs WHERE {conditions}", params
            ).fetchall()
            cur.execute(f"DELETE FROM tool_outputs WHERE {conditions}", params)
            return len(rows), [str(r[0]) for r in rows if r[0] is not None]

        recorded = record.with_encoder(lambda r: record.encode(r[0])) if record else None
        count, paths = self._write(delete, recorded, NOTHING)
        self._remove_tool_output_files(paths)
        return count

    def delete_expired_tool_outputs(
        self, thread: RetainedThread, cutoff_us: int, limit: int
    ) -> int:
        key = thread.key
        where = (
            "scope_key = ? AND tenant = ? AND agent = ? AND scope = ? AND thread = ? AND "
            "create_time_us <= ?"
        )
        params = [
            _scope_key(key.tenant, key.agent, key.scope),
            key.tenant,
            key.agent,
            key.scope,
            key.thread,
            cutoff_us,
        ]
        # A read first: a sweep visits expired threads again on every pass, and most
        # have no output left to delete (no writer job for them).
        if (
            _first(
                self._cursor().execute(f"SELECT 1 FROM tool_outputs WHERE {where} LIMIT 1", params)
            )
            is None
        ):
            return 0

        def chunk(cur: duckdb.DuckDBPyConnection) -> tuple[int, list[str]]:
            row = _first(
                cur.execute(
                    "SELECT last_message_time_us, outputs_expired_through_us FROM threads "
                    "WHERE context_id = ?",
                    [thread.context_id],
                )
            )
            if row is None:
                return 0, []
            last = max(int(row[0] or 0), self._pending.last_of(thread.context_id))
            if last > cutoff_us and cutoff_us > int(row[1]):
                return 0, []  # appended to since it was read: alive again
            rows = cur.execute(
                f"SELECT id, path FROM tool_outputs WHERE {where} LIMIT ?", [*params, limit]
            ).fetchall()
            if rows:
                ids = [str(r[0]) for r in rows]
                cur.execute(
                    f"DELETE FROM tool_outputs WHERE id IN ({', '.join('?' * len(ids))})", ids
                )
            return len(rows), [str(r[1]) for r in rows if r[1] is not None]

        count, paths = self._write(chunk, touches=NOTHING)
        self._remove_tool_output_files(paths)
        return count

    def tool_calls_declaring(self, key: ContextKey, call_id: str) -> str | None:
        row = _first(
            self._cursor().execute(
                "SELECT tool_calls FROM messages WHERE context_id = (SELECT context_id FROM "
                "threads WHERE tenant = ? AND agent = ? AND scope = ? AND thread = ?) AND "
                "tool_call_ids <> '' AND list_contains(string_split(tool_call_ids, ','), ?) "
                "ORDER BY sequence DESC LIMIT 1",
                [key.tenant, key.agent, key.scope, key.thread, call_id],
            )
        )
        return None if row is None else str(row[0])

    def tool_output_fingerprint(self, tenant: str, agent: str, scope: str) -> tuple[int, int, int]:
        row = _first(
            self._cursor().execute(
                "SELECT count(*), coalesce(sum(create_time_us), 0), "
                "coalesce(sum(hash(id)), 0) FROM tool_outputs "
                "WHERE scope_key = ? AND tenant = ? AND agent = ? AND scope = ?",
                [_scope_key(tenant, agent, scope), tenant, agent, scope],
            )
        )
        return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)

    def tool_output_docs(
        self, tenant: str, agent: str, scope: str, after: tuple[int, str] | None, limit: int
    ) -> list[IndexedOutput]:
        position = after or (-1, "")
        rows = (
            self._cursor()
            .execute(
                "SELECT id, create_time_us, thread, task_id, query_id, tool_name, index_text, "
                "hash(id) "
                "FROM tool_outputs WHERE scope_key = ? AND tenant = ? AND agent = ? AND "
                "scope = ? AND (create_time_us > ? OR (create_time_us = ? AND id > ?)) "
                "ORDER BY create_time_us, id LIMIT ?",
                [
                    _scope_key(tenant, agent, scope),
                    tenant,
                    agent,
                    scope,
                    position[0],
                    position[0],
                    position[1],
                    limit,
                ],
            )
            .fetchall()
        )
        return [
            (str(r[0]), int(r[1]), str(r[2]), r[3], r[4], str(r[5]), str(r[6]), int(r[7]))
            for r in rows
        ]

    def _drop_agent_tool_outputs(
        self, cur: duckdb.DuckDBPyConnection, tenant: str, agent: str
    ) -> list[str]:
        """Delete every tool output row of the agent, in every scope (in the caller's
        transaction: DeleteAgent's); returns the paths of their files, to remove once
        that commits (a crash before leaves files no row names: the next open removes
        them)."""
        params = [tenant, agent]
        rows = cur.execute(
            "SELECT path FROM tool_outputs WHERE tenant = ? AND agent = ? AND path IS NOT NULL",
            params,
        ).fetchall()
        cur.execute("DELETE FROM tool_outputs WHERE tenant = ? AND agent = ?", params)
        return [str(r[0]) for r in rows]

    def _remove_tool_output_files(self, paths: Sequence[str]) -> None:
        """Remove files whose rows are gone; one that cannot be removed now is removed at
        the next start."""
        for relative in paths:
            try:
                (self._data_dir / relative).unlink(missing_ok=True)
            except OSError as exc:
                log.warning(
                    "removing a deleted tool output's file failed; the next start removes it",
                    extra={"path": relative, "detail": str(exc)[:300]},
                )

    # ----------------------------------------------------------------- helpers

    def _select(self, where: ToolOutputFilter, sql: str, params: list[Any]) -> list[Any]:
        """Rows of a read by `_filter(where)`: one that leaves out expired contexts'
        outputs reads the threads' live last message times (`live_threads`)."""
        if where.expired_through_us:
            return self._thread_rows(sql, params)
        return self._cursor().execute(sql, params).fetchall()

    def _filter(self, where: ToolOutputFilter) -> tuple[str, list[Any]]:
        conditions, params = filter_sql(where, "?", "live_threads")
        return f"scope_key = ? AND {conditions}", [
            _scope_key(where.tenant, where.agent, where.scope),
            *params,
        ]

    def _reconcile_tool_output_files(self) -> None:
        """At open: remove temporary files and files no row names (a put that did not
        commit, a delete that stopped before its files)."""
        root = self._data_dir / TOOL_OUTPUTS_DIR
        known = {
            str(r[0])
            for r in self._cursor()
            .execute("SELECT path FROM tool_outputs WHERE path IS NOT NULL")
            .fetchall()
        }
        remove_stray_files(
            self._data_dir, root, lambda _, relative: relative not in known, "tool output file"
        )
