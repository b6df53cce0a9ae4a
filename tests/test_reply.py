"""The writer's reply slot (adapters/duckdb/reply.py) keeps `Future`'s meaning where
`_submit` and the writer rely on it: a withdrawn job is never taken, a taken one cannot
be withdrawn, an answer is given once, and a waiting caller wakes with it."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, InvalidStateError

import pytest

from contextd.adapters.duckdb.reply import Reply


def test_a_withdrawn_reply_is_never_taken_nor_answered() -> None:
    reply: Reply[int] = Reply()
    assert reply.cancel()
    assert reply.done()
    assert not reply.set_running_or_notify_cancel()  # the writer skips it
    with pytest.raises(InvalidStateError):
        reply.set_result(1)
    with pytest.raises(CancelledError):
        reply.result(timeout=0)


def test_a_taken_reply_cannot_be_withdrawn_and_is_answered_once() -> None:
    reply: Reply[int] = Reply()
    assert reply.set_running_or_notify_cancel()
    assert not reply.cancel()
    assert not reply.done()
    with pytest.raises(TimeoutError):
        reply.result(timeout=0)
    reply.set_result(7)
    assert reply.done()
    with pytest.raises(InvalidStateError):
        reply.set_exception(RuntimeError("late"))
    assert reply.result() == 7
    assert reply.result(timeout=0) == 7  # any number of times
    assert reply.exception() is None


def test_an_error_is_raised_to_every_reader() -> None:
    reply: Reply[int] = Reply()
    reply.set_running_or_notify_cancel()
    error = ValueError("no")
    reply.set_exception(error)
    assert reply.exception() is error
    for _ in range(2):
        with pytest.raises(ValueError, match="no"):
            reply.result()


def test_a_waiting_caller_wakes_with_the_answer_from_another_thread() -> None:
    replies: list[Reply[int]] = [Reply() for _ in range(16)]
    got: list[int] = []
    lock = threading.Lock()

    def wait(reply: Reply[int]) -> None:
        value = reply.result()  # no timeout: it must be woken
        with lock:
            got.append(value)

    waiters = [threading.Thread(target=wait, args=(r,)) for r in replies]
    for w in waiters:
        w.start()
    for i, reply in enumerate(replies):
        assert reply.set_running_or_notify_cancel()
        reply.set_result(i)
    for w in waiters:
        w.join(60)
    assert sorted(got) == list(range(16))
