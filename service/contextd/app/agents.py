"""Agents: create, read, update (AIP-134 masks, etags), list, delete."""

from __future__ import annotations

from collections.abc import Sequence

from contextd.app.base import UseCases
from contextd.app.paging import page_size
from contextd.domain.errors import (
    Aborted,
)
from contextd.domain.idempotency import RequestRecord
from contextd.domain.limits import (
    agent_bytes,
    checked_settings,
    mask_fields,
)
from contextd.domain.model import (
    Agent,
    AgentSettings,
    Page,
)
from contextd.domain.validation import (
    check_name,
    quote,
)


class AgentCalls(UseCases):
    def create_agent(
        self, tenant: str, name: str, settings: AgentSettings, record: RequestRecord | None = None
    ) -> Agent:
        check_name(name, "agent.name")
        created = self._store.create_agent(tenant, name, checked_settings(settings), record)
        self._forget_agent(tenant, name)
        return created

    def get_agent(self, tenant: str, name: str) -> Agent:
        check_name(name, "name")
        return self._store.get_agent(tenant, name)

    def update_agent(
        self,
        tenant: str,
        name: str,
        settings: AgentSettings,
        fields: Sequence[str],
        etag: str = "",
        record: RequestRecord | None = None,
    ) -> Agent:
        """Update exactly `fields` (mask paths: the updatable fields, "build_options.<option>"
        for one option, "*" for all); an empty list updates nothing. The api layer turns
        an absent mask into the fields the request sets (AIP-134)."""
        check_name(name, "agent.name")
        chosen = mask_fields(fields)
        if not chosen:
            current = self._store.get_agent(tenant, name)
            if etag and etag != current.etag:
                raise Aborted(
                    f"agent {name!r} changed since etag {quote(etag)} was read; read it again",
                    reason="ETAG_MISMATCH",
                    field="agent.etag",
                )
            return current
        updated = self._store.update_agent(
            tenant, name, checked_settings(settings), chosen, etag, record
        )
        self._forget_agent(tenant, name)  # after the commit, so no stale re-read
        return updated

    def list_agents(self, tenant: str, requested_size: int, token: str) -> Page[Agent]:
        size = page_size(requested_size)
        params = ("agents", tenant)
        position = self._pages.decode(token, params, (str,))
        after = str(position.position[0]) if position else None
        agents = self._store.list_agents(tenant, after, size + 1)
        return Page(*self._pages.cut(agents, size, params, lambda a: (a.name,), None, agent_bytes))

    def delete_agent(
        self, tenant: str, name: str, etag: str = "", record: RequestRecord | None = None
    ) -> int:
        check_name(name, "name")
        deleted = self._store.delete_agent(tenant, name, etag, record)
        self._forget_agent(tenant, name)
        self._quota.forget(tenant)  # its threads and snapshots no longer count
        return deleted
