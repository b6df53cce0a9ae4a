"""Events: what the service did, by scope and thread."""

from __future__ import annotations

from contextd.app.base import UseCases
from contextd.app.paging import page_size
from contextd.domain.model import (
    Event,
    Page,
)
from contextd.domain.validation import (
    check_name,
)
from contextd.ports.store import ThreadFilter


class EventCalls(UseCases):
    def list_events(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        event_type: str,
        start_us: int | None,
        end_us: int | None,
        requested_size: int,
        token: str,
    ) -> Page[Event]:
        """Events of one scope, optionally of one thread: never another scope's."""
        check_name(agent, "agent")
        check_name(thread, "thread", allow_empty=True)
        size = page_size(requested_size)
        params = ("events", tenant, agent, scope, thread, event_type, start_us, end_us)
        position = self._pages.decode(token, params, (int,))
        self._store.get_agent(tenant, agent)
        after = int(position.position[0]) if position else 0
        where = ThreadFilter(tenant, agent, scope, thread or None)
        events = self._store.list_events(where, event_type, start_us, end_us, after, size + 1)
        return Page(*self._pages.cut(events, size, params, lambda e: (e.id,)))
