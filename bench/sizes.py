"""Problem sizes and repetitions of the two modes.

quick is what ``make test`` runs on every change: tiny sizes, one or two repetitions, the
whole suite in well under 90 s on two cores, so it proves the suite works rather than
measuring much. full is for docs/benchmarks.md: the issue's sizes (up to 1,000,000
messages), repetitions chosen so the run stays under about 10 minutes on two cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["quick", "full"]


@dataclass(frozen=True, slots=True)
class Sizes:
    mode: Mode
    repeat: int  # timed repetitions of the fast benchmarks (medians are reported)
    count_messages: tuple[int, ...]  # token counting corpora
    trim_history: int  # messages in the trimming history
    read_thread: int  # messages in the BuildContext thread
    bm25_sizes: tuple[int, ...]  # BM25 corpora
    rank_bm25_max: int  # rank_bm25 is pure Python: only up to this size
    bm25_queries: int
    append_seconds: float  # duration of each gRPC append load phase
    sqlite_single: int  # messages for the one-commit-per-message SQLite baseline
    sqlite_batched: int  # messages for each batched SQLite baseline
    window_calls: int  # ListMessages calls timed
    budget: int = 8_000
    tool_output_count: int = 2_000  # stored tool outputs a relevance selection ranks


QUICK = Sizes(
    mode="quick",
    repeat=2,
    count_messages=(2_000,),
    trim_history=10_000,
    read_thread=10_000,
    bm25_sizes=(2_000, 10_000),
    rank_bm25_max=10_000,
    bm25_queries=20,
    append_seconds=1.0,
    sqlite_single=300,
    sqlite_batched=5_000,
    window_calls=10,
)

FULL = Sizes(
    mode="full",
    repeat=5,
    count_messages=(10_000, 100_000),
    trim_history=100_000,
    read_thread=100_000,
    bm25_sizes=(10_000, 100_000, 1_000_000),
    rank_bm25_max=100_000,
    bm25_queries=100,
    append_seconds=12.0,
    sqlite_single=3_000,
    sqlite_batched=50_000,
    window_calls=50,
    tool_output_count=100_000,
)


def sizes(mode: Mode) -> Sizes:
    return QUICK if mode == "quick" else FULL
