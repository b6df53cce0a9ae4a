"""Storage engines: each package implements the ports in `contextd.ports` over one engine."""
