"""Names of the river GGUF format (gguf_tools/FORMAT.md); the patched runtime uses the same strings."""

FORMAT_VERSION = 1

# The 2-D weights of a decoder layer that get a river twin.
LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ARCHITECTURES = ("llama", "qwen2")
RIVER_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
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

DEFAULT_MIN_EXIT_LAYER = 1

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
