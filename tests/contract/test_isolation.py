"""Scope isolation: contexts whose names look alike (a prefix, a case, a separator moved
from one part to the next) never see each other's messages, threads, status, events or
ids, whatever is read."""

from __future__ import annotations

import itertools

from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.model import AgentSettings, ContextKey
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .support import BIG, batch, contents, key, where

# Each differs from the first in one part only, or by where a separator falls between
# parts: an engine that joined the parts into one key would mix some of them up.
LOOK_ALIKES = [
    key("t", agent="a", scope="s", tenant="ten"),
    key("t", agent="a", scope="s", tenant="ten2"),
    key("t", agent="a", scope="s", tenant="Ten"),
    key("t", agent="a2", scope="s", tenant="ten"),
    key("t", agent="A", scope="s", tenant="ten"),
    key("t", agent="a", scope="s2", tenant="ten"),
    key("t", agent="a", scope="", tenant="ten"),
    key("t2", agent="a", scope="s", tenant="ten"),
    key("s\tt", agent="a", scope="", tenant="ten"),
    key("t", agent="a\ts", scope="", tenant="ten"),
    key("t", agent="a", scope="s", tenant="ten\ta"),
    key("t", agent="s", scope="", tenant="ten\ta"),
]


def _label(k: ContextKey) -> str:
    return repr((k.tenant, k.agent, k.scope, k.thread))


def _triple(k: ContextKey) -> tuple[str, str, str]:
    return (k.tenant, k.agent, k.scope)


def _fill(store: Store) -> dict[ContextKey, list[int]]:
    """One message, one event and one status entry per context; its ids."""
    ids: dict[ContextKey, list[int]] = {}
    for n, k in enumerate(LOOK_ALIKES):
        receipts = store.append(k, batch(_label(k)), AgentSettings())
        ids[k] = [r.id for r in receipts]
        store.record_event(k, "mark", {"n": n})
        store.set_status(
            k.tenant, k.agent, k.scope, StatusEntry(k.thread, StatusKind.THREAD, _label(k), "", 0)
        )
    return ids


def test_look_alike_contexts_never_share_messages(store: Store) -> None:
    ids = _fill(store)
    every_id = [i for found in ids.values() for i in found]
    assert len(set(every_id)) == len(every_id)
    for k in LOOK_ALIKES:
        same_scope = [o for o in LOOK_ALIKES if _triple(o) == _triple(k)]
        assert contents(store.list_messages(where(k), None, None, BIG)) == [_label(k)]
        assert contents(store.list_messages(where(k), WindowSpec(0, 0), None, BIG)) == [_label(k)]
        together = store.list_messages(where(k, all_threads=True), None, None, BIG)
        assert sorted(contents(together)) == sorted(_label(o) for o in same_scope)
        assert all(
            _triple(key(m.thread, m.agent, m.scope, k.tenant)) == _triple(k) for m in together
        )
        # Ids of every other context reach nothing through this one.
        assert contents(store.messages_by_ids(k, every_id)) == [_label(k)]
        others = [i for o in LOOK_ALIKES if o != k for i in ids[o]]
        assert store.messages_by_ids(k, others) == []
        ref = store.context_ref(k)
        assert ref is not None
        assert store.window_columns(ref, WindowSpec(0, 0)).column("id").to_pylist() == ids[k]
        counts = store.context_counts(where(k), WindowSpec(0, 0))
        assert (counts[0], counts[2], counts[6]) == (1, 1, 1)
        scope_counts = store.context_counts(where(k, all_threads=True), WindowSpec(0, 0))
        assert scope_counts[2] == scope_counts[6] == len(same_scope)


def test_look_alike_contexts_never_share_threads_status_or_events(store: Store) -> None:
    _fill(store)
    for k in LOOK_ALIKES:
        same_scope = sorted(o.thread for o in LOOK_ALIKES if _triple(o) == _triple(k))
        threads = store.list_threads(k.tenant, k.agent, k.scope, None, BIG)
        assert [t.thread for t in threads] == same_scope
        assert all((t.tenant, t.agent, t.scope) == _triple(k) for t in threads)
        thread = store.get_thread(k)
        assert thread is not None and thread.message_count == 1
        activity = store.thread_activity(k.tenant, k.agent, k.scope, WindowSpec(0, 0), BIG)
        assert sorted(a.thread for a in activity) == same_scope
        status = store.list_status(k.tenant, k.agent, k.scope, None, BIG, None)
        assert sorted(s.key for s in status) == same_scope
        mine = [s for s in status if s.key == k.thread]
        assert [s.state for s in mine] == [_label(k)]
        events = store.list_events(where(k), "", None, None, 0, BIG)
        assert [(e.agent, e.scope, e.thread) for e in events] == [(k.agent, k.scope, k.thread)]
        assert [e.data for e in events] == [f'{{"n":{LOOK_ALIKES.index(k)}}}']
    for tenant, group in itertools.groupby(
        sorted(LOOK_ALIKES, key=lambda k: k.tenant), lambda k: k.tenant
    ):
        names = sorted({k.agent for k in group})
        assert [a.name for a in store.list_agents(tenant, None, BIG)] == names


def test_clears_and_deletes_stay_inside_their_context(store: Store) -> None:
    _fill(store)
    first = LOOK_ALIKES[0]
    store.clear_thread(first)
    store.clear_scope(first.tenant, first.agent, first.scope)
    store.clear_status(first.tenant, first.agent, first.scope, None)
    held = [k for k in LOOK_ALIKES if _triple(k)[:2] == _triple(first)[:2]]
    assert store.delete_agent(first.tenant, first.agent) == len(held) == 5
    for k in LOOK_ALIKES:
        gone = _triple(k)[:2] == _triple(first)[:2]
        assert (store.get_thread(k) is None) is gone, k
        if not gone:
            assert contents(store.list_messages(where(k), WindowSpec(0, 0), None, BIG)) == [
                _label(k)
            ]
            assert len(store.list_status(k.tenant, k.agent, k.scope, None, BIG, None)) >= 1
            assert len(store.list_events(where(k), "", None, None, 0, BIG)) == 1
