"""`snapshot()`: reads inside the block see one state of the store (the one its first
read saw), whatever commits meanwhile: a build's reads are one read transaction."""

from __future__ import annotations

import threading

from contextd.domain.model import AgentSettings
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .support import BIG, KEY, batch, where

EVERYTHING = WindowSpec(0, 0)


def _append_from_another_thread(store: Store, text: str) -> None:
    """Commit an append on another thread (a snapshot belongs to the thread that opened it)."""
    done = threading.Thread(target=store.append, args=(KEY, batch(text), AgentSettings()))
    done.start()
    done.join(30)


def test_reads_in_a_snapshot_ignore_commits_made_after_it_began(store: Store) -> None:
    store.append(KEY, batch("m1"), AgentSettings())
    with store.snapshot():
        ref = store.context_ref(KEY)
        assert ref is not None
        _append_from_another_thread(store, "m2")
        columns = store.window_columns(ref, EVERYTHING).num_rows
        listed = len(store.list_messages(where(KEY), None, None, BIG))
        counts = store.context_counts(where(KEY), EVERYTHING)[2]
    assert (columns, listed, counts) == (1, 1, 1)
    ref = store.context_ref(KEY)
    assert ref is not None
    assert store.window_columns(ref, EVERYTHING).num_rows == 2


def test_a_snapshot_nested_in_another_joins_it(store: Store) -> None:
    store.append(KEY, batch("m1"), AgentSettings())
    with store.snapshot():
        first = len(store.list_messages(where(KEY), None, None, BIG))  # the state is taken
        _append_from_another_thread(store, "m2")
        with store.snapshot():
            inner = len(store.list_messages(where(KEY), None, None, BIG))
        outer = len(store.list_messages(where(KEY), None, None, BIG))
    assert (first, inner, outer) == (1, 1, 1)
