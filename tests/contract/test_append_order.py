"""Ids grow along a thread: concurrent one-message appends to one thread get ids in the
order of their sequence numbers (a build relies on it to rule out a message of a thread
by its id, see docs/architecture.md). On PostgreSQL the ids are taken in the statement
that locks the thread's row, after the lock."""

from __future__ import annotations

import threading

from contextd.domain.model import AgentSettings
from contextd.ports.store import Store

from .support import BIG, batch, key, where


def test_concurrent_one_message_appends_take_ids_in_sequence_order(store: Store) -> None:
    store.append(key(), batch("first"), AgentSettings())
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(15):
                store.append(key(), batch(f"{n}-{i}"), None)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert errors == []
    rows = store.list_messages(where(key()), None, None, BIG)
    assert [r.sequence for r in rows] == list(range(1, 122))
    ids = [r.id for r in rows]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for n in range(8):
        assert [r.content for r in rows if r.content.startswith(f"{n}-")] == [
            f"{n}-{i}" for i in range(15)
        ]
