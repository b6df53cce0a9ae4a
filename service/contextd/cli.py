"""The `contextd` command: `contextd serve` runs the server; `contextd keys` manages API
keys; `context`, `settings`, `messages`, `agents` and `build` are the client verbs (see
contextd.commands), which mirror an agent's chat-style commands over gRPC."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from contextd import __version__
from contextd.commands import CLIENT_COMMANDS, add_client_commands, run_client_command
from contextd.config import add_serve_arguments, settings_from_args
from contextd.domain.errors import StoreLocked, StoreUnavailable
from contextd.keys_cli import add_key_commands, run_key_command
from contextd.logs import configure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="contextd", description="Context management for LLM agents, over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"contextd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the gRPC server")
    add_serve_arguments(serve_parser)
    add_key_commands(commands)
    add_client_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "keys":
        return run_key_command(args)
    if args.command in CLIENT_COMMANDS:
        return run_client_command(args)

    if args.command == "serve":
        settings = settings_from_args(args)
        configure(settings.log_level, settings.log_format)
        from contextd.api.server import serve  # imported late: needs the generated code

        try:
            serve(settings)
        except (StoreLocked, StoreUnavailable, OSError, ValueError) as exc:
            # a held file, an unreachable database, a taken address, a bad TLS file
            print(f"contextd: cannot start: {exc}", file=sys.stderr)
            return 2
        exit_now(0)
    return 0


def exit_now(code: int) -> NoReturn:
    """Leave the process after a completed shutdown, skipping interpreter finalization.

    By now every call is drained and the store is checkpointed and closed, so nothing is
    left to save. What finalization would still do is stop the threads that native
    libraries (gRPC's core, DuckDB) keep: CPython 3.11 ends a daemon thread that wakes
    during finalization with a forced unwind, and a C++ ``catch (...)`` on its stack turns
    that into ``terminate`` (SIGABRT, "FATAL: exception not rethrown"), about once in 40
    stops here. A server should exit with the status its shutdown earned, so logs are
    flushed and the process leaves directly.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
