"""The gRPC edge: decode a request, call the use case, encode the answer; map errors to
statuses; assemble the server (health, reflection, signals)."""
