"""`river chat`: the loop of river_edge/chat.py with scripted input, and the command in-process."""
from __future__ import annotations

import io

import pytest
from typer.testing import CliRunner

from river_edge.chat import Chat, histogram_summary, legend, load
from river_edge.cli.main import app


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return load(tiny_llama, n_ctx=512, tau=0.5)


def run(*args, code=0, input=None):
    r = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert r.exception is None or isinstance(r.exception, SystemExit), f"uncaught {r.exception!r}\n{r.output}"
    assert "Traceback" not in r.output
    assert r.exit_code == code, f"exit {r.exit_code}, wanted {code}\n{r.output}"
    return r


def test_scripted_session(llm):
    out = io.StringIO()
    chat = Chat(llm, out=out, max_tokens=6, temperature=0.0, system="Be brief.")
    script = io.StringIO("/stats\nhello there\n/stats\nsecond question\n/reset\n/stats\n\nthird\n")
    assert chat.run(script) == 0  # ends at EOF
    text = out.getvalue()
    assert text.startswith("no answers yet\n")
    assert text.count("tokens, ") >= 4 and "backbone depth" in text and "/4]" in text
    assert "1 answers" in text and "exits:" in text and "(history cleared)" in text
    # after /reset only the third turn is remembered
    assert [m["role"] for m in chat.history] == ["user", "assistant"] and chat.history[0]["content"] == "third"
    assert chat.messages()[0] == {"role": "system", "content": "Be brief."}
    # the streamed text is the assistant's answer, printed before its statistics line
    answer = chat.history[1]["content"]
    assert answer and text.rstrip().endswith("]") and answer in text


def test_quit_and_unknown_command(llm):
    out = io.StringIO()
    chat = Chat(llm, out=out, max_tokens=4)
    assert chat.run(["/bogus", "/quit", "never asked"]) == 0
    assert "unknown command /bogus" in out.getvalue() and not chat.history


def test_ctrl_c_ends_cleanly(llm):
    def lines():
        yield "hi"
        raise KeyboardInterrupt
    out = io.StringIO()
    assert Chat(llm, out=out, max_tokens=3).run(lines()) == 0


def test_color_mode_emits_ansi(llm):
    out = io.StringIO()
    chat = Chat(llm, out=out, max_tokens=8, temperature=0.0, color=True)
    turn = chat.once("colour me")
    assert "\x1b[" in out.getvalue() and turn.tokens > 0
    assert "\x1b[" in legend() and "full backbone" in legend()


def test_tau_and_no_river_applied(tiny_llama):
    a = load(tiny_llama, n_ctx=256, tau=0.25)
    assert a.thresholds == pytest.approx([0.25] * a.n_layer) and a.river_enabled
    b = load(tiny_llama, n_ctx=256, river=False)
    assert not b.river_enabled
    out = io.StringIO()
    turn = Chat(b, out=out, max_tokens=4).once("hi")
    assert turn.depth == b.n_layer and "(river off)" in out.getvalue()


def test_histogram_summary():
    assert histogram_summary([0, 0, 0, 0, 0], 4) == "exits: none yet"
    s = histogram_summary([1, 0, 3, 0, 6], 4)
    assert s.startswith("exits: full 60%, after 1 30%, all-river 10%")


def test_cli_prompt_one_turn(tiny_llama):
    r = run("chat", tiny_llama, "--prompt", "hello", "-n", "5", "--tau", "0.5", "--temp", "0")
    assert "tokens," in r.stdout and "tok/s, backbone depth" in r.stdout


def test_cli_gate(tiny_llama):
    """--gate 0: every position falls back to the backbone (the backbone's answer); a huge gate never does
    (river tokens after a backbone prefill), which differs on this prompt: the option reaches the loop."""
    def answer(*a):
        return run("chat", tiny_llama, *a, "-p", "What is 2 plus 2?", "-n", "16", "--temp", "0").stdout.splitlines()[0]
    backbone = answer("--mode", "backbone")
    assert answer("--mode", "gated", "--gate", "0") == backbone
    assert answer("--mode", "gated", "--gate", "1e9") != backbone


def test_cli_decide(tiny_llama, monkeypatch):
    """--decide lagged reaches the model the chat runs (and the rule ran under it); it needs river mode."""
    import river_edge.cli.chat as CH   # where `river chat` looks load up

    made, real = [], CH.load
    monkeypatch.setattr(CH, "load", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    run("chat", tiny_llama, "--decide", "lagged", "-p", "hello", "-n", "3", "--temp", "0")
    assert made[-1].decide == "lagged" and made[-1].forced_exit is None and made[-1].exit_histogram().sum() > 0
    r = run("chat", tiny_llama, "--mode", "exact", "--decide", "lagged", "-p", "x", code=2)
    assert "--decide needs river mode" in r.stderr


def test_cli_flash_attn(tiny_llama, monkeypatch):
    """--flash-attn reaches the context the chat runs (exact mode needs it to batch over quantized backbones)."""
    import river_edge.cli.chat as CH   # where `river chat` looks load up

    made, real = [], CH.load
    monkeypatch.setattr(CH, "load", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    run("chat", tiny_llama, "--mode", "exact", "--flash-attn", "-p", "hello", "-n", "3", "--temp", "0")
    run("chat", tiny_llama, "--mode", "exact", "-p", "hello", "-n", "3", "--temp", "0")
    assert [m.context_params.flash_attn_type for m in made[-2:]] == [1, 0]   # LLAMA_FLASH_ATTN_TYPE_ENABLED, _DISABLED


def test_cli_pipe_and_color(tiny_llama):
    r = run("chat", tiny_llama, "-n", "4", "--tau", "0.5", "--color-depth", "--system", "x", input="hi\n/stats\n")
    assert "\x1b[" in r.stdout and "1 answers" in r.stdout
    r = run("chat", tiny_llama, "-n", "4", "--no-river", input="hi\n")
    assert "(river off)" in r.stdout


def test_cli_errors(tiny_llama, tiny_llama_base, tmp_path):
    r = run("chat", tmp_path / "missing.gguf", "-p", "x", code=1)
    assert "river: error:" in r.stderr and "no such file" in r.stderr
    run("chat", tiny_llama, "--tau", "2", code=2)
    run("chat", tiny_llama, "--tau", "0.5", "--no-river", code=2)
    run("chat", tiny_llama, "--mode", "nope", code=2)
    assert "--gate needs --mode gated" in run("chat", tiny_llama, "--gate", "1", "-p", "x", code=2).stderr
    assert "--drafter needs --mode exact" in run("chat", tiny_llama, "--drafter", "ngram", "-p", "x", code=2).stderr
    r = run("chat", tiny_llama, "--mode", "exact", "--drafter", "medusa", "-p", "x", code=1)
    assert "unknown drafter 'medusa'" in r.stderr and "Traceback" not in r.stderr
    run("chat", tiny_llama, "--mode", "gated", "--gate", "-1", "-p", "x", code=2)
    assert "out of range" in run("chat", tiny_llama, "--tau", "nan", code=2).stderr
    # the rules the file format allows: inf is "never exit" / "never fall back", as in the GGUF's keys
    run("chat", tiny_llama, "--tau", "inf", "-p", "x", "-n", "2")
    run("chat", tiny_llama, "--mode", "gated", "--gate", "inf", "-p", "x", "-n", "2")
    r = run("chat", tiny_llama_base, "--tau", "0.5", "-p", "x", code=1)
    assert "river" in r.stderr and "Traceback" not in r.stderr


def test_cli_drafter(tiny_llama):
    """Exact mode answers with the backbone's text whichever drafts."""
    def answer(*a):
        return run("chat", tiny_llama, *a, "-p", "one two one two one", "-n", "16", "--temp", "0").stdout.splitlines()[0]
    backbone = answer("--mode", "backbone")
    assert answer("--mode", "exact", "--drafter", "ngram") == backbone
    assert answer("--mode", "exact", "--drafter", "river+ngram") == backbone
    # the turn's line counts the drafts that stood (each token's Step), where the mode drafts and only there
    chat = Chat(load(tiny_llama, n_ctx=256, mode="exact", drafter="ngram"), out=io.StringIO(), max_tokens=24,
                temperature=0.0)
    turn = chat.ask("one two one two one two one two")
    assert turn.drafted == chat.llm.stats()["call_drafted"] and f"tokens, {turn.drafted} drafted, " in chat.turn_line(turn)
    plain = Chat(load(tiny_llama, n_ctx=256, mode="backbone"), out=io.StringIO(), max_tokens=4, temperature=0.0)
    assert "drafted" not in plain.turn_line(plain.ask("hi"))


def test_cli_exact_on_a_plain_gguf(tiny_llama_base):
    """Exact mode on a GGUF without a river (the file a user already has): prompt lookup drafts, the answer is the
    backbone's, and the per-answer numbers say every step ran the whole backbone; the river drafter is refused."""
    def answer(*a):
        return run("chat", tiny_llama_base, *a, "-p", "one two one two one", "-n", "16", "--temp", "0").stdout
    backbone = answer("--mode", "backbone").splitlines()[0]
    out = answer("--mode", "exact", "--drafter", "ngram")
    assert out.splitlines()[0] == backbone and "Traceback" not in out
    assert answer("--mode", "exact").splitlines()[0] == backbone      # ngram by default on a plain GGUF
    r = run("chat", tiny_llama_base, "--mode", "exact", "--drafter", "river", "-p", "x", code=1)
    assert "needs a river GGUF" in r.stderr


@pytest.mark.parametrize("mode", ["exact", "gated"])
def test_the_speculative_modes_are_timed_from_their_first_token_to_their_last(tiny_llama, mode):
    """Exact and gated decode in their own loop (no logits processor to time them): their speed is still the time
    from the first token to the last, as the other modes', not the mode's own clock that includes the prefill."""
    from river_edge.meter import Meter

    llm = load(tiny_llama, mode=mode, n_ctx=512, threads=1)
    meter = Meter(llm)
    long_prompt = "Count the words in this sentence please. " * 12   # a prefill that is not negligible
    out = llm.create_completion(long_prompt, max_tokens=24, temperature=0, logits_processor=meter.processors())
    assert meter.passive and meter.samples == out["usage"]["completion_tokens"]
    # the mode's own record of the call's first and last token
    assert meter.decode_seconds() == pytest.approx(llm.stats()["call_decode_seconds"]) and meter.decode_seconds() > 0
    assert meter.decode_seconds() < llm.stats()["seconds"]   # the mode's clock counts the prefill too


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(tiny_llama):
    """One over-long line ended the whole session; now it is refused with one line and the next is answered.
    When the history outgrows the context, the oldest exchanges go and the turn's line says so."""
    small = load(tiny_llama, n_ctx=256, tau=0.5)
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(small, out=out, max_tokens=40, temperature=0.0)
    script = io.StringIO("hi\n" + "hello " * 300 + "\nstill here?\n" + "".join(f"turn {i} " * 6 + "\n" for i in range(6)))
    assert chat.run(script, err=err) == 0
    assert err.getvalue().count("does not fit the context") == 1 and "not sent" in err.getvalue()
    assert "hello hello" not in "".join(m["content"] for m in chat.history)
    assert out.getvalue().count("tokens, ") == 8 and "dropped to fit the context" in out.getvalue()


def test_text_that_is_not_utf8_is_named_and_a_piped_line_of_it_is_refused_alone(tiny_llama):
    for opt in ("--system", "--prompt"):
        r = run("chat", tiny_llama, opt, "a\udcffb", *(["-p", "x"] if opt == "--system" else []), code=1)
        assert f"{opt} is not valid UTF-8 (bytes b'\\xff'" in r.stderr
    # a negative seed is llama.cpp's random one, in exact mode as in the others
    run("chat", tiny_llama, "--mode", "exact", "--seed", "-1", "--temp", "0.8", "-p", "x", "-n", "4")
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(load(tiny_llama, n_ctx=256), out=out, max_tokens=4)
    assert chat.run(io.StringIO("hi\nb\udcffd\nho\n"), err=err) == 0
    assert "the message is not valid UTF-8" in err.getvalue() and out.getvalue().count("tokens, ") == 2


def test_a_broken_chat_template_is_one_line(tiny_llama, tmp_path):
    from gguf import GGUFValueType
    from gguf_edit import rewrite

    for template, why in (("{% if %}", "chat template (tokenizer.chat_template) does not parse"),
                          ("{% for i in range(100000000) %}x{% endfor %}", "the message was not sent: OverflowError"),
                          ("{{ raise_exception('boom') }}", "the message was not sent")):
        bad = rewrite(tiny_llama, tmp_path / "t.gguf", keys={"tokenizer.chat_template": (template, GGUFValueType.STRING)})
        r = run("chat", bad, "-p", "hi", "-n", "2", code=1)
        assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_ctrl_c_during_a_scripted_answer_exits_130(tiny_llama, monkeypatch):
    """`river chat -p` interrupted is an interrupted command (exit 130, as every verb); the interactive chat ends
    on Ctrl-C as on EOF (exit 0)."""
    def interrupted(self, text):
        raise KeyboardInterrupt
    monkeypatch.setattr(Chat, "ask", interrupted)
    run("chat", tiny_llama, "-p", "hi", code=130)
    run("chat", tiny_llama, input="hi\n", code=0)


def test_a_line_without_end_ends_the_chat_with_bounded_memory(llm, monkeypatch):
    import river_edge.chat as C
    from river_edge.format import RiverError

    monkeypatch.setattr(C, "MAX_LINE", 100)
    chat = Chat(llm, out=io.StringIO(), max_tokens=2)
    with pytest.raises(RiverError, match="longer than 100 characters"):
        chat.run(io.StringIO("hi\n" + "\0" * 10_000))
    assert len(chat.history) == 2   # "hi" was answered first


def test_ctrl_c_that_lands_in_llama_cpps_log_callback_is_not_lost(tiny_llama, monkeypatch):
    """A Ctrl-C during a model load is raised inside the ctypes log callback, where ctypes prints and drops it (the
    command ran on and exited 0); quiet_llama_logs raises it again once llama.cpp has returned."""
    import river_edge.tokenizer as T

    def interrupted(text):
        raise KeyboardInterrupt
    monkeypatch.setattr(T, "_log_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load(tiny_llama, n_ctx=64)
