"""Status entries: the short facts the status preamble of a build shows."""

from __future__ import annotations

from dataclasses import replace

from contextd.app.base import UseCases
from contextd.app.paging import page_size
from contextd.domain.context import StatusEntry
from contextd.domain.errors import (
    InvalidArgument,
)
from contextd.domain.idempotency import RequestRecord
from contextd.domain.limits import (
    MAX_STATUS_KEY_CHARS,
    MAX_STATUS_STATE_CHARS,
    MAX_STATUS_SUMMARY_CHARS,
)
from contextd.domain.model import (
    Page,
)
from contextd.domain.validation import (
    check_name,
    check_text,
)


class StatusCalls(UseCases):
    def set_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        entry: StatusEntry,
        ttl_us: int | None,
        record: RequestRecord | None = None,
    ) -> StatusEntry:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        if not entry.key or len(entry.key) > MAX_STATUS_KEY_CHARS:
            raise InvalidArgument(
                f"entry.key must be 1 to {MAX_STATUS_KEY_CHARS} characters", field="entry.key"
            )
        if len(entry.state) > MAX_STATUS_STATE_CHARS:
            raise InvalidArgument(
                f"entry.state is longer than {MAX_STATUS_STATE_CHARS} characters",
                field="entry.state",
            )
        if not entry.summary or len(entry.summary) > MAX_STATUS_SUMMARY_CHARS:
            raise InvalidArgument(
                f"entry.summary must be 1 to {MAX_STATUS_SUMMARY_CHARS} characters",
                field="entry.summary",
            )
        check_text(entry.key, "entry.key")
        check_text(entry.state, "entry.state")
        check_text(entry.summary, "entry.summary")
        now = self._clock.now_us()
        expire = entry.expire_time_us
        if ttl_us is not None:
            if ttl_us <= 0:
                raise InvalidArgument("ttl must be positive", field="ttl")
            expire = now + ttl_us
        if expire is not None and expire <= now:
            raise InvalidArgument("entry.expire_time is in the past", field="entry.expire_time")
        return self._store.set_status(
            tenant, agent, scope, replace(entry, expire_time_us=expire), record
        )

    def list_status(
        self,
        tenant: str,
        agent: str,
        scope: str,
        include_expired: bool,
        requested_size: int,
        token: str,
    ) -> Page[StatusEntry]:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        size = page_size(requested_size)
        params = ("status", tenant, agent, scope, include_expired)
        position = self._pages.decode(token, params, (str,))
        self._store.get_agent(tenant, agent)
        after = str(position.position[0]) if position else None
        live_at = None if include_expired else self._clock.now_us()
        entries = self._store.list_status(tenant, agent, scope, after, size + 1, live_at)
        return Page(*self._pages.cut(entries, size, params, lambda e: (e.key,)))

    def clear_status(
        self, tenant: str, agent: str, scope: str, key: str, record: RequestRecord | None = None
    ) -> int:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        return self._store.clear_status(tenant, agent, scope, key or None, record)
