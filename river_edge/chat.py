"""`river chat`: a streaming chat loop over a RiverLlama, driven by any pair of text streams.

The loop is here (testable with scripted input and an io.StringIO for output); cli/main.py only parses
options, loads the model and hands over stdin/stdout. Telemetry per answer comes from a `Meter` (meter.py).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence, TextIO

import numpy as np
from jinja2 import TemplateError  # llama-cpp-python renders chat templates with jinja2 (its dependency)

from . import format as F
from .format import RiverError
from .meter import Meter, river_active
from .tokenizer import quiet_llama_logs

RESET = "\x1b[0m"
# Colour by the share of the backbone a token ran: river from early on .. full backbone (plain text).
BANDS = ((0.25, "\x1b[31m", "<25%"), (0.50, "\x1b[33m", "25-50%"), (0.75, "\x1b[32m", "50-75%"),
         (1.00, "\x1b[36m", "75-99%"))
HELP = "commands: /reset (clear the history), /stats (session numbers), /quit (or Ctrl-D)"


def load(model: str | Path, *, tau: float | None = None, river: bool = True, threads: int | None = None,
         n_ctx: int = 4096, seed: int = 0, mode: str | None = None, **kwargs):
    """A RiverLlama for chatting: `tau` one threshold for every layer (over the GGUF's), `river=False`
    the backbone alone. A GGUF without a river runs as the stock model (tau then is an error)."""
    from river_edge.runtime.llama import RiverLlama

    if mode is not None:
        kwargs["mode"] = mode
    with quiet_llama_logs():
        llm = RiverLlama(str(model), n_ctx=n_ctx, n_threads=threads, seed=seed, **kwargs)
    if tau is not None:
        llm.thresholds = float(tau)
    if not river:
        llm.river_enabled = False
    return llm


def color_of(exit_layer: int | None, n_layer: int) -> str:
    if exit_layer is None or exit_layer >= n_layer - 1:
        return ""
    share = (exit_layer + 1) / n_layer
    return next(code for top, code, _ in BANDS if share < top or top == 1.0)


def legend() -> str:
    parts = [f"{code}{name}{RESET}" for _, code, name in BANDS] + ["full backbone"]
    return "exit depth: " + " ".join(parts)


def histogram_summary(hist: Sequence[int], n_layer: int, top: int = 4) -> str:
    """'exits: full 41%, after 17 22%, all-river 5%, ...' (the most frequent first)."""
    h = np.asarray(hist, dtype=np.int64)
    total = int(h.sum())
    if total == 0:
        return "exits: none yet"

    def name(i: int) -> str:
        e = i - 1
        return "full" if e == n_layer - 1 else ("all-river" if e < 0 else f"after {e}")
    order = [i for i in np.argsort(-h, kind="stable") if h[i] > 0]
    shown = [f"{name(i)} {100 * h[i] / total:.0f}%" for i in order[:top]]
    rest = len(order) - top
    return "exits: " + ", ".join(shown) + (f", {rest} more layers" if rest > 0 else "")


@dataclass
class Turn:
    text: str
    tokens: int
    tok_s: float
    depth: float
    seconds: float
    finish: str | None = None
    dropped: int = 0     # oldest exchanges left out because the history outgrew the context
    drafted: int | None = None   # exact and gated modes: the answer's tokens whose draft stood (runtime/token.py)


@dataclass
class Session:
    tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    answers: int = 0
    hist: np.ndarray | None = None


@dataclass
class Chat:
    """History plus streaming. `ask(text)` answers one user turn, writing the tokens to `out`."""
    llm: object
    out: TextIO = field(default_factory=lambda: sys.stdout)
    system: str | None = None
    max_tokens: int = 512
    color: bool = False
    temperature: float = 0.2
    top_p: float = 0.9
    seed: int = 0
    history: list[dict] = field(default_factory=list)
    session: Session = field(default_factory=Session)

    def __post_init__(self):
        if self.system:
            check_text(self.system, "the system prompt")

    @property
    def n_layer(self) -> int:
        return int(getattr(self.llm, "n_layer", 0))

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def reset(self) -> None:
        self.history.clear()
        self.llm.reset()  # the KV cache: the next prompt is evaluated from scratch
        if hasattr(self.llm, "reset_stats"):   # a RiverLlama (a stock Llama has no statistics)
            self.llm.reset_stats()
        self.session = Session()

    def _stream(self, meter: Meter):
        return self.llm.create_chat_completion(
            self.messages(), stream=True, max_tokens=self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, seed=self.seed, logits_processor=meter.processors())

    def ask(self, text: str) -> Turn:
        check_text(text, "the message")
        self.history.append({"role": "user", "content": text})
        meter = Meter(self.llm)
        t0 = time.perf_counter()
        pieces: list[str] = []
        finish, dropped = None, 0
        while True:
            try:
                stream = self._stream(meter)
                first = next(stream)
                break
            except (ValueError, RuntimeError, OverflowError, TemplateError) as e:
                # the history, or the history and the start of the answer, no longer fit the context: forget the
                # oldest exchange
                full = _context_full(e)
                if not full:
                    self.history.pop()
                    if isinstance(e, RuntimeError):
                        raise
                    # the model's chat template failed (jinja2's sandbox raises OverflowError for a huge range)
                    raise RiverError(f"the message was not sent: {type(e).__name__}: {e}") from None
                if len(self.history) <= 1:
                    self.history.pop()   # this message alone does not fit: not kept, the chat goes on without it
                    raise RiverError(f"the message does not fit the context of {self.llm.n_ctx()} tokens "
                                     f"({e}); it was not sent") from None
                del self.history[:2]
                dropped += 1
        try:
            for chunk in _full_context_ends(_chain(first, stream)):
                choice = chunk["choices"][0]
                piece = choice.get("delta", {}).get("content")
                finish = choice.get("finish_reason") or finish
                if piece:
                    meter.tick()
                    pieces.append(piece)
                    if self.color:
                        code = color_of(meter.exit_now() if meter.river else None, self.n_layer)
                        self.out.write(f"{code}{piece}{RESET}" if code else piece)
                    else:
                        self.out.write(piece)
                    self.out.flush()
        finally:
            answer = "".join(pieces)
            self.history.append({"role": "assistant", "content": answer})
        seconds = time.perf_counter() - t0
        steps = meter.samples
        tokens = steps - 1 if finish == "stop" and steps else steps  # the end-of-turn token is not shown
        st = self.llm.stats() if getattr(self.llm, "mode", None) in F.LOOP_MODES else {}
        turn = Turn(answer, tokens, meter.tok_s(), meter.depth(), seconds, finish, dropped, st.get("call_drafted"))
        s = self.session
        s.tokens += tokens
        s.decode_steps += meter.decode_steps()
        s.decode_seconds += meter.decode_seconds()
        s.answers += 1
        h = meter.histogram()
        s.hist = h if s.hist is None else s.hist + h
        return turn

    def turn_line(self, turn: Turn) -> str:
        river = "" if self.label() == "river on" else f" ({self.label()})"
        gone = f"; {turn.dropped} oldest exchange(s) dropped to fit the context" if turn.dropped else ""
        drafted = f", {turn.drafted} drafted" if turn.drafted is not None else ""
        return (f"[{turn.tokens} tokens{drafted}, {turn.tok_s:.1f} tok/s, backbone depth "
                f"{turn.depth:.1f}/{self.n_layer}{river}{gone}]")

    def stats(self) -> str:
        s = self.session
        if not s.answers:
            return "no answers yet"
        tok_s = s.decode_steps / s.decode_seconds if s.decode_seconds > 0 else 0.0
        h = s.hist if s.hist is not None else np.zeros(self.n_layer + 1, dtype=np.int64)
        depth = F.mean_depth(h, empty=self.n_layer)
        return (f"{s.answers} answers, {s.tokens} tokens, {tok_s:.1f} tok/s decode, backbone depth "
                f"{depth:.1f}/{self.n_layer} ({self.label()}); {histogram_summary(h, self.n_layer)}")

    def label(self) -> str:
        mode = getattr(self.llm, "mode", None)
        if not river_active(self.llm):
            return "river off"
        return f"{mode} mode" if mode in F.LOOP_MODES else "river on"

    def run(self, inp: Iterable[str] | TextIO, interactive: bool = False, err: TextIO | None = None) -> int:
        """The loop: one line per user turn; /reset, /stats, /quit; EOF or Ctrl-C ends it (returns 0).

        `inp`: a text stream or any iterable of lines (a terminal: `terminal_lines()`, which prompts);
        `interactive` prints the help line (and the colour legend) first, on `err`."""
        err = err or self.out
        if interactive:
            err.write(HELP + "\n")
            if self.color:
                err.write(legend() + "\n")
            err.flush()
        lines = _bounded_lines(inp) if hasattr(inp, "readline") else iter(inp)
        try:
            while True:
                line = next(lines, None)
                if line is None:
                    break
                text = line.strip()
                if not text:
                    continue
                if text.startswith("/"):
                    cmd = text.split()[0].lower()
                    if cmd in ("/quit", "/exit", "/q"):
                        break
                    if cmd == "/reset":
                        self.reset()
                        self.out.write("(history cleared)\n")
                    elif cmd == "/stats":
                        self.out.write(self.stats() + "\n")
                    else:
                        self.out.write(f"unknown command {cmd}; {HELP}\n")
                    self.out.flush()
                    continue
                try:
                    turn = self.ask(text)
                except RiverError as e:   # one message too long for the context: the session goes on
                    err.write(f"river: {e}\n")
                    err.flush()
                    continue
                self.out.write("\n" + self.turn_line(turn) + "\n")
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write(RESET + "\n")
            self.out.flush()
        return 0

    def once(self, prompt: str) -> Turn:
        """One scripted turn (--prompt, `river demo`): the answer streamed, then its speed and depth."""
        turn = self.ask(prompt)
        self.out.write("\n" + self.turn_line(turn) + "\n")
        self.out.flush()
        return turn


def terminal_lines(prompt: str = "> "):
    """Lines typed at a terminal, with line editing (input()); ends at EOF (Ctrl-D)."""
    try:
        import readline  # noqa: F401  (arrow keys and history for input())
    except ImportError:
        pass
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print()
            return


MAX_LINE = 1 << 20   # characters of one piped message: far past any context this runs with (n_ctx <= 2^20 tokens)


def _bounded_lines(inp: TextIO):
    """A stream's lines, each read up to MAX_LINE characters: a stream with no newline (`< /dev/zero`) ends the
    chat with a RiverError instead of filling memory."""
    while line := inp.readline(MAX_LINE + 1):
        if len(line) > MAX_LINE:
            raise RiverError(f"a line of input is longer than {MAX_LINE} characters; the chat ends there")
        yield line


def check_text(text: str, what: str) -> str:
    """The text, or a RiverError where UTF-8 cannot hold it (bytes of a command line or a pipe that Python kept as
    lone surrogates): no tokenizer can encode those."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("utf-8", "surrogateescape")
        raise RiverError(f"{what} is not valid UTF-8 (bytes {bad!r} at character {e.start})") from None
    return text


def _context_full(e: Exception) -> bool:
    """llama-cpp-python's words for a full context: it refuses a prompt longer than the context (ValueError), and
    it does not cap an answer by the room left, so its decode then fails (RuntimeError) instead of stopping."""
    return "exceed context window" in str(e) or "llama_decode returned" in str(e)


def _full_context_ends(chunks):
    """The chunks until the context is full: the answer ends there, as at max_tokens."""
    try:
        yield from chunks
    except RuntimeError as e:
        if not _context_full(e):
            raise
        yield {"choices": [{"delta": {}, "finish_reason": "length"}]}


def _chain(first, rest):
    yield first
    yield from rest
