"""The GGUF's own tokenizer and chat template, through llama.cpp (vocab only: no weights are loaded)."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from .format import RiverError


class Tokenizer:
    def __init__(self, path: str | Path):
        import llama_cpp

        try:
            self.llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise RiverError(f"{path}: llama.cpp cannot read its vocabulary ({e})") from None

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode(errors="replace")

    @cached_property
    def _chat(self):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        meta = self.llm.metadata
        template = meta.get("tokenizer.chat_template")
        if not template:
            return None
        tok = lambda key: (self.llm._model.token_get_text(int(meta[key])) if key in meta else "")
        return Jinja2ChatFormatter(template, tok("tokenizer.ggml.eos_token_id"), tok("tokenizer.ggml.bos_token_id"))

    def chat(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of a one-turn chat prompt, ready for the assistant's answer."""
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if self._chat is None:
            return [self.llm.token_bos()] + self.encode(user)
        return self.encode(self._chat(messages=msgs).prompt)
