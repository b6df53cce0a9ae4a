"""BuildContext and CompactContext: hand the request to the builder."""

from __future__ import annotations

from dataclasses import replace

from contextd.app.base import UseCases
from contextd.app.build.build_types import (
    BuildRequest,
    BuildResult,
    CompactResult,
    replayed_compaction,
)
from contextd.app.build.render import FORMATS
from contextd.domain.errors import (
    InvalidArgument,
)
from contextd.domain.idempotency import AlreadyDone, RequestRecord, replay
from contextd.domain.limits import (
    MAX_USER_MESSAGE_BYTES,
    _utf8_len,
    check_field_size,
    check_overrides,
    context_key,
)
from contextd.domain.model import (
    DEFAULT_THREAD,
    BuildOverrides,
)


class BuildCalls(UseCases):
    def build_context(self, request: BuildRequest) -> BuildResult:
        context_key(request.tenant, request.agent, request.scope, request.thread or DEFAULT_THREAD)
        check_overrides(request.overrides)
        check_field_size(
            _utf8_len(request.user_message), MAX_USER_MESSAGE_BYTES, "user_message", "user_message"
        )
        unknown = sorted(set(request.formats) - set(FORMATS))
        if unknown:
            raise InvalidArgument(f"unknown formats: {', '.join(unknown)}", field="formats")
        if not request.thread:
            request = replace(request, thread=DEFAULT_THREAD)
        return self._builder.build(request)

    def compact_context(
        self,
        tenant: str,
        agent: str,
        scope: str,
        thread: str,
        model: str,
        overrides: BuildOverrides,
        record: RequestRecord | None = None,
    ) -> CompactResult:
        """Summarize on demand. A retry (same request id) returns the first summary: it
        is looked up before the summarizer runs, and again in the summary's transaction."""
        key = context_key(tenant, agent, scope, thread or DEFAULT_THREAD)
        check_overrides(overrides)
        if record is not None:
            found = self._store.remembered(record.tenant, record.request_id)
            if found is not None:
                return replayed_compaction(self._store, key, replay(record, found))
        try:
            return self._builder.compact(tenant, agent, scope, key.thread, model, overrides, record)
        except AlreadyDone as done:
            return replayed_compaction(self._store, key, done.payload)
