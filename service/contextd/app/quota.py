"""Per-tenant stored-bytes quota, checked before every write that stores bytes.

No tenant-wide row is written or locked: each engine keeps a byte counter in each
thread's row (which an append updates anyway), and this server reads a tenant's sum
(threads plus snapshots) at most once per `REFRESH_US` of its clock. Between reads it
adds what it admitted itself, and what it is admitting right now, so one server never
lets a tenant past its quota by racing its own calls. Other replicas' writes are seen at
the next read: with N servers a tenant may overshoot by what the other N - 1 admitted in
the last refresh interval (docs/operations.md). Counting errs high, never low: a write
that finished while the sum was being read may be counted twice until the next read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from contextd.domain.clock import MonotonicClock
from contextd.domain.quota import REFRESH_US, check_room

# Tenants whose sums are remembered beyond this many are forgotten when idle.
MAX_TRACKED_TENANTS = 10_000


@dataclass(slots=True)
class _Usage:
    stored: int = 0  # the sum read from the store
    read_at_us: int | None = None  # when (None: read it before trusting `stored`)
    admitted_at_read: int = 0  # `admitted` when that read began
    admitted: int = 0  # bytes this server's finished writes added, ever
    in_flight: int = 0  # bytes of writes admitted and not finished yet

    def used(self) -> int:
        return self.stored + self.admitted - self.admitted_at_read + self.in_flight


class TenantBytes:
    def __init__(self, load: Callable[[str], int], clock: MonotonicClock, limit: int) -> None:
        self._load = load  # the tenant's stored bytes, as the store counts them now
        self._clock = clock
        self.limit = limit  # 0: no quota (nothing is read or tracked)
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}

    @contextmanager
    def admitting(self, tenant: str, adding: int, what: str) -> Iterator[None]:
        """Admit a write of `adding` bytes for the block (RESOURCE_EXHAUSTED when it
        would take the tenant over its quota); counted as stored if the block succeeds."""
        if not self.limit or adding <= 0:
            yield
            return
        while True:
            self._refresh(tenant)
            with self._lock:
                # Gone only if forgotten as idle meanwhile (then read again). A sum that
                # `forget` marked for a new read is still an upper bound: used as is.
                found = self._usage.get(tenant)
                if found is None:
                    continue
                usage = found
                check_room(usage.used(), adding, self.limit, what)
                usage.in_flight += adding
                break
        done = False
        try:
            yield
            done = True
        finally:
            with self._lock:
                usage.in_flight -= adding
                if done:
                    usage.admitted += adding

    @contextmanager
    def admitting_as_it_comes(self, tenant: str, what: str) -> Iterator[Callable[[int], None]]:
        """Admit a write whose size is learned as it arrives (a streamed tool output):
        the block calls `grow(n)` before it stores n more bytes, which is refused
        (RESOURCE_EXHAUSTED) when they would take the tenant over its quota; what grew is
        counted as stored if the block succeeds."""
        reserved = 0
        usage: _Usage | None = None

        def grow(adding: int) -> None:
            nonlocal reserved, usage
            if not self.limit or adding <= 0:
                return
            while True:
                self._refresh(tenant)
                with self._lock:
                    found = self._usage.get(tenant)
                    if found is None:
                        continue
                    if usage is not None and found is not usage:
                        # Forgotten as idle and read again: carry what this write holds.
                        usage.in_flight -= reserved
                        found.in_flight += reserved
                    usage = found
                    check_room(usage.used(), adding, self.limit, what)
                    usage.in_flight += adding
                    reserved += adding
                    return

        done = False
        try:
            yield grow
            done = True
        finally:
            if usage is not None:
                with self._lock:
                    usage.in_flight -= reserved
                    if done:
                        usage.admitted += reserved

    def forget(self, tenant: str) -> None:
        """Data of the tenant was deleted: read its sum again before the next write."""
        with self._lock:
            usage = self._usage.get(tenant)
            if usage is not None:
                usage.read_at_us = None

    def _refresh(self, tenant: str) -> None:
        now = self._clock.now_us()
        with self._lock:
            usage = self._usage.setdefault(tenant, _Usage())
            if usage.read_at_us is not None and now - usage.read_at_us < REFRESH_US:
                return
            admitted_before = usage.admitted
        stored = self._load(tenant)  # outside the lock: other tenants' calls go on
        with self._lock:
            usage = self._usage.setdefault(tenant, _Usage())
            usage.stored, usage.read_at_us = stored, now
            usage.admitted_at_read = admitted_before
            if len(self._usage) > MAX_TRACKED_TENANTS:
                self._forget_idle(now)

    def _forget_idle(self, now: int) -> None:
        for tenant, usage in list(self._usage.items()):
            stale = usage.read_at_us is None or now - usage.read_at_us >= REFRESH_US
            if stale and not usage.in_flight:
                del self._usage[tenant]
