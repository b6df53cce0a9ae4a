"""The embedded engine: one DuckDB file, one writer thread with group commit."""
