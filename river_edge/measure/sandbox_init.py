"""The sandbox's supervisor (run by sandbox.py as `python -I sandbox_init.py`: alone, in namespaces `unshare` made, or
as PID 1 of a PID namespace). It reads its job (JSON) on stdin and writes its verdict (JSON) on stdout:
the program it starts never holds either descriptor, and it cannot read them through /proc either (this process is
not dumpable, and the program runs as another uid or without capabilities).

It runs the program under limits, and, for a checked program, the tests here, in a thread: each call of the
candidate goes to the program over a socket as plain values and its answer comes back the same way (sandbox_wire),
so the verdict is this process's, whatever the program does to its own interpreter. At the deadline, when the tests
end, or when the program exceeds its process count, every process the program started is killed: all of the PID
namespace (or all of the run's own uid), or, with neither, what this child subreaper can still find."""
import ctypes
import json
import os
import resource
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # -I left the script's folder out
from sandbox_wire import WIRE_LIMIT, wire_dumps, wire_loads  # noqa: E402

libc = ctypes.CDLL(None, use_errno=True)
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 4, 36, 38, 24
PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 47, 4
SECURE_NOROOT_ALL = 0xEF   # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE, each locked
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384


def mount(src, dst, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {dst}")


def _blocked(path):
    """The first folder on path that other users cannot enter, or None."""
    parts = path.strip("/").split("/")
    return next((p for p in ("/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1))
                 if not os.stat(p).st_mode & 0o001), None)


def expose_python(workdir):
    """The interpreter and its venv, readable by the program's uid: a tmpfs over each folder on their paths that
    other users cannot enter (/root for pyenv), holding only them, read-only. Only in our own mount namespace:
    the host's folders are not touched."""
    keep = {p: b for p in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)} if (b := _blocked(p))}
    stages = {}
    for i, prefix in enumerate(sorted(keep)):   # staged first: the tmpfs hides the originals
        stages[prefix] = os.path.join(workdir, f".python{i}")
        os.mkdir(stages[prefix], 0o755)
        mount(prefix, stages[prefix], None, MS_BIND | MS_REC)
    tops = set(keep.values())
    for b in sorted(tops):
        if not any(b.startswith(t + "/") for t in tops):
            mount("tmpfs", b, "tmpfs", 0, "mode=755,size=64k")
    for prefix, stage in stages.items():
        os.makedirs(prefix, 0o755, exist_ok=True)
        mount(stage, prefix, None, MS_BIND | MS_REC)
        mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


WRITABLE = ("/tmp", "/var/tmp", "/dev")   # besides the program's folder: scratch space, and /dev/null


def _mounts():
    with open("/proc/self/mountinfo") as f:   # field 5 is the mount point, octal escapes for spaces
        return [ln.split()[4].encode().decode("unicode_escape") for ln in f]


def readonly_host(workdir):
    """Every mount read-only in our namespace but the program's folder and WRITABLE: a program that owns files
    (root without capabilities, or the evaluator's uid) cannot rewrite the code that judges it, nor any other."""
    keep = [workdir] + [p for p in WRITABLE if os.path.isdir(p)]
    for p in keep:
        mount(p, p, None, MS_BIND | MS_REC)   # a mount of their own, left writable below
    keep = tuple(os.path.realpath(p) for p in keep) + ("/proc",)
    for m in reversed(_mounts()):
        if any(m == k or m.startswith(k.rstrip("/") + "/") for k in keep):
            continue
        f = os.statvfs(m).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | (f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048))
        flags |= (1 << 21) if f & 4096 else 0   # ST_RELATIME is MS_RELATIME: kept, as a user namespace requires
        try:
            mount(None, m, None, flags)
        except OSError:
            if m == "/":
                raise


def drop_privileges(uid):
    """The program's own uid (other users' processes, ours included, are out of its reach), or, with no other uid
    to take, no capabilities now or after exec."""
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if os.geteuid() == 0:
        os.setresuid(0, 0, 0)   # undo main()'s shield
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)   # a uid other than 0: every capability goes
        return
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    libc.prctl(PR_SET_SECUREBITS, SECURE_NOROOT_ALL, 0, 0, 0)   # fails without CAP_SETPCAP: then there is none
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
            break


def start(job, chan):
    out = os.open(os.path.join(job["workdir"], "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(os.path.join(job["workdir"], "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    pid = os.fork()
    if pid:
        for fd in (out, err, null):
            os.close(fd)
        return pid
    try:
        os.setsid()
        os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
        if chan is not None:
            os.dup2(chan.fileno(), 3)
        os.closerange(4 if chan is not None else 3, 1 << 16)   # our job, verdict and other ends stay here
        mem, cpu, uid = job["mem"], int(job["timeout"]) + 1, job["uid"]
        limits = [(resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem), (resource.RLIMIT_CPU, cpu),
                  (resource.RLIMIT_FSIZE, job["fsize"]), (resource.RLIMIT_CORE, 0)]
        if uid is not None:   # counts every process of the uid, setsid ones included (root's would be exempt)
            limits.append((resource.RLIMIT_NPROC, job["nproc"]))
        for what, v in limits:
            try:
                resource.setrlimit(what, (v, v))
            except (ValueError, OSError):
                pass
        drop_privileges(uid)
        os.chdir(job["workdir"])
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "HOME": job["workdir"], "TMPDIR": job["workdir"], "LC_ALL": "C.UTF-8"}
        os.execve(job["python"], [job["python"], "-I", os.path.join(job["workdir"], "program.py")], env)
    finally:
        os._exit(127)


class Raised(Exception):
    """The solution raised this (its type and message, as the program reported them)."""


def tester(job, chan, result):
    """The tests, run here against the program's answers: the prompt's own helpers (from the data set, not the
    model) and the test's check(), given a candidate that asks the program."""
    f = chan.makefile("rwb")

    def candidate(*args, **kwargs):
        request = wire_dumps([list(args), kwargs])
        try:
            f.write(request)
            f.flush()
            line = f.readline(WIRE_LIMIT)
        except OSError:   # a reset: the program ended with our request unread
            line = b""
        if not line:
            raise EOFError("the program ended before its tests finished")
        tag, value = wire_loads(line)
        if tag != "ok":
            raise Raised(str(value)[:200])
        return value
    try:
        ns = {"__name__": "__check__"}
        exec(compile(job["check"]["prompt"], "prompt.py", "exec"), ns)
        ns[job["check"]["entry_point"]] = candidate   # a test may name it (HumanEval/33 does)
        exec(compile(job["check"]["test"], "test.py", "exec"), ns)
        ns["check"](candidate)
        result["passed"] = True
    except BaseException as e:   # noqa: BLE001 - any failure of the tests is the verdict
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        result["why"] = str(e) if isinstance(e, Raised) else why[:300]
        result["eof"] = isinstance(e, EOFError)
    finally:
        result["done"] = time.monotonic()
        try:
            chan.shutdown(socket.SHUT_RDWR)   # the program's serve loop ends
        except OSError:
            pass


def descendants():
    """Every process below us: the program's tree, and what it orphaned (reparented to us, the subreaper)."""
    kids = {}
    for d in os.listdir("/proc"):
        try:
            if d.isdigit():
                kids.setdefault(int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [os.getpid()]
    while todo:
        for k in kids.get(todo.pop(), ()):
            out.append(k)
            todo.append(k)
    return out


def uid_procs(uid):
    """The live processes of uid but us (a zombie waits only for its parent to reap it)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(d) != os.getpid() and os.stat(f"/proc/{d}").st_uid == uid and \
                    open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(d))
        except (OSError, IndexError):
            pass
    return out


def count(job):
    """The program's processes: all of our PID namespace, or of its own uid, or all below us."""
    if job["pidns"]:
        return sum(d.isdigit() for d in os.listdir("/proc")) - 1
    return len(uid_procs(job["uid"]) if job["uid"] is not None else descendants())


def kill_uid(uid):
    """Every process of uid, by kill(-1) as that uid until none is left (kill(-1) says 0 even when it reached
    nothing but processes of other users)."""
    killer = os.fork()
    if killer == 0:
        try:
            os.setresuid(uid, uid, uid)
            for _ in range(400):
                os.kill(-1, signal.SIGKILL)
                if not uid_procs(uid):
                    break
                time.sleep(0.005)
        finally:
            os._exit(0)
    os.waitpid(killer, 0)


def kill_all(job, pid, reaped):
    if job["pidns"]:   # PID 1: kill(-1) reaches every process of the namespace but us
        def targets():
            os.kill(-1, signal.SIGKILL)
    elif job["uid"] is not None:
        kill_uid(job["uid"])
        targets = lambda: None  # noqa: E731
    else:
        def targets():
            for t in [pid] + descendants():
                for kill in (os.killpg, os.kill):
                    try:
                        kill(t, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
    for _ in range(500):
        try:
            targets()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            reap(reaped)
        except ChildProcessError:
            return
        time.sleep(0.01)


def reap(reaped):
    """Collect every exited child's status (orphans included); ChildProcessError when none is left."""
    while True:
        p, st = os.waitpid(-1, os.WNOHANG)
        if not p:
            return
        reaped[p] = st


def main():
    if sys.argv[1:2] == ["--kill-uid"]:   # the evaluator's last resort, should a supervisor overstay
        kill_uid(int(sys.argv[2]))
        return
    os.umask(0o022)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)   # no ptrace, no /proc/<us>/fd or environ for the program
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # orphans come to us (PID 1 has them anyway)
    job = json.loads(sys.stdin.buffer.read())
    verdict = sys.stdout
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)
    deadline = time.monotonic() + job["timeout"]
    if job["uid"] is None and not job["pidns"] and os.geteuid() == 0:
        # root without namespaces or a uid to give: a real and saved uid of our own (euid 0 keeps our
        # capabilities) put us out of the reach of kill() from the program, which keeps uid 0 without CAP_KILL
        os.setresuid(job["shield"], 0, job["shield"])
    if job["uid"] is not None:
        os.chown(job["workdir"], job["uid"], job["uid"])
    if job["mountns"]:   # our own mount namespace (unshare --mount): nothing here reaches the host's mounts
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible,subset=pid")
    if job["mountns"] or job["pidns"]:   # --mount-proc made one too
        readonly_host(job["workdir"])
        if job["uid"] is not None:
            expose_python(job["workdir"])
    mine = theirs = None
    if job["check"]:
        mine, theirs = socket.socketpair()
    pid = start(job, theirs)
    result = {"done": 0.0, "passed": False}
    if theirs is not None:
        theirs.close()
        threading.Thread(target=tester, args=(job, mine, result), daemon=True).start()
    reaped, state = {}, "timeout"
    while time.monotonic() < deadline:
        try:
            reap(reaped)
        except ChildProcessError:
            pass
        ended = result["done"] and (pid in reaped or not result.get("eof") or time.monotonic() > result["done"] + 0.5)
        if ended or (pid in reaped and not job["check"]):   # after EOF, the program's exit status is awaited
            state = "ended"
            break
        if count(job) >= job["nproc"]:   # at RLIMIT_NPROC's cap (a fork bomb spins there), or past it (root's)
            state = "nproc"
            break
        time.sleep(0.01)
    kill_all(job, pid, reaped)   # the program's own status too, if it ended as the tests did
    code = os.waitstatus_to_exitcode(reaped[pid]) if pid in reaped else None
    verdict.write(json.dumps({"state": state, "code": code, "passed": result["passed"], "why": result.get("why")}))
    verdict.flush()


if __name__ == "__main__":
    main()
