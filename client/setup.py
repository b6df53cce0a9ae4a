"""Build hooks of contextd-client: its gRPC code is generated from proto/ while building.

Generated code is never committed, so the wheel gets it from the .proto files at build
time: `build_py` copies the package as usual, then runs codegen.py into the build
directory (the source tree stays untouched; any development copy in src/ is overwritten
in the build). `sdist` carries the .proto files (under proto/) and codegen.py, so a wheel
built from the sdist generates the same code. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import codegen  # noqa: E402  (found beside this file, also inside an sdist)


class BuildPyWithGrpc(build_py):
    """build_py, then the generated gRPC modules into the build directory."""

    def run(self) -> None:
        super().run()
        if not self.dry_run:
            codegen.generate(Path(self.build_lib))


class SdistWithProto(sdist):
    """sdist, plus the .proto files the build generates from (they live outside client/)."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        source = codegen.proto_root()
        for proto in sorted((source / "contextd" / "v1").glob("*.proto")):
            dest = Path(base_dir) / "proto" / proto.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(proto, dest)


setup(cmdclass={"build_py": BuildPyWithGrpc, "sdist": SdistWithProto})
