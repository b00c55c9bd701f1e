"""One model over several hosts: ggml's RPC backend (built into the runtime with -DGGML_RPC=ON).

A host serves its CPU with `river rpc-server` (llama.cpp's rpc-server, through the same backend-registry entry
points); a client names the servers, RiverLlama(rpc_servers="host:port,...") or `--rpc`, and offloads layers
to them with n_gpu_layers: as for a GPU, the last n_gpu_layers layers go to the servers (in the order given,
divided by tensor_split) and the first ones stay on the client.
The protocol has no authentication: serve on 127.0.0.1 or a trusted network only.
"""
from __future__ import annotations

import contextlib
import ctypes as c
import gc
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from river_edge.format import RiverError
from river_edge.ports import listen

_CONNECTED: dict[str, int] = {}   # endpoint -> devices it registered (a second register would double them)


def parse_endpoints(servers: str | list[str] | tuple[str, ...]) -> list[str]:
    """'host:port,host:port' (or a list) as endpoints; ValueError naming the first bad one."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    if not any(str(s).strip() for s in items):
        raise ValueError("no RPC server named")
    out = []
    for item in (s.strip() for s in items):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"RPC server {item!r}: expected host:port with a port in 1..65535")
        out.append(f"{host}:{int(port)}")
    return out


def _ggml():
    """libggml of the loaded runtime with the registry functions typed, and the RPC backend's registry."""
    import llama_cpp

    lib = getattr(llama_cpp.llama_cpp, "_ggml", None)
    if lib is None:
        raise RiverError("this llama-cpp-python exposes no ggml backend registry (river-edge's runtime does)")
    llama_cpp.llama_backend_init()
    for name, args, res in (("ggml_backend_reg_by_name", [c.c_char_p], c.c_void_p),
                            ("ggml_backend_reg_get_proc_address", [c.c_void_p, c.c_char_p], c.c_void_p),
                            ("ggml_backend_register", [c.c_void_p], None),
                            ("ggml_backend_reg_dev_count", [c.c_void_p], c.c_size_t),
                            ("ggml_backend_dev_by_type", [c.c_int], c.c_void_p)):
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise RiverError("this runtime was built without ggml's RPC backend (-DGGML_RPC=ON; `make setup` builds it)")
    return lib, reg


def _proc(lib, reg, name: str, restype, *argtypes):
    addr = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not addr:
        raise RiverError(f"ggml's RPC backend has no {name}")
    return c.CFUNCTYPE(restype, *argtypes)(addr)


def connect(servers) -> int:
    """Register the devices of each rpc-server with ggml (once per endpoint): models loaded afterwards offload
    to them. Returns how many RPC devices this process has; RiverError naming a server that does not answer."""
    endpoints = parse_endpoints(servers)
    lib, reg = _ggml()
    add = _proc(lib, reg, "ggml_backend_rpc_add_server", c.c_void_p, c.c_char_p)
    for ep in endpoints:
        if ep in _CONNECTED:
            continue
        host, port = ep.rsplit(":", 1)
        try:   # ggml aborts the process on a server it cannot reach: ask first
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as e:
            raise RiverError(f"RPC server {ep} does not answer ({e.strerror or e}; is `river rpc-server --port "
                               f"{port}` running there?)") from None
        r = add(ep.encode())
        if not r:
            raise RiverError(f"RPC server {ep} reports no device")
        lib.ggml_backend_register(r)
        _CONNECTED[ep] = lib.ggml_backend_reg_dev_count(r)
    return sum(_CONNECTED.values())


def check_listen(host: str, port: int) -> None:
    """RiverError unless the rpc-server can listen on host:port: ggml's server prints a line and returns instead."""
    try:
        socket.inet_aton(host)   # ggml's server takes IPv4 addresses only (inet_addr), not names or IPv6
    except OSError:
        raise RiverError(f"cannot serve on {host}:{port}: the rpc-server listens on an IPv4 address "
                         "(127.0.0.1, 0.0.0.0 or one of this machine's)") from None
    listen(host, port).close()   # `river serve`'s check: bind and listen, then let go for ggml


def serve_rpc(host: str = "127.0.0.1", port: int = 50052, threads: int | None = None, say=None) -> None:
    """Serve this machine's CPU to RPC clients until the process is stopped (blocks); check_listen first, then
    say(line) that it serves."""
    (endpoint,) = parse_endpoints(f"{host}:{port}")
    check_listen(host, port)
    if say:
        say(f"rpc-server on {host}:{port} (Ctrl-C stops it)")
    lib, reg = _ggml()
    start = _proc(lib, reg, "ggml_backend_rpc_start_server", None,
                  c.c_char_p, c.c_char_p, c.c_size_t, c.c_size_t, c.POINTER(c.c_void_p))
    cpu = lib.ggml_backend_dev_by_type(0)   # GGML_BACKEND_DEVICE_TYPE_CPU
    devs = (c.c_void_p * 1)(cpu)
    # The server loop never returns to Python: let Ctrl-C and SIGTERM end the process directly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # the CLI's guard raises it in Python, which never runs again
    start(endpoint.encode(), None, threads or os.cpu_count() or 1, 1, devs)
    raise RiverError(f"rpc-server on {host}:{port} stopped: ggml could not serve there (its message is above)")


def free_port() -> int:
    """A TCP port nothing listens on now (for servers started by tests and benchmarks on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_servers(n: int, threads: int = 1, timeout: float = 30.0):
    """n rpc-servers on 127.0.0.1 in child processes (tests, benchmarks): yields their endpoints, stops them after."""
    procs, endpoints = [], []
    try:
        for _ in range(n):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-c",
                 f"from river_edge.runtime.rpc import serve_rpc; serve_rpc('127.0.0.1', {port}, {threads})"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            endpoints.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + timeout
        for p, ep in zip(procs, endpoints):
            while True:
                if p.poll() is not None:
                    raise RiverError(f"rpc-server {ep} exited: {p.stderr.read().decode(errors='replace')[-500:]}")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", int(ep.rsplit(":", 1)[1]))) == 0:
                        break
                if time.monotonic() > deadline:
                    raise RiverError(f"rpc-server {ep} did not listen within {timeout:.0f} s")
                time.sleep(0.1)
        yield endpoints
    finally:
        gc.collect()   # models (reference cycles) free their buffers on the servers first: ggml aborts otherwise
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


@contextlib.contextmanager
def delayed(endpoints: list[str], delay_ms: float):
    """A TCP forwarder on 127.0.0.1 per endpoint that holds every chunk delay_ms before passing it on, both ways:
    a network's latency on one host (benchmarks). Yields the forwarders' endpoints, in order."""
    stop = threading.Event()
    listeners, out = [], []

    def pump(src, dst):
        q: queue.Queue = queue.Queue()

        def send():
            while True:
                t, data = q.get()
                if data is None:
                    break
                time.sleep(max(0.0, t - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    break
            try:   # pass the end on (a close would not while the other direction's recv holds the socket)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        threading.Thread(target=send, daemon=True).start()
        while not stop.is_set():
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            q.put((time.monotonic() + delay_ms / 1e3, data))
        q.put((0.0, None))

    def forward(lst, target):
        host, port = target.rsplit(":", 1)
        while not stop.is_set():
            try:
                client, _ = lst.accept()
            except OSError:
                return
            server = socket.create_connection((host.strip("[]"), int(port)))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=pump, args=(client, server), daemon=True).start()
            threading.Thread(target=pump, args=(server, client), daemon=True).start()

    try:
        for ep in parse_endpoints(endpoints):
            lst = socket.socket()
            lst.bind(("127.0.0.1", 0))
            lst.listen()
            listeners.append(lst)
            out.append(f"127.0.0.1:{lst.getsockname()[1]}")
            threading.Thread(target=forward, args=(lst, ep), daemon=True).start()
        yield out
    finally:
        gc.collect()   # as in local_servers: models free their server buffers while the path is still open
        stop.set()
        for lst in listeners:
            lst.close()
