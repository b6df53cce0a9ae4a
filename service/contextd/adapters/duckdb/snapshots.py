"""Snapshots on the embedded engine: each document a JSON file, its metadata in DuckDB.

A document is written under the data directory at
`snapshots/<agent, percent-encoded>/<UTC save time>_<id>.json`, atomically (a temporary
file, fsync, rename, fsync of the directory), before its metadata row commits; the row
records the file's path and SHA-256, which every read checks. A delete removes the row,
then the file. So the file and the database agree after every save and delete; what a
crash between the two steps leaves (a file without a row, or a temporary file) is removed
when the store opens, and a row whose file has gone is reported (and read as DATA_LOSS).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb

from contextd.adapters.duckdb.base import (
    NOTHING,
    RETRY_AFTER_S,
    DuckDBBase,
    _first,
    _scope_key,
    log,
)
from contextd.adapters.duckdb.files import fsync_dir, remove_stray_files
from contextd.adapters.rows import SNAPSHOT_COLUMNS, snapshot_from_row
from contextd.domain.errors import DataLoss, StoreBusy, StoreUnavailable
from contextd.domain.idempotency import RequestRecord
from contextd.domain.snapshots import (
    SnapshotInfo,
    snapshot_agent_gone,
    snapshot_not_found,
    utc_name,
)

SNAPSHOTS_DIR = "snapshots"


def document_path(info: SnapshotInfo) -> str:
    """Where a snapshot's document lives, relative to the data directory. Agent names may
    hold "/" and ":", so they are percent-encoded into one safe directory name."""
    agent = quote(info.agent, safe="")
    return f"{SNAPSHOTS_DIR}/{agent}/{utc_name(info.create_time_us)}_{info.id}.json"


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or does not exist, also across a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)
    fsync_dir(path.parent.parent)


def _io_failed(what: str) -> StoreUnavailable:
    return StoreUnavailable(
        f"the store could not {what} a snapshot document (I/O error); retry later",
        retry_after_s=RETRY_AFTER_S,
    )


class SnapshotsMixin(DuckDBBase):
    def save_snapshot(
        self,
        info: SnapshotInfo,
        document: bytes,
        agent_created_us: int,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        relative = document_path(info)
        path = self._data_dir / relative
        try:
            write_atomically(path, document)
        except OSError as exc:
            log.error("writing a snapshot document failed", extra={"detail": str(exc)[:300]})
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise _io_failed("write") from exc
        digest = hashlib.sha256(document).hexdigest()

        def insert(cur: duckdb.DuckDBPyConnection) -> SnapshotInfo:
            # The agent the snapshot was read from must still be there (a DeleteAgent
            # between the read and this write would otherwise leave its snapshot behind).
            agent = _first(
                cur.execute(
                    "SELECT create_time_us FROM agents WHERE tenant = ? AND name = ?",
                    [info.tenant, info.agent],
                )
            )
            if agent is None or agent[0] != agent_created_us:
                raise snapshot_agent_gone(info.agent)
            cur.execute(
                f"INSERT INTO snapshots ({SNAPSHOT_COLUMNS}, scope_key, path, sha256) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    _scope_key(info.tenant, info.agent, info.scope),
                    relative,
                    digest,
                ],
            )
            return info

        try:
            return self._write(insert, record, NOTHING)  # snapshots are not cached
        except StoreBusy:
            # The row may still commit: keep the file (a start removes it if it did not).
            raise
        except BaseException:
            # Not saved (or saved before, under this request id): the file is nobody's.
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise

    def list_snapshots(
        self,
        tenant: str,
        agent: str,
        scope: str,
        after: tuple[int, str] | None,
        limit: int,
    ) -> list[SnapshotInfo]:
        params: list[Any] = [_scope_key(tenant, agent, scope), tenant, agent, scope]
        position = ""
        if after is not None:
            position = "AND (create_time_us < ? OR (create_time_us = ? AND id < ?))"
            params += [after[0], after[0], after[1]]
        rows = (
            self._cursor()
            .execute(
                f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE scope_key = ? "
                f"AND tenant = ? AND agent = ? AND scope = ? {position} "
                "ORDER BY create_time_us DESC, id DESC LIMIT ?",
                [*params, limit],
            )
            .fetchall()
        )
        return [snapshot_from_row(r) for r in rows]

    def get_snapshot(
        self, tenant: str, agent: str, scope: str, snapshot_id: str
    ) -> SnapshotInfo | None:
        row = _first(
            self._cursor().execute(
                f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ? AND tenant = ? "
                "AND agent = ? AND scope = ?",
                [snapshot_id, tenant, agent, scope],
            )
        )
        return snapshot_from_row(row) if row else None

    def snapshot_document(self, info: SnapshotInfo) -> bytes:
        row = _first(
            self._cursor().execute(
                "SELECT path, sha256 FROM snapshots WHERE id = ? AND tenant = ?",
                [info.id, info.tenant],
            )
        )
        if row is None:
            raise snapshot_not_found(info.id)  # deleted since its metadata was read
        relative, digest = str(row[0]), str(row[1])
        try:
            data = (self._data_dir / relative).read_bytes()
        except FileNotFoundError as exc:
            raise DataLoss(
                f"the document of snapshot {info.id!r} is missing ({relative} under the data "
                "directory); restore the file from a backup or delete the snapshot"
            ) from exc
        except OSError as exc:
            log.error("reading a snapshot document failed", extra={"detail": str(exc)[:300]})
            raise _io_failed("read") from exc
        if hashlib.sha256(data).hexdigest() != digest:
            raise DataLoss(
                f"the document of snapshot {info.id!r} ({relative} under the data directory) "
                "is not the one saved (its checksum differs); restore the file from a backup "
                "or delete the snapshot"
            )
        return data

    def delete_snapshot(
        self,
        tenant: str,
        agent: str,
        scope: str,
        snapshot_id: str,
        record: RequestRecord | None = None,
    ) -> SnapshotInfo:
        def delete(cur: duckdb.DuckDBPyConnection) -> tuple[SnapshotInfo, str]:
            where = "id = ? AND tenant = ? AND agent = ? AND scope = ?"
            params = [snapshot_id, tenant, agent, scope]
            row = _first(
                cur.execute(f"SELECT {SNAPSHOT_COLUMNS}, path FROM snapshots WHERE {where}", params)
            )
            if row is None:
                raise snapshot_not_found(snapshot_id)
            cur.execute(f"DELETE FROM snapshots WHERE {where}", params)
            return snapshot_from_row(row), str(row[-1])

        # A retry is answered with the snapshot alone, as the first call was.
        recorded = record.with_encoder(lambda r: record.encode(r[0])) if record else None
        info, relative = self._write(delete, recorded, NOTHING)
        self._remove_documents([relative])
        return info

    # ----------------------------------------------------------------- helpers

    def _drop_agent_snapshots(
        self, cur: duckdb.DuckDBPyConnection, tenant: str, agent: str
    ) -> list[str]:
        """Delete the agent's snapshot rows (in the caller's transaction); returns the
        paths of their documents, to remove once that commits."""
        params = [tenant, agent]
        rows = cur.execute(
            "SELECT path FROM snapshots WHERE tenant = ? AND agent = ?", params
        ).fetchall()
        cur.execute("DELETE FROM snapshots WHERE tenant = ? AND agent = ?", params)
        return [str(r[0]) for r in rows]

    def _remove_documents(self, paths: Sequence[str]) -> None:
        """Remove documents whose rows are gone; one that cannot be removed now is
        removed at the next start."""
        for relative in paths:
            try:
                (self._data_dir / relative).unlink(missing_ok=True)
            except OSError as exc:
                log.warning(
                    "removing a deleted snapshot's document failed; the next start removes it",
                    extra={"path": relative, "detail": str(exc)[:300]},
                )

    def _reconcile_snapshot_files(self) -> None:
        """At open: remove documents no row names (a save that did not commit, a delete
        that stopped before its file) and temporary files; report rows without files."""
        root = self._data_dir / SNAPSHOTS_DIR
        known = {str(r[0]) for r in self._cursor().execute("SELECT path FROM snapshots").fetchall()}
        remove_stray_files(
            self._data_dir,
            root,
            lambda path, relative: (
                path.name.endswith(".tmp") or (path.suffix == ".json" and relative not in known)
            ),
            "snapshot document",
        )
        missing = sorted(p for p in known if not (self._data_dir / p).is_file())
        if missing:
            log.warning(
                "snapshot documents are missing; reading those snapshots is DATA_LOSS",
                extra={"count": len(missing), "first": missing[0]},
            )
