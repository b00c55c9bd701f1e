"""What `river serve` checks in a request before the app sees it: every reason here becomes a 400 naming the field.

Run off the event loop (the middleware hands the body to a worker thread) and outside the model's lock: tokenizing,
grammar parsing and detokenizing read only the vocabulary, so a bad request never holds up the one running, and
every mode answers a request the same way. Grammars and JSON schemas (the grammar field, response_format, tools)
pass runtime.grammars' bounds, checked without recursion, before llama.cpp or llama-cpp-python's converter sees them.
"""
from __future__ import annotations

import ctypes
import math
import re
import threading

import llama_cpp
from pydantic import ValidationError

from river_edge.format import RiverError
from river_edge.runtime.grammars import schema_grammar
from river_edge.runtime.inputs import check_tokens, grammar_error

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")
# A positive temperature below this decodes greedily in every mode: logits / T overflow float32 (and below
# ~1.4e-45 T itself is 0 in float32, where exact mode's own division would give NaN)
TINY_TEMPERATURE = 1e-30
_TOKEN_ID = re.compile(r"-?[0-9]+")   # what int() reads as a token id, without str.isdigit()'s '²' or int()'s '1_0'
_grammar_lock = threading.Lock()     # llama.cpp's log callback is swapped while a grammar parses: one at a time


def refused(body: dict, path: str, proxy) -> str | None:
    """Why a request cannot be served as asked, or None. Raises nothing: the reason becomes a 400. May normalise
    the body in place (a temperature too small for float32 becomes 0)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return f"model must be a string, not {model!r}"
    try:
        proxy.resolve(model)
    except RiverError as e:
        return str(e)
    if (bad := _where(body, _unencodable)) is not None:
        return f"{bad}: not valid Unicode (a lone surrogate), which no tokenizer can encode"
    if (bad := _where(body, lambda x: isinstance(x, float) and not math.isfinite(x))) is not None:
        return f"{bad}: not a finite number"
    if (why := _invalid(body, path)) is not None:
        return why
    llm = proxy.llm
    if path == "/extras/detokenize":
        return _check(check_tokens, body["tokens"], llm.n_vocab(), "tokens") or _whole_characters(llm, body["tokens"])
    if path == "/v1/embeddings" and not llm.context_params.embeddings:
        return "embeddings are not served: the model is loaded without embeddings (use a completion route)"
    if path not in ROUTES:
        return None
    chat = path == "/v1/chat/completions"
    prompt = body.get("prompt", "")
    if not chat and isinstance(prompt, list):
        if len(prompt) > 1:
            return f"prompt: a list of {len(prompt)} prompts; this server answers one prompt per request"
        prompt = prompt[0] if prompt else ""
    if not chat and prompt == "":
        return "the prompt is empty: llama.cpp decodes at least one token"
    # a completion's logprobs is a count (0, or False read as 0, asks for the chosen token's); a chat's is a flag
    lp = body.get("logprobs")
    if ((bool(lp) if chat else lp is not None) or body.get("top_logprobs")) and not llm.decoder.logits_all:
        return "logprobs are not served: the model is loaded without logits_all (every mode would pay for them)"
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            return f"{key} = {body[key]}: this server answers one choice per request"
    if body.get("logit_bias") and body.get("logit_bias_type") != "tokens":
        ids = list(body["logit_bias"])
        if (bad := next((k for k in ids if not _TOKEN_ID.fullmatch(k)), None)) is not None:
            return f"logit_bias: key {bad!r} is not a token id (logit_bias_type 'tokens' takes token text)"
        if why := _check(check_tokens, [int(k) for k in ids], llm.n_vocab(), "logit_bias keys"):
            return why
    if (why := _grammars(body, llm)) is not None:
        return why
    temp = body.get("temperature")
    if isinstance(temp, (int, float)) and 0 < temp < TINY_TEMPERATURE:
        body["temperature"] = 0.0
    if chat:
        if len(body["messages"]) > llm.n_ctx():
            return f"{len(body['messages'])} messages cannot fit the context of {llm.n_ctx()} tokens"
        if (why := _over_context(sum(len(s.encode("utf-8")) for s in _strings(body["messages"])), proxy)):
            return f"messages: {why}"
        why, prompt = rendered(body, proxy.template)
        if why or prompt is None:
            return why
    if (why := _over_context(len(prompt.encode("utf-8")), proxy)) is not None:
        return f"prompt: {why}"
    n = len(llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))
    if n >= llm.n_ctx():
        return f"the prompt is {n} tokens: it does not fit the context of {llm.n_ctx()} (river serve --ctx)"
    return None


def _grammars(body: dict, llm) -> str | None:
    """Every grammar the request makes llama.cpp parse: the grammar field, response_format's JSON schema, and the
    JSON schemas of its tools (a tool_choice must name one of them)."""
    with _grammar_lock:
        if body.get("grammar") is not None and (why := grammar_error(llm, body["grammar"])):
            return why
        schemas = []
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_object" and "schema" in fmt:
            schemas.append(("response_format.schema", fmt["schema"]))
        tools = [t.get("function") or {} for t in body.get("tools") or []]
        names = [f.get("name") for f in tools]
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and (name := (choice.get("function") or {}).get("name")) not in names:
            return f"tool_choice names the tool {name!r}, which is not in tools ({', '.join(map(str, names)) or 'none'})"
        funcs = body.get("functions") or []
        call = body.get("function_call")
        if isinstance(call, dict) and call.get("name") not in [f.get("name") for f in funcs]:
            return f"function_call names the function {call.get('name')!r}, which is not in functions"
        schemas += [(f"tools[{i}].function.parameters", f["parameters"]) for i, f in enumerate(tools) if "parameters" in f]
        schemas += [(f"functions[{i}].parameters", f["parameters"]) for i, f in enumerate(funcs) if "parameters" in f]
        for where, schema in schemas:
            why, gbnf = schema_grammar(schema, llm.n_vocab())
            if why is None:
                why = grammar_error(llm, gbnf)
            if why is not None:
                return f"{where}: {why}"
    return None


def _whole_characters(llm, tokens) -> str | None:
    try:
        llm.detokenize(tokens).decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"tokens: their text is not whole UTF-8 characters (byte {e.start} starts a character the tokens "
                "do not finish); detokenize the whole character's tokens")
    return None


def _over_context(size: int, proxy) -> str | None:
    """Why text of `size` bytes cannot fit the context, judged from its size alone (no token writes more than the
    vocabulary's longest piece): a 30 MiB prompt is refused before it is tokenized."""
    most = max_piece(proxy)
    if size > proxy.llm.n_ctx() * most:
        return (f"{size} bytes do not fit the context of {proxy.llm.n_ctx()} tokens (a token holds at most {most} bytes; "
                "river serve --ctx)")
    return None


def max_piece(proxy) -> int:
    """Bytes of the vocabulary's longest token (special ones as their text): measured once per server."""
    if getattr(proxy, "_max_piece", None) is None:
        llm, buf, most = proxy.llm, ctypes.create_string_buffer(256), 1
        for t in range(llm.n_vocab()):
            n = llama_cpp.llama_token_to_piece(llm._model.vocab, t, buf, len(buf), 0, True)
            most = max(most, abs(n))
        proxy._max_piece = most
    return proxy._max_piece


def _strings(x):
    """Every string in a JSON value (keys too), without recursion."""
    todo = [x]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def _check(check, *args) -> str | None:
    try:
        check(*args)
    except RiverError as e:
        return str(e)
    return None


# The app's own request types, by route: checked here so that a malformed field is a 400 naming it (the app's
# error handler answers its own validation errors with a 500 and a traceback)
def _types() -> dict:
    from llama_cpp.server import types as T  # the server packages load with the app

    return {**dict.fromkeys(ROUTES, T.CreateCompletionRequest), "/v1/chat/completions": T.CreateChatCompletionRequest,
            "/v1/embeddings": T.CreateEmbeddingRequest, "/extras/tokenize": T.TokenizeInputRequest,
            "/extras/tokenize/count": T.TokenizeInputRequest, "/extras/detokenize": T.DetokenizeInputRequest}


def _invalid(body: dict, path: str) -> str | None:
    kind = _types().get(path)
    if kind is None:
        return None
    try:
        kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "the request"
        return f"{where}: {err['msg']}"
    return None


def rendered(body: dict, template) -> tuple[str | None, str | None]:
    """(why the chat template cannot render the request's messages, or None; the prompt it renders, or None where
    the model chats through another format). A template's raise_exception (roles that must alternate) or a failing
    expression would be a 500 from the app. Rendered as the app renders them: after its own validation (which drops
    undeclared keys), with the fields it passes."""
    from llama_cpp.server.types import CreateChatCompletionRequest

    if template is None:
        return None, None
    req = CreateChatCompletionRequest.model_validate(body).model_dump()   # valid: refused() checked it
    try:
        out = template(**{k: req.get(k) for k in ("messages", "functions", "function_call", "tools", "tool_choice")})
    except Exception as e:   # whatever the template raises (TemplateError, ValueError, TypeError, ...) is the request's
        return f"the model's chat template cannot render these messages: {type(e).__name__}: {e}", None
    return None, out.prompt


def _unencodable(x) -> bool:
    """A string with a lone surrogate (JSON allows "\\udcff"; UTF-8 does not)."""
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _where(x, bad, where: str = "the request") -> str | None:
    """Where in a JSON value a leaf or a key is bad (the key holding it), or None."""
    if isinstance(x, dict):
        return next((w for k, v in x.items() if (w := f"key {k!r}" if bad(k) else _where(v, bad, f"{k!r}")) is not None),
                    None)
    if isinstance(x, list):
        return next((w for v in x if (w := _where(v, bad, where)) is not None), None)
    return where if bad(x) else None
