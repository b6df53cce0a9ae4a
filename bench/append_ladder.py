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

Benchmark 5 serves the three lower steps, with the echo server and contextd, in a
32-caller pass of its own (``bench.appends``; alone: ``python -m bench --only appends``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench import servers

# The steps below contextd as served, each removing more of its work.
STEPS = ("writer", "store", "handler")


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
    the DuckDB file in ``data_dir`` (as `servers.start_contextd` starts contextd)."""
    return servers.start_contextd(data_dir, module=("bench.append_ladder", step))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=STEPS, help="the step to serve")
    return serve(parser.parse_args().step)


if __name__ == "__main__":
    sys.exit(main())
