"""contextd's benchmark suite: ``python -m bench --size quick|full``.

Each benchmark measures contextd side by side with what an agent would otherwise use
(tiktoken, langchain, bm25s, rank_bm25, SQLite, a bare gRPC server) in the same run, on
the same deterministic corpus, and reports medians and ratios. The append and read-path
benchmarks also set contextd's PostgreSQL engine beside its default DuckDB one
(``bench.pg``). Timings never fail the run; correctness checks (equal token counts, the
same kept messages) do.
"""
