"""contextd's PEP 517 build backend: generate the gRPC code from proto/, then let maturin build.

Why this is hand-written: maturin builds the Rust extension and packs `service/`, but the
gRPC code in `service/contextd/v1/*_pb2*.py(i)` is generated from proto/ and never
committed, and maturin has no hook to run a generator first. Without this step, `pip install .`
gave a package whose server failed at import. So every hook that makes a wheel first runs
grpc_tools' protoc (the same command as `make proto`), then hands over to maturin; every
other hook is maturin's own. An sdist carries proto/ and this file rather than generated
code, so a wheel built from it generates the code the same way.

The generated code checks at import that the installed grpcio and protobuf are at least the
versions that generated it. pyproject.toml therefore pins grpcio-tools exactly in
[build-system] and keeps the runtime floors of grpcio and protobuf at its versions; this
module refuses to build a wheel when the two disagree, rather than ship one that cannot import.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import maturin  # type: ignore[import-untyped]  # maturin ships no type information

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "service"
GENERATED = OUT_DIR / "contextd" / "v1"

ConfigSettings = Mapping[str, Any] | None

# maturin warns when build-backend is not "maturin"; here it is maturin, one step removed.
os.environ.setdefault("MATURIN_NO_MISSING_BUILD_BACKEND_WARNING", "1")


def generate_grpc_code() -> None:
    """Run protoc on proto/contextd/v1/*.proto into service/, then check the versions."""
    protos = sorted(PROTO_DIR.glob("contextd/v1/*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_DIR}/contextd/v1")
    for stale in GENERATED.glob("*_pb2*.py*"):
        stale.unlink()  # a proto file that was removed must not leave its module behind
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        *(str(p) for p in protos),
    ]
    print("contextd: generating the gRPC code:", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    check_runtime_floors()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _floor(dependencies: list[str], name: str) -> tuple[int, ...]:
    for requirement in dependencies:
        found = re.fullmatch(rf"{name}\s*>=\s*([0-9.]+)\s*(,.*)?", requirement.strip())
        if found:
            return _version(found.group(1))
    raise RuntimeError(f"pyproject.toml: no `{name}>=` floor in [project] dependencies")


def check_runtime_floors() -> None:
    """Fail when the generated code needs a newer grpcio or protobuf than the package requires."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies: list[str] = tomllib.load(f)["project"]["dependencies"]
    needs: dict[str, tuple[int, ...]] = {}
    for module in sorted(GENERATED.glob("*_pb2_grpc.py")):
        found = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", module.read_text())
        if found:
            needs["grpcio"] = _version(found.group(1))
    for module in sorted(GENERATED.glob("*_pb2.py")):
        found = re.search(r"Protobuf Python Version: ([0-9.]+)", module.read_text())
        if found:
            needs["protobuf"] = _version(found.group(1))
    for name, needed in needs.items():
        floor = _floor(dependencies, name)
        if floor < needed:
            shown = ".".join(map(str, needed))
            raise RuntimeError(
                f"the generated gRPC code needs {name}>={shown} but pyproject.toml requires "
                f"{name}>={'.'.join(map(str, floor))}: raise the floor, or pin grpcio-tools "
                "in [build-system] to the version the floors were set for"
            )


def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    generate_grpc_code()
    return str(maturin.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    # An editable install imports service/ in place, so the code is generated there too.
    generate_grpc_code()
    return str(maturin.build_editable(wheel_directory, config_settings, metadata_directory))


def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    return str(maturin.build_sdist(sdist_directory, config_settings))


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    return list(maturin.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings: ConfigSettings = None) -> list[str]:
    return list(maturin.get_requires_for_build_editable(config_settings))


def get_requires_for_build_sdist(config_settings: ConfigSettings = None) -> list[str]:
    return list(maturin.get_requires_for_build_sdist(config_settings))


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: ConfigSettings = None
) -> str:
    return str(maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings))
