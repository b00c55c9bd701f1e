"""The aarch64 side of `make test-arm`, all cached under $RIVER_EDGE_CACHE/arm: Debian's qemu-user, Debian's arm64
Python 3.11 unpacked into a sysroot, and PyPI's aarch64 wheels of what the tests import.

qemu-user comes from bookworm-backports where the release's own lacks `-cpu neoverse-v1` (bookworm's 7.2 does);
it is unpacked, not installed (its static binary needs nothing else). binfmt_misc is not needed: every command
runs as `qemu-aarch64 -L SYSROOT -cpu MODEL python3.11 ...`. As root the Debian side sets itself up (the arm64
architecture for dpkg, the backports source); otherwise it says what to do.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# arm64 packages of Python 3.11 and the libraries its standard modules and the runtime link
DEBS = ["libc6", "libgcc-s1", "libstdc++6", "gcc-12-base", "python3.11-minimal", "libpython3.11-minimal",
        "libpython3.11-stdlib", "libexpat1", "zlib1g", "libssl3", "libbz2-1.0", "libcrypt1", "libffi8", "liblzma5",
        "libsqlite3-0", "libuuid1", "libncursesw6", "libtinfo6", "libnsl2", "libtirpc3", "libdb5.3", "libreadline8",
        "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3", "libkrb5support0", "libcom-err2", "libkeyutils1"]
# what the runtime and the tests import, at the x86 environment's versions (pip resolves their dependencies)
WHEELS = ["numpy", "gguf", "pytest", "jinja2", "diskcache", "typing-extensions"]
PLATFORMS = ["manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"]
BACKPORTS = Path("/etc/apt/sources.list.d/river-edge-backports.sources")
QEMU_MIN = (8, 1)   # the first qemu with -cpu neoverse-v1


def cache() -> Path:
    d = Path(os.environ.get("RIVER_EDGE_CACHE", Path.home() / ".cache" / "river-edge")) / "arm"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def _root(what: str) -> None:
    if os.geteuid() != 0:
        raise SystemExit(f"make test-arm needs {what}: run it as root once, or do that by hand")


def _download(pkgs: list[str], dest: Path) -> list[Path]:
    """apt-get download into dest (apt warns that root downloads it unsandboxed: harmless here)."""
    dest.mkdir(parents=True, exist_ok=True)
    sh(["apt-get", "download", "-qq", *pkgs], cwd=dest)
    return sorted(dest.glob("*.deb"))


def _unpack(debs: list[Path], out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for deb in debs:
        sh(["dpkg-deb", "-x", str(deb), str(tmp)])
    # absolute links (/lib/ld-linux-aarch64.so.1 -> /lib/aarch64-linux-gnu/...) would leave the sysroot
    for p in tmp.rglob("*"):
        if p.is_symlink() and os.readlink(p).startswith("/"):
            target = tmp / os.readlink(p).lstrip("/")
            p.unlink()
            p.symlink_to(os.path.relpath(target, p.parent))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _qemu_versions() -> list[str]:
    out = subprocess.run(["apt-cache", "madison", "qemu-user"], capture_output=True, text=True).stdout
    return [line.split("|")[1].strip() for line in out.splitlines() if "|" in line]


def _upstream(version: str) -> tuple[int, ...]:
    m = re.match(r"(?:\d+:)?(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def qemu() -> Path:
    """qemu-aarch64 from the newest qemu-user Debian offers (backports added on bookworm)."""
    found = sorted(cache().glob("qemu-*/usr/bin/qemu-aarch64"))
    if found:
        return found[-1]
    if not any(_upstream(v) >= QEMU_MIN for v in _qemu_versions()):
        _root("bookworm-backports as an apt source (qemu-user >= 8.1)")
        codename = subprocess.run(["sh", "-c", ". /etc/os-release; echo $VERSION_CODENAME"], capture_output=True,
                                  text=True).stdout.strip()
        BACKPORTS.write_text(f"Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {codename}-backports\n"
                             "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
        sh(["apt-get", "update", "-qq"])
    version = max(_qemu_versions(), key=_upstream)
    if _upstream(version) < QEMU_MIN:
        raise SystemExit(f"no qemu-user >= {'.'.join(map(str, QEMU_MIN))} in apt's sources (found {version})")
    tmp = cache() / "qemu-download"
    shutil.rmtree(tmp, ignore_errors=True)
    debs = _download([f"qemu-user={version}"], tmp)
    out = cache() / f"qemu-{re.sub(r'[^0-9A-Za-z.+~-]', '_', version)}"
    _unpack(debs, out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out / "usr" / "bin" / "qemu-aarch64"


def sysroot() -> Path:
    """Debian's arm64 Python 3.11 and its libraries, unpacked (keyed by the exact package versions)."""
    arches = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True, text=True).stdout.split()
    if "arm64" not in arches:
        _root("dpkg --add-architecture arm64")
        sh(["dpkg", "--add-architecture", "arm64"])
        sh(["apt-get", "update", "-qq"])
    names = [f"{d}:arm64" for d in DEBS]
    r = subprocess.run(["apt-cache", "policy", *names], capture_output=True, text=True)
    if "Candidate: (none)" in r.stdout or r.returncode:
        sh(["apt-get", "update", "-qq"])
        r = subprocess.run(["apt-cache", "policy", *names], capture_output=True, text=True, check=True)
    key = hashlib.sha256(r.stdout.encode()).hexdigest()[:12]
    out = cache() / f"sysroot-{key}"
    if (out / "usr" / "bin" / "python3.11").exists():
        return out
    tmp = cache() / "debs-download"
    shutil.rmtree(tmp, ignore_errors=True)
    _unpack(_download(names, tmp), out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def site() -> Path:
    """PyPI's aarch64 wheels of WHEELS, pinned to the versions this (x86) environment has."""
    pins = [f"{w}=={md.version(w)}" for w in WHEELS]
    key = hashlib.sha256(" ".join(pins + PLATFORMS).encode()).hexdigest()[:12]
    out = cache() / f"site-{key}"
    if (out / ".complete").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    sh([sys.executable, "-m", "pip", "install", "-q", "--target", str(out), "--only-binary=:all:", "--python-version",
        "3.11", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], *pins])
    (out / ".complete").write_text("\n".join(pins) + "\n")
    return out


class Arm:
    """How to run aarch64 Python under qemu with the cross-built runtime (`pkg`: its llama_cpp folder)."""

    def __init__(self, pkg: Path):
        self.qemu, self.root, self.site = qemu(), sysroot(), site()
        self.pkg = pkg

    def cmd(self, cpu: str, *args: str) -> list[str]:
        return [str(self.qemu), "-L", str(self.root), "-cpu", cpu, str(self.root / "usr" / "bin" / "python3.11"), *args]

    def env(self, **extra: str) -> dict[str, str]:
        path = [str(self.pkg.parent), str(ROOT), str(self.site), str(ROOT / "tests"), str(ROOT / "tests" / "arm")]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        # PYTHONSAFEPATH: the path is this list, the cross-built llama_cpp first (no working directory before it)
        return {**env, "PYTHONPATH": os.pathsep.join(path), "PYTHONSAFEPATH": "1", **extra}
