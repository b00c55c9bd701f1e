"""pytest plugin for the suite under qemu-user (tests/arm/run.py: `-p one_thread`): every llama.cpp context on
RIVER_ARM_THREADS threads (1 unless set), whatever the test asks for.

Why: qemu runs each guest thread as a host thread, and ggml's own thread pool (this build has no OpenMP) waits at
every op's barrier by spinning; under emulation, on 2 cores, a tiny model's one-token decode took 79 ms on two
threads against 12 ms on one. The invariants compare runs at the same thread count, so they hold either way.
"""
from __future__ import annotations

import functools
import os

import llama_cpp

THREADS = int(os.environ.get("RIVER_ARM_THREADS", "1"))
_init = llama_cpp.Llama.__init__


@functools.wraps(_init)
def _one_thread_init(self, *args, **kw):
    kw["n_threads"] = kw["n_threads_batch"] = THREADS
    _init(self, *args, **kw)


llama_cpp.Llama.__init__ = _one_thread_init
