"""The `contextd` command. `contextd serve` runs the server; more subcommands will mirror
seed 000's slash commands (clear, save, history, restore) as their RPCs arrive."""

from __future__ import annotations

import argparse
import sys

from contextd import __version__
from contextd.config import add_serve_arguments, settings_from_args
from contextd.errors import StoreLocked
from contextd.logs import configure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="contextd", description="Context management for LLM agents, over gRPC."
    )
    parser.add_argument("--version", action="version", version=f"contextd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the gRPC server")
    add_serve_arguments(serve_parser)
    args = parser.parse_args(argv)

    if args.command == "serve":
        settings = settings_from_args(args)
        configure(settings.log_level, settings.log_format)
        from contextd.server import serve  # imported late: needs the generated code

        try:
            serve(settings)
        except StoreLocked as exc:
            print(f"contextd: cannot start: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"contextd: cannot start: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
