"""Bounds on grammars and JSON schemas, checked in Python without recursion before llama.cpp or llama-cpp-python's
converter sees them. llama.cpp's GBNF parser recurses once per nesting level (20,000 levels overflow a thread's
stack), expands `x{m,n}` into n rules (1000 groups of `"a"{0,1999}` make sampling take minutes), checks a token
reference only against uint32, and aborts the process when no token can satisfy the grammar (a NUL character, a
token outside the vocabulary, a character class with no character in it). llama-cpp-python's JSON-schema converter
recurses once per schema level and writes `maxLength` N as N nested groups. Each check returns the reason a grammar
or schema is refused, or None."""
from __future__ import annotations

import json
import re

MAX_GRAMMAR_BYTES = 256 << 10
MAX_DEPTH = 1024          # nested groups: llama.cpp recurses ~400 bytes of stack per level
MAX_RULES = 8192          # rules after repetition expansion (named, groups, and x{m,n}'s generated ones)
MAX_ELEMENTS = 1 << 20    # grammar elements after expansion (x{m} copies x m times)
REPEAT_LIMIT = 2000       # llama.cpp's own: a larger minimum fails to parse, a larger maximum means no maximum

MAX_SCHEMA_NODES = 10_000
MAX_SCHEMA_DEPTH = 64     # JSON containers: a schema level is one or two
MAX_SCHEMA_REPEAT = 900   # one minLength / maxItems / ...: one nested group per unit (llama.cpp refuses ~1000)
MAX_SCHEMA_REPEATS = 2048  # all of them in one schema
MAX_PATTERN = 512
MAX_INT = 10 ** 18
REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
               "maxContains")
BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
TOP = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
_ESC = {"x": 2, "u": 4, "U": 8}
_WORD = re.compile(r"[a-zA-Z0-9-]")
_DEFINES = re.compile(r"[ \t]*::=")
_TOKEN = re.compile(r"!?<\[([0-9]+)\]>")
_BRACES = re.compile(r"\{\s*([0-9]+)\s*(,\s*([0-9]*)\s*)?\}")
MAX_PATHS = 100_000       # ways rules reach one another at their start (see _Rules.leading_paths)


def _char(text: str, i: int) -> tuple[int | None, int]:
    """The code point at text[i] (a GBNF escape or a character) and the index after it; None for an escape llama.cpp
    refuses (its parser then says why)."""
    c = text[i]
    if c != "\\" or i + 1 >= len(text):
        return ord(c), i + 1
    e = text[i + 1]
    if e in _ESC:
        n = _ESC[e]
        digits = text[i + 2:i + 2 + n]
        try:
            return int(digits, 16), i + 2 + n
        except ValueError:
            return None, i + 2
    return {"t": 9, "r": 13, "n": 10}.get(e, ord(e)), i + 2


def _class_is_empty(ranges: list[tuple[int, int]], negated: bool) -> bool:
    """Whether a character class holds no character a token can write (NUL and surrogates are none)."""
    spans = sorted((max(lo, 1), min(hi, TOP)) for lo, hi in ranges if max(lo, 1) <= min(hi, TOP))
    covered, at = [], 1   # the union of the spans, merged
    for lo, hi in spans:
        if covered and lo <= covered[-1][1] + 1:
            covered[-1] = (covered[-1][0], max(covered[-1][1], hi))
        else:
            covered.append((lo, hi))
    writable = [(1, SURROGATES[0] - 1), (SURROGATES[1] + 1, TOP)]
    if not negated:
        return not any(lo <= w_hi and hi >= w_lo for lo, hi in covered for w_lo, w_hi in writable)
    for w_lo, w_hi in writable:   # negated: empty when the spans cover every writable character
        at = w_lo
        for lo, hi in covered:
            if lo <= at <= hi:
                at = hi + 1
        if at <= w_hi:
            return False
    return True


class _Rules:
    """The grammar's shape as the scan meets it: rule -> alternatives -> symbols, where a symbol is "t" (a terminal),
    "e" (an empty literal), a rule's name, or ("?", symbol, min) for a repetition (groups are rules of their own)."""

    def __init__(self):
        self.alts: dict[str, list[list]] = {}
        self.frames: list[str] = []
        self.groups = 0

    def start(self, name: str) -> None:
        self.frames = [name]
        self.alts.setdefault(name, []).append([])

    def open_group(self) -> None:
        self.groups += 1
        key = f"({self.groups}"
        self.add(key)
        self.frames.append(key)
        self.alts[key] = [[]]

    def close_group(self) -> None:
        if len(self.frames) > 1:
            self.frames.pop()

    def alternative(self) -> None:
        if self.frames:
            self.alts[self.frames[-1]].append([])

    def add(self, sym) -> None:
        if self.frames:
            self.alts[self.frames[-1]][-1].append(sym)

    def repeat(self, lo: int, copies: int) -> None:
        if self.frames and (alt := self.alts[self.frames[-1]][-1]):
            alt[-1] = ("?", alt[-1], lo, copies)

    def leading_paths(self) -> int:
        """The most ways any rule reaches others at its start: llama.cpp's left-recursion check and its stack
        expansion walk each of them (`r0 ::= r1 | r1`, `r1 ::= r2 | r2`, ... doubles the work per rule)."""
        alts = self.alts
        nullable: set[str] = set()
        users: dict[str, set[str]] = {}
        for name, rs in alts.items():
            for alt in rs:
                for sym in alt:
                    while isinstance(sym, tuple):
                        sym = sym[1]
                    if sym not in ("t", "e"):
                        users.setdefault(sym, set()).add(name)

        def empty(sym) -> bool:
            while isinstance(sym, tuple):   # one ("?", ...) wrapper per repetition op on the symbol
                if sym[2] == 0:
                    return True
                sym = sym[1]
            return sym == "e" or sym in nullable
        todo = list(alts)
        while todo:   # worklist: a rule that becomes nullable re-checks the rules that use it
            name = todo.pop()
            if name not in nullable and any(all(empty(s) for s in alt) for alt in alts[name]):
                nullable.add(name)
                todo.extend(users.get(name, ()))
        edges: dict[str, list[tuple[str, int]]] = {}
        for name, rs in alts.items():
            out = edges[name] = []
            for alt in rs:
                for sym in alt:
                    copies, inner = 1, sym
                    while isinstance(inner, tuple):
                        copies, inner = min(copies * (1 + inner[3]), MAX_PATHS + 1), inner[1]
                    if inner in alts:
                        out.append((inner, copies))
                    if not empty(sym):
                        break
        paths: dict[str, int] = {}
        for start in alts:   # iterative post-order; an edge back into the walk (left recursion) counts once
            stack, on = [(start, 0)], {start}
            while stack:
                name, k = stack[-1]
                if name in paths:
                    stack.pop()
                    on.discard(name)
                    continue
                out = edges[name]
                if k < len(out):
                    stack[-1] = (name, k + 1)
                    nxt = out[k][0]
                    if nxt not in paths and nxt not in on:
                        stack.append((nxt, 0))
                        on.add(nxt)
                    continue
                paths[name] = min(1 + sum(c * paths.get(t, 1) for t, c in out), MAX_PATHS + 1)
                stack.pop()
                on.discard(name)
        return max(paths.values(), default=0)


def gbnf_problem(text, n_vocab: int) -> str | None:
    """Why a GBNF grammar is refused before llama.cpp parses it, or None. One pass, no recursion: size, nesting,
    rules and elements after repetition expansion, token references, NUL and empty character classes; then the
    number of ways rules reach one another at their start. Syntax is llama.cpp's to judge (its parser is safe on
    what passes here)."""
    if not isinstance(text, str):
        return f"a grammar is GBNF text, not {type(text).__name__}"
    if "\x00" in text:
        return "the grammar holds a NUL character (llama.cpp reads the grammar as a C string)"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        return f"the grammar is over {MAX_GRAMMAR_BYTES >> 10} KiB"
    i, n, depth, rules, elements, last = 0, len(text), 0, 0, 0, 0
    shape = _Rules()
    while i < n:
        c = text[i]
        if c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
            continue
        if c == '"':
            i, size = i + 1, 0
            while i < n and text[i] != '"':
                cp, i = _char(text, i)
                if cp == 0:
                    return "the grammar's literal holds a NUL character, which no token can write"
                size += 1
            i += 1
            elements, last = elements + size, size
            shape.add("t" if size else "e")
        elif c == "[":
            i += 1
            negated = i < n and text[i] == "^"
            i += negated
            ranges, size = [], 0
            while i < n and text[i] != "]":
                lo, i = _char(text, i)
                hi = lo
                if i + 1 < n and text[i] == "-" and text[i + 1] != "]":
                    hi, i = _char(text, i + 1)
                if lo is not None and hi is not None:
                    ranges.append((lo, hi))
                size += 1
            i += 1
            if _class_is_empty(ranges, negated):
                return f"the grammar's character class {text[max(0, i - 40):i]!r} holds no character a token can write"
            elements, last = elements + size, size
            shape.add("t")
        elif c in "<!":
            m = _TOKEN.match(text, i)
            if m:
                if int(m.group(1)) >= n_vocab:
                    return f"the grammar's token <[{m.group(1)}]> is not a token id of this model (0..{n_vocab - 1})"
                i = m.end()
            else:   # <text>: llama.cpp tokenizes it and wants one token
                i = text.find(">", i) + 1 or n
            elements, last = elements + 1, 1
            shape.add("t")
        elif c == "(":
            depth += 1
            if depth > MAX_DEPTH:
                return f"the grammar nests groups over {MAX_DEPTH} deep"
            rules += 1
            shape.open_group()
            i += 1
        elif c == ")":
            depth = max(depth - 1, 0)
            elements, last = elements + 1, 1
            shape.close_group()
            i += 1
        elif c == "|":
            shape.alternative()
            i += 1
        elif c in "*+?{":
            if c == "{":
                m = _BRACES.match(text, i)
                if not m:
                    i += 1
                    continue
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                i = m.end()
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                i += 1
            if lo > REPEAT_LIMIT:
                return f"the grammar repeats an item at least {lo} times (llama.cpp allows {REPEAT_LIMIT})"
            if hi is not None and hi > REPEAT_LIMIT:
                hi = None   # as llama.cpp reads it
            n_opt = 1 if hi is None else max(hi - lo, 0)
            rules += n_opt
            elements += last * (max(lo, 1) - 1) + n_opt * (last + 3)
            last = last * lo + (1 if n_opt else 0)
            shape.repeat(lo, n_opt)
        elif c == ".":
            elements, last = elements + 1, 1
            shape.add("t")
            i += 1
        elif _WORD.match(c):
            start = i
            while i < n and _WORD.match(text[i]):
                i += 1
            if (m := _DEFINES.match(text, i)) and depth == 0:   # name ::= starts a rule
                rules += 1
                shape.start(text[start:i])
                i = m.end()
            else:
                elements, last = elements + 1, 1
                shape.add(text[start:i])
        else:
            i += 1
        if rules > MAX_RULES:
            return (f"the grammar makes over {MAX_RULES} rules once its repetitions are expanded "
                    "(x{m,n} makes n - m rules)")
        if elements > MAX_ELEMENTS:
            return f"the grammar makes over {MAX_ELEMENTS} elements once its repetitions are expanded"
    if shape.leading_paths() > MAX_PATHS:
        return (f"the grammar's rules reach one another at their start in over {MAX_PATHS} ways (as r0 ::= r1 | r1, "
                "r1 ::= r2 | r2, ...): llama.cpp would walk each of them")
    return None


def schema_problem(schema) -> str | None:
    """Why a JSON schema is refused before llama-cpp-python's (recursive) converter runs, or None: its size and
    depth, the repetitions it asks for, its patterns, and references outside the schema (never fetched)."""
    todo, nodes, repeats = [(schema, 1, "schema")], 0, 0
    while todo:
        x, depth, where = todo.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema has over {MAX_SCHEMA_NODES} values"
        if depth > MAX_SCHEMA_DEPTH:
            return f"{where}: the schema nests over {MAX_SCHEMA_DEPTH} deep"
        if isinstance(x, list):
            todo.extend((v, depth + 1, where) for v in x)
            continue
        if not isinstance(x, dict):
            continue
        for k, v in x.items():
            if k in REPEAT_KEYS and not isinstance(v, dict):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or not 0 <= v <= MAX_SCHEMA_REPEAT:
                    return f"{where}.{k} = {v!r}: give a whole number in 0..{MAX_SCHEMA_REPEAT}"
                repeats += int(v)
                if repeats > MAX_SCHEMA_REPEATS:
                    return f"{where}.{k}: the schema's lengths and item counts add up to over {MAX_SCHEMA_REPEATS}"
            elif k in BOUND_KEYS and not isinstance(v, dict):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or abs(v) > MAX_INT:
                    return f"{where}.{k} = {v!r}: give a number within ±10^18"
            elif k == "pattern" and isinstance(v, str):
                if (why := _pattern_problem(v)) is not None:
                    return f"{where}.pattern: {why}"
            elif k == "$ref":
                if not isinstance(v, str) or not v.startswith("#"):
                    return f"{where}.$ref = {v!r}: only references inside the schema ('#/...') are followed"
            todo.append((v, depth + 1, f"{where}.{k}"))
    return None


def _pattern_problem(p: str) -> str | None:
    if len(p) > MAX_PATTERN:
        return f"over {MAX_PATTERN} characters"
    depth = top = 0
    for c in p:
        depth += (c == "(") - (c == ")")
        top = max(top, depth)
    if top > 32:
        return "groups nested over 32 deep"
    total = sum(int(b or a) for a, b in re.findall(r"\{([0-9]+)(?:,([0-9]*))?\}", p))
    if total > MAX_SCHEMA_REPEAT:
        return f"its repetitions ({{m,n}}) add up to over {MAX_SCHEMA_REPEAT}"
    return None


def schema_grammar(schema, n_vocab: int) -> tuple[str | None, str | None]:
    """(why a JSON schema cannot constrain sampling, or None; its GBNF, as llama-cpp-python writes it)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if (why := schema_problem(schema)) is not None:
        return why, None
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:   # noqa: BLE001 (the converter raises what it meets: KeyError, AssertionError, ...)
        return f"the schema cannot be turned into a grammar ({type(e).__name__}: {str(e)[:200]})", None
    return gbnf_problem(gbnf, n_vocab), gbnf
