"""SearchMessages: the k messages of a scope that best match a query, with snippets.

The rules live here and in domain/search.py (validation, terms, window, snippets); the
engines only rank (see `MessageSearch` in ports/store.py), so both answer the same
question and mark the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

from contextd.app.base import UseCases
from contextd.domain.model import MessageRange
from contextd.domain.search import SearchHit, SearchQuery, hits_wanted, query_terms, with_snippet
from contextd.domain.validation import check_name
from contextd.domain.window import WindowSpec


@dataclass(frozen=True, slots=True)
class SearchResult:
    hits: list[SearchHit]
    window: WindowSpec | None  # None: the whole history was searched


class SearchCalls(UseCases):
    def search_messages(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        message_range: MessageRange,
        query: str,
        k: int,
    ) -> SearchResult:
        """Validate, resolve the agent and its window, rank in the store, cut snippets."""
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_name(thread, "thread", allow_empty=True)
        terms = query_terms(query)
        wanted = hits_wanted(k)
        found = self._store.get_agent(tenant, agent)
        window: WindowSpec | None = None
        if message_range == MessageRange.WINDOW:
            window = found.window_at(scope, self._clock.now_us())
        ranked = self._store.search_messages(
            SearchQuery(
                tenant=tenant,
                agent=agent,
                agent_created_us=found.create_time_us,
                scope=scope,
                thread=thread or None,
                window=window,
                text=query,
                terms=terms,
                k=wanted,
            )
        )
        hits = [with_snippet(SearchHit(m, score), query) for m, score in ranked]
        return SearchResult(hits, window)
