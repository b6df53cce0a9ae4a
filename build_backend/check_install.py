"""`make check-install`'s last step: does an installed contextd serve? Run by the venv's python.

The Makefile builds an sdist and a wheel from it, installs the wheel into a fresh venv and
runs this file with that venv's interpreter, from outside the source tree and without
PYTHONPATH, so that everything imported here comes from the installed package. It starts the
`contextd` console script on a free port, asks health and reflection through that port, and
stops it with SIGTERM, expecting a clean exit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import contextd
from contextd.v1 import context_service_pb2, context_service_pb2_grpc

START_SECONDS = 120


def main() -> int:
    installed = Path(contextd.__file__).resolve()
    if "site-packages" not in installed.parts:
        print(f"check-install: contextd was imported from {installed}, not the venv")
        return 1
    service = context_service_pb2.DESCRIPTOR.services_by_name["ContextService"].full_name
    assert context_service_pb2_grpc.__name__.endswith("_pb2_grpc")
    command = Path(sys.executable).with_name("contextd")
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(command), "serve", "--addr", "127.0.0.1:0", "--data-dir", f"{tmp}/data"],
                stderr=log,
                stdout=subprocess.DEVNULL,
            )
        try:
            port = wait_for_port(proc, log_path)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=30
                )
                if health.status != health_pb2.HealthCheckResponse.SERVING:
                    raise SystemExit(f"check-install: health says {health}")
                listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
                )
                names = [s.name for r in listing for s in r.list_services_response.service]
                if service not in names:
                    raise SystemExit(f"check-install: reflection lists {names}")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if code != 0:
            print(log_path.read_text())
            print(f"check-install: contextd serve exited with {code} after SIGTERM")
            return 1
    print(f"check-install: {installed.parent} served {service} on port {port} and stopped")
    return 0


def wait_for_port(proc: subprocess.Popen[bytes], log_path: Path) -> int:
    """The port from the "contextd serving" line; fails if the server exits or stays silent."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if '"contextd serving"' in line:
                return int(json.loads(line)["port"])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise SystemExit("check-install: contextd serve did not start:\n" + log_path.read_text())


if __name__ == "__main__":
    sys.exit(main())
