"""contextd: context management for LLM agents, served over gRPC."""

__version__ = "0.1.0"
