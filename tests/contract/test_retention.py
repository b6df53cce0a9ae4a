"""Retention in the store: caps and expiry in every reader of a window, the expiry marker
an append writes, and the sweep's chunked, resumable deletes (driven through the use
case, as the server's periodic sweep does)."""

from __future__ import annotations

import json
from dataclasses import replace

from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock
from contextd.domain.model import AgentSettings, MessageBatch, NewMessage, Role
from contextd.domain.retention import RetentionPolicy, ScopeRetention
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .conftest import StoreOpener
from .support import BIG, HOUR, MINUTE, assert_every_reader_sees, batch, history, key, where

TTL = 24 * HOUR


def _tool_batch(*items: tuple[Role, str, str, tuple[str, ...]]) -> MessageBatch:
    return prepare_batch(
        [NewMessage(role=r, content=text, tool_call_id=call) for r, text, call, _ in items],
        "",
        [calls for *_, calls in items],
    )


def _settings(policy: RetentionPolicy, *overrides: ScopeRetention) -> AgentSettings:
    return AgentSettings(retention=policy, retention_overrides=tuple(overrides))


def _service(store: Store) -> ContextService:
    return ContextService(store, ExtractiveSummarizer())


def _window(clock: ManualClock, policy: RetentionPolicy) -> WindowSpec:
    return WindowSpec(0, 0).with_retention(policy, clock.now_us())


def test_a_cap_keeps_the_newest_messages_and_never_splits_a_tool_group(
    store: Store, clock: ManualClock
) -> None:
    k = key()
    store.append(k, batch("u1", "a1", "u2"), AgentSettings())
    store.append(k, _tool_batch((Role.TOOL_USE, "use", "", ("c1",))), AgentSettings())
    # The result comes in a later append: its group still starts at the tool_use.
    store.append(k, _tool_batch((Role.TOOL_RESULT, "result", "c1", ())), AgentSettings())
    store.append(k, batch("a2", role=Role.ASSISTANT), AgentSettings())
    everything = ["u1", "a1", "u2", "use", "result", "a2"]

    def capped(n: int) -> WindowSpec:
        return _window(clock, RetentionPolicy(max_messages=n))

    assert_every_reader_sees(store, k, capped(4), ["u2", "use", "result", "a2"])
    assert_every_reader_sees(store, k, capped(3), ["use", "result", "a2"])
    # The 2nd newest is a result whose tool_use is older: the group leaves whole, the
    # boundary moves toward newer messages.
    assert_every_reader_sees(store, k, capped(2), ["a2"])
    assert_every_reader_sees(store, k, capped(100), everything)
    assert_every_reader_sees(store, k, WindowSpec(0, 0), everything)
    assert history(store, k) == everything  # a cap alone deletes nothing


def test_an_expired_context_is_empty_on_every_read_and_restarts_without_its_past(
    store: Store, clock: ManualClock
) -> None:
    policy = RetentionPolicy(ttl_us=TTL)
    k = key()
    [old] = store.append(k, replace(batch("old"), ttl_us=TTL), _settings(policy))
    store.append(key("t2"), replace(batch("other"), ttl_us=TTL), _settings(policy))
    clock.set(old.create_time_us + TTL - 1)
    assert_every_reader_sees(store, k, _window(clock, policy), ["old"])
    clock.set(old.create_time_us + TTL)  # ttl after its newest message: expired
    assert_every_reader_sees(store, k, _window(clock, policy), [])
    before = store.get_thread(k)
    assert before is not None
    clock.advance(MINUTE)
    store.append(k, replace(batch("new"), ttl_us=TTL), _settings(policy))
    assert_every_reader_sees(store, k, _window(clock, policy), ["new"])
    # Without retention the old message is still hidden: the append wrote a clear marker
    # at the moment the thread expired.
    assert_every_reader_sees(store, k, WindowSpec(0, 0), ["new"])
    thread = store.get_thread(k)
    assert thread is not None
    assert thread.last_clear_time_us == before.last_message_time_us + TTL
    assert history(store, k) == ["old", "new"]  # until the sweep deletes it


def test_the_sweep_deletes_expired_contexts_in_chunks_and_records_it(
    store: Store, clock: ManualClock
) -> None:
    service = _service(store)
    policy = RetentionPolicy(ttl_us=TTL)
    k = key()
    store.append(k, replace(batch(*[f"m{i}" for i in range(25)]), ttl_us=TTL), _settings(policy))
    clock.advance(TTL)
    store.append(key("fresh"), replace(batch("kept"), ttl_us=TTL), _settings(policy))
    report = service.sweep_retention(chunk_rows=10)
    assert (report.ran, report.expired_deleted, report.threads) == (True, 25, 1)
    assert report.transactions == 3  # 10 + 10 + 5, each its own transaction
    assert history(store, k) == []
    assert history(store, key("fresh")) == ["kept"]
    thread = store.get_thread(k)
    assert thread is not None and thread.message_count == 0 and thread.token_estimate == 0
    [event] = store.list_events(where(k), "retention.swept", None, None, 0, BIG)
    data = json.loads(event.data)
    assert (data["expired_deleted"], data["deleted"], data["expired_through_sequence"]) == (
        25,
        25,
        25,
    )
    # Sequence numbers are never taken twice: the thread goes on from 26.
    [receipt] = store.append(k, replace(batch("again"), ttl_us=TTL), _settings(policy))
    assert receipt.sequence == 26
    assert service.sweep_retention(chunk_rows=10).expired_deleted == 0  # nothing left


def test_a_sweep_stopped_midway_resumes_after_a_restart(
    store_opener: StoreOpener, clock: ManualClock
) -> None:
    store = store_opener(clock)
    policy = RetentionPolicy(ttl_us=TTL)
    k = key()
    store.append(k, replace(batch(*[f"m{i}" for i in range(12)]), ttl_us=TTL), _settings(policy))
    clock.advance(TTL)
    # What a pass does before it is stopped: the mark and one chunk.
    [thread] = store.retention_threads("default", "a1", 0, BIG)
    assert store.mark_expired(thread, clock.now_us() - TTL) == 12
    assert store.delete_retained(thread, 12, False, 5) == 5
    store.close()
    store = store_opener(clock)
    assert len(history(store, k)) == 7
    report = _service(store).sweep_retention(chunk_rows=5)
    assert report.expired_deleted == 7
    assert history(store, k) == []
    thread_row = store.get_thread(k)
    assert thread_row is not None and thread_row.message_count == 0


def test_an_append_after_expiry_leaves_the_past_to_the_sweep(
    store: Store, clock: ManualClock
) -> None:
    policy = RetentionPolicy(ttl_us=TTL)
    k = key()
    store.append(k, replace(batch("old1", "old2"), ttl_us=TTL), _settings(policy))
    clock.advance(TTL + MINUTE)
    store.append(k, replace(batch("new"), ttl_us=TTL), _settings(policy))
    report = _service(store).sweep_retention()
    assert report.expired_deleted == 2
    assert history(store, k) == ["new"]
    assert_every_reader_sees(store, k, _window(clock, policy), ["new"])


def test_the_sweep_deletes_overflow_only_when_the_policy_says_so(
    store: Store, clock: ManualClock
) -> None:
    keep = RetentionPolicy(max_messages=2)
    drop = RetentionPolicy(max_messages=2, delete_overflow=True)
    settings = _settings(keep, ScopeRetention("dm:*", drop))
    kept, dropped = key(), key(scope="dm:7")
    for k in (kept, dropped):
        store.append(k, batch("u1", "u2"), settings)
        store.append(k, _tool_batch((Role.TOOL_USE, "use", "", ("c1",))), settings)
        store.append(k, _tool_batch((Role.TOOL_RESULT, "result", "c1", ())), settings)
        store.append(k, batch("a", role=Role.ASSISTANT), settings)
    report = _service(store).sweep_retention(chunk_rows=2)
    # The split group goes with what fell out: u1, u2, use and its result.
    assert report.overflow_deleted == 4
    assert history(store, dropped) == ["a"]
    assert history(store, kept) == ["u1", "u2", "use", "result", "a"]
    [event] = store.list_events(where(dropped), "retention.swept", None, None, 0, BIG)
    assert json.loads(event.data)["overflow_deleted"] == 4
    assert store.list_events(where(kept), "retention.swept", None, None, 0, BIG) == []


def test_one_sweeper_at_a_time(store_opener: StoreOpener, clock: ManualClock) -> None:
    """On PostgreSQL two replicas (stores) of one database; one DuckDB file has one."""
    first = store_opener(clock)
    second = store_opener(clock) if "Postgres" in type(first).__name__ else first
    policy = RetentionPolicy(ttl_us=TTL)
    first.append(key(), replace(batch("old"), ttl_us=TTL), _settings(policy))
    clock.advance(TTL)
    with first.sweep_lock() as held:
        assert held
        report = _service(second).sweep_retention()
        assert not report.ran and report.expired_deleted == 0
    assert _service(second).sweep_retention().expired_deleted == 1


def test_agents_without_retention_keep_everything(store: Store, clock: ManualClock) -> None:
    k = key()
    store.append(k, batch(*[f"m{i}" for i in range(30)]), AgentSettings())
    clock.advance(10 * TTL)
    report = _service(store).sweep_retention()
    assert report.ran and report.transactions == 0
    assert len(history(store, k)) == 30
    assert store.retention_agents(None, BIG) == []
