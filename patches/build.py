#!/usr/bin/env python3
"""Build llama-cpp-python 0.3.36 with the river patch series applied, cache the wheel, install it.

The wheel is cached under $RIVER_EDGE_CACHE (default ~/.cache/river-edge) keyed by the hash of the
series, the build flags and the compilers (and the CPU where ggml is built natively: on Linux x86-64 and ARM
every CPU variant is in the wheel, so it travels), so an unchanged series reinstalls in seconds and an
installed build that already matches does nothing at all.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
_HERE = Path(__file__).resolve().parent
# Only what river-edge uses: the shared libraries.  No mtmd, tools, tests, examples or server.
CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # ggml's RPC backend (a small loadable module): layers of one model on other hosts' rpc-servers
    # (`river rpc-server`, RiverLlama(rpc_servers=...)).
    "-DGGML_RPC=ON",
]
# As llama.cpp's release builds: every CPU variant as a loadable module, the best one the host can run
# chosen at load (patch 0010 installs and loads them). The wheel then runs on any host of its
# architecture, and AMX, AVX512 or AVX2 kernels are used where the CPU has them.
PORTABLE = ["-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DGGML_NATIVE=OFF"]


def portable() -> bool:
    """GGML_CPU_ALL_VARIANTS covers x86-64 and ARM on Linux; elsewhere (macOS: Metal) a native build."""
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


def series(extra_cmake: list[str] = ()) -> list[tuple[Path, str]]:
    """(patch, where) in the order named by patches/series: one file name per line, then `root` for a patch
    to llama-cpp-python itself (applied at the sdist's root), else it patches the vendored llama.cpp; and
    `if=GGML_X` for a patch that only builds with that backend on (-DGGML_X=ON among the CMake flags)."""
    out = []
    for line in (_HERE / "series").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        cond = [w[3:] for w in words[1:] if w.startswith("if=")]
        if cond and f"-D{cond[0]}=ON" not in extra_cmake:
            continue
        where = [w for w in words[1:] if not w.startswith("if=")]
        out.append((_HERE / words[0], where[0] if where else "vendor/llama.cpp"))
    return out


def cpu_tag() -> str:
    if portable():
        return platform.machine()   # every CPU variant is in the wheel
    # GGML_NATIVE builds for this CPU: a cached wheel must not travel to a different one.
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}:{flags}"


def version_lines(exes) -> str:
    """Each program's first --version line (or why not): another compiler, another binary."""
    out = []
    for exe in exes:
        try:
            r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
            out.append(f"{exe}: {r.stdout.splitlines()[0] if r.stdout else r.returncode}")
        except (OSError, subprocess.TimeoutExpired):
            out.append(f"{exe}: missing")
    return "\n".join(out)


def compilers() -> str:
    """The C and C++ compilers CMake will pick."""
    return version_lines(os.environ.get(var, default) for var, default in (("CC", "cc"), ("CXX", "c++")))


def series_hash(extra_cmake: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"{VERSION}\n{sys.version_info[:2]}\n{cpu_tag()}\n{compilers()}\n".encode())
    h.update(" ".join(CMAKE_ARGS + (PORTABLE if portable() else []) + extra_cmake).encode())
    hash_series(h, extra_cmake)
    return h.hexdigest()[:16]


def code_of(patch: Path) -> bytes:
    """A patch's diff without its description: what `patch` applies, so rewording a header rebuilds nothing."""
    data = patch.read_bytes()
    at = min((i for i in (data.find(b"diff --git "), data.find(b"--- a/")) if i >= 0), default=0)
    return data[at:]


def hash_series(h, extra_cmake: list[str]) -> None:
    """Feed each patch of the series (name, where it applies, its code) into h."""
    for p, where in series(extra_cmake):
        h.update(p.name.encode() + b"\0" + where.encode() + b"\0" + code_of(p))


def runtime_cache_dir() -> Path:
    d = Path(os.environ.get("RIVER_EDGE_CACHE", Path.home() / ".cache" / "river-edge")) / "runtime"
    d.mkdir(parents=True, exist_ok=True)
    return d


def run_command(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def sdist(python: str) -> Path:
    d = runtime_cache_dir() / "sdist"
    found = list(d.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        run_command([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(d)])
        found = list(d.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    return found[0]


def prepare_tree(python: str, dest: Path, extra_cmake: list[str] = ()) -> Path:
    """Unpack the sdist into dest and apply the series to its vendored llama.cpp."""
    with tarfile.open(sdist(python)) as tf:
        tf.extractall(dest, filter="data")
    root = dest / f"llama_cpp_python-{VERSION}"
    for p, where in series(extra_cmake):
        run_command(["patch", "-p1", "--forward", "--batch", "-d", str(root if where == "root" else root / where), "-i", str(p)])
    return root


def cuda_args(python: str, extra: list[str]) -> list[str]:
    """ggml-cuda links cuBLAS. A CUDA toolkit without it (nvcc and cudart alone, as on our CI hosts) gets
    NVIDIA's own cuBLAS wheel of the same CUDA release from PyPI, unpacked into the cache, and CMake is
    pointed at it; a full toolkit needs nothing."""
    if "-DGGML_CUDA=ON" not in extra or any(a.startswith("-DCUDA_cublas_LIBRARY") for a in extra):
        return []
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("GGML_CUDA=ON needs nvcc on PATH (the CUDA toolkit)")
    root = Path(os.path.realpath(nvcc)).parent.parent
    have = lambda name: any(root.glob(f"lib*/{name}")) or any(root.glob(f"targets/*/lib/{name}")) or \
        any(root.glob(f"lib*/stubs/{name}")) or any(root.glob(f"targets/*/lib/stubs/{name}")) or \
        any(Path("/usr/lib").glob(f"*/{name}"))
    # no libcuda.so to link (no driver, no toolkit stubs): ggml's pool without the driver's virtual memory API
    vmm = [] if have("libcuda.so") else ["-DGGML_CUDA_NO_VMM=ON"]
    if have("libcublas.so*"):
        return vmm
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    release = out.split("release ")[1].split(",")[0]          # "13.0"
    dest = runtime_cache_dir() / "cuda" / f"cublas-{release}"
    installed = pip_nvidia(python)   # the one PyTorch's CUDA build brought, if any (a machine without network)
    if installed is not None and any(installed.glob(f"*/lib/libcublas.so.{release.split('.')[0]}*")):
        dest = installed.parent
    elif not (dest / "nvidia").is_dir():
        run_command([python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(dest), f"nvidia-cublas=={release}.*"])
    base = next(p.parent.parent for p in sorted(dest.glob("nvidia/*/lib/libcublas.so*")))
    lib, inc = base / "lib", base / "include"
    find = lambda name: next(iter(sorted(lib.glob(f"{name}.so*"))))
    return vmm + [f"-DCUDA_cublas_LIBRARY={find('libcublas')}", f"-DCUDA_cublasLt_LIBRARY={find('libcublasLt')}",
            f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}"]


def pip_nvidia(python: str) -> Path | None:
    """The `nvidia` folder of NVIDIA's PyPI wheels in python's environment (cuBLAS, cudart), if any."""
    out = subprocess.run([python, "-c", "import nvidia; print(list(nvidia.__path__)[0])"], capture_output=True, text=True)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def installed_tag(python: str) -> str | None:
    out = subprocess.run([python, "-c", "import llama_cpp, pathlib; "
                          "p = pathlib.Path(llama_cpp.__file__).with_name('RIVER_BUILD'); "
                          "print(p.read_text().strip() if p.exists() else '')"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--python", default=sys.executable, help="interpreter of the target environment")
    ap.add_argument("--cmake-args", default=os.environ.get("RIVER_CMAKE_ARGS", ""),
                    help="extra CMake flags, e.g. -DGGML_CUDA=ON (part of the cache key)")
    ap.add_argument("--source-only", metavar="DIR", help="only unpack and patch the tree into DIR")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--no-install", action="store_true",
                    help="build and cache the wheel only (e.g. a CUDA build on a machine without a GPU)")
    args = ap.parse_args()
    extra = args.cmake_args.split()

    if args.source_only:
        print(prepare_tree(args.python, Path(args.source_only), extra))
        return 0

    asked = " ".join(extra)
    extra += cuda_args(args.python, extra)
    tag = series_hash(extra)
    if not args.force and not args.no_install and installed_tag(args.python) == tag:
        print(f"patched llama-cpp-python {tag} already installed")
        return 0
    wheels = runtime_cache_dir() / "wheels" / tag
    if args.force or not any(wheels.glob("*.whl")):
        t0 = time.monotonic()
        # A tree and CMake build folder of their own under the cache, removed afterwards: with ccache
        # installed (ggml's GGML_CCACHE) and paths relative to this folder, a rebuild after a change to
        # the series recompiles only what the change touched.
        work = runtime_cache_dir() / "build" / tag
        shutil.rmtree(work, ignore_errors=True)
        try:
            root = prepare_tree(args.python, work / "src", extra)
            (root / "llama_cpp" / "RIVER_BUILD").write_text(tag + "\n")
            # The marker file must ship in the wheel: scikit-build-core packages llama_cpp/ whole.
            env = dict(os.environ, CMAKE_ARGS=" ".join(CMAKE_ARGS + (PORTABLE if portable() else []) + extra),
                       CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2),
                       SKBUILD_BUILD_DIR=str(work / "cmake"), CCACHE_BASEDIR=str(work), CCACHE_NOHASHDIR="1")
            out = work / "wheel"
            run_command([args.python, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(root)], env=env)
            wheels.mkdir(parents=True, exist_ok=True)
            for w in out.glob("*.whl"):
                shutil.copy2(w, wheels / w.name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"built in {time.monotonic() - t0:.0f} s with {os.cpu_count()} cores: {asked or 'CPU only'}")
    wheel = next(wheels.glob("*.whl"))
    if args.no_install:
        print(f"cached {wheel} (not installed; `make setup RIVER_CMAKE_ARGS=\"{asked}\"` installs it)")
        return 0
    run_command([args.python, "-m", "pip", "install", "--force-reinstall", "--no-deps", "-q", str(wheel)])
    # Its own small dependencies (numpy, jinja2, diskcache, typing-extensions) if missing.
    run_command([args.python, "-m", "pip", "install", "-q", "typing-extensions>=4.5.0", "numpy>=1.20.0",
         "diskcache>=5.6.1", "jinja2>=2.11.3"])
    print(f"installed patched llama-cpp-python {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
