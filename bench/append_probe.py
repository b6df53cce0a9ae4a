"""Why appends are slow: watch the store's group commit under 32 concurrent callers.

Runs in a child process, in process (no gRPC): 32 threads call
``ContextService.append_messages`` with one message each, either each on its own thread
of conversation (as in benchmark 5) or all on one shared thread. The store's private
``_commit_appends`` is wrapped to count groups and time them, which shows whether the
writer thread is saturated, how many calls each commit carries, and what a group costs
per distinct conversation thread it touches (about nothing since thread counters are no
longer updated in each commit). "Busy" counts commits of appends only, not the writer's
counter flushes or other writes. It is a diagnostic, so it is skipped (not
failed) if the store's internals change shape.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import corpus

CALLERS = 32


def child_probe(shared: bool, seconds: float) -> dict[str, Any]:
    from bench.readpath import service_over
    from contextd.adapters.duckdb.store import Store
    from contextd.domain.model import NewMessage, Role

    original = getattr(Store, "_commit_appends", None)
    if original is None:
        return {"skipped": "Store._commit_appends no longer exists"}
    groups: list[tuple[int, float]] = []

    def commit(self: Any, writer: Any, jobs: list[Any]) -> None:
        start = time.perf_counter()
        original(self, writer, jobs)
        groups.append((len(jobs), time.perf_counter() - start))

    Store._commit_appends = commit  # type: ignore[method-assign]
    history = corpus.conversation(CALLERS, tools=False)
    calls = [0] * CALLERS
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="contextd-bench-probe-") as tmp:
        store = Store.open(Path(tmp) / "probe.duckdb")
        service = service_over(store)

        def caller(k: int) -> None:
            thread = "shared" if shared else f"caller-{k}"
            batch = [NewMessage(role=Role(history[k].role), content=history[k].content)]
            while not stop.is_set():
                service.append_messages("default", "probe", "", thread, batch, create_agent=True)
                calls[k] += 1

        workers = [threading.Thread(target=caller, args=(k,)) for k in range(CALLERS)]
        for w in workers:
            w.start()
        time.sleep(0.5)
        groups.clear()
        done0, start = sum(calls), time.perf_counter()
        time.sleep(seconds)
        wall = time.perf_counter() - start
        done = sum(calls) - done0
        measured = list(groups)
        stop.set()
        for w in workers:
            w.join()
        store.close()
    busy = sum(t for _, t in measured)
    return {
        "calls_per_s": done / wall,
        "groups": len(measured),
        "mean_group": sum(n for n, _ in measured) / max(1, len(measured)),
        "writer_busy": busy / wall,
        "group_ms": 1_000 * busy / max(1, len(measured)),
    }
