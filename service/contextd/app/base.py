"""What every use case shares: the store (a port), the clock, limits, page tokens."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from contextd.app.build.builder import (
    ContextBuilder,
)
from contextd.app.build.summarizer import (
    NoSessionSummarizer,
    SessionSummarizer,
    Summarizer,
)
from contextd.app.paging import PageTokens
from contextd.app.quota import TenantBytes
from contextd.domain.access import ApiKey
from contextd.domain.idempotency import Remembered
from contextd.domain.limits import (
    Limits,
)
from contextd.domain.model import (
    Agent,
    StoredMessage,
)
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store


@dataclass(frozen=True, slots=True)
class MessagePage:
    messages: list[StoredMessage]
    next_page_token: str
    window: WindowSpec | None


class UseCases:
    """The state the use cases share; each group of calls is a mixin over it."""

    def __init__(
        self,
        store: Store,
        summarizer: Summarizer,
        limits: Limits | None = None,
        page_tokens: PageTokens | None = None,
        session_summarizer: SessionSummarizer | None = None,
    ) -> None:
        self._store = store
        # Snapshot summaries: the summarizer's own when it can write them.
        if session_summarizer is None:
            session_summarizer = (
                summarizer if isinstance(summarizer, SessionSummarizer) else NoSessionSummarizer()
            )
        self._session_summarizer = session_summarizer
        # The server's one clock, owned by the store (see clock.py).
        self._clock = store.clock
        self._limits = limits or Limits()
        # Without a key from the data directory, tokens are signed with a key of this
        # process only (fine for a service object that lives and dies with its caller).
        self._pages = page_tokens or PageTokens(secrets.token_bytes(32))
        self._builder = ContextBuilder(store, summarizer)
        # Stored bytes per tenant, checked before writes that store bytes (see quota.py).
        self._quota = TenantBytes(
            store.tenant_stored_bytes, self._clock, self._limits.tenant_max_bytes
        )
        # The model of each agent, read on every append to count its tokens. Invalidated on
        # update and delete here; an engine shared by replicas checks it in the append
        # transaction (StaleModel), so a stale entry costs a recount, never a wrong count.
        self._models: dict[tuple[str, str], str] = {}
        # The retention settings of each agent, read on every append (the ttl decides
        # whether the append restarts an expired thread). Invalidated with `_models`; on
        # PostgreSQL the append transaction reads the agent's own policy instead.
        self._policies: dict[tuple[str, str], Agent] = {}
        # Keys this replica found active, by key id, with their secrets' hashes: neither
        # ever changes (only whether the key is active), so a call with one of them may be
        # admitted at once when its write confirms the key (app/keys.py).
        self._known_keys: dict[str, tuple[ApiKey, str]] = {}

    def _model_of(self, tenant: str, agent: str) -> str:
        key = (tenant, agent)
        model = self._models.get(key)
        if model is None:
            found = self._store.find_agent(tenant, agent)
            model = found.model if found else ""
            if found:
                self._models[key] = model
        return model

    def _ttl_of(self, tenant: str, agent: str, scope: str) -> int:
        """The retention ttl of the agent's contexts in `scope` (0 when it has none)."""
        key = (tenant, agent)
        found = self._policies.get(key)
        if found is None:
            found = self._store.find_agent(tenant, agent)
            if found is None:
                return 0
            self._policies[key] = found
        return found.retention_for(scope).ttl_us

    def _forget_agent(self, tenant: str, agent: str) -> None:
        """Drop what is cached of an agent (after an update or delete committed)."""
        self._models.pop((tenant, agent), None)
        self._policies.pop((tenant, agent), None)

    def remembered(self, tenant: str, request_id: str) -> Remembered | None:
        """A write recorded under this request id, if any (see idempotency.py)."""
        return self._store.remembered(tenant, request_id)
