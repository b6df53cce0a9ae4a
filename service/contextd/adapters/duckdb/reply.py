"""A writer job's answer: the part of `concurrent.futures.Future` the writer uses, lighter.

Every append's caller waits for its answer from the writer thread. `Future` does that
with a Python-level `threading.Condition` over an RLock: the caller allocates a waiter
lock per wait, and on waking it must take the Condition's lock back, which the writer
may still hold while it answers the rest of its group, so a woken caller often blocks
a second time (one more context switch and one more GIL hand-off per call). Under 32
callers those costs, paid with the GIL held on the writer's side, were a good part of
its time per call.

Here the wait is one `threading.Lock` held from creation and released once by the
answer: the caller blocks in C on that lock and wakes with nothing more to take. A
second small lock makes the state changes atomic (cancel by a caller that gave up,
against the writer taking the job); neither is ever held across a wait, so both are
uncontended in practice.

Only what the writer and `_submit` use is provided: `set_running_or_notify_cancel`,
`cancel`, `done`, `set_result`, `set_exception`, `result` and `exception`, with
`Future`'s meaning (a cancelled reply raises CancelledError, answering a finished one
raises InvalidStateError).
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, InvalidStateError
from typing import Generic, TypeVar

T = TypeVar("T")

_PENDING = 0
_RUNNING = 1
_CANCELLED = 2
_FINISHED = 3


class Reply(Generic[T]):
    """One job's result or error, set once by the writer, awaited by one caller."""

    __slots__ = ("_error", "_ready", "_state", "_state_lock", "_value")

    def __init__(self) -> None:
        self._state = _PENDING
        self._value: T | None = None
        self._error: BaseException | None = None
        self._state_lock = threading.Lock()
        # Held until the reply is finished or cancelled; whoever waits blocks on it.
        self._ready = threading.Lock()
        self._ready.acquire()

    def set_running_or_notify_cancel(self) -> bool:
        """The writer takes the job: False if its caller withdrew it (never write it)."""
        with self._state_lock:
            if self._state == _CANCELLED:
                return False
            if self._state != _PENDING:
                raise RuntimeError(f"reply taken twice (state {self._state})")
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        """Withdraw a job the writer has not taken: True if it is now never written."""
        with self._state_lock:
            if self._state == _CANCELLED:
                return True
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
        self._ready.release()
        return True

    def done(self) -> bool:
        return self._state in (_CANCELLED, _FINISHED)

    def set_result(self, value: T) -> None:
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, value: T | None, error: BaseException | None) -> None:
        with self._state_lock:
            if self._state in (_CANCELLED, _FINISHED):
                done = "cancelled" if self._state == _CANCELLED else "finished"
                raise InvalidStateError(f"reply already {done}")
            self._value, self._error = value, error
            self._state = _FINISHED
        self._ready.release()  # wakes the caller, if it waits

    def _wait(self, timeout: float | None) -> None:
        if self._state in (_CANCELLED, _FINISHED):
            return
        if not self._ready.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError
        self._ready.release()  # stays released: any later wait returns at once

    def result(self, timeout: float | None = None) -> T:
        """The value (or raise the error), waiting at most `timeout` seconds (TimeoutError)."""
        self._wait(timeout)
        if self._state == _CANCELLED:
            raise CancelledError
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # None only when T admits it

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error of a finished reply (None: it has a value)."""
        self._wait(timeout)
        if self._state == _CANCELLED:
            raise CancelledError
        return self._error
