"""Tiny random GGUFs of every supported architecture for tests: real layout, byte-level BPE tokenizer, ChatML
template."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType

from river_edge.format import ARCHITECTURES, RiverError

from . import quant
from .build import build_river

# ChatML, as SmolLM2-Instruct and Qwen2.5-Instruct use; llama.cpp's chat handler renders it.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A handful of English merges so that text tokenizes into more than bytes (each uses earlier ones).
MERGES = ("Ġ t", "h e", "i n", "e r", "a n", "Ġ a", "o n", "r e", "Ġt he", "Ġ s", "o u", "e n", "a t",
          "Ġ w", "Ġ o", "i s", "Ġ c", "o r", "e s", "in g", "Ġ i", "l l", "Ġ h", "Ġ 1", "Ġ =", "Ġ (")
# the pre-tokenizers of the real models we use (Gemma's and Mistral's vocabularies are not BPE: any will do)
PRE = {"llama": "smollm", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3": "default", "mistral3": "default"}
# Llama 3's rope_freqs for a head of `n_rot`: each pair's frequency divided by 1 (fast) .. 8 (slow), smoothly
# between, as Llama 3.x ships them (factor 8, low/high frequency factors 1/4, an 8192-token original context)


def llama3_rope_freqs(n_rot: int, base: float) -> np.ndarray:
    wavelen = 2 * np.pi * base ** (np.arange(0, n_rot, 2) / n_rot)
    smooth = np.clip((8192 / wavelen - 1) / (4 - 1), 0, 1)
    return (1 / ((1 - smooth) / 8 + smooth)).astype(np.float32)


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map, in GPT-2's token order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:  # unprintable bytes map to U+0100 and up, in byte order
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return [chr(c) for c in cs]


def vocabulary(vocab: int | None = None) -> tuple[list[str], list[int], int]:
    """(tokens, token types, id of the first special token); `vocab` pads with unused tokens."""
    tokens = _byte_tokens() + [m.replace(" ", "") for m in MERGES]
    first_special = len(tokens)
    tokens += SPECIAL
    types = [TokenType.NORMAL] * first_special + [TokenType.CONTROL] * len(SPECIAL)
    if vocab is not None:
        if vocab < len(tokens):
            raise RiverError(f"vocab must be at least {len(tokens)}")
        pad = vocab - len(tokens)
        tokens += [f"<|unused_{i}|>" for i in range(pad)]
        types += [TokenType.UNUSED] * pad
    return tokens, [int(t) for t in types], first_special


def write_tiny_model(path: str | Path, arch: str = "llama", n_layer: int = 4, n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, vocab: int | None = None, seed: int = 0,
                     wtype: str = "f32", tie_embeddings: bool = False, river: str | None = None,
                     backbone: str = "f16", n_ctx: int = 2048, head_dim: int | None = None,
                     rope_freqs: bool = False, n_swa: int = 0, swa_pattern: int | None = None) -> Path:
    """Write a random model at `path`; with `river` a river GGUF (built from it with `backbone`).

    `wtype` is the type of the 2-D weights (f32, or a ggml type such as q4_1 to look like a shipped
    model); norms and biases are F32. `tie_embeddings`: no output.weight, as SmolLM2 and Qwen2.5-0.5B ship.
    `head_dim`: other than n_embd / n_head (Gemma 3's is). `rope_freqs`: Llama 3's RoPE frequency tensor (llama).
    `n_swa`: Gemma 3's sliding window (every layer but each 6th slides, or each `swa_pattern`-th). mistral3 gets an attention temperature
    that starts at position 4, so short sequences exercise it.
    """
    if arch not in ARCHITECTURES:
        raise RiverError(f"unsupported architecture '{arch}': river-edge supports {', '.join(ARCHITECTURES)}")
    if rope_freqs and arch not in ("llama", "mistral3"):
        raise RiverError(f"{arch} reads no rope_freqs tensor")
    if n_embd % n_head or n_head % n_head_kv:
        raise RiverError("n_embd must divide by n_head and n_head by n_head_kv")
    path = Path(path)
    if river is not None:
        fd, base = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".base.gguf")
        os.close(fd)
        try:
            write_tiny_model(base, arch, n_layer, n_embd, n_head, n_head_kv, n_ff, vocab, seed, wtype,
                             tie_embeddings, None, backbone, n_ctx, head_dim, rope_freqs, n_swa, swa_pattern)
            return build_river(base, path, backbone=backbone, river=river)
        finally:
            os.unlink(base)

    rng = np.random.default_rng(seed)
    tokens, types, sp = vocabulary(vocab)
    hd = head_dim or n_embd // n_head
    base = 500000.0 if rope_freqs else 10000.0 if arch in ("llama", "mistral3") else 1000000.0
    w = GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type(int(LlamaFileType.ALL_F32 if wtype == "f32" else quant.FILE_TYPES.get(wtype, LlamaFileType.GUESSED)))
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(base)
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if n_swa:
        w.add_sliding_window(n_swa)
    if swa_pattern is not None:
        w.add_sliding_window_pattern(swa_pattern)
    if arch == "mistral3":
        w.add_attn_temperature_scale(0.1)
        w.add_rope_scaling_orig_ctx_len(4)
    w.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(sp)  # <|endoftext|>
    w.add_eos_token_id(sp + 2)  # <|im_end|>: a chat turn ends there
    w.add_pad_token_id(sp)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def matrix(name: str, n_out: int, n_in: int, std: float) -> None:
        # numpy (n_out, n_in) = ggml [ne0 = n_in, ne1 = n_out]; 1/sqrt(n_in) keeps activations O(1).
        x = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
        if wtype == "f32":
            w.add_tensor(name, x)
        else:
            qt = quant.type_for_row(quant.ggml_type(wtype), n_in)
            w.add_tensor(name, quant.quantize(x, qt), raw_dtype=qt)

    def vector(name: str, n: int, mean: float, std: float) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n) * std).astype(np.float32))

    # Embeddings of rms ~2/sqrt(n): tied or not, logits come out with a spread of about 2.
    matrix("token_embd.weight", len(tokens), n_embd, 2.0 / np.sqrt(n_embd))
    for i in range(n_layer):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", n_embd, 1.0, 0.1)
        matrix(f"{b}.attn_q.weight", n_head * hd, n_embd, n_embd ** -0.5)
        matrix(f"{b}.attn_k.weight", n_head_kv * hd, n_embd, n_embd ** -0.5)
        matrix(f"{b}.attn_v.weight", n_head_kv * hd, n_embd, n_embd ** -0.5)
        if arch == "qwen2":
            vector(f"{b}.attn_q.bias", n_head * hd, 0.0, 0.1)
            vector(f"{b}.attn_k.bias", n_head_kv * hd, 0.0, 0.1)
            vector(f"{b}.attn_v.bias", n_head_kv * hd, 0.0, 0.1)
        if arch in ("qwen3", "gemma3"):   # per-head RMS norms of q and k
            vector(f"{b}.attn_q_norm.weight", hd, 1.0, 0.1)
            vector(f"{b}.attn_k_norm.weight", hd, 1.0, 0.1)
        matrix(f"{b}.attn_output.weight", n_embd, n_head * hd, (n_head * hd) ** -0.5)
        if arch == "gemma3":   # norms after attention and after the FFN
            vector(f"{b}.post_attention_norm.weight", n_embd, 1.0, 0.1)
            vector(f"{b}.post_ffw_norm.weight", n_embd, 1.0, 0.1)
        vector(f"{b}.ffn_norm.weight", n_embd, 1.0, 0.1)
        matrix(f"{b}.ffn_gate.weight", n_ff, n_embd, n_embd ** -0.5)
        matrix(f"{b}.ffn_up.weight", n_ff, n_embd, n_embd ** -0.5)
        matrix(f"{b}.ffn_down.weight", n_embd, n_ff, n_ff ** -0.5)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(hd, base))
    vector("output_norm.weight", n_embd, 1.0, 0.1)
    if not tie_embeddings:
        matrix("output.weight", len(tokens), n_embd, 2.0 / np.sqrt(n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
