"""Threads: clears (thread, scope or agent), listing, and the stats of a context."""

from __future__ import annotations

from contextd.app.base import UseCases
from contextd.app.paging import page_size
from contextd.domain.errors import (
    InvalidArgument,
    NotFound,
)
from contextd.domain.idempotency import RequestRecord
from contextd.domain.limits import (
    context_key,
)
from contextd.domain.model import (
    ContextKey,
    ContextStats,
    Page,
    Thread,
)
from contextd.domain.validation import (
    check_name,
)
from contextd.ports.store import ThreadFilter


class ThreadCalls(UseCases):
    def clear_context(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        all_scopes: bool = False,
        record: RequestRecord | None = None,
    ) -> int:
        """Move a clear marker to now and return it: of one thread, of every thread of one
        scope (thread empty), or of the whole agent (all_scopes, and nothing narrower).
        A clear never reaches past the scope it names."""
        check_name(agent, "agent")
        check_name(thread, "thread", allow_empty=True)
        if all_scopes:
            if scope or thread:
                field = "scope" if scope else "thread"
                raise InvalidArgument(
                    f"all_scopes clears every scope and thread of the agent; leave {field} "
                    "unset, or drop all_scopes to clear only what it names",
                    field=field,
                )
            return self._store.clear_agent(tenant, agent, record)
        if not thread:
            return self._store.clear_scope(tenant, agent, scope, record)
        return self._store.clear_thread(context_key(tenant, agent, scope, thread), record)

    def list_threads(
        self, tenant: str, agent: str, scope: str, requested_size: int, token: str
    ) -> Page[Thread]:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        size = page_size(requested_size)
        params = ("threads", tenant, agent, scope)
        position = self._pages.decode(token, params, (str,))
        self._store.get_agent(tenant, agent)
        after = str(position.position[0]) if position else None
        threads = self._store.list_threads(tenant, agent, scope, after, size + 1)
        return Page(*self._pages.cut(threads, size, params, lambda t: (t.thread,)))

    def context_stats(self, tenant: str, agent: str, scope: str, thread: str) -> ContextStats:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_name(thread, "thread", allow_empty=True)
        found = self._store.get_agent(tenant, agent)
        thread_clear: int | None = None
        if thread:
            one = self._store.get_thread(ContextKey(tenant, agent, scope, thread))
            if one is None:
                raise NotFound(
                    f"agent {agent!r} has no thread {thread!r} in scope {scope!r}",
                    reason="THREAD_NOT_FOUND",
                )
            thread_clear = one.last_clear_time_us
        now = self._clock.now_us()
        policy = found.retention_for(scope)
        window = found.window_at(scope, now)
        counts = self._store.context_counts(
            ThreadFilter(tenant, agent, scope, thread or None), window
        )
        window_count, window_tokens, total_count, total_tokens, oldest, newest, threads = counts
        exists = int(window_count) > 0
        # The context (or, for a scope, its thread updated last) expires ttl after its
        # newest message; told only while it holds something.
        expire = policy.expire_time_us(newest) if exists else None
        return ContextStats(
            exists=exists,
            expire_time_us=expire,
            expires_in_us=None if expire is None else max(0, expire - now),
            retention=policy,
            window_start_time_us=window.age_after_us,
            last_clear_time_us=max(found.last_clear_time_us, thread_clear or 0),
            rolling_window_us=found.rolling_window_us,
            window_message_count=int(window_count),
            window_token_estimate=int(window_tokens),
            total_message_count=int(total_count),
            total_token_estimate=int(total_tokens),
            oldest_message_time_us=oldest,
            newest_message_time_us=newest,
            thread_count=int(threads),
        )
