"""Names of the river GGUF format (gguf_tools/FORMAT.md) and the rules for its values; the patched runtime uses
the same strings and rules."""

import math
import numbers

FORMAT_VERSION = 1

# The 2-D weights of a decoder layer that get a river twin.
LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "mistral3")
RIVER_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
BACKBONE_TYPES = ("keep", "f16", "q8_0")

KEY_VERSION = "river.format_version"
KEY_TYPE = "river.type"
KEY_LAYER_TYPES = "river.layer_types"
KEY_BACKBONE_TYPE = "river.backbone_type"
KEY_THRESHOLDS = "river.thresholds"
KEY_MIN_EXIT = "river.min_exit_layer"
KEY_CALIBRATED = "river.calibrated"
KEY_FIT_SUMMARY = "river.fit_summary"
KEY_SOURCE_SHA = "river.source_sha256"
KEY_TOOL_VERSION = "river.tool_version"
KEY_IMATRIX_SHA = "river.imatrix_sha256"
KEY_GATE = "river.gate_entropy"        # gated mode: fall back to the backbone at river entropy >= this (nats)
KEY_GATE_SUMMARY = "river.gate_summary"
KEY_HEAD_RANKING = "river.head_ranking"   # head drafting: every vocabulary id, most emitted first (Python reads it)

DEFAULT_MIN_EXIT_LAYER = 1
# The C API's sentinels (llama.h, LLAMA_RIVER_*), one meaning each: exit layers are -1 (all river) .. n_layer-1
EXIT_RULE = -2  # llama_river_set_forced_exit: no forced exit, the rule decides
EXIT_NONE = -3  # llama_river_last_exit: no ubatch ran the river graph (yet, or river off)
EXIT_LAGGED = -4  # llama_river_set_forced_exit: the rule on the previous ubatch's scores (no sync in the graph)
ERR_NONE, ERR_SIZE, ERR_VALUE, ERR_HEAD = -100, -101, -102, -103   # no river; buffer size; value; no river head

# Optional low-bit copy of the LM head; the runtime uses it only when every layer is river (drafting, `fast`).
RIVER_HEAD = "river.output.weight"
HEAD_TYPES = ("none", *RIVER_TYPES)
DEFAULT_HEAD_TYPE = "q4_0"


def head_source(tensor_names) -> str:
    """The backbone's LM head: output.weight, or the token embeddings when they are tied."""
    return "output.weight" if "output.weight" in tensor_names else "token_embd.weight"


def river_tensor(layer: int, weight: str) -> str:
    return f"river.blk.{layer}.{weight}.weight"


def backbone_tensor(layer: int, weight: str) -> str:
    return f"blk.{layer}.{weight}.weight"


class RiverError(Exception):
    """A problem with user input (a file, an argument) that is reported as one line, no traceback."""


class RiverWarning(UserWarning):
    """A setting that ran but did not do what it asked (the CLI prints it as one line)."""


# -- the rules for river keys and controls: one place for `river validate`, `inspect`, RiverLlama's setters and
# the gated mode. The patched loader and C API (patches/0002, 0004: llama_river_threshold_ok) apply the same
# rules, and tests/test_validation.py feeds the same bad files to both.

def _number(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise RiverError(f"{what} must be a number, got {type(v).__name__} {v!r}")
    return float(v)


def check_version(v) -> int:
    if v is None:
        raise RiverError(f"{KEY_VERSION} is missing (not a river GGUF written by river-edge?)")
    if isinstance(v, bool) or not isinstance(v, int) or v != FORMAT_VERSION:
        raise RiverError(f"{KEY_VERSION} {v!r} is not {FORMAT_VERSION}, the version this river-edge reads")
    return v


def check_threshold(v, what: str = "threshold") -> float:
    """A cosine threshold in [0, 1] (exit after layer l when s_l > tau_l), or +inf (never exit). Negative
    values would mean "exit whatever the layer did", which is a forced exit, not a threshold."""
    x = _number(v, what)
    if not (0.0 <= x <= 1.0 or x == math.inf):
        raise RiverError(f"{what} {x} out of range: a cosine threshold is in [0, 1], or inf (never exit)")
    return x


def check_thresholds(v, n_layer: int, what: str = "thresholds") -> list[float]:
    """One threshold for every layer, or one number for all of them."""
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return [check_threshold(v, what)] * n_layer
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise RiverError(f"{what} must be a number or a list of {n_layer} numbers, got {type(v).__name__} {v!r}")
    if len(v) != n_layer:
        raise RiverError(f"{what}: need {n_layer} values (one per layer), got {len(v)}")
    return [check_threshold(x, f"{what}[{i}]") for i, x in enumerate(v)]


def _layer(v, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise RiverError(f"{what} must be a whole number, got {type(v).__name__} {v!r}")
    if not lo <= int(v) <= hi:
        raise RiverError(f"{what} {int(v)} out of range {lo}..{hi}")
    return int(v)


def check_nonnegative(v, what: str) -> float:
    x = _number(v, what)
    if not x >= 0.0:   # (NaN too)
        raise RiverError(f"{what} {x} out of range: a number >= 0")
    return x


def check_ranking(v, n_vocab: int, what: str = "head ranking") -> list[int]:
    """The trimmed head's ranking: every vocabulary id once (0..n_vocab-1), most emitted first."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise RiverError(f"{what} must be a list of {n_vocab} token ids, got {type(v).__name__}")
    if len(v) != n_vocab:
        raise RiverError(f"{what}: need {n_vocab} token ids (the vocabulary), got {len(v)}")
    seen = bytearray(n_vocab)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < n_vocab or seen[t]:
            raise RiverError(f"{what}[{i}] {t!r}: every id 0..{n_vocab - 1} must appear once")
        seen[t] = 1
    return [int(t) for t in v]


def check_min_exit_layer(v, n_layer: int, what: str = "min exit layer") -> int:
    return _layer(v, what, 0, n_layer - 1)


def check_forced_exit(v, n_layer: int) -> int | None:
    """None (the rule decides), -1 (all river) .. n_layer - 1 (backbone)."""
    return None if v is None else _layer(v, "forced exit layer", -1, n_layer - 1)


# The decoding modes (RiverLlama(mode=...), `river chat/serve --mode`, the benchmarks' configurations); the first
# two own the decoding loop (runtime/exact.py, runtime/gated.py), the others are one llama.cpp decode per token with
# the river set so
MODES = ("exact", "gated", "river", "fast", "backbone")
LOOP_MODES = ("exact", "gated")
LOSSLESS_MODES = ("exact", "backbone")   # their text is the stock runtime's on the same file: backbone K/V only
# Each front end's default. The library (and `river chat`, which is the library's loop) runs the paper's method (the
# rule: river); `river serve` runs exact mode, because an API client asks for the model's text and exact mode is that
# text. A GGUF without a river runs as the stock model (backbone) everywhere.
DEFAULT_MODE = {"library": "river", "serve": "exact"}


def check_mode(m) -> str:
    if m not in MODES:
        raise RiverError(f"unknown mode {m!r}: use one of {', '.join(MODES)}")
    return m


def split_mode(config: str) -> tuple[str, str]:
    """The one reading of `mode[:variant]` (exact:ngram: exact mode drafting by prompt lookup; river:lagged: the rule
    decided a step late): (mode, variant, "" for none). The mode is one of MODES; which variants run is the engine's
    to say."""
    mode, _, variant = str(config).partition(":")
    if mode not in MODES:
        raise RiverError(f"unknown mode {mode!r} in {config!r}: use one of {', '.join(MODES)}")
    return mode, variant


def default_mode(has_river: bool, front: str = "library") -> str:
    return DEFAULT_MODE[front] if has_river else "backbone"


DECISIONS = ("sync", "lagged")   # how the rule reads the scores: per layer as it runs, or the previous step's


def check_decide(v) -> str:
    """The rule's decision: sync (the paper's rule: each checked layer's score read as it finishes, a sync per
    layer) or lagged (the exit chosen from the previous step's scores, all read once after the step)."""
    if v not in DECISIONS:
        raise RiverError(f"decide {v!r}: use one of {', '.join(DECISIONS)}")
    return v


# Loading limits, checked before llama.cpp sees a value: its context length is 32-bit (2^32 wraps to a tiny
# context that then aborts) and sizes arrays up front; ggml runs at most GGML_MAX_N_THREADS threads.
MAX_CTX = 1 << 20
MAX_THREADS = 512


def check_count(v, what: str, lo: int, hi: int) -> int:
    """A whole number in lo..hi (numpy integers too); RiverError naming `what` otherwise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
        raise RiverError(f"{what} {v!r}: a whole number in {lo}..{hi}")
    return int(v)


def check_gate(v, what: str = "gate") -> float:
    """The gated mode's entropy gate, in nats: >= 0 (0: always the backbone), or inf (never)."""
    x = _number(v, what)
    if not (x >= 0.0):
        raise RiverError(f"{what} {x} out of range: an entropy gate is >= 0 nats, or inf")
    return x


def mean_depth(hist, empty: float = 0.0) -> float:
    """Mean backbone layers per step of an exit histogram (llama_river_get_histogram: counts[e + 1] = steps that
    exited after layer e, so index i means i backbone layers); `empty` when it counts nothing."""
    counts = [float(x) for x in hist]
    n = sum(counts)
    return sum(i * c for i, c in enumerate(counts)) / n if n else float(empty)
