"""runtime.grammars: the bounds a grammar or JSON schema must pass before llama.cpp (or llama-cpp-python's converter)
sees it. Pure Python: no model."""
from __future__ import annotations

import random
import time

import pytest

from river_edge.runtime.grammars import MAX_DEPTH, MAX_RULES, gbnf_problem, schema_grammar, schema_problem

V = 1000   # a vocabulary of 1000 tokens


@pytest.mark.parametrize("text", [
    'root ::= "a" [a-z]+ <[5]> ("x" | "y"){2,5}',
    'root ::= [^"\\\\\\x7F\\x00-\\x1F]*   # a comment with ( and "',
    'root ::= "a"{0,1999} "b"{3} !<[999]>',
    'root ::= [\\x00-\\x7f]',              # a class that holds NUL and more: fine
    "root ::= " + "(" * MAX_DEPTH + '"a"' + ")" * MAX_DEPTH,
])
def test_ordinary_grammars_pass(text):
    assert gbnf_problem(text, V) is None


@pytest.mark.parametrize("text, fragment", [
    ("root ::= <[1000]>", "<[1000]> is not a token id"),
    ('root ::= "a" !<[99999]>', "<[99999]>"),
    ('root ::= "\\x00"', "NUL"),
    ('root ::= "a\\u0000"', "NUL"),
    ('root ::= "\\U00000000"', "NUL"),
    ('root ::= "a"\x00', "NUL"),
    ("root ::= [\\x00]", "holds no character"),
    ("root ::= [b-a]", "holds no character"),
    ("root ::= [^\\x01-\\U0010FFFF]", "holds no character"),
    ("root ::= [\\uD800-\\uDFFF]", "holds no character"),
    ("root ::= " + "(" * (MAX_DEPTH + 1) + '"a"' + ")" * (MAX_DEPTH + 1), f"over {MAX_DEPTH} deep"),
    ("root ::= " + " ".join(['"a"{0,1999}'] * 1000), f"over {MAX_RULES} rules"),
    ("root ::= " + " ".join(['"a"*'] * (MAX_RULES + 1)), "rules"),
    ("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(MAX_RULES + 1)), "rules"),
    ('root ::= "' + "a" * 2000 + '"{2000}', "elements"),
    ('root ::= "a"{2001}', "at least 2001 times"),
    ("root ::= " + "(" * 30000 + '"a"' + ")" * 30000, "deep"),
    (b"root ::= x".decode() * 100_000, "KiB"),
    (None, "not NoneType"),
])
def test_what_llama_cpp_would_die_or_stall_on_is_refused(text, fragment):
    why = gbnf_problem(text, V)
    assert why is not None and fragment in why, why


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 200}, "n": {"type": "integer"}},
     "required": ["name"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 1000}, "maxItems": 50},
    {"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"},
    {"type": "string", "pattern": "^[a-z]{2,8}$"},
])
def test_ordinary_schemas_convert(schema):
    why, gbnf = schema_grammar(schema, V)
    assert why is None and "root ::=" in gbnf


@pytest.mark.parametrize("schema, fragment", [
    ({"const": "\u0000"}, "NUL"),
    ({"type": "string", "maxLength": 30000}, "schema.maxLength = 30000"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 30000}, "maxItems"),
    ({"type": "string", "minLength": 1.5}, "minLength"),
    ({"type": "string", "minLength": True}, "minLength"),
    ({"properties": {f"p{i}": {"type": "string", "maxLength": 800} for i in range(3)}}, "add up to over"),
    ({"type": "integer", "minimum": 10 ** 300}, "minimum"),
    ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    ({"type": "string", "pattern": "a{0,5000}"}, "pattern"),
    ({"type": "string", "pattern": "(" * 40 + ")" * 40}, "nested over 32"),
    ({"$ref": "#/nowhere"}, "cannot be turned into a grammar"),
])
def test_schemas_past_the_bounds_are_refused(schema, fragment):
    why, _ = schema_grammar(schema, V)
    assert why is not None and fragment in why, why


def test_a_deep_schema_is_refused_without_recursion():
    deep = {"type": "string"}
    for _ in range(100_000):
        deep = {"type": "array", "items": deep}
    why = schema_problem(deep)
    assert why is not None and "nests over" in why


def test_random_grammars_are_judged_quickly():
    """Random text from GBNF's alphabet: every answer is None or a reason, each in well under a second."""
    rng = random.Random(7)
    alphabet = ['"a"', '"\\x00"', "[a-z]", "[^a]", "(", ")", "|", "*", "+", "?", "{0,1999}", "{3}", "<[5]>",
                "<[5000]>", "x", " ", "\n", "root ::= ", "x ::= ", "#c\n", "."]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
        t = time.perf_counter()
        why = gbnf_problem(text, V)
        assert why is None or isinstance(why, str)
        assert time.perf_counter() - t < 1.0


@pytest.mark.parametrize("text", [
    "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | r{i + 1}\n" for i in range(30)) + 'r30 ::= "a"\n',
    "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}? (r{i + 1} | r{i + 1})\n" for i in range(30)) + 'r30 ::= "a"\n',
])
def test_rules_reaching_each_other_in_exponentially_many_ways_are_refused(text):
    """llama.cpp's left-recursion check walks every way rules reach one another at their start: 30 doubling rules
    took a minute, 40 would take a day."""
    why = gbnf_problem(text, V)
    assert why is not None and "ways" in why, why


@pytest.mark.parametrize("text", [
    "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | r{i + 1}\n" for i in range(12)) + 'r12 ::= "a"\n',
    "root ::= items\nitems ::= item items?\nitem ::= [a-z]+ \" \"",   # right recursion
    __import__("llama_cpp").llama_grammar.JSON_GBNF,
    __import__("llama_cpp").llama_grammar.C_GBNF,
])
def test_rules_reaching_each_other_in_few_ways_pass(text):
    assert gbnf_problem(text, V) is None
