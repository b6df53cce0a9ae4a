"""A build reads from one snapshot of the store, on either engine.

Its reads (agent, thread, window columns, the messages it keeps, status, activity) are
one read transaction: a write committed while a build reads is wholly invisible to it,
never half seen (a window read before an append, its messages after it).
"""

from __future__ import annotations

from conftest import InProcessServer
from contextd.domain.model import ContextKey
from contextd.domain.window import WindowSpec

EVERYTHING = WindowSpec(0, 0)


def test_reads_inside_a_snapshot_see_the_state_at_its_start(server: InProcessServer) -> None:
    client, store = server.client, server.running.store
    client.append("a1", "m1")
    key = ContextKey("default", "a1", "", "t1")
    with store.snapshot():
        ref = store.context_ref(key)
        assert ref is not None
        before = store.window_columns(ref, EVERYTHING).num_rows
        client.append("a1", "m2")  # committed by the server meanwhile
        inside = store.window_columns(ref, EVERYTHING).num_rows
        thread = store.get_thread(key)
    after_ref = store.context_ref(key)
    assert after_ref is not None
    after = store.window_columns(after_ref, EVERYTHING).num_rows
    assert (before, inside, after) == (1, 1, 2)
    assert thread is not None


def test_a_snapshot_ends_with_its_block_even_on_error(server: InProcessServer) -> None:
    client, store = server.client, server.running.store
    client.append("a1", "m1")
    key = ContextKey("default", "a1", "", "t1")
    try:
        with store.snapshot():
            store.context_ref(key)
            raise KeyError("the build failed")
    except KeyError:
        pass
    client.append("a1", "m2")
    ref = store.context_ref(key)
    assert ref is not None
    assert store.window_columns(ref, EVERYTHING).num_rows == 2
