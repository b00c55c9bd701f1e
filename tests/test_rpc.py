"""ggml's RPC backend from Python (river_edge/runtime/rpc.py): server names checked, an absent server named, and a
benchmark over two local rpc-servers with the exit decisions' cost. The runtime's invariants over RPC are in
test_device.py (`make test-rpc`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from river_edge.cli.main import app
from river_edge.format import RiverError
from river_edge.runtime.rpc import free_port, parse_endpoints


def test_endpoints_are_checked():
    assert parse_endpoints("127.0.0.1:50052, host.lan:1") == ["127.0.0.1:50052", "host.lan:1"]
    assert parse_endpoints(["[::1]:8"]) == ["[::1]:8"]
    for bad, why in (("127.0.0.1", "'127.0.0.1'"), ("h:0", "'h:0'"), ("h:65536", "'h:65536'"), (":5", "':5'"),
                     ("h:x", "'h:x'"), ("", "no RPC server")):
        with pytest.raises(ValueError, match=why):
            parse_endpoints(bad)


def test_a_server_that_does_not_answer_is_named(tiny_llama):
    from river_edge.runtime.llama import RiverLlama

    ep = f"127.0.0.1:{free_port()}"
    with pytest.raises(RiverError, match=f"RPC server {ep} does not answer"):
        RiverLlama(str(tiny_llama), n_ctx=64, rpc_servers=ep, n_gpu_layers=-1)
    with pytest.raises(RiverError, match="expected host:port"):
        RiverLlama(str(tiny_llama), n_ctx=64, rpc_servers="nowhere")


def test_bench_over_local_rpc_servers(tiny_llama, tmp_path):
    """`river bench --rpc local:2`: every layer on two rpc-servers; exact is still the backbone; `sync` says
    what one exit decision costs there. In a process of its own: ggml keeps RPC devices registered for the
    process's life, and any later model load would ask the stopped servers for their memory."""
    r = subprocess.run([sys.executable, "-m", "river_edge.cli.main", "bench", str(tiny_llama), "--mode", "exact,sync",
                        "--rpc", "local:2", "--gpu-layers", "-1", "--quick", "-o", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "bench_modes_tiny-llama_rpc.json").read_text())
    assert res["offload"]["n_gpu_layers"] == -1 and len(res["offload"]["rpc_servers"].split(",")) == 2
    assert sum(d.startswith("RPC") for d in res["offload"]["devices"]) == 2
    cs = res["configs"]
    assert cs["exact"]["identical_runs"] == cs["exact"]["runs"] == 1
    assert cs["sync"]["identical_runs"] == 1          # every layer checked, none exits: the backbone's tokens
    assert cs["sync"]["layers_checked"] == 2         # tiny: 4 layers, min exit layer 1: layers 1 and 2
    assert "us per checked layer" in r.stdout


def test_bench_through_a_delaying_forwarder(tiny_llama, tmp_path):
    """--rpc-delay routes every message through a forwarder that holds it: the run still completes, exact
    still writes the backbone's tokens, and the JSON says what latency was added."""
    r = subprocess.run([sys.executable, "-m", "river_edge.cli.main", "bench", str(tiny_llama), "--mode", "exact",
                        "--rpc", "local:1", "--rpc-delay", "1", "--gpu-layers", "-1", "--quick", "-o", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "bench_modes_tiny-llama_rpc_delay1ms.json").read_text())
    assert res["offload"]["rpc_delay_ms"] == 1.0 and sum(d.startswith("RPC") for d in res["offload"]["devices"]) == 1
    assert res["configs"]["exact"]["identical_runs"] == res["configs"]["exact"]["runs"] == 1


def test_bench_rpc_options_are_checked(tiny_llama, runner):
    for args, why in ((["--rpc", "local:0", "--mode", "exact", "--gpu-layers", "-1"], "local:N with N >= 1"),
                      (["--rpc", "local:1", "--mode", "exact"], "--rpc needs --gpu-layers"),   # it offloaded nothing
                      (["--rpc", "local:2"], "--rpc goes with --mode"),
                      (["--flash-attn", "--max-rounds", "3"], "--flash-attn and --max-rounds go with --mode")):
        r = runner.invoke(app, ["bench", str(tiny_llama), *args])
        said = " ".join(r.output.replace("│", " ").split())   # typer's error box wraps long lines
        assert r.exit_code != 0 and why in said and "Traceback" not in r.output


def test_rpc_server_refuses_a_bad_address_before_serving(runner):
    r = runner.invoke(app, ["rpc-server", "--host", ""])
    assert r.exit_code == 2 and "expected host:port" in r.output and "Traceback" not in r.output
    # ggml's server printed a line and exited 0 for these: now one error line, exit 1, before "rpc-server on"
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, why in (("::1", "listens on an IPv4 address"), ("nonexistent.invalid", "IPv4 address"),
                          ("127.0.0.1", "Address already in use")):
            r = subprocess.run([sys.executable, "-m", "river_edge.cli.main", "rpc-server", "--host", host, "--port",
                                str(port)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and why in r.stderr and "rpc-server on" not in r.stderr, (host, r.stderr)


def test_chat_rpc_without_layers_is_refused(tiny_llama, runner):
    r = runner.invoke(app, ["chat", str(tiny_llama), "--rpc", "127.0.0.1:50052", "--prompt", "hi"])
    said = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and "--rpc needs --gpu-layers" in said


def test_chat_says_when_gpu_layers_offloaded_nothing(tiny_llama):
    """The CPU build with no rpc-servers: --gpu-layers offloads nothing; one warning line says so, the chat runs."""
    from river_edge.host import devices

    if any(not d.startswith("CPU") for d in devices()):
        pytest.skip(f"this runtime has a device: {devices()}")
    r = subprocess.run([sys.executable, "-m", "river_edge.cli.main", "chat", str(tiny_llama), "--gpu-layers", "2",
                        "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    warned = [x for x in r.stderr.splitlines() if "offloaded nothing" in x]
    assert warned == [x for x in r.stderr.splitlines() if x.strip()] and warned[0].startswith("river: warning: ")


def test_chat_names_a_bad_or_absent_server(tiny_llama, runner):
    for rpc, why in (("nowhere", "expected host:port"), (f"127.0.0.1:{free_port()}", "does not answer")):
        r = runner.invoke(app, ["chat", str(tiny_llama), "--rpc", rpc, "--gpu-layers", "-1", "--prompt", "hi",
                                "--max-tokens", "2"])
        assert r.exit_code != 0 and why in r.output and "Traceback" not in r.output, r.output
