"""Peak memory of one phase of a process, for the BM25 comparison.

``ru_maxrss`` is the process's all-time peak, so generating the corpus (which has its own
transient peaks) can hide what building an index adds. We therefore sample the resident
set every few milliseconds during the phase, and also take ``ru_maxrss`` if it rose
during the phase; the larger of the two, minus the resident set before the phase, is
the phase's peak. Each library runs in its own child process, so numbers never mix.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import resource
import threading
from types import TracebackType

import psutil  # type: ignore[import-untyped,unused-ignore]


def _release_free_heap() -> None:
    """Ask glibc to return freed heap pages to the OS (``malloc_trim(0)``).

    Without it, memory a build freed (copies of the texts, per-document scratch) stays
    resident and looks like part of the index. No-op where glibc is absent.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


class PeakMemory:
    """Context manager measuring the extra resident memory (bytes) of its body: at its
    peak, and what is still held at the end once freed heap is returned to the OS (the
    structure built, without the build's transients)."""

    def __init__(self, interval: float = 0.002) -> None:
        self._interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._peak_sampled = 0
        self.base = 0
        self.peak_extra = 0
        self.retained_extra = 0

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak_sampled = max(self._peak_sampled, self._proc.memory_info().rss)

    @staticmethod
    def _maxrss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def __enter__(self) -> PeakMemory:
        gc.collect()
        self.base = self._proc.memory_info().rss
        self._maxrss_before = self._maxrss()
        self._peak_sampled = self.base
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        gc.collect()
        peak = max(self._peak_sampled, self._proc.memory_info().rss)
        _release_free_heap()
        end = self._proc.memory_info().rss
        maxrss = self._maxrss()
        if maxrss > self._maxrss_before:
            peak = max(peak, maxrss)
        self.peak_extra = peak - self.base
        self.retained_extra = end - self.base
