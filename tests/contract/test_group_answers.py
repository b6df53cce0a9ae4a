"""Concurrent appends are committed in groups and each caller is answered with its own
result: its own receipts (ids of its own messages), its own error (a call for a missing
agent fails alone; the calls grouped with it are written), and its own first receipts
when it retries with its request id."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from contextd.domain.errors import NotFound
from contextd.domain.idempotency import AlreadyDone, RequestRecord
from contextd.domain.model import AgentSettings
from contextd.ports.store import Store

from .support import batch, key

CALLERS = 32
ROUNDS = 6


def _record(request_id: str) -> RequestRecord:
    return RequestRecord("default", request_id, "AppendMessages", "fp", lambda r: repr(r).encode())


def test_each_grouped_caller_gets_the_receipts_of_its_own_message(store: Store) -> None:
    store.append(key("t0"), batch("first"), AgentSettings())
    answers: dict[tuple[int, int], Any] = {}
    start = threading.Barrier(CALLERS)

    def caller(n: int) -> None:
        start.wait()
        for i in range(ROUNDS):
            text = f"caller {n} round {i}"
            try:
                answers[n, i] = (
                    text,
                    store.append(key(f"t{n}"), batch(text), None, _record(f"r-{n}-{i}")),
                )
            except BaseException as exc:  # pragma: no cover - reported below
                answers[n, i] = exc

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(answers) == CALLERS * ROUNDS
    ids: set[int] = set()
    for (n, i), answer in answers.items():
        assert not isinstance(answer, BaseException), answer
        text, receipts = answer
        assert len(receipts) == 1
        assert receipts[0].sequence == i + (2 if n == 0 else 1)
        stored = store.messages_by_ids(key(f"t{n}"), [receipts[0].id])
        assert [m.content for m in stored] == [text]
        ids.add(receipts[0].id)
    assert len(ids) == CALLERS * ROUNDS
    # A retry with the same request id is answered with that call's own first receipts.
    for n in (0, 17, CALLERS - 1):
        text, receipts = answers[n, 2]
        with pytest.raises(AlreadyDone) as done:
            store.append(key(f"t{n}"), batch(text), None, _record(f"r-{n}-2"))
        assert done.value.payload == repr(receipts).encode()


def test_an_error_in_a_group_fails_only_its_own_call(store: Store) -> None:
    store.append(key("t0"), batch("first"), AgentSettings())
    answers: dict[int, Any] = {}
    start = threading.Barrier(CALLERS)

    def caller(n: int) -> None:
        start.wait()
        # Every fourth caller names an agent that does not exist (and may not be created).
        agent = "missing" if n % 4 == 0 else "a1"
        try:
            answers[n] = store.append(key(f"t{n}", agent=agent), batch(f"m{n}"), None)
        except BaseException as exc:
            answers[n] = exc

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(answers) == CALLERS
    for n, answer in answers.items():
        if n % 4 == 0:
            assert isinstance(answer, NotFound) and answer.reason == "AGENT_NOT_FOUND"
        else:
            assert not isinstance(answer, BaseException), answer
            stored = store.messages_by_ids(key(f"t{n}"), [answer[0].id])
            assert [m.content for m in stored] == [f"m{n}"]
