"""Both log formats carry an event's fields: with `--addr host:0` the start line is the only
place that says which port was bound, so plain-text logs must carry it as JSON logs do."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contextd.logs import TextFormatter


def test_text_log_start_line_names_the_bound_port(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "contextd", "serve"],
        env={
            **os.environ,
            "CONTEXTD_ADDR": "127.0.0.1:0",
            "CONTEXTD_DATA_DIR": str(tmp_path / "data"),
            "CONTEXTD_LOG_FORMAT": "text",
        },
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = ""
        while "contextd serving" not in line:
            line = proc.stderr.readline()
            assert line, "server exited before serving"
        assert not line.lstrip().startswith("{"), line  # text, not JSON
        found = re.search(r" port=(\d+)(?: |$)", line)
        assert found, line
        port = int(found.group(1))
        assert port != 0
        assert " addr=127.0.0.1:0" in line
        # The port in the line is the one the server listens on.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert "shutting down signal=SIGTERM" in rest


def test_text_fields_that_hold_spaces_are_quoted() -> None:
    record = logging.LogRecord("contextd.x", logging.INFO, __file__, 1, "hello", None, None)
    record.database = "/data dir/contextd.duckdb"
    record.code = "INVALID_ARGUMENT"
    record.empty = ""
    line = TextFormatter().format(record)
    assert line.endswith(
        ' contextd.x: hello database="/data dir/contextd.duckdb" code=INVALID_ARGUMENT empty=""'
    )
