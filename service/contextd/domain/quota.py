"""Per-tenant stored bytes: what counts, and the rule a write must meet.

A tenant's stored bytes are the content, tool_calls and metadata (UTF-8) of every message
its threads hold (cleared ones included: a clear deletes nothing) plus the `size_bytes` of
every snapshot it keeps, plus the `size_bytes` (the result's size, before compression) of
every tool output it stores: the unit of the message size limit and of the snapshot limits.
Agents' settings, status entries and events are bounded per agent by their own limits and
are not counted.

The engines keep a byte counter in each thread's row (updated with the thread's other
counters, so no append of a tenant waits on a row shared by the whole tenant); the
server sums a tenant's rows, caches the sum for `REFRESH_US` on its clock and adds what it
admitted since. See TenantBytes in contextd.app.quota.
"""

from __future__ import annotations

from collections.abc import Iterable

from contextd.domain.errors import ResourceExhausted
from contextd.domain.model import NewMessage

# How long a server trusts a tenant's sum read from the store (its own admissions are
# added meanwhile); also the retry delay of a refused write: by then room freed on any
# replica is seen.
REFRESH_US = 1_000_000
REASON = "TENANT_STORAGE_EXHAUSTED"


def stored_bytes(messages: Iterable[NewMessage]) -> int:
    """What a batch adds to its tenant's stored bytes."""
    return sum(_utf8(m.content) + _utf8(m.tool_calls) + _utf8(m.metadata) for m in messages)


def _utf8(text: str) -> int:
    # isascii() is O(1) on CPython: the common case costs no copy.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_room(used: int, adding: int, limit: int, what: str) -> None:
    """RESOURCE_EXHAUSTED (TENANT_STORAGE_EXHAUSTED) when `adding` bytes would take a
    tenant holding `used` over `limit` (0: no limit)."""
    if limit and adding and used + adding > limit:
        raise ResourceExhausted(
            f"this tenant stores {used:,} of its {limit:,} bytes; {what} of {adding:,} bytes "
            "would exceed them. Delete agents or snapshots to free room, or ask the operator "
            "for a larger quota (tenant_max_bytes)",
            reason=REASON,
            retry_after_s=REFRESH_US / 1_000_000,
        )
