"""`river serve`: llama-cpp-python's own OpenAI-compatible app with a RiverLlama as its model.

One model, every decoding mode: a request names `NAME` (the server's mode) or `NAME:MODE`
(`NAME:exact`, `NAME:river`, ...), and `/v1/models` lists them all. Requests run one at a time (the
app's lock), each under its own mode; RiverLlama drops KV cells another mode wrote, so a lossy request
never leaks into an exact one. A bad model name (on any route), a request for logprobs (the model is loaded
without logits_all) or for more than one choice, an empty prompt, text that is not valid Unicode or messages the
chat template refuses to render is a 400 before anything runs, streaming included.
"""
from __future__ import annotations

import ipaddress
import json
import os
import sys
import threading
from pathlib import Path

import anyio

from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from river_edge import format as F
from river_edge.format import MODES, RiverError
from river_edge.ports import listen
from river_edge.runtime import inputs
from river_edge.runtime.llama import RiverLlama
from river_edge.serve_checks import refused

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

    def __init__(self, llm, name: str, mode: str, log=None):
        self.llm, self.name, self.default = llm, name, mode
        if log is not None:   # one line per request, as llama.cpp's server prints its timings
            llm.decoding.on_call_end = lambda s: log(request_line(s))
        self.served_modes = MODES if llm.has_river else ("backbone",)
        self.template = _gguf_template(llm)

    def resolve(self, model: str | None) -> str:
        """The mode a request's model field asks for; RiverError naming the problem otherwise."""
        if model is None or model == self.name or model == COPILOT:
            return self.default
        name, sep, mode = model.partition(":")
        if name != self.name or not sep:
            raise RiverError(f"unknown model {model!r}: this server has {', '.join(self)}")
        if mode not in self.served_modes:
            raise RiverError(f"unknown mode {mode!r} in model {model!r}: use one of {', '.join(self.served_modes)}")
        return mode

    def __call__(self, model: str | None = None):
        # called as a request takes the model (the app's lock): a stream an earlier client abandoned is closed now,
        # not later by the garbage collector in the middle of this request (harmless then too: Spec.owns)
        self.llm.end_streams()
        self.llm.mode = self.resolve(model)
        return self.llm

    def __iter__(self):
        yield self.name
        for m in self.served_modes:
            yield f"{self.name}:{m}"

    def free(self):
        self.llm.close()


def request_line(s: dict) -> str:
    """A finished request in one line: its mode, its tokens, how many were drafts that stood, its decode speed."""
    speed = f", {s['tok_s']:.1f} tok/s" if s["tok_s"] is not None else ""
    drafted = f" ({s['drafted']} from drafts)" if s["mode"] in F.LOOP_MODES else ""
    return f"request: {s['mode']} mode, {s['tokens']} tokens{drafted}{speed}"


def _gguf_template(llm):
    """The GGUF's chat template as llama-cpp-python's app renders it (its own formatter and tokens), or None when
    the model chats through another format."""
    if llm.chat_handler is not None or llm.chat_format != "chat_template.default":
        return None

    text = lambda t: llm._model.token_get_text(t) if t != -1 else ""   # noqa: E731 (as Llama.__init__ does)
    return Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], text(llm.token_eos()), text(llm.token_bos()))


class CheckModel:
    """ASGI middleware: a request that refused() turns down (a `model` the proxy cannot resolve, on any route;
    logprobs; n > 1; an empty prompt; text that is not Unicode; a grammar or schema past the bounds; messages the chat
    template cannot render) gets a 400 with the reason, before the app starts (a streamed response could no longer
    change its status). The body is parsed and checked in a worker thread: a large one never stalls the event loop,
    and so never another client's stream. A Host header naming another machine is a 403 (DNS rebinding)."""

    def __init__(self, app, proxy: RiverProxy, origins: tuple[str, ...] = (), hosts: tuple[str, ...] = ()):
        self.app, self.proxy, self.origins, self.hosts = app, proxy, origins, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host")
        if host is not None and not allowed_host(host.decode("latin-1"), self.hosts, self.origins):
            # a page that rebound its own name to this machine sends its name: it must not read the GET routes
            return await _error(send, 403, f"requests for host {host.decode('latin-1')!r} are not allowed; start the "
                                           "server with --host NAME, or --allow-origin for a web page's host")
        origin = headers.get(b"origin")
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
        why, body = await anyio.to_thread.run_sync(self.check, b"".join(chunks), scope.get("path"))
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

    def check(self, body: bytes, path: str) -> tuple[str | None, bytes]:
        """(why the request is refused, or None; the body to pass on: re-encoded where refused() normalised it)."""
        try:
            req = json.loads(body or b"{}")
        except RecursionError:
            return "the request body nests JSON too deeply", body
        except ValueError as e:
            return f"the request body is not JSON ({e})", body
        if not isinstance(req, dict):
            return "the request body is not a JSON object", body
        temp = req.get("temperature")
        try:
            why = refused(req, path, self.proxy)
        except RecursionError:   # parsed, but too deep for the checks that walk it
            why = "the request body nests JSON too deeply"
        if why is None and req.get("temperature") is not temp:
            body = json.dumps(req).encode()
        return why, body


# Seconds a completion may run before it is ended as at max_tokens: a grammar that makes sampling slow, or a long
# answer, cannot hold the model (one request at a time) for ever
REQUEST_SECONDS = 600.0
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


def allowed_host(host: str, hosts: tuple[str, ...], origins: tuple[str, ...]) -> bool:
    """A Host header the server answers: an IP address or localhost (no page can rebind those names), the name it
    was started on (--host), or the host of an --allow-origin ('*': any)."""
    if "*" in origins:
        return True
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name in ("localhost", *hosts) or name.endswith(".localhost"):
        return True
    if any(name == o.partition("://")[2].rsplit(":", 1)[0].strip("[]").lower() for o in origins):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


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
               threads: int | None = None, allow_origins: tuple[str, ...] = (), hosts: tuple[str, ...] = (),
               request_seconds: float | None = REQUEST_SECONDS, log=None, **river_kw):
    """The OpenAI app over one river GGUF (`mode` for requests that name no mode; default exact, or
    backbone for a GGUF without a river) and its proxy. Cross-origin requests from web pages are refused
    unless their origin is in allow_origins ('*': any); a Host header is answered for IP addresses, localhost,
    `hosts` and the allowed origins' hosts. A completion runs at most request_seconds (then ends as at max_tokens).
    `log` gets one line per finished request (request_line)."""
    server_app, ModelSettings, ServerSettings = _deps()
    name = check_name(name if name is not None else Path(model).name.removesuffix(".gguf"))
    llm = RiverLlama(str(model), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, **river_kw)
    mode = mode or F.default_mode(llm.has_river, "serve")
    llm.mode = mode   # a mode the file cannot run fails here, as in chat: "needs a river GGUF"
    proxy = RiverProxy(llm, name, mode, log)
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
    app.add_middleware(CheckModel, proxy=proxy, origins=origins, hosts=tuple(h.lower() for h in hosts))
    inputs.time_budget = request_seconds
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
        app, proxy = create_app(model, hosts=(host,), log=say, **kw)
        say(f"serving {model} on http://{host}:{port}/v1 as {proxy.name} (default mode {proxy.default}); "
            "Ctrl-C stops")
        # SIGTERM or Ctrl-C: open connections get a few seconds, then the server stops even if a request still runs
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)).run(sockets=[sock])
    finally:
        sock.close()
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        # a request's worker thread is still inside llama.cpp (no Python code runs there to stop it): exiting normally
        # would wait for it, and freeing the model under it could crash; the process ends here instead
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
