"""The HumanEval sandbox against programs written to escape it (issue 43, item 5): a supervisor the program cannot
stop, a process limit over every descendant, a verdict it cannot forge, no handle to the evaluator. Each test runs
under the isolation this host allows; the ones that only the namespaced modes promise skip elsewhere."""
import os
import shutil
import tempfile
import time

import pytest

from river_edge.measure import sandbox as S
from river_edge.measure.tasks import humaneval_program

PROMPT = 'def add_one(x):\n    """x + 1"""\n'
TEST = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 6\n"


def strong():
    """The program cannot reach the evaluator's processes (a PID namespace, or a uid of its own)."""
    return "weak" not in S.isolation()


@pytest.fixture
def shared():
    """A folder the program can write to whatever its uid (pytest's tmp_path sits in a 0700 folder)."""
    d = tempfile.mkdtemp(prefix="river-sandbox-test-")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def beating(path, within=0.5):
    """Whether a heartbeat file was written in the last `within` seconds."""
    try:
        return time.time() - float(open(path).read() or 0) < within
    except (OSError, ValueError):
        return False


def heartbeat_code(path, secs=15):
    """Source that writes the time into path every 50 ms for `secs` seconds (bounded: nothing outlives the test
    run even if the sandbox failed)."""
    return (f"def _beat():\n    import time\n    end = time.time() + {secs}\n    while time.time() < end:\n"
            f"        open({path!r}, 'w').write(repr(time.time()))\n        time.sleep(0.05)\n")


def checked(solution):
    return humaneval_program(PROMPT, f"```python\n{solution}```", TEST, "add_one")


def test_isolation_is_named_and_a_program_runs():
    assert S.isolation() and S.run_sandboxed("print('hi')\n", timeout=5) == (True, "passed")
    if os.geteuid() == 0 and shutil.which("unshare"):
        print(S.isolation())


def test_right_passes_and_wrong_fails():
    assert S.run_sandboxed(checked("def add_one(x):\n    return x + 1\n"), timeout=10) == (True, "passed")
    ok, why = S.run_sandboxed(checked("def add_one(x):\n    return x\n"), timeout=10)
    assert not ok and "AssertionError" in why
    with pytest.raises(TypeError):   # a plain program's own output proves nothing
        S.run_sandboxed("print(1)\n", signal_done=True)


@pytest.mark.parametrize("cheat", [
    # the old done signal and checker, called or replaced through __main__
    "import __main__, sys\n__main__._river_done()\nsys.exit(0)\ndef add_one(x):\n    return 0\n",
    "import __main__\nclass _A:\n    def __eq__(self, o):\n        return True\n"
    "__main__._river_plain = lambda v: _A()\ndef add_one(x):\n    return 0\n",
    # an answer equal to everything, and one of a subclass of int
    "class _A:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\ndef add_one(x):\n    return _A()\n",
    "class _I(int):\n    def __eq__(self, o):\n        return True\ndef add_one(x):\n    return _I(0)\n",
    # assert disabled in its own interpreter; AssertionError swallowed; exit early
    "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\ndef add_one(x):\n    return 0\n",
    "import sys\nsys.exit(0)\ndef add_one(x):\n    return 0\n",
    # a forged verdict on every descriptor it holds, and on the supervisor's stdout through /proc
    "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'[\"l\", [\"ok\", 2]]\\n')\n"
    "    except OSError:\n        pass\nfor fd in range(8):\n    try:\n"
    "        open('/proc/%d/fd/%d' % (os.getppid(), fd), 'w').write("
    "'{\"state\": \"ended\", \"code\": 0, \"passed\": true, \"why\": null}')\n    except OSError:\n        pass\n"
    "def add_one(x):\n    return 0\n",
])
def test_a_wrong_solution_cannot_forge_a_pass(cheat):
    ok, why = S.run_sandboxed(checked(cheat), timeout=10)
    assert not ok, why


def test_a_program_that_kills_its_supervisor_does_not_outlive_the_deadline(shared):
    """It starts a setsid daemon, then SIGKILLs its parent (the supervisor) and its parent's parent."""
    if not strong():
        pytest.skip(f"weak isolation here: {S.isolation()}")
    beat, own = os.path.join(shared, "daemon"), os.path.join(shared, "self")
    prog = (heartbeat_code(beat) + "import ctypes, os, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
            "    libc.setsid()\n    _beat()\n    libc._exit(0)\n"
            "sup = libc.getppid()\nlibc.kill(sup, 9)\n"
            "try:\n    libc.kill(int(open('/proc/%d/stat' % sup).read().rsplit(')', 1)[1].split()[1]), 9)\n"
            "except OSError:\n    pass\n" + heartbeat_code(own).replace("_beat", "_self") + "_self()\n")
    t = time.monotonic()
    ok, why = S.run_sandboxed(prog, timeout=2)
    assert not ok and why == "timed out" and time.monotonic() - t < 6
    time.sleep(0.6)
    assert os.path.exists(beat) and os.path.exists(own)   # the attack ran
    assert not beating(beat) and not beating(own)


def test_a_timeout_kills_every_descendant(shared):
    """A fork chain (each process forks a successor, setsid, exits) and a setsid daemon: the program itself exits at
    once (a pass), and what it left is killed then."""
    chain, daemon = os.path.join(shared, "chain"), os.path.join(shared, "daemon")
    prog = (heartbeat_code(daemon) + "import ctypes, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
            "    libc.setsid()\n    _beat()\n    libc._exit(0)\nend = time.time() + 15\nwhile time.time() < end:\n"
            "    if libc.fork() != 0:\n        libc._exit(0)\n    libc.setsid()\n"
            f"    open({chain!r}, 'w').write(repr(time.time()))\n    time.sleep(0.01)\n")
    t = time.monotonic()
    S.run_sandboxed(prog, timeout=1)
    assert time.monotonic() - t < 5
    time.sleep(0.6)
    assert os.path.exists(chain) and os.path.exists(daemon)
    assert not beating(chain) and not beating(daemon)


def test_the_process_limit_counts_setsid_children(shared):
    """A setsid child starts 150 sleepers: either fork fails past the limit or the run fails for it."""
    prog = ("import ctypes, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n    libc.setsid()\n"
            "    for i in range(150):\n        if libc.fork() == 0:\n"
            f"            open({shared!r} + '/s%d' % i, 'w').write('x')\n            time.sleep(3)\n"
            "            libc._exit(0)\n    time.sleep(3)\n    libc._exit(0)\ntime.sleep(2)\n")
    ok, why = S.run_sandboxed(prog, timeout=6)
    assert "processes" in why or len(os.listdir(shared)) <= S.NPROC, (why, len(os.listdir(shared)))


def test_no_handle_to_the_evaluators_stdout_or_environment(monkeypatch, capfd):
    """The program looks for the evaluator's environment and stdout in every /proc entry it can see."""
    if not strong():
        pytest.skip(f"weak isolation here: {S.isolation()}")
    monkeypatch.setenv("RIVER_TEST_SECRET", "hunter2")
    prog = ("import os\nfound = []\nfor d in os.listdir('/proc'):\n    if not d.isdigit():\n        continue\n"
            "    try:\n        if b'hunter2' in open('/proc/%s/environ' % d, 'rb').read():\n"
            "            found.append(d)\n    except OSError:\n        pass\n    for fd in (1, 2):\n        try:\n"
            "            open('/proc/%s/fd/%d' % (d, fd), 'a').write('WRITTEN BY THE PROGRAM\\n')\n"
            "        except OSError:\n            pass\n"
            "assert not found and b'hunter2' not in open('/proc/self/environ', 'rb').read(), found\n")
    ok, why = S.run_sandboxed(prog, timeout=10)
    assert ok, why
    out, err = capfd.readouterr()
    assert "WRITTEN BY" not in out + err


def test_it_cannot_rewrite_the_code_that_judges_it():
    """The supervisor's own folder (and any other file the program's uid might own) is out of its reach."""
    if not strong():
        pytest.skip(f"weak isolation here: {S.isolation()}")
    victim = S.HERE / "sandbox_planted.py"
    prog = f"open({str(victim)!r}, 'w').write('planted')\n"
    try:
        ok, why = S.run_sandboxed(prog, timeout=5)
        # read-only, not its uid's, or (a checkout under /tmp) not even visible: the program's /tmp is its own
        assert not ok and any(w in why for w in ("Read-only", "Permission", "No such file")), why
    finally:
        planted = victim.exists()
        victim.unlink(missing_ok=True)
        assert not planted


def test_the_fallback_without_namespaces_still_judges(monkeypatch, shared):
    """RIVER_SANDBOX=none: no namespaces, as on a host that refuses unshare; named so in the record."""
    monkeypatch.setenv("RIVER_SANDBOX", "none")
    assert S.isolation().startswith("no namespaces")
    assert S.run_sandboxed(checked("def add_one(x):\n    return x + 1\n"), timeout=10) == (True, "passed")
    assert not S.run_sandboxed(checked("def add_one(x):\n    return 0\n"), timeout=10)[0]
    daemon = os.path.join(shared, "daemon")
    prog = (heartbeat_code(daemon) + "import ctypes, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
            "    libc.setsid()\n    _beat()\n    libc._exit(0)\ntime.sleep(20)\n")
    assert S.run_sandboxed(prog, timeout=1) == (False, "timed out")
    time.sleep(0.6)
    assert not beating(daemon)


def test_every_mode_this_host_runs_judges_and_cleans_up(monkeypatch, shared):
    """Each isolation the probe may fall back to (and a user namespace, as a host without root gets): those that
    run here judge right and wrong and kill a setsid daemon at the deadline."""
    userns = S.Confinement(("--user", "--map-root-user", "--fork", "--pid", "--mount-proc", "--kill-child"), False)
    ran = []
    default = S._mode()   # the rest of this file tests it
    for i, mode in enumerate(S._candidates() + [userns]):
        if mode == default or not S._run("print(1)\n", 5, 256, mode)[0]:
            continue
        monkeypatch.setattr(S, "_mode", lambda m=mode: m)
        assert S.run_sandboxed(checked("def add_one(x):\n    return x + 1\n"), timeout=10) == (True, "passed")
        assert not S.run_sandboxed(checked("def add_one(x):\n    return -x\n"), timeout=10)[0]
        beat = os.path.join(shared, f"daemon{i}")
        prog = (heartbeat_code(beat) + "import ctypes, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
                "    libc.setsid()\n    _beat()\n    libc._exit(0)\ntime.sleep(20)\n")
        assert S.run_sandboxed(prog, timeout=0.5) == (False, "timed out"), mode
        time.sleep(0.3)
        assert os.path.exists(beat) and not beating(beat, 0.25), mode
        ran.append(mode.describe())
    print("\n".join(ran))
