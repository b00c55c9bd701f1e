#!/usr/bin/env python3
"""Cross-compile the patched runtime for aarch64 Linux and cache it: the llama_cpp package (pure Python plus
its shared libraries) that `make test-arm` runs under qemu-user.

The same sdist, series and CMake flags as patches/build.py (`prepare_tree`, `series`, CMAKE_ARGS, PORTABLE), so
ggml's ARM CPU variants (armv8.0_1 ... armv9.2_2) are loadable modules beside libllama, as in llama.cpp's
release builds. The compiler is Debian's clang-19 aimed at Debian's aarch64 cross toolchain (its glibc,
libstdc++ and binutils): the cross GCC 12 rejects the SME variants' -march=armv9.2-a+sme. The result is cached
under $RIVER_EDGE_CACHE/runtime/aarch64/<tag>, the tag hashing the series, the flags and the compilers, so an
unchanged series does not rebuild. Prints the package's folder (its parent goes on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import build as B   # patches/build.py, beside this file

TRIPLE = "aarch64-linux-gnu"
CC, CXX = "clang-19", "clang++-19"
# clang has no aarch64 OpenMP runtime here (libomp is not in the cross toolchain): ggml's own thread pool, as
# in Apple Silicon builds, where Apple's clang has no OpenMP either.
ARM_ARGS = ["-DGGML_OPENMP=OFF", "-DCMAKE_BUILD_TYPE=Release"]
TOOLCHAIN = f"""\
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER {CC})
set(CMAKE_C_COMPILER_TARGET {TRIPLE})
set(CMAKE_CXX_COMPILER {CXX})
set(CMAKE_CXX_COMPILER_TARGET {TRIPLE})
set(CMAKE_FIND_ROOT_PATH /usr/{TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
"""
# Debian packages the build needs (amd64): the compiler, the aarch64 glibc/libstdc++/binutils
DEBS = ["clang-19", f"gcc-{TRIPLE}", f"g++-{TRIPLE}"]


def flags(extra: list[str] = ()) -> list[str]:
    return B.CMAKE_ARGS + B.PORTABLE + ARM_ARGS + list(extra)


def tag(extra: list[str] = ()) -> str:
    h = hashlib.sha256()
    tools = B.version_lines((CC, CXX, f"{TRIPLE}-g++", f"{TRIPLE}-ld"))
    h.update(f"{B.VERSION}\n{TRIPLE}\n{tools}\n{TOOLCHAIN}\n{' '.join(flags(extra))}\n".encode())
    B.hash_series(h, list(extra))
    return h.hexdigest()[:16]


def ensure_debs() -> None:
    """As root, Debian's packages (as `make build-vulkan` does); otherwise say which are missing."""
    missing = [d for d, exe in zip(DEBS, (CC, f"{TRIPLE}-gcc", f"{TRIPLE}-g++")) if shutil.which(exe) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"install {' '.join(missing)} (Debian names) first")
    B.run_command(["apt-get", "update", "-qq"])
    B.run_command(["apt-get", "install", "-y", "-qq", *missing])


def build_aarch64(python: str = sys.executable, extra: list[str] = (), force: bool = False) -> Path:
    """The cached llama_cpp package for aarch64, built if missing."""
    ensure_debs()
    t = tag(extra)
    dest = B.runtime_cache_dir() / "aarch64" / t
    pkg = dest / "llama_cpp"
    if (pkg / "RIVER_BUILD").exists() and not force:
        return pkg
    t0 = time.monotonic()
    work = B.runtime_cache_dir() / "build" / f"aarch64-{t}"
    root = work / "src" / f"llama_cpp_python-{B.VERSION}"
    # a build that stopped after patching (interrupted, or failed late) goes on where it was
    if not (work / "patched").exists():
        shutil.rmtree(work, ignore_errors=True)
        B.prepare_tree(python, work / "src", list(extra))
        (work / "aarch64.cmake").write_text(TOOLCHAIN)
        (work / "patched").touch()
    B.run_command(["cmake", "-S", str(root), "-B", str(work / "cmake"), f"-DCMAKE_TOOLCHAIN_FILE={work / 'aarch64.cmake'}",
           f"-DSKBUILD_PLATLIB_DIR={work / 'platlib'}", *flags(extra)])
    # not a sub-make of `make test-arm`: that prints every directory the build enters
    quiet = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    B.run_command(["cmake", "--build", str(work / "cmake"), "--parallel", str(os.cpu_count() or 2)], env=quiet)
    B.run_command(["cmake", "--install", str(work / "cmake")])   # also into the tree's llama_cpp/lib
    # llama-cpp-python is pure Python over ctypes: its package from the patched tree, the libraries in it
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(root / "llama_cpp", tmp / "llama_cpp", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "llama_cpp" / "RIVER_BUILD").write_text(f"{t}\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    shutil.rmtree(work, ignore_errors=True)
    print(f"built for aarch64 in {time.monotonic() - t0:.0f} s with {os.cpu_count()} cores", flush=True)
    return pkg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="an interpreter with pip (downloads the sdist if needed)")
    ap.add_argument("--cmake-args", default="", help="extra CMake flags (part of the cache key)")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args()
    print(build_aarch64(args.python, args.cmake_args.split(), args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
