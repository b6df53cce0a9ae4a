"""Per-tenant request rates: one token bucket per tenant, on the server's clock.

Each tenant may make `rate` calls a second on average, in bursts of up to `burst`. The
buckets are this server's: with N replicas a tenant's ceiling is N times the rate (a shared
limit would put a database write on every call's path). Time comes from the server's
injected clock, so tests step it by hand.
"""

from __future__ import annotations

import threading

from contextd.domain.clock import MonotonicClock

# Buckets of tenants idle long enough to be full again are dropped beyond this many, so
# memory stays bounded whatever tenants call.
MAX_TRACKED_TENANTS = 10_000


class TenantRates:
    def __init__(self, rate: float, clock: MonotonicClock, burst: float | None = None) -> None:
        self._rate = rate
        self._burst = burst if burst is not None else max(1.0, rate)
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, int]] = {}  # tenant -> (tokens, at time us)

    def take(self, tenant: str) -> float | None:
        """Spend one call of `tenant`'s: None when allowed, else the seconds to wait."""
        now = self._clock.now_us()
        with self._lock:
            tokens, at = self._buckets.get(tenant, (self._burst, now))
            tokens = min(self._burst, tokens + (now - at) / 1_000_000 * self._rate)
            if tokens < 1.0:
                self._buckets[tenant] = (tokens, now)
                return (1.0 - tokens) / self._rate
            self._buckets[tenant] = (tokens - 1.0, now)
            if len(self._buckets) > MAX_TRACKED_TENANTS:
                self._forget_full(now)
            return None

    def _forget_full(self, now: int) -> None:
        full_after_us = self._burst / self._rate * 1_000_000
        for tenant, (_, at) in list(self._buckets.items()):
            if now - at >= full_after_us:
                del self._buckets[tenant]
