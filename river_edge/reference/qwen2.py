"""Qwen2 decoder layer: llama's, with q/k/v biases (picked up from the GGUF) and NEOX RoPE on halves."""
from . import llama


class Block(llama.Block):
    neox = True
