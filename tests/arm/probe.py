"""What one process of the runtime sees, on either side of `make test-arm` (aarch64 under qemu, or the x86 host):
the ggml CPU variant loaded and every variant's score, ggml's feature line, and for each GGUF in a folder the
buffer types its weights landed in, the repacked layouts ggml chose (its debug log: q4_0_8x8, ...) and the
logits of a fixed token sequence under several exits, with extra buffer types on and off.

    python probe.py MODELS_DIR OUT.json OUT.npz
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

PROMPT = [5, 77, 120, 3, 64, 200, 18, 41, 99, 7]
FED = [12, 150, 9, 201, 33, 88]   # fed one at a time: the same tokens on both hosts, whatever either predicts
THREADS = int(os.environ.get("RIVER_ARM_THREADS", "1"))   # one: see one_thread.py


def variant_scores(lib: Path) -> dict[str, int]:
    """ggml_backend_score() of every CPU variant in the build: 0 where this CPU lacks the variant's ISA."""
    out = {}
    for p in sorted(lib.glob("libggml-cpu-*.so")):
        f = ctypes.CDLL(str(p)).ggml_backend_score
        f.restype = ctypes.c_int
        out[p.name[len("libggml-cpu-"):-len(".so")]] = int(f())
    return out


def logits(llm) -> np.ndarray:
    """Teacher-forced logits on both hosts' reference path: the prompt as one batch on ggml's reference kernels (as
    exact mode verifies: batch invariance), then one token at a time. The stock batched kernels are left out: on the
    emulated `max` CPU (SVE 512, SME) those of plain Q4_K and Q6_K weights land 2 logits from x86's."""
    llm.reset()
    dec = llm.decoder
    dec.remove(0)
    rows = [np.array(dec.verify(PROMPT, 0, True))]
    rows += [np.array(dec.decode([t], len(PROMPT) + i)) for i, t in enumerate(FED)]
    return np.concatenate(rows).astype(np.float32)


def main(models: Path, out_json: Path, out_npz: Path) -> int:
    t0 = time.monotonic()
    import llama_cpp

    from river_edge.doctor import load_logged
    from river_edge import host as H

    devices = H.devices()
    rt = H.runtime_info()
    info = {"cpu": H.cpu(), "devices": devices, "cpu_variant": rt["cpu_variant"], "system_info": rt["system_info"],
            "build": rt["build"], "import_s": round(time.monotonic() - t0, 1), "models": {}}
    arrays = {}
    for path in sorted(models.glob("*.gguf")):
        for extra in (True, False):
            llm, log = load_logged(path, n_ctx=64, n_threads=THREADS, n_threads_batch=THREADS,
                                   logits_all=True, extra_bufts=extra)
            exits = {"backbone": None}
            if llm.has_river:
                L = llm.n_layer
                exits = {"backbone": L - 1, f"exit{L // 2}": L // 2, "river": -1}
            rec = {"placement": H.placement(llm), "repacked": H.repacked(log), "batch_invariant": llm.batch_invariant,
                   "departing": len(llm.departing)}
            for cfg, e in exits.items():
                if e is not None:
                    llm.forced_exit = e
                arrays[f"{path.stem}|{cfg}|{'extra' if extra else 'plain'}"] = logits(llm)
            info["models"][f"{path.stem}|{'extra' if extra else 'plain'}"] = rec
            llm.close()
    q4 = models / "llama-q4_0.gguf"
    if q4.exists():   # what `river doctor MODEL` prints here (the command is this function and one echo)
        from river_edge.doctor import report
        info["doctor"] = report(q4, THREADS)
    # last: loading every variant puts them all in this process's memory map, where cpu_variant() looks
    info["variant_scores"] = variant_scores(Path(llama_cpp.__file__).with_name("lib"))
    info["probe_s"] = round(time.monotonic() - t0, 1)
    np.savez(out_npz, **arrays)
    out_json.write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
