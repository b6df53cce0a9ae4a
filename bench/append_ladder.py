"""A probe: where single-message appends under 32 callers lose to the echo ceiling.

contextd (DuckDB) is served four ways, each beside the echo server under the same load
(32 callers, one message per call, as benchmark 5):

- ``full``: contextd as served;
- ``writer``: the store's writer answers every append of a group at once, writing
  nothing (what is left: the servicer, the use case, the hand-off to the writer thread
  and back);
- ``store``: the store's ``append`` answers at once, on the handler thread (what is
  left: interceptors, key check, decoding, validation, request record, token counts);
- ``handler``: AppendMessages answers at once (what is left: gRPC and the interceptors).

Each step down removes one part of the work, so the steps show what each part costs in
calls per second against the echo of the same minutes. The parts are patched out of the
served process before it serves (`serve`): a diagnostic, as `bench.append_probe` is,
never used by the service. The answers carry one receipt per message, which is what the
load checks.

Benchmark 5 serves the three lower steps beside contextd and the echo server in its
32-caller load (``bench.appends``); alone, with rounds of its own:
``python -m bench.append_ladder --rounds 6 --seconds 3``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import servers

STEPS = ("full", "writer", "store", "handler")


def _patch(step: str) -> None:
    """Remove the work below `step` from this process's contextd (see the module)."""
    from contextd.adapters.duckdb.store import Store
    from contextd.api.servicer import ContextServicer
    from contextd.domain.model import MessageReceipt
    from contextd.v1 import context_service_pb2 as pb

    # What each step replaces must still exist, or the step would measure all of contextd.
    for owner, name in (
        (Store, "_commit_appends"),
        (Store, "append"),
        (ContextServicer, "AppendMessages"),
    ):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(f"{owner.__name__}.{name} is gone: update bench/append_ladder.py")
    receipt = MessageReceipt(id=1, create_time_us=1, token_estimate=1)
    if step == "writer":

        def commit(self: Any, writer: Any, jobs: list[Any]) -> None:
            for job in jobs:
                job.future.set_result([receipt] * job.rows)

        Store._commit_appends = commit  # type: ignore[method-assign]
    elif step == "store":
        stored = Store.append
        agents: set[tuple[str, str]] = set()

        def append(self: Any, key: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            # The first append of an agent is stored (it creates the agent), so the
            # service finds the agent's settings cached, as it does when appends store.
            if (key.tenant, key.agent) not in agents:
                agents.add((key.tenant, key.agent))
                return stored(self, key, batch, *args, **kwargs)
            return [receipt] * len(batch.messages)

        Store.append = append  # type: ignore[method-assign]
    elif step == "handler":

        def handle(self: Any, request: Any, context: Any) -> Any:
            return pb.AppendMessagesResponse(
                receipts=[pb.MessageReceipt(id=1) for _ in request.messages]
            )

        ContextServicer.AppendMessages = handle  # type: ignore[method-assign]


def serve(step: str) -> int:
    _patch(step)
    from contextd.cli import main

    return main(["serve"])


def start(step: str, data_dir: Path) -> servers.ServerProcess:
    """``contextd serve`` with the work below `step` removed, on a free loopback port over
    the DuckDB file in ``data_dir`` (as `servers.start_contextd` starts it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return servers._start(
        f"contextd-{step}",
        [sys.executable, "-m", "bench.append_ladder", "--serve", step],
        {
            "CONTEXTD_STORE": "",
            "CONTEXTD_DATA_DIR": str(data_dir),
            "CONTEXTD_ADDR": "127.0.0.1:0",
            "CONTEXTD_LOG_FORMAT": "json",
            "CONTEXTD_LOG_LEVEL": "INFO",
            "CONTEXTD_WORKERS": "32",
        },
        data_dir.parent / "contextd.log",
        '"contextd serving"',
    )


def run(rounds: int, seconds: float) -> dict[str, list[tuple[float, float]]]:
    """Calls/s and server CPU ms per call of each server, round after round."""
    from bench.load import child_load

    tmp = Path(tempfile.mkdtemp(prefix="contextd-append-ladder-"))
    started = {"echo": servers.start_echo(tmp / "echo")}
    try:
        started["full"] = servers.start_contextd(tmp / "full" / "data")
        for step in STEPS[1:]:
            started[step] = start(step, tmp / step / "data")
        measured: dict[str, list[tuple[float, float]]] = {name: [] for name in started}
        for r in range(rounds):
            order = list(started) if r % 2 == 0 else list(reversed(started))
            for name in order:
                server = started[name]
                out = child_load(server.address, server.proc.pid, 32, 1, seconds)
                rate = statistics.mean(out["calls_per_s"])
                measured[name].append((rate, out["server_cpu"] / rate * 1000))
        return measured
    finally:
        for server in started.values():
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=STEPS, help="serve one step (used by the runner)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    measured = run(args.rounds, args.seconds)
    echo = [rate for rate, _ in measured["echo"]]
    print(f"{'server':8} {'calls/s':>8} {'of echo (median, min)':>22} {'server CPU ms/call':>19}")
    for name, rows in measured.items():
        ratios = [rate / e for (rate, _), e in zip(rows, echo, strict=True)]
        print(
            f"{name:8} {statistics.median(r for r, _ in rows):8,.0f} "
            f"{statistics.median(ratios):14.2f}, {min(ratios):.2f} "
            f"{statistics.median(c for _, c in rows):19.3f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
