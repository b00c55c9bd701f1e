"""The GGUF's own tokenizer and chat template, through llama.cpp (vocab only: no weights are loaded)."""
from __future__ import annotations

import contextlib
import ctypes
from functools import cached_property
from pathlib import Path

from .format import RiverError


def _log_text(text: bytes) -> str:
    return text.decode("utf-8", errors="replace")


@contextlib.contextmanager
def quiet_llama_logs():
    """Swallow llama.cpp's log lines (model loading chatter such as "llama_context: n_ctx_seq (512) >
    n_ctx_train ...") while the block runs; yields the list of lines, for error messages.

    `verbose=False` is not enough: llama-cpp-python 0.3.36 maps ggml's log levels with an older enum, so
    WARN (3) counts as ERROR and is printed. Swapping the log callback leaves file descriptors alone
    (suppress_stdout_stderr would dup2 over fds 1/2 and hide a progress bar drawn by another thread).
    """
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []
    interrupted: list[bool] = []

    @llama_cpp.llama_log_callback
    def swallow(level, text, user_data):
        try:
            lines.append(_log_text(text))
        except KeyboardInterrupt:   # Ctrl-C lands here during a load: ctypes would print it and drop it
            interrupted.append(True)

    llama_cpp.llama_log_set(swallow, ctypes.c_void_p(0))
    try:
        yield lines
    finally:  # back to llama-cpp-python's own callback (module-level: never garbage-collected)
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    if interrupted:   # raised once llama.cpp has returned, so the command exits 130 instead of running on
        raise KeyboardInterrupt


class Tokenizer:
    def __init__(self, path: str | Path):
        import llama_cpp

        with quiet_llama_logs() as log:
            try:
                self.llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            except (ValueError, RuntimeError) as e:
                why = next((ln.strip() for ln in reversed(log) if ln.strip()), "")
                raise RiverError(f"{path}: llama.cpp cannot read its vocabulary ({e}"
                                 + (f": {why})" if why else ")")) from None

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
