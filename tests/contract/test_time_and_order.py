"""Times, order and ids: commit times from the store's clock, strictly increasing per
thread; sequences 1..N per thread in append order; ids unique and never reused; a
client's source_time kept beside the commit time, never instead of it."""

from __future__ import annotations

import threading

from contextd.domain.clock import ManualClock
from contextd.domain.model import AgentSettings
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .conftest import StoreOpener
from .support import BIG, DAY, HOUR, MINUTE, START_US, batch, contents, history, key, where


def test_commit_times_come_from_the_injected_clock(store: Store, clock: ManualClock) -> None:
    first = store.append(key(), batch("a", "b"), AgentSettings())
    assert START_US <= first[0].create_time_us <= clock.now_us()
    assert first[0].create_time_us == first[1].create_time_us  # one commit, one time
    moved = clock.advance(DAY)
    [later] = store.append(key(), batch("c"), AgentSettings())
    assert moved < later.create_time_us <= clock.now_us() < moved + MINUTE
    stored = store.list_messages(where(key()), None, None, BIG)
    assert [m.create_time_us for m in stored] == [
        first[0].create_time_us,
        first[0].create_time_us,
        later.create_time_us,
    ]
    thread = store.get_thread(key())
    assert thread is not None
    assert thread.create_time_us == first[0].create_time_us
    assert thread.last_message_time_us == later.create_time_us


def test_commit_times_of_a_thread_strictly_increase_while_the_clock_stands(
    store: Store, clock: ManualClock
) -> None:
    times = [
        store.append(key(), batch(f"m{i}"), AgentSettings())[0].create_time_us for i in range(5)
    ]
    assert times == sorted(set(times))
    marker = store.clear_thread(key())
    [after] = store.append(key(), batch("after the clear"), AgentSettings())
    assert times[-1] < marker < after.create_time_us <= clock.now_us()


def test_threads_are_numbered_in_append_order(store: Store) -> None:
    first = store.append(key(), batch("a", "b", "c"), AgentSettings())
    other = store.append(key("t2"), batch("x"), AgentSettings())
    later = store.append(key(), batch("d"), AgentSettings())
    elsewhere = store.append(key(scope="dm:1"), batch("y"), AgentSettings())
    assert [r.sequence for r in first] == [1, 2, 3]
    assert [r.sequence for r in later] == [4]
    assert [r.sequence for r in other] == [r.sequence for r in elsewhere] == [1]
    stored = store.list_messages(where(key()), None, None, BIG)
    assert [(m.content, m.sequence) for m in stored] == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    threads = store.list_threads("default", "a1", "", None, BIG)
    assert [(t.thread, t.last_sequence, t.message_count) for t in threads] == [
        ("t1", 4, 4),
        ("t2", 1, 1),
    ]


def test_concurrent_appends_are_numbered_without_gap_or_repeat(store: Store) -> None:
    """Four writers on two threads: every append is stored, each writer's messages keep
    their order, and each thread is numbered 1..N by commit order."""
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        k = key(f"t{n % 2}")
        try:
            for i in range(10):
                store.append(k, batch(f"{n}-{i}-a", f"{n}-{i}-b"), AgentSettings())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert errors == []
    ids: list[int] = []
    for thread in ("t0", "t1"):
        rows = store.list_messages(where(key(thread)), None, None, BIG)
        assert [r.sequence for r in rows] == list(range(1, 41))
        times = [r.create_time_us for r in rows]
        assert times == sorted(times)
        for n in (int(thread[1]), int(thread[1]) + 2):
            mine = [r.content for r in rows if r.content.startswith(f"{n}-")]
            assert mine == [f"{n}-{i}-{s}" for i in range(10) for s in "ab"]
        ids += [r.id for r in rows]
        assert store.context_counts(where(key(thread)), WindowSpec(0, 0))[2] == 40
    assert len(set(ids)) == 80


def test_source_times_are_kept_apart_from_commit_times(store: Store, clock: ManualClock) -> None:
    """A source time (past or a little ahead) is stored as given; the commit time is the
    store's own, and the thread's order is the append order whatever source times say."""
    now = clock.now_us()
    store.append(key(), batch("yesterday", source_time_us=now - DAY), AgentSettings())
    store.append(key(), batch("a year ago", source_time_us=now - 365 * DAY), AgentSettings())
    store.append(key(), batch("ahead", source_time_us=now + 4 * MINUTE), AgentSettings())
    store.append(key(), batch("untimed"), AgentSettings())
    stored = store.list_messages(where(key()), None, None, BIG)
    assert contents(stored) == ["yesterday", "a year ago", "ahead", "untimed"]
    assert [m.source_time_us for m in stored] == [
        now - DAY,
        now - 365 * DAY,
        now + 4 * MINUTE,
        None,
    ]
    commits = [m.create_time_us for m in stored]
    assert commits == sorted(set(commits))
    assert all(now <= t <= clock.now_us() < now + MINUTE for t in commits)
    # A source time ahead never moves the store's clock.
    [next_commit] = store.append(key("t2"), batch("other"), AgentSettings())
    assert next_commit.create_time_us < now + MINUTE


def test_every_thread_together_is_read_by_commit_time(store: Store, clock: ManualClock) -> None:
    now = clock.now_us()
    store.append(key("t1"), batch("first", source_time_us=now - HOUR), AgentSettings())
    store.append(key("t2"), batch("second", source_time_us=now - DAY), AgentSettings())
    store.append(key("t1"), batch("third"), AgentSettings())
    everything = store.list_messages(where(key(), all_threads=True), None, None, BIG)
    assert [(m.content, m.thread) for m in everything] == [
        ("first", "t1"),
        ("second", "t2"),
        ("third", "t1"),
    ]


def test_ids_are_unique_and_never_reused_after_a_delete(
    store: Store, store_opener: StoreOpener, clock: ManualClock
) -> None:
    issued = [r.id for r in store.append(key("t1"), batch("a", "b"), AgentSettings())]
    issued += [r.id for r in store.append(key("t2"), batch("c"), AgentSettings())]
    issued += [r.id for r in store.append(key("t1", agent="a2"), batch("d"), AgentSettings())]
    events = [store.record_event(key("t1"), "test", {"n": n}).id for n in range(3)]
    assert len(set(issued)) == len(issued) == 4 and len(set(events)) == 3
    store.delete_agent("default", "a2")  # holds the newest message id
    store.delete_agent("default", "a1")  # holds the newest event ids
    [fresh] = store.append(key("t1"), batch("again"), AgentSettings())
    assert fresh.id > max(issued) and fresh.sequence == 1
    event = store.record_event(key("t1"), "test", {})
    assert event.id > max(events)

    store.delete_agent("default", "a1")  # again, now holding the newest of both
    store.close()  # and after a restart
    reopened = store_opener(clock)
    [later] = reopened.append(key("t1"), batch("once more"), AgentSettings())
    assert later.id > fresh.id
    assert reopened.record_event(key("t1"), "test", {}).id > event.id
    assert history(reopened, key("t1")) == ["once more"]


def test_the_clock_starts_above_stored_times_after_a_restart(
    store: Store, store_opener: StoreOpener, clock: ManualClock
) -> None:
    """Reopened on a clock an hour behind, the store still stamps every write after all
    it stored, so a message appended after the last clear is in the window."""
    store.append(key(), batch("before"), AgentSettings())
    marker = store.clear_thread(key())
    store.close()
    behind = ManualClock(START_US - HOUR)
    reopened = store_opener(behind)
    [after] = reopened.append(key(), batch("after"), AgentSettings())
    assert after.create_time_us > marker
    assert contents(reopened.list_messages(where(key()), WindowSpec(0, 0), None, BIG)) == ["after"]
