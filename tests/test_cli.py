"""The `contextd` command line's client verbs, run as processes against a real server.

Every test runs on both engines (the `server` fixture): the command line talks gRPC
through the client package, prints tables or JSON, and fails with one line and a non-zero
status, never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Client, InProcessServer


def _run(
    server: InProcessServer, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "contextd", *args, "--server", server.client.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


def _json(server: InProcessServer, *args: str) -> Any:
    return json.loads(_run(server, *args, "--json").stdout)


def test_agents_and_settings(server: InProcessServer, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.md"
    prompt.write_text("You are terse.")
    created = _json(server, "agents", "create", "demo", "--system-prompt-file", str(prompt))
    assert created["name"] == "demo" and created["system_prompt"] == "You are terse."
    assert [a["name"] for a in _json(server, "agents", "list")] == ["demo"]
    _run(
        server,
        "settings",
        "set",
        "--agent",
        "demo",
        "--model",
        "gpt-4o",
        "--rolling-window",
        "12h",
        "--option",
        "budget_tokens=8000",
        "--option",
        "summarize=false",
    )
    settings = _json(server, "settings", "get", "--agent", "demo")
    assert settings["model"] == "gpt-4o"
    assert settings["rolling_window"] == 12 * 3600
    assert settings["build_options"]["budget_tokens"] == 8000
    assert settings["build_options"]["summarize"] is False
    table = _run(server, "settings", "get", "--agent", "demo").stdout
    assert "gpt-4o" in table and "43200" in table
    gone = _json(server, "agents", "delete", "demo")
    assert gone == {"deleted_message_count": 0}
    assert _json(server, "agents", "list") == []


def test_messages_clear_stats_and_build(server: InProcessServer, client: Client) -> None:
    client.append("demo", "What is 2 + 2?", thread="t1")
    client.append("demo", "4", thread="t1", role=2)
    lines = _run(server, "messages", "--agent", "demo", "--thread", "t1", "--json").stdout
    contents = [json.loads(line)["content"] for line in lines.splitlines()]
    assert contents == ["What is 2 + 2?", "4"]
    table = _run(server, "messages", "--agent", "demo", "--thread", "t1").stdout
    assert "What is 2 + 2?" in table and "assistant" in table
    built = _run(
        server, "build", "--agent", "demo", "--thread", "t1", "--message", "And 3 + 3?"
    ).stdout
    assert "What is 2 + 2?" in built and "And 3 + 3?" in built
    anthropic = _json(server, "build", "--agent", "demo", "--thread", "t1", "--format", "anthropic")
    assert json.loads(anthropic["rendering"])["messages"][0]["role"] == "user"
    stats = _json(server, "context", "stats", "--agent", "demo", "--thread", "t1")
    assert (stats["window_message_count"], stats["total_message_count"]) == (2, 2)
    assert stats["exists"] and stats["expires_in"] is None  # kept indefinitely by default
    _run(server, "context", "clear", "--agent", "demo", "--thread", "t1")
    stats = _json(server, "context", "stats", "--agent", "demo", "--thread", "t1")
    assert (stats["window_message_count"], stats["total_message_count"]) == (0, 2)
    assert not stats["exists"]
    shown = _run(server, "context", "stats", "--agent", "demo", "--thread", "t1").stdout
    assert "the context is empty" in shown
    everything = _run(server, "messages", "--agent", "demo", "--thread", "t1", "--all", "--json")
    assert len(everything.stdout.splitlines()) == 2  # clears delete nothing


def test_save_history_restore(server: InProcessServer, client: Client) -> None:
    client.append("demo", "first", "second", thread="t1")
    saved = _json(
        server, "context", "save", "--agent", "demo", "--thread", "t1", "--description", "v1"
    )
    assert saved["message_count"] == 2 and saved["description"] == "v1"
    assert saved["summary"]  # written by the API or the fallback, never empty here
    history = _json(server, "context", "history", "--agent", "demo")
    assert [s["id"] for s in history] == [saved["id"]]
    _run(server, "context", "clear", "--agent", "demo", "--thread", "t1")
    restored = _json(server, "context", "restore", saved["id"], "--agent", "demo")
    assert restored["restored_count"] == 2 and restored["threads"] == ["t1"]
    assert client.contents(client.window("demo")) == ["first", "second"]
    branch = _json(
        server, "context", "restore", saved["id"], "--agent", "demo", "--into-thread", "b1"
    )
    assert branch["threads"] == ["b1"]


def test_failures_are_one_line_with_a_status(server: InProcessServer) -> None:
    missing = _run(server, "settings", "get", "--agent", "nope", check=False)
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "contextd settings get: agent 'nope' does not exist (AGENT_NOT_FOUND)"
    )
    unknown_snapshot = _run(server, "context", "restore", "zzz", "--agent", "nope", check=False)
    assert unknown_snapshot.returncode == 1 and len(unknown_snapshot.stderr.splitlines()) == 1
    bad = _run(server, "settings", "set", "--agent", "x", "--option", "nope=1", check=False)
    assert bad.returncode == 2 and "expected NAME=VALUE" in bad.stderr
    usage = _run(server, "settings", "set", "--agent", "x", "--rolling-window", "soon", check=False)
    assert usage.returncode == 2 and "is not a duration" in usage.stderr


def test_a_server_that_is_down_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextd", "agents", "list", "--server", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "cannot reach the server at 127.0.0.1:1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "verb",
    [
        ["context", "clear"],
        ["context", "save"],
        ["context", "history"],
        ["context", "restore"],
        ["context", "stats"],
        ["settings", "get"],
        ["settings", "set"],
        ["messages"],
        ["agents", "list"],
        ["agents", "create"],
        ["agents", "delete"],
        ["build"],
        ["keys", "create"],
    ],
)
def test_every_verb_has_help_with_an_example(verb: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextd", *verb, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert "example: contextd " + " ".join(verb) in done.stdout


def test_messages_follow_prints_new_messages(server: InProcessServer, client: Client) -> None:
    client.append("demo", "already there", thread="t1")
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "contextd",
            "messages",
            "--agent",
            "demo",
            "--thread",
            "t1",
            "--follow",
            "--json",
            "--server",
            server.client.address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None
        first = json.loads(follower.stdout.readline())
        assert first["content"] == "already there"
        client.append("demo", "appended later", thread="t1")
        deadline = time.monotonic() + 30
        later = json.loads(follower.stdout.readline())
        assert time.monotonic() < deadline
        assert later["content"] == "appended later"
    finally:
        follower.kill()
        follower.communicate(timeout=30)


def test_messages_search(server: InProcessServer, client: Client) -> None:
    """`contextd messages search` goes through the typed client's search_messages: best
    match first, whole history with --all, the match marked in the table."""
    client.append("demo", "the deploy timed out at 03:00", thread="t1")
    client.append("demo", "lunch at noon", "deploy again after the timeout fix", thread="t2")
    _run(server, "context", "clear", "--agent", "demo", "--thread", "t1")
    window = _run(server, "messages", "search", "deploy timeout", "--agent", "demo", "--json")
    hits = [json.loads(line) for line in window.stdout.splitlines()]
    assert [h["message"]["content"] for h in hits] == ["deploy again after the timeout fix"]
    everything = _run(
        server, "messages", "search", "deploy timeout", "--agent", "demo", "--all", "--json"
    )
    found = [json.loads(line)["message"]["content"] for line in everything.stdout.splitlines()]
    assert sorted(found) == ["deploy again after the timeout fix", "the deploy timed out at 03:00"]
    table = _run(server, "messages", "search", "lunch", "--agent", "demo").stdout
    assert "«lunch»" in table
