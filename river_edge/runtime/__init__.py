"""The runtime: RiverLlama over the patched llama.cpp (llama.py; the C API bound in capi.py), its decoding modes
(spec.py; exact.py, gated.py) over the model's decoder (decoder.py), exact mode's drafters and cost model
(drafters.py, costs.py), sampling (sampling.py), and layers on other hosts' rpc-servers (rpc.py)."""


def __getattr__(name):
    # `from river_edge.runtime import RiverLlama`, without importing llama_cpp for the modules beside it
    if name == "RiverLlama":
        from .llama import RiverLlama
        return RiverLlama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
