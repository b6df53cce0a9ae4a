"""Search over message history on PostgreSQL: its own full-text search, in the database.

Why this shape:
- Every replica reads the same rows and the same index, so replicas never diverge and
  nothing is kept in a replica's memory. `messages.search_tsv` (schema version 7; since
  version 8 made by the append where it can be made exactly, else by a trigger, see
  search_vector.py) is `to_tsvector('simple', ...)` of the message's content and
  tool_calls with every run of characters other than letters and digits turned into one
  space (so `foo.bar/baz_qux` gives four words, as the embedded engine's tokenizer does,
  rather than PostgreSQL's host and file tokens), under a GIN index. 'simple' neither
  stems nor drops stop words, so text in any language is indexed as written. The
  column covers the first 196,608 characters of content and 65,536 of tool_calls (a
  tsvector holds at most 1 MB).
- The query is the terms domain/search.py cut (the same on both engines), OR-ed into a
  tsquery, ranked by ts_rank_cd (cover density, normalised by 1 + log of the length).
- Ranking reads each match's whole vector (a tool output's is tens of kB, out of line),
  so a common word made a search rank a tenth of a million-message scope (p99 1.6 s).
  Only the newest `search_candidates` matches are ranked. They are found without
  visiting every match: the GIN bitmap ANDed with a range of the tenant's newest ids
  (messages_by_id), the range widened (in the same transaction) until it holds that
  many matches of the scope or the whole history. Each step ranks its candidates only
  when they are final, in the same statement. The range's bound reaches the planner as
  an InitPlan's value (RANGE_BOUND): statistics lag behind the newest ids, and an
  estimate from them made the planner test the range's every vector instead.
- CJK terms (character pairs) cannot be found through the tsvector (PostgreSQL keeps a
  run of CJK characters as one word), so each is matched as a substring (strpos) of the
  content and tool_calls, and each one a message holds adds 0.1 to its rank. Such a
  search reads the messages of each id range rather than the index.
- Work is bounded by a statement timeout (SEARCH_TIMEOUT after `SEARCH_TIMEOUT_S`).
"""

from __future__ import annotations

from typing import Any

from psycopg import errors as pg_errors

from contextd.adapters.postgres.base import PostgresBase
from contextd.adapters.postgres.message_sql import SELECT_MESSAGES, window_predicate
from contextd.adapters.rows import message_from_row
from contextd.domain.limits import MAX_SEARCH_CANDIDATES
from contextd.domain.model import StoredMessage
from contextd.domain.search import SearchQuery, is_cjk_term, search_timeout

# The most a search may take before it is cancelled (a statement timeout).
SEARCH_TIMEOUT_S = 10.0

# Rank added per CJK term a message holds (ts_rank_cd of one word is around 0.1).
CJK_TERM_RANK = 0.1

# A search's work memory: the bitmaps of its index scans stay exact (a lossy bitmap
# rechecks every row of a page against its vector).
SEARCH_WORK_MEM = "64MB"

# The first id range searched spans this many ids per candidate (the newest ids of the
# tenant); each next range is wider by what the matches found so far ask for. 25 ends a
# search matching one message in 25 or more in one step: over 1,000,000
# messages p99 fell from about 540 ms (8) to about 290 ms (A/B, two rounds).
FIRST_SPAN_PER_CANDIDATE = 25


# A step's id bound, handed to the planner as an InitPlan's value, which it cannot see
# when it plans (it takes such a range for a third of the rows). A bound it sees is
# estimated from the histogram of messages.id, and the newest ids, the very ones a
# search starts from, lie past its last bucket until the next ANALYZE (autovacuum's
# comes once a tenth of the table is new; after a bulk load, minutes later): the
# planner took the range for a few rows and read it newest first through messages_by_id,
# testing every row's vector (read out of line) against the query, 100,000-270,000 of
# them in 0.6-4.4 s, where the GIN bitmap ANDed with the range reads the 2,000-6,000
# matches (bench search, 1,000,000 messages, the searches right after the load).
RANGE_BOUND = "AND m.id >= (SELECT %s::bigint)"

# The settings of a search's transaction.
SEARCH_SETTINGS = (
    f"SET LOCAL statement_timeout = {int(SEARCH_TIMEOUT_S * 1000)}",
    # The candidates come from the GIN index ANDed with an id range of messages_by_id (a
    # bitmap the size of the range, never of every match); the bitmap stays exact, and a
    # sequential scan would read every row's vector.
    f"SET LOCAL work_mem = '{SEARCH_WORK_MEM}'",
    "SET LOCAL enable_seqscan = off",
)


def search_step(query: SearchQuery, limit: int, lowest: int | None) -> tuple[str, list[Any]]:
    """The statement of one step and its parameters: the newest `limit` matches with ids
    from `lowest` on (None: the whole history) (c), how many there are (found), and, when
    they are the candidates (`limit` of them, or the whole history's), the best k."""
    words = [t for t in query.terms if not is_cjk_term(t)]
    cjk = [t for t in query.terms if is_cjk_term(t)]
    # Terms hold letters, marks and digits only: nothing tsquery syntax reads.
    tsquery = " | ".join(words)
    rank_params: list[Any] = [tsquery]
    held = ["(strpos(m.content, %s) > 0 OR strpos(m.tool_calls, %s) > 0)" for _ in cjk]
    cjk_params = [p for t in cjk for p in (t, t)]
    rank = "coalesce(ts_rank_cd(m.search_tsv, to_tsquery('simple', %s), 1), 0)"
    if held:
        rank += " + " + " + ".join(f"{CJK_TERM_RANK} * ({h})::int" for h in held)
        rank_params += cjk_params
    matches = []
    match_params: list[Any] = []
    if words:
        matches.append("m.search_tsv @@ to_tsquery('simple', %s)")
        match_params.append(tsquery)
    matches += held
    match_params += cjk_params
    where_params: list[Any] = [query.tenant, query.agent, query.scope]
    clauses = ""
    if query.thread is not None:
        clauses += " AND t.thread = %s"
        where_params.append(query.thread)
    if query.window is not None:
        predicate, window_params = window_predicate(query.window)
        clauses += f" AND {predicate}"
        where_params += window_params
    bound, bound_params = ("", []) if lowest is None else (RANGE_BOUND, [lowest])
    sql = f"""
        WITH c AS MATERIALIZED (
            SELECT m.id
            FROM threads t JOIN messages m
              ON m.tenant = t.tenant AND m.context_id = t.context_id
            WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s {clauses}
              AND NOT m.is_summary AND ({" OR ".join(matches)}) {bound}
            ORDER BY m.id DESC
            LIMIT %s
        ), n AS (SELECT count(*) AS found FROM c)
        SELECT n.found, r.id, r.score
        FROM n LEFT JOIN LATERAL (
            SELECT m.id, {rank} AS score
            FROM c JOIN messages m ON m.tenant = %s AND m.id = c.id
            WHERE %s OR n.found >= %s
            ORDER BY score DESC, m.id
            LIMIT %s
        ) r ON true
    """
    params = [
        *where_params,
        *match_params,
        *bound_params,
        limit,
        *rank_params,
        query.tenant,
        lowest is None,
        limit,
        query.k,
    ]
    return sql, params


class SearchMixin(PostgresBase):
    # The most matching messages a search ranks (the newest; a test lowers it).
    search_candidates: int = MAX_SEARCH_CANDIDATES

    def search_messages(self, query: SearchQuery) -> list[tuple[StoredMessage, float]]:
        limit = self.search_candidates
        try:
            with self._reading() as conn, conn.transaction():
                for setting in SEARCH_SETTINGS:
                    conn.execute(setting)
                row = conn.execute(
                    "SELECT min(id), max(id) FROM messages WHERE tenant = %s", [query.tenant]
                ).fetchone()
                if row is None or row[0] is None:
                    return []
                oldest, newest = int(row[0]), int(row[1])
                span = FIRST_SPAN_PER_CANDIDATE * limit
                while True:
                    lowest = max(oldest, newest - span + 1)
                    whole = lowest <= oldest
                    # The whole history needs no bound.
                    step, params = search_step(query, limit, None if whole else lowest)
                    ranked = conn.execute(step, params).fetchall()
                    found = int(ranked[0][0])
                    if whole or found >= limit:
                        break
                    # Widen the id range by what the matches' density so far asks for.
                    span = int(span * min(64.0, max(2.0, 1.5 * limit / max(found, 1))))
                hits = [(int(r[1]), float(r[2])) for r in ranked if r[1] is not None]
                if not hits:
                    return []
                rows = conn.execute(
                    f"""
                    SELECT {SELECT_MESSAGES}
                    FROM messages m
                    JOIN threads t ON t.tenant = m.tenant AND t.context_id = m.context_id
                    WHERE m.tenant = %s AND m.id = ANY(%s)
                    """,
                    [query.tenant, [i for i, _ in hits]],
                ).fetchall()
        except pg_errors.QueryCanceled as exc:
            raise search_timeout(SEARCH_TIMEOUT_S) from exc
        by_id = {m.id: m for m in map(message_from_row, rows)}
        return [(by_id[i], score) for i, score in hits if i in by_id]
