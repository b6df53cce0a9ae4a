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
- CJK terms (character pairs) cannot be found through the tsvector (PostgreSQL keeps a
  run of CJK characters as one word), so each is matched as a substring (strpos) of the
  content and tool_calls, and each one a message holds adds 0.1 to its rank. Such a
  search reads every message of the scope (or thread or window) rather than the index.
- Work is bounded by a statement timeout (SEARCH_TIMEOUT after `SEARCH_TIMEOUT_S`).
"""

from __future__ import annotations

from typing import Any

from psycopg import errors as pg_errors

from contextd.adapters.postgres.base import PostgresBase
from contextd.adapters.postgres.messages import _SELECT_MESSAGES, window_predicate
from contextd.adapters.rows import message_from_row
from contextd.domain.model import StoredMessage
from contextd.domain.search import SearchQuery, is_cjk_term, search_timeout

# The most a search may take before it is cancelled (a statement timeout).
SEARCH_TIMEOUT_S = 10.0

# Rank added per CJK term a message holds (ts_rank_cd of one word is around 0.1).
CJK_TERM_RANK = 0.1


class SearchMixin(PostgresBase):
    def search_messages(self, query: SearchQuery) -> list[tuple[StoredMessage, float]]:
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
        sql = f"""
            WITH hits AS (
                SELECT m.tenant, m.id, {rank} AS score
                FROM threads t JOIN messages m
                  ON m.tenant = t.tenant AND m.context_id = t.context_id
                WHERE t.tenant = %s AND t.agent = %s AND t.scope = %s {clauses}
                  AND NOT m.is_summary AND ({" OR ".join(matches)})
                ORDER BY score DESC, m.id
                LIMIT %s
            )
            SELECT {_SELECT_MESSAGES}, h.score
            FROM hits h
            JOIN messages m ON m.tenant = h.tenant AND m.id = h.id
            JOIN threads t ON t.tenant = m.tenant AND t.context_id = m.context_id
            ORDER BY h.score DESC, h.id
        """
        params = [*rank_params, *where_params, *match_params, query.k]
        try:
            with self._reading() as conn, conn.transaction():
                conn.execute(f"SET LOCAL statement_timeout = {int(SEARCH_TIMEOUT_S * 1000)}")
                rows = conn.execute(sql, params).fetchall()
        except pg_errors.QueryCanceled as exc:
            raise search_timeout(SEARCH_TIMEOUT_S) from exc
        return [(message_from_row(r[:-1]), float(r[-1])) for r in rows]
