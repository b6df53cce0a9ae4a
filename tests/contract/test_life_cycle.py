"""Closing and reopening: an acknowledged write survives a reopen; a call after close is
Unavailable (never lost, never hung, never a driver error)."""

from __future__ import annotations

import pytest

from contextd.domain.clock import ManualClock
from contextd.domain.errors import Unavailable
from contextd.domain.model import AgentSettings
from contextd.ports.store import Store

from .conftest import StoreOpener
from .support import BIG, batch, history, key, where


def test_calls_after_close_are_unavailable_not_lost_or_hung(
    store: Store, store_opener: StoreOpener, clock: ManualClock
) -> None:
    store.append(key(), batch("before"), AgentSettings())
    version = store.schema_version()
    store.close()
    with pytest.raises(Unavailable):
        store.append(key(), batch("after"), AgentSettings())
    with pytest.raises(Unavailable):
        store.clear_thread(key())
    with pytest.raises(Unavailable):
        store.list_messages(where(key()), None, None, BIG)
    reopened = store_opener(clock)
    assert history(reopened, key()) == ["before"]
    thread = reopened.get_thread(key())
    assert thread is not None and thread.last_clear_time_us is None
    assert reopened.schema_version() == version  # migrated once, not again
