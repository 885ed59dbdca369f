"""Builds castore's one optional extension, castore.format._b3tree (castore/native/b3tree.c).

Everything else about the package is in pyproject.toml. The extension is compiled from
the BLAKE3 team's C implementation, which tools/blake3_sources.sh puts in build/blake3-c/
(the Makefile runs it before installing). Without those sources, or where the build
fails, castore installs without the extension and works as before: a read of part of a
chunk then reads and verifies the whole chunk (docs/FORMAT.md, "Chunk pieces").
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = os.path.join("build", "blake3-c")


def _extension() -> list[Extension]:
    if not os.path.exists(os.path.join(HERE, SOURCES, "blake3.c")):
        print("castore: no BLAKE3 C sources in build/blake3-c: building without the extension")
        return []
    sources = [
        "castore/native/b3tree.c",
        f"{SOURCES}/blake3_dispatch.c",
        f"{SOURCES}/blake3_portable.c",
    ]
    machine = platform.machine().lower()
    macros: list[tuple[str, str | None]] = []
    if machine in ("x86_64", "amd64") and sys.platform != "win32":
        sources += [
            f"{SOURCES}/blake3_{kind}_x86-64_unix.S" for kind in ("sse2", "sse41", "avx2", "avx512")
        ]
    elif machine in ("aarch64", "arm64"):
        sources.append(f"{SOURCES}/blake3_neon.c")
        macros.append(("BLAKE3_USE_NEON", "1"))
    else:
        macros += [(f"BLAKE3_NO_{kind}", None) for kind in ("SSE2", "SSE41", "AVX2", "AVX512")]
    return [
        Extension(
            "castore.format._b3tree",
            sources=sources,
            include_dirs=[SOURCES],
            define_macros=macros,
            extra_compile_args=["-O3"],
        )
    ]


class OptionalBuildExt(build_ext):
    """Assembles blake3's .S kernels, and installs castore without the extension if it fails."""

    def build_extensions(self) -> None:
        self.compiler.src_extensions.append(".S")
        super().build_extensions()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # a missing compiler, an unexpected blake3 version
            print(f"castore: building castore.format._b3tree failed ({exc}); installing without it")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"castore: building {ext.name} failed ({exc}); installing without it")


setup(ext_modules=_extension(), cmdclass={"build_ext": OptionalBuildExt})
