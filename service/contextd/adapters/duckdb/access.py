"""API keys on DuckDB."""

from __future__ import annotations

import threading

import duckdb

from contextd.adapters.duckdb.base import NOTHING, DuckDBBase, _first
from contextd.adapters.rows import KEY_COLUMNS, key_from_row
from contextd.domain.access import ApiKey, key_not_found
from contextd.domain.idempotency import RequestRecord

# How many keys `find_key` keeps in memory; past it the memory starts again.
KEYS_KEPT = 4096


class AccessMixin(DuckDBBase):
    """Keys in the DuckDB file. Whether any key is active is asked on every call that
    comes without a key, and a call's key is found on every call with one, so both are
    kept in memory: exact here, because one process owns the file and every change goes
    through this store (`contextd keys --direct` needs the server stopped). A key read
    from the file was a read by SQL, whose barrier first applies the append journal:
    every keyed append applied it (11 ms at the median against 1.3 ms, paired)."""

    _active_keys_known: bool | None = None
    # Keys found, by id (None: not initialized yet), and the revocations made so far: a
    # key read while a revocation commits is kept only if none happened meanwhile.
    _keys_found: dict[str, tuple[ApiKey, str]] | None = None
    _keys_revoked = 0
    _keys_lock: threading.Lock

    def create_key(
        self, key: ApiKey, secret_hash: str, record: RequestRecord | None = None
    ) -> ApiKey:
        def insert(cur: duckdb.DuckDBPyConnection) -> ApiKey:
            now = self.clock.tick()
            cur.execute(
                f"INSERT INTO api_keys ({KEY_COLUMNS}, secret_hash) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [key.key_id, key.tenant, int(key.role), key.name, now, None, secret_hash],
            )
            return ApiKey(key.key_id, key.tenant, key.role, key.name, now)

        created = self._write(insert, record, NOTHING)  # keys are not cached
        self._active_keys_known = True
        return created

    def find_key(self, key_id: str) -> tuple[ApiKey, str] | None:
        kept = self._keys_found
        if kept is not None and (found := kept.get(key_id)) is not None:
            return found
        revocations = self._keys_revoked
        row = _first(
            self._cursor().execute(
                f"SELECT {KEY_COLUMNS}, secret_hash FROM api_keys WHERE key_id = ?", [key_id]
            )
        )
        if not row:
            return None  # unknown ids are not kept: any id could be asked for
        found = (key_from_row(row), str(row[6]))
        with self._keys_lock:
            if revocations == self._keys_revoked:  # else it may predate a revocation
                if self._keys_found is None or len(self._keys_found) >= KEYS_KEPT:
                    self._keys_found = {}
                self._keys_found[key_id] = found
        return found

    def list_keys(
        self, tenant: str, after_key_id: str | None, limit: int, include_revoked: bool
    ) -> list[ApiKey]:
        rows = (
            self._cursor()
            .execute(
                f"SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant = ? AND key_id > ? "
                "AND (? OR revoke_time_us IS NULL) ORDER BY key_id LIMIT ?",
                [tenant, after_key_id or "", include_revoked, limit],
            )
            .fetchall()
        )
        return [key_from_row(r) for r in rows]

    def revoke_key(self, tenant: str, key_id: str, record: RequestRecord | None = None) -> ApiKey:
        def revoke(cur: duckdb.DuckDBPyConnection) -> ApiKey:
            row = _first(
                cur.execute(
                    f"SELECT {KEY_COLUMNS} FROM api_keys WHERE key_id = ? AND tenant = ?",
                    [key_id, tenant],
                )
            )
            if row is None:
                raise key_not_found(key_id)
            key = key_from_row(row)
            if key.revoke_time_us is not None:
                return key
            now = self.clock.tick()
            cur.execute("UPDATE api_keys SET revoke_time_us = ? WHERE key_id = ?", [now, key_id])
            return ApiKey(key.key_id, key.tenant, key.role, key.name, key.create_time_us, now)

        revoked = self._write(revoke, record, NOTHING)
        self._active_keys_known = None  # read again on the next ask
        with self._keys_lock:  # before the revocation is answered: no call finds it kept
            self._keys_revoked += 1
            if self._keys_found is not None:
                self._keys_found.pop(key_id, None)
        return revoked

    def any_active_key(self) -> bool:
        if self._active_keys_known is not None:
            return self._active_keys_known
        row = _first(
            self._cursor().execute(
                "SELECT EXISTS (SELECT 1 FROM api_keys WHERE revoke_time_us IS NULL)"
            )
        )
        self._active_keys_known = bool(row[0]) if row else False
        return self._active_keys_known
