"""`river doctor`: one screen a user pastes into a bug report (versions, runtime build, CPU, devices, and
where ggml placed a model's weights)."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from river_edge import host as H
from river_edge.format import ARCHITECTURES
from river_edge.tokenizer import quiet_llama_logs


def report(model: Path | None = None, threads: int | None = None) -> str:
    h = H.host(threads)
    rt, c = h["runtime"], h["cpu"]
    if rt["llama_cpp_python"] is None:
        runtime = "llama-cpp-python not installed (run `make setup`)"
    elif rt["patched"]:
        runtime = f"llama-cpp-python {rt['llama_cpp_python']}, patched with river-edge's series (build {rt['build']})"
    else:
        runtime = f"llama-cpp-python {rt['llama_cpp_python']}, stock: river GGUFs need the patched build (`make setup`)"
    lines = [
        f"river-edge  {h['river_edge']} (Python {h['python']}, {h['platform']})",
        f"runtime     {runtime}",
        f"cpu         {c['model']}, {c['cpus']} cpus; ISA {' '.join(c['isa']) or '?'}",
        f"load        {' '.join(map(str, h['loadavg_1_5_15']))} (1, 5, 15 min)",
        f"rivers for  {', '.join(ARCHITECTURES)} (general.architecture; any other is refused)",
    ]
    if rt["llama_cpp_python"] is not None:
        chosen = ("chosen by GGML_CPU_VARIANT" if os.environ.get("GGML_CPU_VARIANT")
                  else "the best this CPU runs")
        variant = (f"CPU variant {rt['cpu_variant']} (one of the build's variants, {chosen})"
                   if rt["cpu_variant"] else "CPU backend built in (native build)")
        lines.append(f"devices     {'; '.join(rt['devices']) or '?'}; {variant}")
        lines.append(f"ggml        {rt['system_info']}")
    if model is not None and rt["patched"]:
        placed = {}
        for extra in (True, False):   # loaded twice: the weights' buffer types with ggml's extra types and without
            llm, log = load_logged(model, n_ctx=256, n_threads=threads, extra_bufts=extra)
            layouts = H.repacked(log)
            placed[extra] = "; ".join(f"{role} " + ", ".join(f"{b} x{n}" for b, n in bufts.items())
                                      for role, bufts in H.placement(llm).items()) + \
                (" (repacked: " + ", ".join(f"{k} x{n}" for k, n in layouts.items()) + ")" if layouts else "")
            about = (f"model       {model}: {llm.n_layer} layers, river {'yes' if llm.has_river else 'no'}, "
                     f"threads {llm.context_params.n_threads} (batch {llm.context_params.n_threads_batch})")
            llm.close()
        lines += [about, f"extra bufts on  {placed[True]}", f"extra bufts off {placed[False]}"]
    elif model is not None:
        lines.append(f"model       {model}: weights' buffer types need the patched runtime")
    return "\n".join(lines)


def load_logged(model: Path, **kw):
    """A RiverLlama and llama.cpp's log of its load, ggml's debug lines included (the repacked layouts): loaded
    verbose, so that RiverLlama leaves the log callback to us, with llama-cpp-python's own prints swallowed."""
    import llama_cpp._logger

    from river_edge.runtime.llama import RiverLlama

    with quiet_llama_logs() as log, contextlib.redirect_stderr(io.StringIO()):
        llm = RiverLlama(str(model), verbose=True, **kw)
    llm.verbose = False
    llama_cpp._logger.set_verbose(False)   # as a quiet load leaves it
    return llm, "".join(log)
