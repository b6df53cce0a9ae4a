"""A tenant's stored bytes on PostgreSQL: its threads' byte counters (kept current by
every append, in the thread row it locks anyway) plus its snapshots' and tool outputs'
sizes; the sums are index ranges on (tenant, ...), never a scan of messages."""

from __future__ import annotations

from contextd.adapters.postgres.base import PostgresBase, first


class UsageMixin(PostgresBase):
    def tenant_stored_bytes(self, tenant: str) -> int:
        with self._reading() as conn:
            row = first(
                conn,
                "SELECT (SELECT coalesce(sum(stored_bytes), 0) FROM threads WHERE tenant = %s)"
                " + (SELECT coalesce(sum(size_bytes), 0) FROM snapshots WHERE tenant = %s)"
                " + (SELECT coalesce(sum(size_bytes), 0) FROM tool_outputs WHERE tenant = %s)",
                [tenant, tenant, tenant],
            )
        return int(row[0]) if row else 0
