"""`river serve`: llama-cpp-python's own OpenAI-compatible app with a RiverLlama as its model.

One model, every decoding mode: a request names `NAME` (the server's mode) or `NAME:MODE`
(`NAME:exact`, `NAME:river`, ...), and `/v1/models` lists them all. Requests run one at a time (the
app's lock), each under its own mode; RiverLlama drops KV cells another mode wrote, so a lossy request
never leaks into an exact one. A bad model name (on any route), a request for logprobs (the model is loaded
without logits_all) or for more than one choice, an empty prompt, text that is not valid Unicode or messages the
chat template refuses to render is a 400 before anything runs, streaming included.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from pydantic import ValidationError

from river_edge import format as F
from river_edge.format import MODES, RiverError
from river_edge.ports import listen
from river_edge.runtime.inputs import check_tokens, grammar_error
from river_edge.runtime.llama import RiverLlama

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")
COPILOT = "copilot-codex"   # the model name the app passes for its Copilot route: the server's default mode


def _deps():
    try:
        import uvicorn  # noqa: F401
        from llama_cpp.server import app as server_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError as e:
        raise RiverError(f"river serve needs llama-cpp-python's server packages ({e.name} is missing): "
                         "run `make setup`") from None
    return server_app, ModelSettings, ServerSettings


class RiverProxy:
    """What llama-cpp-python's app asks for a model: one RiverLlama, its mode set per request."""

    def __init__(self, llm, name: str, mode: str):
        self.llm, self.name, self.default = llm, name, mode
        self.modes = MODES if llm.has_river else ("backbone",)
        self.template = _gguf_template(llm)

    def resolve(self, model: str | None) -> str:
        """The mode a request's model field asks for; RiverError naming the problem otherwise."""
        if model is None or model == self.name or model == COPILOT:
            return self.default
        name, sep, mode = model.partition(":")
        if name != self.name or not sep:
            raise RiverError(f"unknown model {model!r}: this server has {', '.join(self)}")
        if mode not in self.modes:
            raise RiverError(f"unknown mode {mode!r} in model {model!r}: use one of {', '.join(self.modes)}")
        return mode

    def __call__(self, model: str | None = None):
        # called as a request takes the model (the app's lock): a stream an earlier client abandoned is closed now,
        # not later by the garbage collector in the middle of this request (harmless then too: Spec.owns)
        self.llm.end_streams()
        self.llm.mode = self.resolve(model)
        return self.llm

    def __iter__(self):
        yield self.name
        for m in self.modes:
            yield f"{self.name}:{m}"

    def free(self):
        self.llm.close()


def refused(body: dict, path: str, proxy: RiverProxy) -> str | None:
    """Why a request cannot be served as asked, or None. Raises nothing: the reason becomes a 400. Every check
    here is cheap or runs outside the model's lock (tokenizing reads only the vocabulary), so a bad request never
    holds up the one running, and every mode answers a request the same way."""
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
        return _check(check_tokens, body["tokens"], llm.n_vocab(), "tokens")
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
    lp = body.get("logprobs")   # 0 asks for the chosen token's (and 0 == False: compared by identity)
    if (lp is not None and lp is not False or body.get("top_logprobs")) and not llm.decoder.logits_all:
        return "logprobs are not served: the model is loaded without logits_all (every mode would pay for them)"
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            return f"{key} = {body[key]}: this server answers one choice per request"
    if body.get("logit_bias") and body.get("logit_bias_type") != "tokens":
        ids = list(body["logit_bias"])
        if (bad := next((k for k in ids if not k.strip().lstrip("-").isdigit()), None)) is not None:
            return f"logit_bias: key {bad!r} is not a token id (logit_bias_type 'tokens' takes token text)"
        if why := _check(check_tokens, [int(k) for k in ids], llm.n_vocab(), "logit_bias keys"):
            return why
    if body.get("grammar") is not None and (why := grammar_error(llm, body["grammar"])):
        return why
    if chat:
        if len(body["messages"]) > llm.n_ctx():
            return f"{len(body['messages'])} messages cannot fit the context of {llm.n_ctx()} tokens"
        why, prompt = rendered(body, proxy.template)
        if why or prompt is None:
            return why
    n = len(llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))
    if n >= llm.n_ctx():
        return f"the prompt is {n} tokens: it does not fit the context of {llm.n_ctx()} (river serve --ctx)"
    return None


def _check(check, *args) -> str | None:
    try:
        check(*args)
    except RiverError as e:
        return str(e)
    return None


# The app's own request types, by route: checked here so that a malformed field is a 400 naming it (the app's
# error handler answers its own validation errors with a 500 and a traceback)
def _types() -> dict:
    from llama_cpp.server import types as T  # the server packages load with the app (_deps)

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


def _gguf_template(llm):
    """The GGUF's chat template as llama-cpp-python's app renders it (its own formatter and tokens), or None when
    the model chats through another format."""
    if llm.chat_handler is not None or llm.chat_format != "chat_template.default":
        return None

    text = lambda t: llm._model.token_get_text(t) if t != -1 else ""   # noqa: E731 (as Llama.__init__ does)
    return Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], text(llm.token_eos()), text(llm.token_bos()))


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
    """Where in a JSON value a leaf is bad (the key holding it), or None."""
    if isinstance(x, dict):
        return next((w for k, v in x.items() if (w := _where(v, bad, f"{k!r}")) is not None), None)
    if isinstance(x, list):
        return next((w for v in x if (w := _where(v, bad, where)) is not None), None)
    return where if bad(x) else None


class CheckModel:
    """ASGI middleware: a request that refused() turns down (a `model` the proxy cannot resolve, on any route;
    logprobs; n > 1; an empty prompt; text that is not Unicode; messages the chat template cannot render) gets a
    400 with the reason, before the app starts (a streamed response could no longer
    change its status)."""

    def __init__(self, app, proxy: RiverProxy, origins: tuple[str, ...] = ()):
        self.app, self.proxy, self.origins = app, proxy, origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = dict(scope.get("headers") or []).get(b"origin")
        if origin is not None and not allowed_origin(origin.decode("latin-1"), self.origins):
            # a browser names the page's origin: a web page must not drive a local model unless the user allowed it
            return await _error(send, 403, f"requests from origin {origin.decode('latin-1')!r} are not allowed; "
                                           "start the server with --allow-origin ORIGIN to allow a web page")
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY:
                return await _error(send, 413, f"the request body is over {MAX_BODY >> 20} MiB")
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        try:
            req = json.loads(body or b"{}")
        except RecursionError:
            return await _error(send, 400, "the request body nests JSON too deeply")
        except ValueError as e:
            return await _error(send, 400, f"the request body is not JSON ({e})")
        if not isinstance(req, dict):
            return await _error(send, 400, "the request body is not a JSON object")
        try:
            why = refused(req, scope.get("path"), self.proxy)
        except RecursionError:   # parsed, but too deep for the checks that walk it
            why = "the request body nests JSON too deeply"
        if why:
            return await _error(send, 400, why)

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)


# A request larger than this is refused before it is parsed (a whole context of text is a few MiB)
MAX_BODY = 32 << 20
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def allowed_origin(origin: str, allowed: tuple[str, ...]) -> bool:
    """A page may call the server if its origin is named (--allow-origin; '*' for any), or it is served from this
    machine's loopback (the app's own /docs page). A page elsewhere, DNS rebinding included, names its own origin."""
    if "*" in allowed or origin in allowed:
        return True
    scheme, _, rest = origin.partition("://")
    host = rest.rsplit(":", 1)[0] if not rest.endswith("]") else rest
    return scheme in ("http", "https") and host in LOOPBACK


async def _error(send, status: int, message: str):
    data = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def check_name(name: str) -> str:
    """The model name clients use: not empty, and no ':' (a request's model reads NAME:MODE)."""
    if not name or ":" in name or name != name.strip():
        raise RiverError(f"model name {name!r}: give a non-empty name without ':' or surrounding spaces (requests "
                         "name NAME:MODE), e.g. --name mymodel")
    return name


def create_app(model: Path, *, name: str | None = None, mode: str | None = None, n_ctx: int = 4096,
               threads: int | None = None, allow_origins: tuple[str, ...] = (), **river_kw):
    """The OpenAI app over one river GGUF (`mode` for requests that name no mode; default exact, or
    backbone for a GGUF without a river) and its proxy. Cross-origin requests from web pages are refused
    unless their origin is in allow_origins ('*': any)."""
    server_app, ModelSettings, ServerSettings = _deps()
    name = check_name(name if name is not None else Path(model).name.removesuffix(".gguf"))
    llm = RiverLlama(str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, **river_kw)
    mode = mode or F.default_mode(llm.has_river, "serve")
    llm.mode = mode   # a mode the file cannot run fails here, as in chat: "needs a river GGUF"
    proxy = RiverProxy(llm, name, mode)
    proxy.resolve(f"{name}:{mode}")   # a bad default mode fails here, not at the first request
    settings = ModelSettings(model=str(model), model_alias=name, n_ctx=n_ctx)
    # requests queue one after another: a new one must not cut a running stream (the app's default)
    server = ServerSettings(interrupt_requests=False)
    keep = server_app.set_llama_proxy
    server_app.set_llama_proxy = lambda model_settings: None   # the app would load a stock Llama
    try:
        app = server_app.create_app(server_settings=server, model_settings=[settings])
    finally:
        server_app.set_llama_proxy = keep
    server_app._llama_proxy = proxy
    # the app lets every origin in, with credentials: any web page could drive a local model. Ours: none but
    # those named, and no credentials (the server has no cookies to send)
    from fastapi.middleware.cors import CORSMiddleware

    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
    origins = tuple(check_origin(o) for o in allow_origins)
    app.add_middleware(CheckModel, proxy=proxy, origins=origins)
    if origins:   # outermost: it answers preflights itself
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    return app, proxy


def check_origin(origin: str) -> str:
    """An origin as browsers send it: scheme://host[:port], or '*'."""
    scheme, sep, rest = origin.partition("://")
    if origin != "*" and (scheme not in ("http", "https") or not sep or not rest or "/" in rest):
        raise RiverError(f"origin {origin!r}: give scheme://host[:port] (as a browser sends it, no path), or '*'")
    return origin


def serve(model: Path, *, host: str = "127.0.0.1", port: int = 8000, say=print, **kw) -> None:
    import uvicorn

    sock = listen(host, port)   # before the model loads: a taken port fails at once
    try:
        app, proxy = create_app(model, **kw)
        say(f"serving {model} on http://{host}:{port}/v1 as {proxy.name} (default mode {proxy.default}); "
            "Ctrl-C stops")
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
