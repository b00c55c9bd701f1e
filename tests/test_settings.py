"""Each river setting is declared once (river_edge/settings.py): RiverLlama's keyword defaults, the CLI's options and
the setters read the declaration, and a bad value gets the rule's one line through every door."""
from __future__ import annotations

import inspect
import re

import pytest

from river_edge.format import RiverError
from river_edge.settings import SETTINGS

pytest.importorskip("llama_cpp")

from river_edge.runtime.capi import runtime_is_patched  # noqa: E402

patched = pytest.mark.skipif(not runtime_is_patched(), reason="needs the patched llama-cpp-python")


def _line(fn) -> str:
    with pytest.raises(RiverError) as e:
        fn()
    return str(e.value)


def _flat(text: str) -> str:
    """A rich usage error's words, its box and wrapping taken out."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_riverllamas_keyword_defaults_are_the_declared_ones():
    from river_edge.runtime.llama import RiverLlama

    params = inspect.signature(RiverLlama.__init__).parameters
    kwargs = [n for n in SETTINGS if n in params]
    assert kwargs == ["thresholds", "min_exit_layer", "forced_exit", "mode", "gate", "decide", "drafter"]
    assert {n: params[n].default for n in kwargs} == {n: SETTINGS[n].default for n in kwargs}


def test_the_cli_options_carry_the_declared_help():
    from typer.main import get_command

    from river_edge.cli.main import app

    cmds = get_command(app).commands
    chat = {p.name: p for p in cmds["chat"].params}
    for name, opt in (("thresholds", "tau"), ("mode", "mode"), ("gate", "gate"), ("drafter", "drafter"),
                      ("decide", "decide")):
        assert chat[opt].help == SETTINGS[name].help, opt
    assert chat["gate"].show_default == SETTINGS["gate"].shown and chat["decide"].show_default == "sync"
    serve = {p.name: p for p in cmds["serve"].params}
    assert serve["mode"].help.endswith(SETTINGS["mode"].help) and serve["mode"].help.startswith("Mode of requests")


@patched
def test_a_bad_value_is_the_rules_one_line_through_every_door(tiny_llama, runner):
    from river_edge.cli.main import app
    from river_edge.runtime.llama import RiverLlama

    llm = RiverLlama(str(tiny_llama), n_ctx=64)
    L = llm.n_layer
    gate = _line(lambda: SETTINGS["gate"](-1.0))
    assert gate == "gate -1.0 out of range: an entropy gate is >= 0 nats, or inf"
    assert _line(lambda: setattr(llm, "gate", -1.0)) == gate
    assert _line(lambda: RiverLlama(str(tiny_llama), n_ctx=64, gate=-1.0)) == gate
    r = runner.invoke(app, ["chat", str(tiny_llama), "--mode", "gated", "--gate", "-1", "-p", "x"])
    assert r.exit_code == 2 and gate in _flat(r.output)
    decide = _line(lambda: SETTINGS["decide"]("eager"))
    assert _line(lambda: setattr(llm, "decide", "eager")) == decide
    assert _line(lambda: RiverLlama(str(tiny_llama), n_ctx=64, decide="eager")) == decide
    for name, bad in (("thresholds", 2.0), ("min_exit_layer", L), ("forced_exit", L)):
        assert _line(lambda: setattr(llm, name, bad)) == _line(lambda: SETTINGS[name](bad, L)), name
    assert _line(lambda: setattr(llm, "mode", "turbo")) == "unknown mode 'turbo': use one of " \
        "exact, gated, river, fast, backbone"
    assert llm.gate == llm.decoding.gate and llm.decide == "sync"   # the bad values left nothing behind


@patched
def test_exact_modes_options_are_checked_as_they_are_set(tiny_llama):
    from river_edge.runtime.llama import RiverLlama

    d = RiverLlama(str(tiny_llama), n_ctx=64, mode="exact").decoding
    assert (d.kmax, d.draft_k, d.draft_stop) == (8, None, 0.5)   # the declared defaults
    assert _line(lambda: setattr(d, "draft_k", 9)) == "draft_k 9: a whole number in 0..8"
    assert _line(lambda: setattr(d, "draft_k", "3")) == "draft_k '3': a whole number in 0..8"
    d.kmax = 12   # the bound is the model's kmax
    d.draft_k = 9
    draw = lambda: 3   # noqa: E731  (a callable drawing k per cycle stands as given)
    d.draft_k = draw
    assert d.draft_k is draw
    assert _line(lambda: setattr(d, "draft_stop", -0.5)) == "draft_stop -0.5 out of range: a number >= 0"
    assert _line(lambda: setattr(d, "draft_stop", "x")) == "draft_stop must be a number, got str 'x'"
    d.draft_stop = 1.01   # above every probability: each cycle stops after its first draft
    d.draft_stop = None
    assert d.draft_stop is None and _line(lambda: setattr(d, "kmax", 0)) == "kmax 0: a whole number in 1..64"
