"""When the DuckDB file is checkpointed: when the writer is idle, seldom under load.

A checkpoint moves what the WAL holds into the database file: DuckDB compresses it and
writes it a second time, and every commit waits while it runs (a checkpoint started on
another connection blocks the writer's commits just the same). Its cost grows with the
WAL it folds in (measured on this project's message rows: about 10-40 ms of wall time
per MB of WAL, 6-20 us of CPU per message), so it is deferred, not avoided; what matters
is when callers pay it. With DuckDB's default threshold (16 MB, about 25,000 messages)
an import of batches of 1,000 stalled one call in 25 for 0.4-1.4 s, the p99 of the
batched benchmark.

So the writer checkpoints on its own as soon as it has had nothing to do for
IDLE_CHECKPOINT_S and the WAL holds at least IDLE_CHECKPOINT_BYTES: a burst of appends
commits with no checkpoint in its way, and an idle store keeps a short WAL (a short
replay after a crash). A commit still checkpoints when the WAL reaches the store's
checkpoint threshold (DEFAULT_CHECKPOINT_THRESHOLD, `--store-checkpoint-threshold`),
which bounds the WAL, and so the replay after a crash, under a load that never pauses.
Nothing here touches durability: every commit is in the WAL (fsynced) before its caller
is answered, checkpointed or not.

DuckDB refuses a checkpoint ("there are other write transactions active") after an
UPDATE committed while a read was running, until the reads that follow one another on
any connection pause (measured on DuckDB 2.0; appended rows alone do not do it). The
idle writer's flush of the thread counters is such an update, and a search streaming its
index build (then searching) such a run of reads: the checkpoint after a bulk load was
refused for the whole build and every search after it. So the idle writer leaves the
counters pending while a checkpoint is due (they are read live, and recounted after a
crash: nothing waits for them) and flushes them after it. A refusal that still happens
(an append's own update under a steady stream of reads) is expected: it is logged in one
line and retried after RETRY_BUSY_CHECKPOINT_S; any other failure keeps its traceback
and waits RETRY_CHECKPOINT_S.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb

# The WAL size at which a commit checkpoints (DuckDB's checkpoint_threshold). About
# 400,000 messages of the benchmark's corpus: a sustained import pays one long stall per
# that many messages instead of one short stall per 25,000; replaying a WAL this size
# after a crash takes several seconds. The resident set does not grow with it (DuckDB
# evicts the blocks of uncheckpointed rows under its memory limit too).
DEFAULT_CHECKPOINT_THRESHOLD = "256MB"
# How long the writer must have had nothing to do before it checkpoints: longer than the
# gap between the calls of a steady stream of appends, so such a stream is not made to
# wait behind a checkpoint it could have finished first.
IDLE_CHECKPOINT_S = 0.25
# The smallest WAL worth an idle checkpoint (a checkpoint has a fixed cost of its own).
IDLE_CHECKPOINT_BYTES = 4 << 20
# After a failed idle checkpoint, how long before the next attempt.
RETRY_CHECKPOINT_S = 5.0
# After an idle checkpoint refused for running reads (see the module docstring): soon, as
# reads of rows still in the WAL are slower (about 2x for a search's point lookups).
RETRY_BUSY_CHECKPOINT_S = 1.0


def wal_path(database: Path) -> Path:
    """The write-ahead log DuckDB keeps beside `database`."""
    return database.with_name(database.name + ".wal")


def wal_bytes(path: Path | None) -> int:
    """The size of the WAL at `path` (0 when there is none: nothing to checkpoint)."""
    if path is None:
        return 0
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def refused_for_readers(exc: BaseException) -> bool:
    """Whether a CHECKPOINT failed only because running reads hold back a committed
    update (the expected refusal of the module docstring, told by DuckDB's own text)."""
    return isinstance(exc, duckdb.TransactionException) and (
        "other write transactions active" in str(exc)
    )
