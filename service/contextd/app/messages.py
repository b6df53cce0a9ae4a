"""Messages: append (counted under the agent's model, retried if it changed) and list."""

from __future__ import annotations

from collections.abc import Sequence

from contextd.app.base import MessagePage, UseCases
from contextd.app.paging import page_size
from contextd.app.tool_outputs import ToolOutputCalls
from contextd.domain.batches import prepare_batch
from contextd.domain.errors import (
    InvalidArgument,
    ResourceExhausted,
    StaleModel,
    Unavailable,
)
from contextd.domain.idempotency import RequestRecord
from contextd.domain.limits import (
    check_messages,
    context_key,
    message_bytes,
)
from contextd.domain.model import (
    DEFAULT_THREAD,
    AgentSettings,
    MessageRange,
    MessageReceipt,
    NewMessage,
    Role,
)
from contextd.domain.quota import stored_bytes
from contextd.domain.validation import (
    check_name,
)
from contextd.domain.window import MAX_SOURCE_LEAD_US, WindowSpec
from contextd.ports.store import ThreadFilter


class MessageCalls(UseCases):
    def append_messages(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        messages: Sequence[NewMessage],
        create_agent: bool = False,
        record: RequestRecord | None = None,
    ) -> list[MessageReceipt]:
        """Validate the whole batch, estimate its tokens in one Rust call, append durably."""
        key = context_key(tenant, agent, scope, thread or DEFAULT_THREAD)
        if not messages:
            raise InvalidArgument("messages must hold at least one message", field="messages")
        if len(messages) > self._limits.max_batch_messages:
            raise ResourceExhausted(
                f"a batch holds at most {self._limits.max_batch_messages:,} messages; "
                f"got {len(messages):,}",
                reason="BATCH_TOO_LARGE",
                field="messages",
            )
        latest_allowed = self._clock.now_us() + MAX_SOURCE_LEAD_US
        call_ids = check_messages(messages, self._limits.max_message_bytes, latest_allowed)
        if isinstance(self, ToolOutputCalls):  # large tool results go aside (tool_outputs.py)
            messages = self.keep_tool_results_aside(key, messages)
        model = self._model_of(tenant, key.agent)
        ttl_us = self._ttl_of(tenant, key.agent, key.scope)
        adding = stored_bytes(messages) if self._quota.limit else 0
        settings = AgentSettings() if create_agent else None
        for _ in range(3):
            batch = prepare_batch(messages, model, call_ids, ttl_us=ttl_us)
            try:
                if not adding:  # no quota (or nothing to count): no admission to hold
                    return self._store.append(key, batch, settings, record)
                with self._quota.admitting(tenant, adding, "this append"):
                    return self._store.append(key, batch, settings, record)
            except StaleModel as changed:
                # Another replica changed the agent's model since this one cached it.
                model = changed.model
                self._models[(tenant, key.agent)] = model
        raise Unavailable(
            "the agent's model kept changing during this append; retry",
            retry_after_s=0.1,
        )

    def append_answers_retries(self, messages: Sequence[NewMessage]) -> bool:
        """Whether `append_messages` may run a request without looking its id up first:
        the store reads the record in its own first statement and no step before it
        writes or refuses anything a retry must not redo (TOOL_RESULTs may be stored
        aside, and a quota admits before the store answers)."""
        return (
            self._store.append_reads_record
            and not self._quota.limit
            and all(m.role != Role.TOOL_RESULT for m in messages)
        )

    def list_messages(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        message_range: MessageRange,
        requested_size: int,
        token: str,
    ) -> MessagePage:
        check_name(agent, "agent")
        check_name(scope, "scope", allow_empty=True)
        check_name(thread, "thread", allow_empty=True)
        size = page_size(requested_size)
        # "messages/2": positions became (sequence, id) for one thread; older tokens are
        # rejected as issued for other parameters rather than misread.
        params = ("messages/2", tenant, agent, scope, thread, int(message_range))
        position = self._pages.decode(token, params, (int, int))
        found = self._store.get_agent(tenant, agent)
        window: WindowSpec | None = None
        if message_range == MessageRange.WINDOW:
            now = self._clock.now_us()
            if position is not None and position.window is not None:
                # The first page's window; retention applies as of each page (like thread
                # markers, read live).
                window = WindowSpec(*position.window).with_retention(
                    found.retention_for(scope), now
                )
            else:
                window = found.window_at(scope, now)
        after = (int(position.position[0]), int(position.position[1])) if position else None
        where = ThreadFilter(tenant, agent, scope, thread or None)
        rows = self._store.list_messages(where, window, after, size + 1)
        # One thread pages by sequence, all threads by (create_time, id): the store's order.
        page, next_token = self._pages.cut(
            rows,
            size,
            params,
            (lambda m: (m.sequence, m.id)) if thread else (lambda m: (m.create_time_us, m.id)),
            None if window is None else (window.clear_after_us, window.age_after_us),
            message_bytes,
        )
        return MessagePage(page, next_token, window)
