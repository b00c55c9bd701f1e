"""Exact speed-ups a llama.cpp user has, side by side on one model (issue: River-Spec, item 4):

  backbone       the plain backbone file, stock llama-cpp-python, greedy
  exact          river-edge's exact mode on the river GGUF (the river drafts, the backbone verifies)
  prompt-lookup:N  llama-cpp-python's LlamaPromptLookupDecoding(num_pred_tokens=N) on the backbone file, N swept
                 (2, 4 and its default 10: on a CPU an 11-token batch costs several steps)
  draft-model    classic speculative decoding: a smaller model of the same tokenizer drafts k tokens
                 greedily (its own KV cache, prefix reused), llama-cpp-python verifies

    .venv/bin/python -m bench.spec_compare --river ~/.cache/river-edge/rivers/qwen2.5-coder-1.5b.river.gguf \
        --draft ~/.cache/river-edge/models/qwen2.5-coder-0.5b.gguf --name qwen2.5-coder-1.5b

One process, every configuration on the same prompt in a rotating order each round; ratios are medians over
rounds of (config tok/s) / (backbone tok/s) of the same round; every output is compared with the backbone's.
Peak resident memory of each configuration is measured in a fresh subprocess (load, 32 tokens).
Writes bench/results/spec_compare_<name>.json and .png. `--text-prompts N` instead counts, untimed, how many of N
distinct prompts (the four above, then packaged calibration prompts) each configuration writes the backbone's text
for, one configuration loaded at a time: text_spec_compare_<name>.json. `--parting TEXT_JSON` then says, for each
prompt where exact parts from the stock backbone there, which side moved (parting_<name>.json beside it):

    GGML_CPU_VARIANT=zen4 .venv/bin/python -m bench.spec_compare --river ... --draft ... --name qwen2.5-coder-1.5b \
        --parting bench/results/hosts/amd-epyc-zen4/text_spec_compare_qwen2.5-coder-1.5b.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from river_edge.gguf_tools.writer import write_text
from river_edge.host import host, placement
from river_edge.measure.harness import rotation, timed_greedy
from river_edge.measure.plots import save
from bench.recorded import cpu_words

_HERE = Path(__file__).resolve().parent
PROMPTS = [
    "def quicksort(arr):\n    \"\"\"Sort a list of integers in place.\"\"\"\n",
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\nAnswer: Let's think step by step.",
    "The history of the printing press begins",
    "import numpy as np\n\ndef softmax(x):\n",
]

SPEC_CONFIGS = ("backbone", "exact", "prompt-lookup:2", "prompt-lookup:4", "prompt-lookup:10", "draft-model")


class ModelDraft(LlamaDraftModel):
    """Greedy drafts from a second, smaller model (classic speculative decoding)."""

    def __init__(self, path: str, k: int, **kw):
        self.llm = llama_cpp.Llama(path, verbose=False, **kw)
        self.k = k

    def __call__(self, input_ids, /, **kwargs):
        m, ids = self.llm, [int(x) for x in input_ids]
        n = 0
        for a, b in zip(m.input_ids[: m.n_tokens], ids):
            if a != b:
                break
            n += 1
        m.n_tokens = min(n, len(ids) - 1)          # re-decode at least the last token for its logits
        m.eval(ids[m.n_tokens:])
        out = []
        for i in range(self.k):
            t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(m._ctx.ctx, -1),
                                                    shape=(m.n_vocab(),))))
            out.append(t)
            if i + 1 < self.k:
                m.eval([t])
        return np.array(out, dtype=np.intc)


def llama_for_config(config: str, a) -> llama_cpp.Llama:
    kw = dict(n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads, seed=0, verbose=False)
    if config == "exact":
        from river_edge.runtime.llama import RiverLlama
        return RiverLlama(a.river, mode="exact", **kw)
    if config.startswith("prompt-lookup:"):
        n = int(config.partition(":")[2])
        return llama_cpp.Llama(a.backbone, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=n), **kw)
    if config == "draft-model":
        return llama_cpp.Llama(a.backbone, draft_model=ModelDraft(a.draft, a.k, n_ctx=1024, n_threads=a.threads,
                                                                  n_threads_batch=a.threads), **kw)
    return llama_cpp.Llama(a.backbone, **kw)


def gen(llm, prompt: list[int], n: int) -> tuple[list[int], float]:
    """The harness's timer (river_edge.measure.harness.timed_greedy), a draft model's own context reset first."""
    def reset_draft(m):
        if isinstance(getattr(m, "draft_model", None), ModelDraft):
            m.draft_model.llm.reset()
    out, tok_s, _ = timed_greedy(llm, prompt, n, before=reset_draft)
    return out, tok_s


def probe_peak_memory(config: str, a) -> None:
    llm = llama_for_config(config, a)
    p = llm.tokenize(PROMPTS[0].encode())
    gen(llm, p, 32)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            print(json.dumps({"peak_mib": int(line.split()[1]) / 1024}))


def text_pass(a) -> dict:
    """Each configuration once on each of a.text_prompts distinct prompts; how many equal the backbone's tokens."""
    from river_edge.measure.files import packaged_prompts

    configs = ["backbone"] + [c for c in a.configs.split(",") if c != "backbone"]
    texts = (PROMPTS + packaged_prompts(a.text_prompts))[:a.text_prompts]
    outs = {}
    for c in configs:   # one model at a time: the 1.5B's configurations together would not fit small hosts
        m = llama_for_config(c, a)
        outs[c] = [gen(m, m.tokenize(t.encode()), a.tokens)[0] for t in texts]
        print(c, sum(o == b for o, b in zip(outs[c], outs["backbone"])), "/", len(texts), flush=True)
        m.close()
    return {"kind": "text", "model": a.name, "tokens": a.tokens, "prompts": texts, "threads": a.threads,
            "host": host(a.threads), "identical_runs": {c: int(sum(o == b for o, b in zip(outs[c], outs["backbone"])))
                                                        for c in configs}, "runs": len(texts), "outputs": outs}


def parting(a, text: dict) -> dict:
    """Where exact parts from the stock backbone in a same-text pass, which side moved: the parting token's top two
    logits in the stock run (prompt as one batch), and the texts of the stock Llama fed the prompt one token at a
    time and of RiverLlama's backbone mode (each compared with exact's)."""
    from river_edge.runtime.llama import RiverLlama

    kw = dict(n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads, seed=0, verbose=False)
    rows = []
    for i, (b, e) in enumerate(zip(text["outputs"]["backbone"], text["outputs"]["exact"])):
        if b == e:
            continue
        k = next(j for j in range(min(len(b), len(e))) if b[j] != e[j])
        m = llama_cpp.Llama(a.backbone, logits_all=True, **kw)
        p = m.tokenize(text["prompts"][i].encode())
        first = int(next(iter(m.generate(p, temp=0.0, reset=True))))   # outputs start after the first token
        m.reset()
        m.eval(p)                                # as the stock run decodes: the prompt as one batch, then token by token
        for t in [first] + b[:k]:
            m.eval([t])
        lg = np.asarray(m.scores[len(p) + k])  # the row that chose output k
        row = {"prompt": i, "output_token": k, "top2": [[int(t), m.detokenize([int(t)]).decode(errors="replace"),
                                                        float(lg[t])] for t in np.argsort(lg)[::-1][:2]]}
        m.close()
        for name, make in (("stock_one_token_at_a_time", lambda: llama_cpp.Llama(a.backbone, n_batch=1, **kw)),
                           ("river_backbone_mode", lambda: RiverLlama(a.river, mode="backbone", **kw))):
            m = make()
            row[name + "_equals_exact"] = gen(m, m.tokenize(text["prompts"][i].encode()), len(e))[0] == e
            m.close()
        rows.append(row)
    return {"kind": "parting", "model": a.name, "text": text.get("as_host") or "this host", "host": host(a.threads),
            "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--river", required=True, help="river GGUF of the target model (built with a river head)")
    ap.add_argument("--backbone", help="its plain backbone file (default: written once beside the river GGUF)")
    ap.add_argument("--draft", required=True, help="the draft model's GGUF (same tokenizer)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--k", type=int, default=4, help="draft length of the draft-model configuration")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(SPEC_CONFIGS))
    ap.add_argument("--text-prompts", type=int, help="the same-text pass over N distinct prompts instead (untimed)")
    ap.add_argument("--parting", type=Path, help="a text_spec_compare JSON: where exact parts from the stock "
                    "backbone there, which side moved (parting_<name>.json beside it; run under that JSON's CPU variant)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=_HERE / "results")
    a = ap.parse_args(argv)
    if a.backbone is None:
        from river_edge.gguf_tools.convert import plain
        a.backbone = str(Path(a.river).with_name(Path(a.river).name.replace(".river.gguf", "") + ".backbone.gguf"))
        if not Path(a.backbone).is_file():
            plain(a.river, a.backbone, "backbone")
    if a.probe:
        probe_peak_memory(a.probe, a)
        return 0
    if a.parting:
        write_text(a.parting.with_name(f"parting_{a.name}.json"),
                   json.dumps(parting(a, json.loads(a.parting.read_text())), indent=1) + "\n")
        return 0
    if a.text_prompts:
        a.out.mkdir(parents=True, exist_ok=True)
        write_text(a.out / f"text_spec_compare_{a.name}.json", json.dumps(text_pass(a), indent=1) + "\n")
        return 0
    configs = a.configs.split(",")
    models = {c: llama_for_config(c, a) for c in configs}
    prompts = [models["backbone"].tokenize(p.encode()) for p in PROMPTS]
    for c in configs:                                # warm-up: graphs, pages, the exact mode's cost model
        gen(models[c], prompts[0], 8)
    load_before = os.getloadavg()
    rows, same = [], {c: [] for c in configs}
    for r in range(a.rounds):
        p = prompts[r % len(prompts)]
        order = rotation(configs, r)
        res = {c: gen(models[c], p, a.tokens) for c in order}
        for c in configs:
            same[c].append(res[c][0] == res["backbone"][0])
        rows.append({c: res[c][1] for c in configs})
        print(r, {c: round(rows[-1][c] / rows[-1]["backbone"], 2) for c in configs}, flush=True)
    ex = models["exact"].stats() if "exact" in models else {}
    held = {"backbone": models["backbone"], "river": models.get("exact"),   # whose weights sit in which buffers
            "draft": getattr(getattr(models.get("draft-model"), "draft_model", None), "llm", None)}
    bufts = {f: placement(m) for f, m in held.items() if m is not None}
    del models, held   # free before the memory probes
    mem = {}
    for c in configs:
        out = subprocess.run([sys.executable, __file__, "--probe", c, "--river", a.river, "--backbone", a.backbone,
                              "--draft", a.draft, "--name", a.name, "--k", str(a.k), "--threads", str(a.threads)],
                             capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        mem[c] = json.loads(lines[-1])["peak_mib"] if lines else None
    files = {"backbone": a.backbone, "river": a.river, "draft": a.draft}
    summary = {
        "model": a.name, "files": files, "file_mib": {k: Path(v).stat().st_size / 2**20 for k, v in files.items()},
        "threads": a.threads, "tokens": a.tokens, "rounds": a.rounds, "draft_k": a.k,
        "prompts": PROMPTS, "load_before": load_before, "load_after": os.getloadavg(), "host": host(a.threads),
        "buffer_types": bufts,
        "tok_s_median": {c: float(np.median([row[c] for row in rows])) for c in configs},
        "ratio_median": {c: float(np.median([row[c] / row["backbone"] for row in rows])) for c in configs},
        "identical_rounds": {c: int(sum(same[c])) for c in configs},
        "peak_mib": mem, "rows": rows,
        "exact_stats": {k: ex.get(k) for k in ("acceptance_rate", "mean_draft_len", "tokens_per_cycle", "cost_model")},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    write_text(a.out / f"spec_compare_{a.name}.json", json.dumps(summary, indent=1) + "\n")
    _plot(summary, a.out / f"spec_compare_{a.name}.png")
    print(json.dumps({k: summary[k] for k in ("tok_s_median", "ratio_median", "identical_rounds", "peak_mib")},
                     indent=1))
    return 0


def _plot(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(s["ratio_median"])
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["0.5" if c == "backbone" else "C0" if c == "exact" else "C3" if c == "draft-model" else "C1" for c in cs]
    ax[0].bar(cs, [s["ratio_median"][c] for c in cs], color=colors)
    for i, c in enumerate(cs):   # same-text counts live in the table: the untimed pass over 16 prompts
        ax[0].text(i, s["ratio_median"][c], f"{s['ratio_median'][c]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax[0].set_ylim(0, max(s["ratio_median"].values()) * 1.12)
    ax[0].axhline(1, color="0.6", lw=0.8)
    ax[0].set_ylabel("decode speed / backbone (median of rounds)")
    ax[0].set_title(f"{s['model']}: greedy, {s['threads']} threads, {s['tokens']} tokens\n{cpu_words(s)}", fontsize=10)
    ax[1].bar(cs, [s["peak_mib"].get(c) or 0 for c in cs], color=colors)
    ax[1].set_ylabel("peak resident memory (MiB)")
    ax[1].set_title("load + 32 tokens, fresh process", fontsize=10)
    for a_ in ax:
        a_.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
