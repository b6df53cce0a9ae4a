"""The `contextd` client verbs: the chat-style commands of an agent, over gRPC.

    contextd context clear|save|history|restore|stats
    contextd settings get|set
    contextd messages [--all] [--follow]
    contextd messages search QUERY [--all] [-k N]
    contextd agents list|create|delete
    contextd build

Each talks to a server (`--server`, `--api-key`, `--tls-ca`, or CONTEXTD_SERVER,
CONTEXTD_API_KEY, CONTEXTD_TLS_CA) through the `contextd-client` package, prints tables
(rich) or, with `--json`, JSON for scripts, and fails with one line on stderr and a
non-zero status: 1 when the server refused or could not be reached, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contextd.config import DEFAULT_ADDR

if TYPE_CHECKING:
    from contextd_client import Client

EXIT_REFUSED = 1
EXIT_USAGE = 2

_EXAMPLES = {
    "context clear": "contextd context clear --agent demo --thread t1",
    "context save": 'contextd context save --agent demo --description "before the refactor"',
    "context history": "contextd context history --agent demo",
    "context restore": "contextd context restore 01J9Z3 --agent demo",
    "context stats": "contextd context stats --agent demo --thread t1",
    "settings get": "contextd settings get --agent demo",
    "settings set": "contextd settings set --agent demo --model gpt-4o --rolling-window 12h",
    "messages": "contextd messages --agent demo --thread t1 --follow; "
    'contextd messages search "deploy timeout" --agent demo --all',
    "agents list": "contextd agents list",
    "agents create": "contextd agents create demo --system-prompt-file prompt.md",
    "agents delete": "contextd agents delete demo",
    "build": "contextd build --agent demo --thread t1 --format anthropic",
}
_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> timedelta:
    """argparse type: 90, 90s, 15m, 12h, 7d."""
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a duration like 90s, 15m or 12h")
    return timedelta(seconds=int(match.group(1)) * _UNITS[match.group(2)])


def _verb(
    group: Any, name: str, help_text: str, full: str, *, context: bool = True, agent: bool = True
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = group.add_parser(
        name,
        help=help_text,
        description=help_text,
        epilog=f"example: {_EXAMPLES[full]}",
    )
    connection = parser.add_argument_group("server")
    connection.add_argument(
        "--server",
        default=os.environ.get("CONTEXTD_SERVER", DEFAULT_ADDR),
        help="host:port (env CONTEXTD_SERVER; default %(default)s)",
    )
    connection.add_argument(
        "--api-key", default=os.environ.get("CONTEXTD_API_KEY"), help="env CONTEXTD_API_KEY"
    )
    connection.add_argument(
        "--tls-ca",
        default=os.environ.get("CONTEXTD_TLS_CA"),
        help="PEM file of the CA that signed the server's certificate: use TLS",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    if agent:
        parser.add_argument("--agent", required=True, help="the agent's name")
    if context:
        parser.add_argument(
            "--scope",
            default="",
            help="guild:G/channel:C/user:U, dm:U, or a key (default: the agent's own scope)",
        )
        parser.add_argument("--thread", default="", help="the thread (default: main)")
    return parser


def add_client_commands(commands: Any) -> None:
    """The client verbs, beside `serve` and `keys`."""
    context = commands.add_parser("context", help="clear, save, restore a context; its stats")
    verbs = context.add_subparsers(dest="verb", required=True)
    clear = _verb(verbs, "clear", "start the window afresh (deletes nothing)", "context clear")
    clear.add_argument(
        "--all-scopes", action="store_true", help="clear the whole agent, every scope"
    )
    save = _verb(verbs, "save", "save the window as a snapshot (does not clear)", "context save")
    save.add_argument("--description", default="")
    _verb(verbs, "history", "list the saved snapshots, newest first", "context history")
    restore = _verb(
        verbs, "restore", "bring a snapshot's messages back into the window", "context restore"
    )
    restore.add_argument("snapshot_id")
    restore.add_argument(
        "--into-thread", default="", help="restore into this new thread instead (a branch)"
    )
    _verb(verbs, "stats", "message and token counts of the window and history", "context stats")

    settings = commands.add_parser("settings", help="read or change an agent's settings")
    setting_verbs = settings.add_subparsers(dest="verb", required=True)
    _verb(setting_verbs, "get", "show the agent's settings", "settings get", context=False)
    setter = _verb(setting_verbs, "set", "change settings", "settings set", context=False)
    setter.add_argument("--rolling-window", type=duration, help="e.g. 24h")
    setter.add_argument("--model", help="a model of the registry, e.g. gpt-4o")
    setter.add_argument("--system-prompt-file", type=Path, help="file holding the prompt")
    setter.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a build option, e.g. budget_tokens=8000 or summarize=true (repeatable)",
    )

    messages = _verb(
        commands, "messages", "list a thread's messages, or search the scope's", "messages"
    )
    messages.add_argument(
        "action",
        nargs="?",
        choices=["list", "search"],
        default="list",
        help="list (default) or search: the messages best matching QUERY, best first",
    )
    messages.add_argument("query", nargs="?", default="", help="what to search for")
    messages.add_argument("--all", action="store_true", help="the whole history, not the window")
    messages.add_argument(
        "--follow", action="store_true", help="keep printing new messages (Ctrl-C stops)"
    )
    messages.add_argument(
        "-k", type=int, default=0, help="search: how many hits at most (default 10, max 100)"
    )

    agents = commands.add_parser("agents", help="list, create, delete agents")
    agent_verbs = agents.add_subparsers(dest="verb", required=True)
    _verb(agent_verbs, "list", "list the agents", "agents list", context=False, agent=False)
    create = _verb(
        agent_verbs, "create", "create an agent", "agents create", context=False, agent=False
    )
    create.add_argument("name")
    create.add_argument("--system-prompt-file", type=Path)
    create.add_argument("--model", default="")
    create.add_argument("--rolling-window", type=duration)
    delete = _verb(
        agent_verbs,
        "delete",
        "delete an agent and all it holds",
        "agents delete",
        context=False,
        agent=False,
    )
    delete.add_argument("name")

    build = _verb(commands, "build", "print the context an LLM call would get", "build")
    build.add_argument(
        "--format",
        choices=["text", "anthropic", "openai"],
        default="text",
        help="the rendering to print (default text)",
    )
    build.add_argument("--message", default="", help="the new user message (not stored)")
    build.add_argument("--model", default="", help="count for this model (default: the agent's)")
    build.add_argument("--budget", type=int, help="token budget (default: the model's)")


CLIENT_COMMANDS = ("context", "settings", "messages", "agents", "build")


def _scope(text: str) -> Any:
    """A --scope value as the client's typed scope (None: the agent's own)."""
    from contextd_client import ChannelScope, DirectMessageScope, KeyScope

    if not text:
        return None
    if text.startswith("guild:"):
        parts = dict(p.split(":", 1) for p in text.split("/") if ":" in p)
        if set(parts) != {"guild", "channel", "user"}:
            raise ValueError("a channel scope is guild:G/channel:C/user:U")
        return ChannelScope(parts["guild"], parts["channel"], parts["user"])
    if text.startswith("dm:"):
        return DirectMessageScope(text[3:])
    return KeyScope(text)


def _plain(value: Any) -> Any:
    """A client result as JSON-ready data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


class Output:
    """Tables for people (rich), JSON for scripts."""

    def __init__(self, as_json: bool) -> None:
        from rich.console import Console

        self.as_json = as_json
        self.console = Console(highlight=False, soft_wrap=True)

    def data(self, value: Any) -> None:
        print(json.dumps(_plain(value), ensure_ascii=False))

    def table(self, title: str, columns: list[str], rows: Iterable[list[Any]]) -> None:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*(str(v) for v in row))
        self.console.print(table)

    def line(self, text: str) -> None:
        self.console.print(text, markup=False)

    def working(self, text: str) -> Any:
        """A spinner while a long call runs (people only, never in JSON)."""
        import contextlib

        if self.as_json or not sys.stdout.isatty():
            return contextlib.nullcontext()
        return self.console.status(text)


def _options(pairs: list[str]) -> Any:
    from contextd_client import BuildOptions

    fields = {f.name: f for f in dataclasses.fields(BuildOptions)}
    values: dict[str, Any] = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        if name not in fields or not raw:
            raise ValueError(
                f"--option {pair[:40]!r}: expected NAME=VALUE with NAME one of "
                f"{', '.join(sorted(fields))}"
            )
        kind = str(fields[name].type)
        if "bool" in kind:
            values[name] = raw.lower() in ("1", "true", "yes", "on")
        elif "float" in kind:
            values[name] = float(raw)
        else:
            values[name] = int(raw)
    return BuildOptions(**values)


def _search(client: Client, args: argparse.Namespace, out: Output) -> int:
    from contextd_client import MessageRange

    found = client.search_messages(
        agent=args.agent,
        query=args.query,
        scope=_scope(args.scope),
        thread=args.thread,
        range=MessageRange.ALL if args.all else MessageRange.WINDOW,
        k=args.k,
    )
    if out.as_json:
        for hit in found.hits:
            out.data(hit)
        return 0
    out.table(
        f"{args.agent}: {args.query[:60]}",
        ["score", "thread", "#", "time", "role", "snippet"],
        (
            [
                f"{h.score:.3f}",
                h.message.thread,
                h.message.sequence,
                _when(h.message.create_time),
                h.message.role.name.lower(),
                h.marked("«", "»"),
            ]
            for h in found.hits
        ),
    )
    return 0


def _messages(client: Client, args: argparse.Namespace, out: Output) -> int:
    from contextd_client import MessageRange

    if args.action == "search":
        return _search(client, args, out)
    ranged = MessageRange.ALL if args.all else MessageRange.WINDOW
    scope = _scope(args.scope)

    def listing(after: int) -> list[Any]:
        found = client.list_messages(
            agent=args.agent, scope=scope, thread=args.thread, range=ranged
        )
        return [m for m in found if m.sequence > after or not args.thread]

    shown = listing(0)
    if out.as_json:
        for m in shown:
            out.data(m)
    else:
        out.table(
            f"{args.agent} / {args.thread or 'main'}",
            ["#", "time", "role", "content"],
            (
                [m.sequence, _when(m.create_time), m.role.name.lower(), m.content[:200]]
                for m in shown
            ),
        )
    last = max((m.sequence for m in shown), default=0)
    seen = {m.id for m in shown}
    while args.follow:
        time.sleep(1.0)
        for m in listing(last):
            if m.id in seen:
                continue
            seen.add(m.id)
            last = max(last, m.sequence)
            if out.as_json:
                out.data(m)
            else:
                out.line(
                    f"{m.sequence:>5} {_when(m.create_time)} {m.role.name.lower():<11} {m.content}"
                )
    return 0


def _settings_get(client: Client, args: argparse.Namespace, out: Output) -> int:
    agent = client.get_agent(name=args.agent)
    if out.as_json:
        out.data(agent)
        return 0
    options = {k: v for k, v in _plain(agent.build_options).items() if v is not None}
    window = agent.rolling_window.total_seconds() if agent.rolling_window else 0
    out.table(
        f"agent {agent.name}",
        ["setting", "value"],
        [
            ["model", agent.model or "(none: estimates)"],
            ["rolling window", f"{window:g} s"],
            ["system prompt", agent.system_prompt[:120] or "(empty)"],
            ["docs", ", ".join(d.name for d in agent.docs) or "(none)"],
            ["build options", json.dumps(options) if options else "(defaults)"],
            ["etag", agent.etag],
        ],
    )
    return 0


def _settings_set(client: Client, args: argparse.Namespace, out: Output) -> int:
    changes: dict[str, Any] = {}
    if args.rolling_window is not None:
        changes["rolling_window"] = args.rolling_window
    if args.model is not None:
        changes["model"] = args.model
    if args.system_prompt_file is not None:
        changes["system_prompt"] = args.system_prompt_file.read_text()
    if args.option:
        changes["build_options"] = _options(args.option)
    if not changes:
        raise ValueError("nothing to change: give --model, --rolling-window, ... (see --help)")
    agent = client.update_agent(name=args.agent, **changes)
    if out.as_json:
        out.data(agent)
    else:
        out.line(f"updated {agent.name}: {', '.join(sorted(changes))}")
    return 0


def _context(client: Client, args: argparse.Namespace, out: Output) -> int:
    scope = _scope(args.scope)
    if args.verb == "clear":
        marker = client.clear_context(
            agent=args.agent, scope=scope, thread=args.thread, all_scopes=args.all_scopes
        )
        if out.as_json:
            out.data({"clear_time": marker})
        else:
            out.line(f"cleared at {_when(marker)} (nothing deleted; the window starts now)")
        return 0
    if args.verb == "stats":
        stats = client.get_context_stats(agent=args.agent, scope=scope, thread=args.thread)
        if out.as_json:
            out.data(stats)
            return 0
        out.table(
            f"{args.agent} / {args.thread or 'every thread'}",
            ["", "messages", "tokens (estimate)"],
            [
                ["window", stats.window_message_count, stats.window_token_estimate],
                ["history", stats.total_message_count, stats.total_token_estimate],
            ],
        )
        out.line(f"window since {_when(stats.window_start_time)}; threads: {stats.thread_count}")
        if not stats.exists:
            out.line("the context is empty (never written, cleared, aged out or expired)")
        elif stats.expires_in is not None:
            out.line(f"expires in {stats.expires_in} (at {_when(stats.expire_time)})")
        return 0
    if args.verb == "save":
        with out.working("saving (the summary may take a few seconds)..."):
            snapshot = client.save_snapshot(
                agent=args.agent, scope=scope, thread=args.thread, description=args.description
            )
        if out.as_json:
            out.data(snapshot)
        else:
            out.line(f"saved snapshot {snapshot.id}: {snapshot.message_count} messages")
            out.line(f"summary: {snapshot.summary}")
        return 0
    if args.verb == "history":
        snapshots = list(client.list_snapshots(agent=args.agent, scope=scope))
        if out.as_json:
            out.data(snapshots)
            return 0
        out.table(
            f"snapshots of {args.agent}",
            ["id", "time", "messages", "description", "summary"],
            (
                [s.id, _when(s.create_time), s.message_count, s.description, s.summary[:80]]
                for s in snapshots
            ),
        )
        return 0
    # restore
    with out.working("restoring..."):
        restored = client.restore_snapshot(
            agent=args.agent, scope=scope, id=args.snapshot_id, branch_thread=args.into_thread
        )
    if out.as_json:
        out.data(restored)
    else:
        out.line(
            f"restored {restored.restored_count} messages into "
            f"{', '.join(restored.threads) or 'no thread'}"
        )
    return 0


def _agents(client: Client, args: argparse.Namespace, out: Output) -> int:
    if args.verb == "list":
        agents = list(client.list_agents())
        if out.as_json:
            out.data(agents)
        else:
            out.table(
                "agents",
                ["name", "model", "created"],
                ([a.name, a.model or "-", _when(a.create_time)] for a in agents),
            )
        return 0
    if args.verb == "create":
        fields: dict[str, Any] = {"name": args.name, "model": args.model}
        if args.system_prompt_file is not None:
            fields["system_prompt"] = args.system_prompt_file.read_text()
        if args.rolling_window is not None:
            fields["rolling_window"] = args.rolling_window
        agent = client.create_agent(**fields)
        if out.as_json:
            out.data(agent)
        else:
            out.line(f"created agent {agent.name}")
        return 0
    deleted = client.delete_agent(name=args.name)
    if out.as_json:
        out.data({"deleted_message_count": deleted})
    else:
        out.line(f"deleted agent {args.name} and its {deleted} messages")
    return 0


def _build(client: Client, args: argparse.Namespace, out: Output) -> int:
    from contextd_client import BuildOptions, ContextFormat

    chosen = ContextFormat[args.format.upper()]
    options = BuildOptions(budget_tokens=args.budget) if args.budget else None
    built = client.build_context(
        agent=args.agent,
        scope=_scope(args.scope),
        thread=args.thread,
        user_message=args.message,
        model=args.model,
        options=options,
        formats=[chosen],
    )
    rendering = next((r.content for r in built.renderings if r.format == chosen), "")
    if out.as_json:
        out.data({"rendering": rendering, "stats": built.stats})
    else:
        print(rendering)
        stats = built.stats
        print(
            f"-- {stats.total_tokens} of {stats.budget_tokens} tokens ({stats.tokenizer}), "
            f"{stats.messages_after} of {stats.messages_before} messages, {stats.strategy}",
            file=sys.stderr,
        )
    return 0


_RUNNERS: dict[str, Callable[[Client, argparse.Namespace, Output], int]] = {
    "context": _context,
    "messages": _messages,
    "agents": _agents,
    "build": _build,
}


def run_client_command(args: argparse.Namespace) -> int:
    """Run one client verb; every failure is one line on stderr and a non-zero status."""
    name = f"contextd {args.command}" + (f" {args.verb}" if getattr(args, "verb", None) else "")
    try:
        import grpc

        from contextd_client import Client, ContextdError, Unavailable
    except ImportError:
        print(
            f"{name}: the client package is not installed (pip install ./client, or make build)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    tls: Any = None
    try:
        if args.tls_ca:
            tls = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
        out = Output(args.json)
        with Client(args.server, api_key=args.api_key, tls=tls, timeout=60.0) as client:
            if args.command == "settings":
                run = _settings_get if args.verb == "get" else _settings_set
                return run(client, args, out)
            return _RUNNERS[args.command](client, args, out)
    except Unavailable as exc:
        print(f"{name}: cannot reach the server at {args.server}: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED
    except ContextdError as exc:
        reason = f" ({exc.reason})" if exc.reason else ""
        print(f"{name}: {exc.message}{reason}", file=sys.stderr)
        return EXIT_REFUSED
    except (ValueError, OSError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: still one line (and a status) rather than a trace
        print(f"{name}: unexpected error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
