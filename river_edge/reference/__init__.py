"""PyTorch reference of River-LLM over GGUF weights (the specification the runtime is tested against)."""
from .model import Cache, Policy, RiverModel, Step

__all__ = ["Cache", "Policy", "RiverModel", "Step"]
