"""API keys on PostgreSQL."""

from __future__ import annotations

from contextd.adapters.postgres.base import Conn, PostgresBase, first
from contextd.adapters.rows import KEY_COLUMNS, key_from_row
from contextd.domain.access import ApiKey, key_not_found
from contextd.domain.idempotency import RequestRecord


class AccessMixin(PostgresBase):
    # Every write a call makes checks a key the call owes a check of in its own
    # transaction (base.py `pay_owed_key_check`, KEY_STANDS): a call may be admitted
    # from what the replica knows of its key, without a look-up of its own.
    confirms_owed_keys = True

    def create_key(
        self, key: ApiKey, secret_hash: str, record: RequestRecord | None = None
    ) -> ApiKey:
        def insert(conn: Conn) -> ApiKey:
            now = self.clock.tick()
            conn.execute(
                f"INSERT INTO api_keys ({KEY_COLUMNS}, secret_hash) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [key.key_id, key.tenant, int(key.role), key.name, now, None, secret_hash],
            )
            return ApiKey(key.key_id, key.tenant, key.role, key.name, now)

        return self._write(insert, record)

    def find_key(self, key_id: str) -> tuple[ApiKey, str] | None:
        with self._reading_once() as conn:  # every call with a key reads it
            row = first(
                conn,
                f"SELECT {KEY_COLUMNS}, secret_hash FROM api_keys WHERE key_id = %s",
                [key_id],
            )
        return (key_from_row(row), row[6]) if row else None

    def list_keys(
        self, tenant: str, after_key_id: str | None, limit: int, include_revoked: bool
    ) -> list[ApiKey]:
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {KEY_COLUMNS} FROM api_keys WHERE tenant = %s AND key_id > %s "
                "AND (%s OR revoke_time_us IS NULL) ORDER BY key_id LIMIT %s",
                [tenant, after_key_id or "", include_revoked, limit],
            ).fetchall()
        return [key_from_row(r) for r in rows]

    def revoke_key(self, tenant: str, key_id: str, record: RequestRecord | None = None) -> ApiKey:
        def revoke(conn: Conn) -> ApiKey:
            row = first(
                conn,
                f"SELECT {KEY_COLUMNS} FROM api_keys WHERE key_id = %s AND tenant = %s FOR UPDATE",
                [key_id, tenant],
            )
            if row is None:
                raise key_not_found(key_id)
            key = key_from_row(row)
            if key.revoke_time_us is not None:
                return key
            now = self.clock.tick()
            conn.execute("UPDATE api_keys SET revoke_time_us = %s WHERE key_id = %s", [now, key_id])
            return ApiKey(key.key_id, key.tenant, key.role, key.name, key.create_time_us, now)

        return self._write(revoke, record)

    def any_active_key(self) -> bool:
        with self._reading_once() as conn:  # every call without a key asks
            row = first(
                conn, "SELECT EXISTS (SELECT 1 FROM api_keys WHERE revoke_time_us IS NULL)", []
            )
        return bool(row[0]) if row else False
