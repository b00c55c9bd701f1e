"""What a calibration fits to (Target) and how it measures (Settings)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..format import RiverError, check_count


@dataclass
class Target:
    """What the fit must meet on average over decode tokens: kl (max mean KL), agreement (min top-1
    agreement with the backbone) or depth (max mean backbone layers per token: a speed target)."""
    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in ("kl", "agreement", "depth"):
            raise RiverError(f"unknown calibration target {self.kind!r}: use kl, agreement or depth")
        if not math.isfinite(self.value) or self.value < 0 or (self.kind == "agreement" and self.value > 1):
            raise RiverError(f"calibration target {self.kind}={self.value} is out of range")

    def met(self, m: dict) -> bool:
        return {"kl": m["kl"] <= self.value, "agreement": m["agreement"] >= self.value,
                "depth": m["depth"] <= self.value}[self.kind]


MAX_PROMPTS, MAX_TOKENS = 4096, 8192   # a calibration decodes n_prompts x max(decode, online) tokens in torch


@dataclass
class Settings:
    n_prompts: int = 16           # split into fit and test halves
    decode_tokens: int = 32       # tokens per prompt whose exit signals and damage are recorded (the fit)
    online_tokens: int = 256      # tokens per prompt of the online checks: the lengths users generate
    batch: int = 8                # prompts decoded in lockstep (each exits on its own)
    rule: str = "per-layer"       # per-layer quantile thresholds, or "single" tau
    seed: int = 0
    prompts: list[str] = field(default_factory=list)  # empty: the packaged calibration set

    def __post_init__(self):
        check_count(self.n_prompts, "n_prompts", 2, MAX_PROMPTS)
        check_count(self.decode_tokens, "decode_tokens", 1, MAX_TOKENS)
        check_count(self.online_tokens, "online_tokens", 1, MAX_TOKENS)
        check_count(self.batch, "batch", 1, MAX_PROMPTS)
        if self.rule not in ("per-layer", "single"):
            raise RiverError(f"rule {self.rule!r}: use per-layer or single")

    def recorded(self) -> dict:
        """The settings as a fit summary stores them (the prompts themselves are not kept)."""
        return {k: v for k, v in asdict(self).items() if k != "prompts"}
