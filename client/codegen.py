"""Generate the client's gRPC code from proto/ under its own import name, contextd_client.v1.

Why the output is rewritten, and only its Python import lines: protoc names a generated
module after its .proto path, so `contextd/v1/context_service.proto` gives `contextd.v1`,
which is the server's package. The client's modules must live under `contextd_client.v1`
instead, yet a process may import both (the server's tests drive an in-process server with
this client): protobuf's default descriptor pool accepts a file name twice only if both
registrations are byte-identical, and rejects two different files that define the same
messages (package contextd.v1). So the .proto is compiled with the same include root and
file name as the server's, which keeps the serialized descriptor identical (both
registrations share one file descriptor and one message class per message), and only the
lines that name Python modules are rewritten: `from contextd.v1 import ...` and the module
name the builder gives the message classes. The descriptor bytes are never touched.

Used by setup.py (the wheel: generated into the build directory, never into the source
tree), by `make proto` and by the tests (the development copy in client/src, git-ignored):
    python client/codegen.py OUT_DIR [PROTO_DIR]
Needs grpcio-tools; nothing here is imported by the installed package.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "contextd_client"
SERVER_PACKAGE = "contextd"
API = "v1"

# The lines of protoc's Python output that name Python modules (never descriptor bytes).
_IMPORT = re.compile(rf"^(\s*)from {SERVER_PACKAGE}\.{API} import ", re.MULTILINE)
_BUILDER = re.compile(
    rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')({SERVER_PACKAGE}\.{API}\.)"
)


def proto_root() -> Path:
    """The directory holding contextd/v1/*.proto: the repository's proto/ beside client/, or
    the copy an sdist carries (see setup.py)."""
    for candidate in (HERE / "proto", HERE.parent / "proto"):
        if (candidate / SERVER_PACKAGE / API).is_dir():
            return candidate
    raise FileNotFoundError(f"no {SERVER_PACKAGE}/{API}/*.proto under {HERE}/proto or ../proto")


def rewrite(text: str) -> str:
    """protoc's output for contextd.v1 with its module names moved to contextd_client.v1."""
    text = _IMPORT.sub(rf"\1from {PACKAGE}.{API} import ", text)
    return _BUILDER.sub(rf"\g<1>{PACKAGE}.{API}.", text)


def generate(out_dir: Path, protos: Path | None = None) -> list[Path]:
    """Write contextd_client/v1/*_pb2*.py(i) under `out_dir`; returns the files written."""
    root = protos or proto_root()
    sources = sorted((root / SERVER_PACKAGE / API).glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files under {root}/{SERVER_PACKAGE}/{API}")
    target = out_dir / PACKAGE / API
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",  # the include root the server uses: same file names, same bytes
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            *(str(p.relative_to(root)) for p in sources),
        ]
        subprocess.run(command, check=True, cwd=root)
        generated = sorted((Path(tmp) / SERVER_PACKAGE / API).glob("*_pb2*.py*"))
        for stale in target.glob("*_pb2*.py*"):
            stale.unlink()  # a removed .proto must not leave its module behind
        written = []
        for path in generated:
            out = target / path.name
            out.write_text(rewrite(path.read_text()))
            written.append(out)
    check_runtime_floors(written)
    return written


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def check_runtime_floors(files: list[Path]) -> None:
    """Fail when the generated code needs a newer grpcio or protobuf than the package
    requires: it checks their versions at import, so such a wheel could not be imported."""
    with open(HERE / "pyproject.toml", "rb") as f:
        dependencies: list[str] = tomllib.load(f)["project"]["dependencies"]
    floors = {}
    for requirement in dependencies:
        found = re.fullmatch(r"([a-z0-9-]+)\s*>=\s*([0-9.]+)\s*(,.*)?", requirement.strip())
        if found:
            floors[found.group(1)] = _version(found.group(2))
    needs = {}
    for path in files:
        text = path.read_text()
        if found := re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", text):
            needs["grpcio"] = _version(found.group(1))
        if found := re.search(r"Protobuf Python Version: ([0-9.]+)", text):
            needs["protobuf"] = _version(found.group(1))
    for name, needed in needs.items():
        if floors.get(name, ()) < needed:
            raise RuntimeError(
                f"the generated code needs {name}>={'.'.join(map(str, needed))}; raise its "
                "floor in client/pyproject.toml or pin grpcio-tools in [build-system] lower"
            )


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python client/codegen.py OUT_DIR [PROTO_DIR]")
    paths = generate(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None)
    print("contextd_client: generated", ", ".join(p.name for p in paths))
