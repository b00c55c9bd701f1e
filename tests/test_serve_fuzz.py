"""`river serve` against requests drawn at random from a fixed seed: every field of the request types with wrong
types, out-of-range values and odd Unicode, and random grammars, JSON schemas and sizes. The server answers every
request (a 200, or a 4xx naming the problem: never a 5xx, a traceback, a hang or a dead process), and a reference
request keeps its text. Bounded in count and time (a tiny model, --request-seconds 5)."""
from __future__ import annotations

import json
import random
import time

import pytest

from test_serve import _serve
from test_serve_faults import call

openai = pytest.importorskip("openai")
capi = pytest.importorskip("river_edge.runtime.capi")
pytestmark = pytest.mark.skipif(not capi.runtime_is_patched(), reason="needs the patched llama-cpp-python")

COMPLETION = {"model": "tiny:exact", "prompt": "the river", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny:exact", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
ODD = ["", "\u0000", "\udcff", "\u202e\u0301", "\U0001d518", "\ufeff", "a" * 5000, " ", "²", "--5", "1_0", "\n"]
NUMBERS = [-1, 0, 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 63, 2 ** 64 + 1, 1e308, -1e308, 1e-46, 5e-324, 0.5, -0.0]
WRONG = [None, True, False, [], {}, [1, "a"], {"a": 1}, "x"]


@pytest.fixture(scope="module")
def fuzzed(tiny_llama):
    srv = _serve(tiny_llama, "--request-seconds", "5")
    client = next(srv)
    yield client.base_url.port
    srv.close()


def _answered(port: int, path: str, body, what) -> int:
    t = time.monotonic()
    status, _, text = call(port, path, body, timeout=60)
    assert isinstance(status, int) and status < 500, (what, status, text[:300])
    if status != 200:
        msg = json.loads(text)["error"]["message"]
        assert msg and "Traceback" not in msg and "\n" not in msg.strip(), (what, msg)
    assert time.monotonic() - t < 30, what
    return status


def _reference(port: int) -> str:
    status, _, text = call(port, "/v1/completions", {**COMPLETION, "prompt": "the cat sat", "max_tokens": 12})
    assert status == 200, text
    return json.loads(text)["choices"][0]["text"]


def test_every_field_with_wrong_types_odd_values_and_odd_unicode(fuzzed):
    from llama_cpp.server import types as T

    port, rng = fuzzed, random.Random(43)
    want = _reference(port)
    deadline = time.monotonic() + 120
    for path, base, kind in (("/v1/completions", COMPLETION, T.CreateCompletionRequest),
                             ("/v1/chat/completions", CHAT, T.CreateChatCompletionRequest)):
        for field in kind.model_fields:
            keyed = [{k: 1} for k in ODD]   # odd keys, for the fields that are maps
            for value in WRONG + NUMBERS + ODD + keyed + [rng.choice(NUMBERS) * rng.random()]:
                body = {**base, field: value}
                if field in ("max_tokens", "min_tokens") and isinstance(value, int) and value > 64:
                    body["max_tokens"] = 64   # a long answer is fine, but not 2^31 of them in a bounded test
                _answered(port, path, body, (field, value))
                assert time.monotonic() < deadline, "out of time"
    assert _reference(port) == want


DRAWN: set = set()


def _grammar(rng: random.Random) -> str:
    """Junk from GBNF's alphabet, or one of the shapes that crashed or held the server, at a random size."""
    kind = rng.choice(("junk", "deep", "repeats", "doubling", "chain"))
    n = rng.choice([3, 1100, 30000])
    DRAWN.add((kind, n))
    if kind == "deep":
        return "root ::= " + "(" * n + '"a"' + ")" * n
    if kind == "repeats":
        return "root ::= " + " ".join(['"a"{0,1999}'] * min(n, 1000))
    if kind == "doubling":
        n = min(n, 40)
        return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
    if kind == "chain":
        return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
    parts = ['"a"', '"\\x00"', "[a-z]", "[^a]", "[b-a]", "(", ")", "|", "*", "+", "?", "{0,1999}", "{3}", "{2001}",
             "<[5]>", "<[99999]>", "x", " ", "\n", "x ::= ", '"\\u00e9"', "#c\n", "."]
    return "root ::= " + "".join(rng.choice(parts) for _ in range(rng.randint(1, 60))) + '\nx ::= "x"'


def _schema(rng: random.Random):
    leaf = rng.choice([{"type": "string", "maxLength": rng.choice([0, 5, 900, 901, 30000])},
                       {"type": "integer", "minimum": rng.choice([0, -5, 10 ** 30])},
                       {"type": "array", "items": {"type": "boolean"}, "maxItems": rng.choice([3, 2000])},
                       {"const": rng.choice(["a", "\u0000", "é"])}, {"enum": ["x", 1, None]},
                       {"type": "string", "pattern": rng.choice(["^[a-z]{2,4}$", "a{0,5000}", "(" * 40 + ")" * 40])},
                       {"$ref": rng.choice(["#/nowhere", "https://example.com/s.json"])}, {"type": "nonsense"}])
    for _ in range(rng.choice([0, 1, 3, 70])):
        leaf = rng.choice([{"type": "array", "items": leaf}, {"type": "object", "properties": {"p": leaf}}])
    return leaf


def test_random_grammars_schemas_and_sizes(fuzzed):
    port, rng = fuzzed, random.Random(2)
    want = _reference(port)
    deadline = time.monotonic() + 45
    seen = set()
    for i in range(100):
        kind = rng.choice(("grammar", "schema", "tools", "size"))
        if kind == "grammar":
            path, body = "/v1/completions", {**COMPLETION, "grammar": _grammar(rng)}
        elif kind == "schema":
            path, body = "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object",
                                                                             "schema": _schema(rng)}}
        elif kind == "tools":
            tool = {"type": "function", "function": {"name": "f", "parameters": _schema(rng)}}
            path, body = "/v1/chat/completions", {**CHAT, "tools": [tool], "tool_choice": rng.choice(
                ["auto", {"type": "function", "function": {"name": rng.choice(["f", "g"])}}])}
        else:
            path, body = "/v1/completions", {**COMPLETION, "prompt": rng.choice(["word ", "日本", "\U0001d518"])
                                             * rng.choice([1, 100, 10_000, 1_000_000])}
        seen.add((kind, _answered(port, path, body, (i, kind, str(body)[:200]))))
        assert time.monotonic() < deadline, "out of time"
    assert {k for k, s in seen if s == 400} >= {"grammar", "schema", "size"}   # the draws reached the refusals
    assert {("deep", 30000), ("repeats", 1100), ("doubling", 1100), ("chain", 30000)} <= DRAWN   # and the crashes
    assert _reference(port) == want
