"""What a measurement records besides time: peak memory in a fresh process, and the host's load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def load_avg() -> dict:
    la = os.getloadavg()
    try:
        up = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        up = ""
    return {"loadavg_1_5_15": [round(x, 2) for x in la], "uptime": up}


def in_fresh_process(module: str, arg: dict, timeout: int = 900) -> dict:
    """Run `python -m module --memory-probe ARG` and return the JSON its last line prints (peak_rss's)."""
    p = subprocess.run([sys.executable, "-m", module, "--memory-probe", json.dumps(arg)],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["probe failed"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def peak_rss(load, work) -> dict:
    """In a probe process: peak RSS before loading, after `load()` and after `work(model)`, in MiB."""
    import llama_cpp  # noqa: F401  (the library itself counts in the baseline)

    base = hwm_mib()
    m = load()
    loaded = hwm_mib()
    work(m)
    peak = hwm_mib()
    return {"baseline_mib": base, "after_load_mib": loaded, "peak_mib": peak, "model_mib": peak - base}


def hwm_mib() -> float:
    """Peak RSS of this process (VmHWM). Not ru_maxrss: Linux keeps that across fork and exec, so a probe
    started by a big parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB on most, bytes on macOS
