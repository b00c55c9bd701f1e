"""River GGUF tools: build a river GGUF from a base model, quantize with ggml, inspect and validate."""
from .build import build_river, set_river_keys
from .inspect import check, format_report, inspect_gguf, validate
from .quant import quantize
from .tiny import write_tiny_model

__all__ = ["build_river", "check", "format_report", "inspect_gguf", "quantize", "set_river_keys", "validate",
           "write_tiny_model"]
