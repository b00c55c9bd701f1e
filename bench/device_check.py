"""The device check: everything river-edge can learn from one short call on a GPU machine with many cores.

    make device-bundle      # here, with the network: what the GPU machine cannot download, into .device/
    make device-check       # there (OUT=folder): probe, runtime, CUDA invariants, modes benchmarks, one JSON

The GPU machine reaches no network and gets at most 64 MiB with the working tree, so `bundle` carries:
- the runtime: a CUDA wheel of this series when one is cached (`make build-cuda`), else the patched source
  (llama-cpp-python 0.3.36 plus patches/series, trimmed of llama.cpp's models, docs, tools and other backends),
  which `run` compiles there for the GPU it finds (ggml-cuda for that one architecture, every CPU variant) into
  .device/build, kept between calls while the machine stays warm, so a second call resumes;
- the pure wheels it lacks (gguf, diskcache), and the shapes of the zoo's models with their CPU figures.

The models themselves cannot travel (SmolLM2's file alone is 98 MB), so `run` benchmarks each at its real shape
with random weights: the same tensors, types and graph, so the same step and batch costs, and a river whose
acceptance is the random model's own. Each JSON row says so; the acceptance measured on the CPU for the real
weights is carried beside it, and the cost model turns the two into the exact mode's projected speed. The rule's
thresholds are set so its mean exit depth is the real model's. The PyTorch reference is not run there.

`run` writes $OUT/device_check.json (probe, runtime, tests, benchmarks per device and thread count, the host-side
share of an exact cycle) and $OUT/device_check.log; `python -m bench.steps report` renders a
device_check.json found in bench/results/hosts/NAME/ as that host's tables. On a machine without a GPU `run`
rehearses everything but the CUDA parts (and says so in the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "patches"))
import build as B   # noqa: E402  (patches/build.py: the series, its flags, the CUDA libraries)
BUNDLE = _ROOT / ".device"
CHECKED_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
# llama.cpp's folders the build never reads (-DLLAMA_BUILD_TOOLS=OFF etc.) and the backends it does not build
TRIM = ("models", "docs", "tools", "benches", "examples", "scripts", "conversion", "tests", "media", "gguf-py",
        *(f"ggml/src/ggml-{b}" for b in ("sycl", "hexagon", "opencl", "et", "metal", "vulkan", "cann", "musa",
                                        "kompute", "webgpu", "zdnn", "blas", "hip", "openvino", "virtgpu")))
ROOT_TRIM = (".git", "examples", "docs", "tests")   # of llama-cpp-python itself (its .git alone is 38 MB)
LIMIT = 58 << 20   # of the call's 64 MiB, the rest for the working tree


# -- here: the bundle ----------------------------------------------------------------------------------

def _cuda_wheel(arch: str) -> Path | None:
    """The wheel `make build-cuda CUDA_ARCH=arch` cached for this series, if any."""
    extra = f"-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES={arch}".split()
    found = sorted((B.runtime_cache_dir() / "wheels" / B.series_hash(extra + B.cuda_args(sys.executable, extra))).glob("*.whl"))
    return found[0] if found else None


def _shapes() -> dict:
    """Each zoo model's shape (from its GGUF header) and what the CPU measured on its real weights."""
    from river_edge import zoo
    from river_edge.gguf_tools.reader import open_gguf, value

    out = {}
    for name in CHECKED_MODELS:
        r = open_gguf(zoo.prepare(name))
        arch = value(r, "general.architecture")
        get = lambda k: value(r, f"{arch}.{k}")   # noqa: E731
        names = {t.name for t in r.tensors}
        out[name] = dict(arch=arch, n_layer=get("block_count"), n_embd=get("embedding_length"),
                         n_ff=get("feed_forward_length"), n_head=get("attention.head_count"),
                         n_head_kv=get("attention.head_count_kv"), vocab=len(value(r, "tokenizer.ggml.tokens")),
                         tie_embeddings="output.weight" not in names, cpu=_cpu_figures(name))
    return out


def _cpu_figures(model: str) -> dict:
    """Acceptance (exact) and mean exit depth (the rule) this repository measured on the real weights."""
    p = _ROOT / "bench" / "results" / f"modes_{model}.json"
    if not p.is_file():
        return {}
    d = json.loads(p.read_text())
    c = d.get("configs", {})
    return {"acceptance": c.get("exact", {}).get("acceptance_rate"), "mean_depth": c.get("river", {}).get("mean_depth"),
            "exact_ratio": c.get("exact", {}).get("ratio_median"), "host": d.get("host", {}).get("cpu", {}).get("model"),
            "threads": d.get("threads")}


def bundle(args) -> int:
    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    (BUNDLE / "wheels").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(BUNDLE / "wheels"), "gguf==0.19.0", "diskcache>=5.6.1"], check=True)
    wheel = Path(args.wheel) if args.wheel else _cuda_wheel(args.cuda_arch)
    if wheel is not None:
        shutil.copy2(wheel, BUNDLE / "wheels" / wheel.name)
    else:
        tmp = BUNDLE / "tmp"
        root = B.prepare_tree(sys.executable, tmp)
        for t in TRIM:
            shutil.rmtree(root / "vendor" / "llama.cpp" / t, ignore_errors=True)
        for t in ROOT_TRIM:
            shutil.rmtree(root / t, ignore_errors=True)
        (root / "llama_cpp" / "RIVER_BUILD").write_text(B.series_hash([]) + "+cuda\n")
        with tarfile.open(BUNDLE / "src.tar.gz", "w:gz") as tf:
            tf.add(root, arcname="llama_cpp_python")
        shutil.rmtree(tmp)
    (BUNDLE / "shapes.json").write_text(json.dumps(_shapes(), indent=1))
    size = sum(p.stat().st_size for p in BUNDLE.rglob("*") if p.is_file())
    print(f"{BUNDLE}: {size / 2**20:.1f} MiB ({'a CUDA wheel' if wheel else 'the patched source'}); "
          f"carry it: run(carry=['.device'], command='make device-check')")
    if size > LIMIT:
        print(f"over {LIMIT >> 20} MiB: the call cannot carry it", file=sys.stderr)
        return 1
    return 0


# -- there: the check ----------------------------------------------------------------------------------

def sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def cuda_lib_dirs() -> list[str]:
    """Where CUDA's libraries are: the toolkit's, and those of NVIDIA's wheels beside PyTorch."""
    dirs = [str(p.parent) for pat in ("usr/local/cuda*/lib64/libcudart.so*", "usr/local/cuda*/targets/*/lib/libcudart.so*")
            for p in sorted(Path("/").glob(pat))]
    nv = B.pip_nvidia(sys.executable)
    return list(dict.fromkeys(dirs + ([str(p.parent) for p in sorted(nv.glob("*/lib/libcu*.so*"))] if nv else [])))


def probe_machine() -> dict:
    smi = shutil.which("nvidia-smi")
    gpu = sh("nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader") if smi else ""
    where = [*cuda_lib_dirs(), "/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu"]   # the driver's: the last two
    libs = {n: next((str(p) for d in where for p in sorted(Path(d).glob(f"{n}*"))), None)
            for n in ("libcuda.so", "libcudart.so", "libcublas.so")}
    return {"gpu": gpu or None, "nvcc": sh("nvcc --version | tail -2") if shutil.which("nvcc") else None,
            "libraries": libs, "python": sys.version.split()[0], "machine": platform.machine(),
            "cpu": sh("lscpu | grep -m1 'Model name'").split(":")[-1].strip(), "cores": os.cpu_count()}


def install_runtime(log, cap: str | None) -> dict:
    """The patched llama-cpp-python and this project into .device/site: the carried wheel, or built here."""
    site = BUNDLE / "site"
    site.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
           "--upgrade", "--target", str(site)]
    t0, how = time.monotonic(), "carried wheel"
    wheels = sorted(str(p) for p in (BUNDLE / "wheels").glob("*.whl"))
    if not any("llama_cpp_python" in w for w in wheels):
        how = "built here"
        src = BUNDLE / "build" / "llama_cpp_python"
        if not src.is_dir():
            with tarfile.open(BUNDLE / "src.tar.gz") as tf:
                tf.extractall(BUNDLE / "build", filter="data")
        # SASS for the GPU found only (no PTX), no NCCL (one GPU): the least ggml-cuda to compile
        cuda = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cap}-real", "-DGGML_CUDA_NCCL=OFF"] if cap else []
        flags = B.CMAKE_ARGS + B.PORTABLE + cuda + B.cuda_args(sys.executable, cuda)
        env = dict(os.environ, CMAKE_ARGS=" ".join(flags), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2),
                   SKBUILD_BUILD_DIR=str(BUNDLE / "build" / "cmake"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(BUNDLE / "build" / "wheel"), str(src)], env=env, check=True, stdout=log, stderr=log)
        wheels += [str(p) for p in (BUNDLE / "build" / "wheel").glob("*.whl")]
    subprocess.run(pip + wheels + [str(_ROOT)], check=True, stdout=log, stderr=log)
    return {"how": how, "seconds": round(time.monotonic() - t0, 1), "cuda_arch": cap}


def child_env() -> dict:
    """The installed runtime on the path, and CUDA's libraries where the loader finds them (ggml-cuda links cudart
    and cuBLAS)."""
    ld = ":".join(dict.fromkeys(cuda_lib_dirs() + [os.environ.get("LD_LIBRARY_PATH", "")]))
    return dict(os.environ, PYTHONPATH=str(BUNDLE / "site"), PYTHONUNBUFFERED="1", LD_LIBRARY_PATH=ld.strip(":"))


def tests(log, out: Path) -> dict:
    """tests/test_device.py on CUDA: every architecture offloaded whole and three split (smollm2 needs the
    network for its model: left out)."""
    env = dict(child_env(), RIVER_TEST_DEVICE="cuda")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device.py",
                        "-k", "not smollm2", f"--junitxml={out / 'device_tests.xml'}"],
                       cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return {"returncode": r.returncode, "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bundle", help="here: write .device/ (what the GPU machine cannot download)")
    b.add_argument("--wheel", help="a CUDA wheel of this series to carry (default: the cached one, if any)")
    b.add_argument("--cuda-arch", default="90", help="the CUDA_ARCH of `make build-cuda` whose cached wheel to carry")
    r = sub.add_parser("run", help="there: the check, into --out")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device-check")))
    r.add_argument("--models", default=",".join(CHECKED_MODELS))
    r.add_argument("--threads", default="8,16", help="CPU thread counts for the CPU's modes benchmark")
    r.add_argument("--budget", type=float, default=450, help="seconds; stages that would not fit are skipped")
    r.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    if args.what == "bundle":
        return bundle(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if Path("/usr/local/cuda/bin/nvcc").exists():   # the toolkit, where images put it, if not on PATH
        os.environ["PATH"] += os.pathsep + "/usr/local/cuda/bin"
    t0 = time.monotonic()
    res = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "probe": probe_machine()}
    cap = (res["probe"]["gpu"] or "").split(",")[-1].strip().replace(".", "") or None
    with open(args.out / "device_check.log", "a") as log:
        try:
            res["runtime"] = install_runtime(log, cap)
        except (subprocess.CalledProcessError, OSError) as e:
            res["runtime"] = {"error": str(e)}
            (args.out / "device_check.json").write_text(json.dumps(res, indent=1))
            print(f"device check: no runtime ({e}); see {args.out / 'device_check.log'}", file=sys.stderr)
            return 1
        if cap:
            log.flush()
            res["tests"] = tests(log, args.out)
        else:
            res["tests"] = {"skipped": "no GPU (nvidia-smi found none)"}
        (args.out / "device_check.json").write_text(json.dumps(res, indent=1))
        # the benchmarks import the installed runtime: a child with the site on its path
        # the tree's root after the site, for bench.* (its river_edge/ lacks the installed subpackages: the site's
        # comes first); run as a file, not -m, which would put the working directory's river_edge/ first
        env = dict(child_env(), PYTHONPATH=f"{BUNDLE / 'site'}{os.pathsep}{_ROOT}")
        left = args.budget - (time.monotonic() - t0)
        r = subprocess.run([sys.executable, str(_ROOT / "bench" / "device_bench.py"), "--out", str(args.out),
                            "--models", args.models, "--threads", args.threads, "--budget", str(left),
                            "--tokens", str(args.tokens), "--shapes", str(BUNDLE / "shapes.json"),
                            *(["--gpu"] if cap else [])], env=env, stdout=log, stderr=subprocess.STDOUT)
    bench = args.out / "device_bench.json"
    res["bench"] = json.loads(bench.read_text()) if bench.is_file() else {"error": f"exit {r.returncode}"}
    bench.unlink(missing_ok=True)
    res["seconds"] = round(time.monotonic() - t0, 1)
    (args.out / "device_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("probe", "runtime", "tests")}, indent=1))
    return 0 if r.returncode == 0 and res["tests"].get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
