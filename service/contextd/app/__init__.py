"""The use cases, written against the ports (`contextd.ports`) only: no SQL, no gRPC.

`service` holds the calls of the API; `build/` assembles a context for one LLM call.
"""
