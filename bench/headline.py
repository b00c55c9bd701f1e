"""The README's first screen: exact mode against the files a user would run instead, memory beside speed, one
table per host, from the `modes_*` JSON alone (report.py writes it between the README's headline markers)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import builds as B
from bench.recorded import GEMMA, PLAIN_CONFIGS, QWEN, QWEN15, SMOL, dash, host_line, load_modes, load_record
from bench.recorded import other_hosts


def paired_ratio(m: dict, c: str, ref: str) -> float | None:
    """Median over (round, prompt) of config c's tok/s over ref's in the same round and prompt."""
    if ref not in m["configs"]:
        return None
    return float(np.median([r["tok_s"][c] / r["tok_s"][ref] for r in m["rows"]]))


# (JSON key, label, name of its backbone row)
F16 = "backbone (F16 upcast)"
HEADLINE_MODELS = ((SMOL, SMOL, F16), (GEMMA, GEMMA, F16), (QWEN, QWEN, F16), (f"{QWEN}-q8_0", f"{QWEN}, Q8_0 + river", "backbone (Q8_0)"),
                   (QWEN15, QWEN15, F16), (f"{QWEN15}-q8_0", f"{QWEN15}, Q8_0 + river", "backbone (Q8_0)"),
                   (f"{QWEN15}-keep", f"{QWEN15}, shipped weights + river", "backbone (the shipped weights)"))


HEADLINE_CONFIGS = ("backbone", "exact", "exact:river+ngram", "exact:draft", *PLAIN_CONFIGS.split(","))


def headline(out: Path) -> list[str]:
    """README's first tables: exact mode against the files a user would run instead, memory beside speed; one
    table per host (ratios move a lot between hosts)."""
    by_host: dict[str, list[str]] = {}
    used: dict[str, dict[str | None, dict[str, list[str]]]] = {}   # host -> build -> timed/same text -> tables
    known = B.load_builds(out)
    passes: set[int | None] = set()   # prompts of each table's same-text pass (None: the timed runs')
    for folder, (key, label, backbone) in ((f, k) for f in (out, *other_hosts(out)) for k in HEADLINE_MODELS):
        m = load_modes(folder, key)
        if not m:
            continue
        host = host_line(m).split(", load")[0]
        rows = by_host.setdefault(host, [])
        passes.add((m.get("same_text") or {}).get("prompts"))
        st = m.get("same_text") or {}
        timed, text = B.build_of(m), st.get("build", B.build_of(m))
        # a pass run elsewhere under this host's CPU variant (--as-host) is said, never passed off as this host's
        made = f" (made on {st['host'].removeprefix('host ')}, under ggml's {st['cpu_variant']} variant)" if st.get("as_host") else ""
        for b, what in ((timed, "timed rows"), (text, "same-text counts" + made)):
            used.setdefault(host, {}).setdefault(b, {}).setdefault(what, []).append(label)
        for c, d in m["configs"].items():
            if c not in HEADLINE_CONFIGS:
                continue
            lo, hi = d.get("ratio_ci95") or (d["ratio_min"], d["ratio_max"])
            mem = (d.get("memory") or {}).get("peak_mib")
            name = {"backbone": backbone, "shipped": "the shipped file"}.get(c, c)
            # a backbone row: the backbone's own file (files.prepare_files' plain-f16), not the river GGUF it ran from
            notes = m.get("notes") or {}
            own = (notes.get("file_bytes", {}).get("plain-f16") or notes.get("backbone_bytes")) if c == "backbone" else None
            mib = own / 2**20 if own else d["file_mib"]
            rows.append(f"| {label} | {name} | {d['tok_s_median']:.1f} | {d['ratio_median']:.2f}x ({lo:.2f}-{hi:.2f}) | "
                        f"{dash(paired_ratio(m, c, 'shipped'), '{:.2f}x')} | {dash(paired_ratio(m, c, 'q8_0'), '{:.2f}x')} | "
                        f"{d['identical_runs']}/{d['runs']} | "
                        f"{mib:.0f} | {dash(mem, '{:.0f}')} | {_short(timed)} / {_short(text)} |")
    if not by_host:
        return []
    ups = [u for m in (SMOL, QWEN, QWEN15) if (u := load_record(out, f"upcast_{m}"))]
    moved = (f" ({min(u['moved_share'] for u in ups):.0%}-{max(u['moved_share'] for u in ups):.0%} of them move, "
             f"each by at most {max(u['max_rel'] for u in ups):.2g} of its value where F16 is normal; "
             "docs/results.md)") if ups else ""
    out_lines = ["Greedy decoding; every configuration alternates in one process on the same chat prompts; median over "
                 "rounds and prompts with a bootstrap 95% interval. *Same text*: runs whose every token equals the "
                 f"backbone's{_same_text_words(passes)}. The offline models ship quantized and the backbone is their F16 upcast: the shipped "
                 f"weights rounded to F16{moved}, a close twin of the shipped file but not a copy, so a speed-up over the "
                 "backbone is not one over the file you have: that is the next column (and *x plain Q8_0* the one after: paired medians over the same rounds and prompts). Q8_0/Q4_K_M/Q4_0 are llama-quantize of the backbone. Peak memory: a fresh process "
                 "loading the file(s) and generating. *File MiB*: a backbone row's is the backbone alone (it ran from the "
                 "river GGUF with the river off), an exact row's the river GGUF (both weight sets). The rows *shipped weights + river* and *Q8_0 + river* are river "
                 "GGUFs whose backbone is the shipped file's own tensors or Q8_0: every configuration there runs with "
                 "flash attention, under which ggml's batched attention rounds as its one-token path does; exact mode "
                 "drafts only as far as its start-up probe finds batch rows exact (Q8_0: every size measured; the "
                 "shipped Q4_K_M on AMD Zen 4: 3 rows), and *same text* compares with that backbone."
                 + _before(used, known), ""]
    for host, rows in by_host.items():
        out_lines += [f"*{host}:*", "",
                      "| model | config | tok/s | x backbone (95% CI) | x shipped file | x plain Q8_0 | same text as backbone "
                      "| file MiB | peak MiB | build (timed / same text) |",
                      "|---|---|---|---|---|---|---|---|---|---|", *rows, "", _legend(used[host], known), ""]
    return out_lines + ["Generated by `.venv/bin/python -m bench.steps report` from `bench/results/modes_*.json`, their same-text "
                        "passes `text_*.json` and `builds.json` (another host's from `bench/results/hosts/NAME/`); every "
                        "drafter, mode and figure in [docs/results.md](docs/results.md)."]


def _before(used: dict, known: dict) -> str:
    """The intro's word on builds: which timed rows predate batch invariance."""
    old = sorted({b for h in used.values() for b, roles in h.items() if "timed rows" in roles and B.predates(b, known)})
    return (" *Build*: patches/build.py's series hash, as each JSON records it (timed rows / same-text counts)"
            + (f"; the rows timed on {', '.join(f'`{_short(b)}`' for b in old)} were measured before patch 0013 "
               "(batch invariance)" if old else "") + ".")


def _short(b: str | None) -> str:
    return b[:8] if b else "not recorded"


def _legend(used: dict[str | None, dict[str, list[str]]], known: dict) -> str:
    """Under a table: each build it shows, what it gave, and whether the table mixes builds."""
    parts = [f"`{_short(b)}` = {B.words(b, known)}: " + "; ".join(f"{what} of " + ", ".join(f'"{x}"' for x in labels)
                                                                for what, labels in used[b].items()) for b in used]
    mixed = (f"This table mixes {len(used)} builds (bench/builds.py matches each to its patch series): "
             if len(used) > 1 else "One build: ")
    return mixed + "; ".join(parts) + "."


def _same_text_words(passes: set[int | None]) -> str:
    counted = sorted(n for n in passes if n)
    if not counted:
        return " (the timed runs)"
    n = f"{counted[0]}" if len(counted) == 1 else f"{counted[0]}-{counted[-1]}"
    return (f", each configuration run once on each of {n} distinct chat prompts, untimed"
            + ("; the timed runs where a table has no such pass" if None in passes else "") + " (docs/results.md "
            "says where each count was made)")


HEADLINE = ("<!-- headline:begin (generated by `.venv/bin/python -m bench.steps report`) -->", "<!-- headline:end -->")
