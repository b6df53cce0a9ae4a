"""Retries: a write given a RequestRecord is done once; the same request again raises
AlreadyDone with the first payload and writes nothing; another request under the same id
is REQUEST_ID_REUSED; records are kept per tenant."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from contextd.domain.clock import ManualClock
from contextd.domain.context import StatusEntry, StatusKind
from contextd.domain.errors import InvalidArgument, NotFound
from contextd.domain.idempotency import AlreadyDone, Remembered, RequestRecord
from contextd.domain.model import AgentSettings
from contextd.ports.store import Store

from .support import BIG, MINUTE, batch, history, key


def record(
    request_id: str = "r1",
    fingerprint: str = "f1",
    *,
    tenant: str = "default",
    method: str = "contextd.v1.TestRequest",
) -> RequestRecord:
    return RequestRecord(tenant, request_id, method, fingerprint, lambda v: repr(v).encode())


def test_a_retried_append_writes_once_and_answers_the_first_payload(store: Store) -> None:
    receipts = store.append(key(), batch("once"), AgentSettings(), record())
    with pytest.raises(AlreadyDone) as again:
        store.append(key(), batch("once"), AgentSettings(), record())
    assert again.value.payload == repr(receipts).encode()
    assert history(store, key()) == ["once"]
    thread = store.get_thread(key())
    assert thread is not None and thread.message_count == 1
    assert store.remembered("default", "r1") == Remembered(
        "contextd.v1.TestRequest", "f1", repr(receipts).encode()
    )


def _race(store: Store, n: int, racers: int) -> list[bytes]:
    """`racers` attempts of one append with one request id, released at once: what each
    was answered (its receipts, or the payload AlreadyDone replays)."""
    start = threading.Barrier(racers)
    answers: list[bytes] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def attempt() -> None:
        start.wait()
        try:
            receipts = store.append(key(), batch(f"raced {n}"), None, record(f"race {n}"))
            payload = repr(receipts).encode()
        except AlreadyDone as done:
            payload = done.payload
        except BaseException as exc:  # pragma: no cover - reported below
            with lock:
                errors.append(exc)
            return
        with lock:
            answers.append(payload)

    attempts = [threading.Thread(target=attempt) for _ in range(racers)]
    for t in attempts:
        t.start()
    for t in attempts:
        t.join()
    assert errors == []
    return answers


def test_concurrent_attempts_under_one_request_id_write_once(store: Store) -> None:
    """Attempts of one append race (a client retrying while its first attempt is still
    running), eight at a time, round after round: one writes, every other answers its
    payload, and the thread holds each message once. On PostgreSQL the losers conflict on
    the record's key when they write it, roll back and run again, on connections that
    stay usable."""
    store.append(key(), batch("before"), AgentSettings())
    rounds, racers = 6, 8
    for n in range(rounds):
        answers = _race(store, n, racers)
        assert len(answers) == racers and len(set(answers)) == 1
    assert history(store, key()) == ["before", *(f"raced {n}" for n in range(rounds))]
    thread = store.get_thread(key())
    assert thread is not None and thread.message_count == 1 + rounds
    store.append(key(), batch("after"), None, record("next"))
    assert history(store, key())[-1] == "after"


def test_another_request_under_the_same_id_is_refused(store: Store) -> None:
    store.append(key(), batch("first"), AgentSettings(), record())
    with pytest.raises(InvalidArgument) as other:
        store.append(key(), batch("second"), AgentSettings(), record(fingerprint="f2"))
    assert other.value.reason == "REQUEST_ID_REUSED"
    with pytest.raises(InvalidArgument) as other_method:
        store.clear_thread(key(), record(method="contextd.v1.ClearContextRequest"))
    assert other_method.value.reason == "REQUEST_ID_REUSED"
    assert history(store, key()) == ["first"]
    thread = store.get_thread(key())
    assert thread is not None and thread.last_clear_time_us is None


def test_records_are_kept_per_tenant(store: Store) -> None:
    store.append(key(), batch("default's"), AgentSettings(), record())
    assert store.remembered("other", "r1") is None
    # The same id and request under another tenant is another request: it writes.
    other = key(tenant="other")
    store.append(other, batch("other's"), AgentSettings(), record(tenant="other"))
    assert history(store, other) == ["other's"]
    with pytest.raises(AlreadyDone):
        store.append(other, batch("other's"), AgentSettings(), record(tenant="other"))
    found = store.remembered("other", "r1")
    assert found is not None and found.fingerprint == "f1"
    assert history(store, key()) == ["default's"]


def test_a_failed_write_records_nothing(store: Store) -> None:
    with pytest.raises(NotFound):
        store.append(key(), batch("no agent yet"), None, record())
    assert store.remembered("default", "r1") is None
    store.append(key(), batch("no agent yet"), AgentSettings(), record())
    assert history(store, key()) == ["no agent yet"]


@dataclass(frozen=True)
class Write:
    """A write done with a record, something done between the first call and its retry,
    and what must read the same after the retry as before it."""

    call: Callable[[Store, RequestRecord], Any]
    between: Callable[[Store], Any]
    observe: Callable[[Store], Any]


def _agent(store: Store) -> Any:
    found = store.find_agent("default", "a1")
    return None if found is None else (found.update_time_us, found.last_clear_time_us)


def _threads(store: Store) -> Any:
    return [
        (t.scope, t.thread, t.last_clear_time_us, t.message_count)
        for scope in ("", "dm:1")
        for t in store.list_threads("default", "a1", scope, None, BIG)
    ]


def _status(store: Store) -> Any:
    return store.list_status("default", "a1", "", None, BIG, None)


ENTRY = StatusEntry("job", StatusKind.PROCESS, "running", "builds", 0)

WRITES = {
    "create_agent": Write(
        lambda s, r: s.create_agent("default", "a1", AgentSettings(), r),
        lambda s: s.delete_agent("default", "a1"),
        _agent,
    ),
    "update_agent": Write(
        lambda s, r: s.update_agent(
            "default", "a1", AgentSettings(system_prompt="v2"), frozenset({"system_prompt"}), "", r
        ),
        lambda s: s.update_agent(
            "default", "a1", AgentSettings(system_prompt="v3"), frozenset({"system_prompt"})
        ),
        lambda s: s.get_agent("default", "a1").system_prompt,
    ),
    "delete_agent": Write(
        lambda s, r: s.delete_agent("default", "a1", "", r),
        lambda s: s.create_agent("default", "a1", AgentSettings()),
        _agent,
    ),
    "clear_agent": Write(lambda s, r: s.clear_agent("default", "a1", r), lambda s: None, _agent),
    "clear_scope": Write(
        lambda s, r: s.clear_scope("default", "a1", "", r), lambda s: None, _threads
    ),
    "clear_thread": Write(lambda s, r: s.clear_thread(key(), r), lambda s: None, _threads),
    "set_status": Write(
        lambda s, r: s.set_status("default", "a1", "", ENTRY, r),
        lambda s: s.clear_status("default", "a1", "", None),
        _status,
    ),
    "clear_status": Write(
        lambda s, r: s.clear_status("default", "a1", "", "job", r),
        lambda s: s.set_status("default", "a1", "", ENTRY),
        _status,
    ),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_every_write_is_done_once(store: Store, clock: ManualClock, name: str) -> None:
    """The retry comes a minute later, after another write changed what the first did:
    it answers the first payload and undoes nothing."""
    write = WRITES[name]
    if name != "create_agent":
        store.append(key(), batch("hello"), AgentSettings())
        store.append(key(scope="dm:1"), batch("elsewhere"), AgentSettings())
        store.set_status("default", "a1", "", ENTRY)
    first = write.call(store, record())
    clock.advance(MINUTE)
    write.between(store)
    before = write.observe(store)
    with pytest.raises(AlreadyDone) as again:
        write.call(store, record())
    assert again.value.payload == repr(first).encode()
    assert write.observe(store) == before
