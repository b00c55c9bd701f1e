"""`river serve`: llama-cpp-python's OpenAI app over a river GGUF, started on 127.0.0.1 in a subprocess and
driven with the `openai` client package, as a user's own client would."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
capi = pytest.importorskip("river_edge.runtime.capi")
pytestmark = pytest.mark.skipif(not capi.runtime_is_patched(), reason="needs the patched llama-cpp-python")

MSGS = [{"role": "user", "content": "say something"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from _serve(tiny_llama)


def _serve(model, *args):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "river_edge.cli.main", "serve", str(model), "--port", str(port),
                          "--name", "tiny", "--ctx", "512", "-t", "1", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    deadline = time.time() + 60
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if p.poll() is not None or time.time() > deadline:
                p.kill()
                pytest.fail(f"river serve did not start: {p.stdout.read()}")
            time.sleep(0.2)
    client.process = p   # its output: the server's lines
    try:
        yield client
    finally:   # also when a test closes the generator
        p.terminate()
        p.wait(10)


def _chat(client, model, **kw):
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=24, temperature=0, **kw)
    return r.choices[0].message.content


def test_models_lists_every_mode(server):
    ids = [m.id for m in server.models.list().data]
    assert ids == ["tiny", "tiny:exact", "tiny:gated", "tiny:river", "tiny:fast", "tiny:backbone"]


def test_exact_writes_the_backbones_text_and_fast_does_not(server):
    backbone = _chat(server, "tiny:backbone")
    assert _chat(server, "tiny:exact") == backbone
    assert _chat(server, "tiny") == backbone          # the server's default mode: exact
    assert _chat(server, "tiny:fast") != backbone     # the mode really changes per request
    assert _chat(server, "tiny:exact") == backbone    # and a lossy request leaves nothing behind
    r = server.completions.create(model="tiny:exact", prompt="the cat", max_tokens=16, temperature=0)
    b = server.completions.create(model="tiny:backbone", prompt="the cat", max_tokens=16, temperature=0)
    assert r.choices[0].text == b.choices[0].text


def test_streaming(server):
    chunks = server.chat.completions.create(model="tiny:exact", messages=MSGS, max_tokens=24, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _chat(server, "tiny:backbone")


def test_two_concurrent_clients(server):
    want = {m: _chat(server, f"tiny:{m}") for m in ("exact", "fast")}
    got = {}

    def ask(m):
        got[m] = _chat(server, f"tiny:{m}")
    threads = [threading.Thread(target=ask, args=(m,)) for m in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


@pytest.mark.parametrize("model, fragment", [("tiny:turbo", "unknown mode 'turbo'"),
                                             ("other", "unknown model 'other'")])
def test_bad_model_names_are_400s(server, model, fragment):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            server.chat.completions.create(model=model, messages=MSGS, max_tokens=4, stream=stream)
        assert fragment in str(e.value)


@pytest.mark.parametrize("kw, fragment", [(dict(logprobs=True, top_logprobs=2), "logprobs are not served"),
                                          (dict(n=3), "n = 3")])
def test_what_the_server_cannot_answer_is_a_400_not_a_500(server, kw, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat.completions.create(model="tiny:exact", messages=MSGS, max_tokens=4, **kw)
    assert fragment in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        server.completions.create(model="tiny", prompt="the cat", max_tokens=4, **({"logprobs": 2} if "logprobs" in kw else kw))
    assert fragment in str(e.value)


def _post(url: str, body) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_route_checks_the_model_and_copilot_gets_the_default_mode(server):
    base = str(server.base_url).removesuffix("/").removesuffix("/v1")
    code, r = _post(f"{base}/extras/tokenize", {"model": "other", "input": "hi"})
    assert code == 400 and "unknown model 'other'" in r["error"]["message"]
    code, r = _post(f"{base}/extras/tokenize", {"model": "tiny:fast", "input": "hi"})
    assert code == 200 and r["tokens"]
    code, r = _post(f"{base}/v1/engines/copilot-codex/completions", {"prompt": "the cat", "max_tokens": 16,
                                                                      "temperature": 0})
    b = server.completions.create(model="tiny:exact", prompt="the cat", max_tokens=16, temperature=0)
    assert code == 200 and r["choices"][0]["text"] == b.choices[0].text


@pytest.mark.parametrize("body, fragment", [(b"{bad", "not JSON"), (b"[1, 2]", "not a JSON object"),
                                            (b'{"model": 5, "prompt": "x"}', "model must be a string"),
                                            (b'{"prompt": ""}', "the prompt is empty"),
                                            (b'{"prompt": "a\\udcffb"}', "'prompt': not valid Unicode")])
def test_a_malformed_body_is_a_400(server, body, fragment):
    base = str(server.base_url).removesuffix("/").removesuffix("/v1")
    code, r = _post(f"{base}/v1/completions", body)
    assert code == 400 and fragment in r["error"]["message"]


def test_a_negative_seed_is_llama_cpps_random_seed_in_every_mode(server):
    for mode in ("exact", "backbone"):
        r = server.completions.create(model=f"tiny:{mode}", prompt="the cat", max_tokens=8, temperature=1.0, seed=-1)
        assert r.choices[0].finish_reason in ("length", "stop")


def test_a_taken_port_is_one_line_before_serving(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "river_edge.cli.main", "serve", str(tiny_llama), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "cannot serve on 127.0.0.1" in r.stderr and "serving" not in r.stderr


def test_messages_the_chat_template_refuses_are_a_400(tiny_llama, tmp_path):
    """A template's raise_exception (here: roles must alternate, as Mistral's and Llama 2's templates demand) or a
    failing expression was a 500 from llama-cpp-python's app; it is a 400 naming the template's reason, and the
    server answers on. Messages are rendered as the app renders them: a key its validation drops is no reason."""
    from gguf import GGUFValueType
    from gguf_edit import rewrite

    template = ("{% for m in messages %}{% if m.thinking is defined %}{{ raise_exception('thinking') }}{% endif %}"
                "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{{ '<' + m['content'] }}"
                "{% endfor %}")
    model = rewrite(tiny_llama, tmp_path / "t.gguf", keys={"tokenizer.chat_template": (template, GGUFValueType.STRING)})
    client = next(srv := _serve(model))
    try:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=MSGS * 2, max_tokens=2, stream=stream)
            assert "chat template cannot render these messages: ValueError: roles must alternate" in str(e.value)
        parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]   # '<' + a list
        with pytest.raises(openai.BadRequestError, match="TypeError"):
            client.chat.completions.create(model="tiny", messages=parts, max_tokens=2)
        turns = [*MSGS, {"role": "assistant", "content": "ok", "thinking": "hm"}, *MSGS]   # the app drops "thinking"
        assert client.chat.completions.create(model="tiny", messages=turns, max_tokens=2).choices[0].message.content
    finally:
        srv.close()


def test_each_request_is_one_line_of_the_servers_output(tiny_llama):
    """As llama.cpp's server prints each request's timings: the mode, the tokens, the drafts that stood among them
    (each Token's `draft`, in the modes that draft) and the decode speed."""
    client = next(srv := _serve(tiny_llama))
    try:
        client.completions.create(model="tiny:exact", prompt="one two one two one two", max_tokens=16, temperature=0)
        client.completions.create(model="tiny:backbone", prompt="the cat", max_tokens=8, temperature=0)
    finally:
        srv.close()
    lines = [x for x in client.process.stdout.read().splitlines() if x.startswith("request: ")]
    assert len(lines) == 2, lines
    exact = re.fullmatch(r"request: exact mode, (\d+) tokens \((\d+) from drafts\), [\d.]+ tok/s", lines[0])
    assert exact and int(exact[2]) <= int(exact[1]) <= 16, lines[0]
    assert re.fullmatch(r"request: backbone mode, \d+ tokens, [\d.]+ tok/s", lines[1]), lines[1]
