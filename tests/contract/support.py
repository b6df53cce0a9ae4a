"""Shorthands of the contract suite: keys, batches and what every reader of a window sees."""

from __future__ import annotations

from collections.abc import Sequence

from contextd.domain.batches import prepare_batch
from contextd.domain.model import ContextKey, MessageBatch, NewMessage, Role, StoredMessage
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store, ThreadFilter

SECOND = 1_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
DAY = 24 * HOUR
# 2033-05-18: far from any machine's clock, so a time read back came from the test's clock.
START_US = 2_000_000_000 * SECOND
BIG = 10_000  # a limit no test reaches

KEY = ContextKey("default", "a1", "", "t1")


def key(
    thread: str = "t1", agent: str = "a1", scope: str = "", tenant: str = "default"
) -> ContextKey:
    return ContextKey(tenant, agent, scope, thread)


def batch(*texts: str, source_time_us: int | None = None, role: Role = Role.USER) -> MessageBatch:
    """Messages of one role, counted with the estimate (the model of a default agent)."""
    return prepare_batch(
        [NewMessage(role=role, content=t, source_time_us=source_time_us) for t in texts],
        "",
        [()] * len(texts),
    )


def summary(text: str, first_id: int, last_id: int) -> MessageBatch:
    """A compaction summary standing for the messages `first_id`..`last_id`."""
    return prepare_batch(
        [NewMessage(role=Role.USER, content=text)], "", [()], summarized_ids=(first_id, last_id)
    )


def where(k: ContextKey, *, all_threads: bool = False) -> ThreadFilter:
    return ThreadFilter(k.tenant, k.agent, k.scope, None if all_threads else k.thread)


def contents(messages: Sequence[StoredMessage]) -> list[str]:
    return [m.content for m in messages]


def history(store: Store, k: ContextKey) -> list[str]:
    """Every message of the thread, in sequence order."""
    return contents(store.list_messages(where(k), None, None, BIG))


def every_reader(store: Store, k: ContextKey, window: WindowSpec) -> dict[str, list[str]]:
    """The window of one thread (`window` is the agent's) as each reader sees it: the
    listing of the thread and of all its threads, the build's two reads, the counts and
    the thread activity (the counts as lists of that many "?")."""
    thread = contents(store.list_messages(where(k), window, None, BIG))
    everything = store.list_messages(where(k, all_threads=True), window, None, BIG)
    ref = store.context_ref(k)
    planned: list[str] = []
    loaded: list[str] = []
    if ref is not None:
        own = window.with_thread_clear(ref.last_clear_time_us)
        table = store.window_columns(ref, own)
        ids = table.column("id").to_pylist()
        if ids:
            by_id = {m.id: m.content for m in store.messages_by_ids(k, ids)}
            planned = [by_id[i] for i in ids]
            first = table.column("sequence").to_pylist()[0]
            loaded = contents(store.window_messages_from(ref, own, first, (min(ids), max(ids))))
    counted = store.context_counts(where(k), window)[0]
    activity = {
        a.thread: a.window_message_count
        for a in store.thread_activity(k.tenant, k.agent, k.scope, window, BIG)
    }
    return {
        "thread": thread,
        "all threads": [m.content for m in everything if m.thread == k.thread],
        "columns": planned,
        "loaded": loaded,
        "counts": ["?"] * int(counted),
        "activity": ["?"] * activity.get(k.thread, 0),
    }


def assert_every_reader_sees(
    store: Store, k: ContextKey, window: WindowSpec, expected: list[str]
) -> None:
    seen = every_reader(store, k, window)
    lists = {name: got for name, got in seen.items() if name not in ("counts", "activity")}
    assert all(got == expected for got in lists.values()), seen
    assert len(seen["counts"]) == len(seen["activity"]) == len(expected), seen
