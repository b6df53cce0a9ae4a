"""Entry point: ``python -m bench --size quick|full [--only tokens,bm25,...]``.

quick (what ``make test`` runs) writes to bench/results/ (git-ignored); full writes
docs/benchmarks.md and docs/benchmarks.png. A failed correctness check or a crashed
benchmark makes the exit status non-zero after the report of the rest is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import (
    appends,
    bm25,
    buildscale,
    machine,
    pg,
    quality,
    readpath,
    report,
    search,
    tokens,
    tool_outputs,
    trim,
    window_reads,
)
from bench.child import REPO
from bench.model import Section
from bench.sizes import Sizes, sizes
from bench.stats import progress

BENCHMARKS: dict[str, Callable[[Sizes], Section | list[Section]]] = {
    "tokens": tokens.run,
    "trim": trim.run,
    "readpath": readpath.run,
    "buildscale": buildscale.run,
    "bm25": bm25.run,
    "appends": appends.run,
    "window_reads": window_reads.run,
    "search": search.run,
    "quality": quality.run,
    "tool_outputs": tool_outputs.run,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--size", choices=["quick", "full"], default="quick")
    parser.add_argument(
        "--only", default="", help="comma-separated subset of: " + ", ".join(BENCHMARKS)
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for benchmarks.md/.png (default: docs/ for full, bench/results/ for quick)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="re-render the report from bench/results/<size>.json, measure nothing",
    )
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    sz = sizes(args.size)
    results_dir = REPO / "bench" / "results"
    out_dir = args.out or (REPO / "docs" if sz.mode == "full" else results_dir)

    # A run written elsewhere (--out) keeps its raw results there too: a partial run
    # (--only) must never replace the saved results of the last whole one.
    json_path = (args.out or results_dir) / f"{sz.mode}.json"
    if args.report_only:
        saved, machine_rows, mode, wall_s, saved_failures = report.load(json_path)
        md = report.write(saved, machine_rows, mode, wall_s, saved_failures, out_dir, json_path)
        progress(f"re-rendered {md} from {json_path}")
        return 0

    load_at_start = os.getloadavg()
    started = time.perf_counter()
    sections: list[Section] = []
    failures: list[str] = []
    for name in chosen:
        progress(f"== {name} ==")
        try:
            made = BENCHMARKS[name](sz)
            sections.extend(made if isinstance(made, list) else [made])
        except Exception as exc:
            traceback.print_exc()
            kind = "correctness check failed" if isinstance(exc, AssertionError) else "crashed"
            failures.append(f"{name}: {kind}: {exc}")
        finally:
            # A finished benchmark's databases would keep PostgreSQL busy (autovacuum,
            # checkpoints of their pages) while the next one measures.
            pg.drop_databases()
    wall = time.perf_counter() - started
    machine_rows = machine.describe(REPO, load_at_start)
    if pg.started():
        machine_rows.append(("PostgreSQL server (the PostgreSQL engine's rows)", pg.version()))
    pg.stop()
    md = report.write(
        sections,
        machine_rows,
        sz.mode,
        wall,
        failures,
        out_dir,
        json_path,
    )
    progress(f"done in {wall:.0f} s: {md}")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
