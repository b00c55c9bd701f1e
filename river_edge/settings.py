"""The river settings, each declared once (as llama-cpp-python's server/settings.py declares its own): the default, the
rule that bounds a value (format.py's check_*, which the loader, `river validate` and the setters apply alike) and
the help. RiverLlama's keyword arguments and setters, llm.decoding's options and the CLI's options read them here, so
a bad value gets the same one line wherever it is given."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from river_edge import format as F


@dataclass(frozen=True)
class Setting:
    name: str                   # RiverLlama's keyword argument and attribute (llm.decoding's for exact mode's options)
    default: Any
    check: Callable[..., Any]   # (value, *the model's bound where the rule has one: n_layer, kmax) -> the value
    help: str
    shown: str | None = None    # the default in words, where the GGUF or the runtime supplies it

    def __call__(self, value, *bound):
        """The value under the setting's rule, or RiverError in one line."""
        return self.check(value, *bound)


class Guarded:
    """An attribute that only its setting's rule sets (`bound(obj)`: the rule's bound on that object)."""

    def __init__(self, setting: Setting, bound: Callable[[Any], tuple] = lambda obj: ()):
        self.setting, self.bound = setting, bound

    def __set_name__(self, owner, name):
        self.slot = f"_{name}_value"

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.slot, self.setting.default)

    def __set__(self, obj, value):
        setattr(obj, self.slot, self.setting(value, *self.bound(obj)))


def _draft_k(v, kmax: int):
    """None (the cost model's k), a callable drawing k per cycle (tests sweep k so), or a whole number 0..kmax."""
    return v if v is None or callable(v) else F.check_count(v, "draft_k", 0, kmax)


def _draft_stop(v):
    return None if v is None else F.check_nonnegative(v, "draft_stop")


SETTINGS = {s.name: s for s in (
    Setting("thresholds", None, F.check_thresholds, shown="the GGUF's river.thresholds",
            help="Exit thresholds over the GGUF's calibrated ones: one cosine in [0, 1] for every layer (inf never "
                 "exits), or in Python a list of one per layer."),
    Setting("min_exit_layer", None, F.check_min_exit_layer, shown="the GGUF's river.min_exit_layer",
            help="The first layer the rule may exit after."),
    Setting("forced_exit", None, F.check_forced_exit, shown="none: the rule decides",
            help="Exit after this layer on every token: -1 all river .. n_layer - 1 the backbone."),
    Setting("mode", None, F.check_mode, shown=f"{F.DEFAULT_MODE['library']} (backbone for a GGUF without a river)",
            help="Decoding mode: exact (a drafter proposes, the backbone verifies: the stock runtime's text), gated "
                 "(backbone where the river is unsure), river (the exit rule), fast (all river), backbone (the "
                 "river off)."),
    Setting("gate", None, F.check_gate, shown="the GGUF's river.gate_entropy",
            help="Gated mode: re-decode on the backbone where the river's output entropy (nats) is at least this."),
    Setting("decide", "sync", F.check_decide,
            help="River mode's exit decision: sync (the paper's rule, a read-back per checked layer) or lagged (the "
                 "rule on the previous token's scores, no sync inside a step: for GPUs and rpc-servers)."),
    # (its rule is the runtime's: a name of the DRAFTERS table, a GGUF path or a Drafter; drafters.resolve_drafter)
    Setting("drafter", None, lambda v: v, shown="river (ngram for a GGUF without a river)",
            help="Exact mode's drafter: river, ngram (prompt lookup), ngram-cache, river+ngram, head (a trimmed LM "
                 "head drafts, the full head verifies k positions at once: greedy text), or a draft model's GGUF "
                 "(same vocabulary). The output is the stock runtime's whichever drafts; any GGUF runs exact mode "
                 "with a drafter that needs no river."),
    # (64: the start-up probe times every batch size up to kmax + 1)
    Setting("kmax", 8, lambda v: F.check_count(v, "kmax", 1, 64),
            help="Exact mode: the longest draft the cost model weighs (its probe times batches of 1..kmax+1)."),
    Setting("draft_k", None, _draft_k, shown="the cost model's k",
            help="Exact mode: draft exactly this many tokens per cycle (0..kmax), whatever the measured costs say."),
    # on the 1.5B the backbone took 64% of drafts below 0.5 and all 607 at 0.7 or more (bench/levers.py;
    # docs/design.md, section 4)
    Setting("draft_stop", 0.5, _draft_stop,
            help="Exact mode: a cycle stops drafting after a model draft whose top-1 probability is below this (that "
                 "draft is still verified; above 1: after every first draft); None drafts the cost model's k "
                 "whatever the confidence."),
)}
