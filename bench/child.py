"""Run one measurement in a fresh Python process and get its JSON result back.

Why separate processes: peak memory (``ru_maxrss``) is per process and only ever grows,
so two libraries measured in one process would mix their numbers; CPU pinning
(``sched_setaffinity``) must happen before a library sizes its thread pool; and a
library's warm caches or leaked threads must not flatter or penalise the next one.

Usage (internal): ``python -m bench.child '{"fn": "bench.bm25:child_bm25", "kwargs": {}}'``.
The function's JSON-serialisable return value is printed as the last line of stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_MARK = "BENCH-RESULT "


def run(
    fn: str,
    kwargs: dict[str, Any] | None = None,
    *,
    cpus: set[int] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 3_600,
) -> Any:
    """Call ``fn`` ("package.module:function") in a child process and return its result.

    ``cpus`` pins the child to those CPUs before anything is imported.
    """
    payload = json.dumps({"fn": fn, "kwargs": kwargs or {}, "cpus": sorted(cpus) if cpus else None})
    proc = subprocess.run(
        [sys.executable, "-m", "bench.child", payload],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.stderr:
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{fn} failed with exit code {proc.returncode}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    raise RuntimeError(f"{fn} printed no result:\n{proc.stdout[-2000:]}")


def _main(argv: list[str]) -> None:
    payload = json.loads(argv[1])
    if payload["cpus"]:
        os.sched_setaffinity(0, set(payload["cpus"]))
    module_name, func_name = payload["fn"].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(**payload["kwargs"])
    print(_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv)
