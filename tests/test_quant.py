"""ggml's quantizer through ctypes: layout, accuracy, agreement with gguf-py, imatrix, errors."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quant_shape_to_byte_shape
from gguf.quants import quantize as gguf_quantize

from river_edge.format import RiverError
from river_edge.gguf_tools import quant

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 512)).astype(np.float32)
# rms error / rms value that each type must beat on gaussian data
TOLERANCE = {"f16": 1e-3, "bf16": 8e-3, "q4_0": 0.12, "q4_1": 0.12, "q5_0": 0.06, "q5_1": 0.06, "q8_0": 0.01,
             "q2_k": 0.33, "q3_k": 0.17, "q4_k": 0.1, "q5_k": 0.05, "q6_k": 0.025}


@pytest.mark.parametrize("name", list(quant.TYPES))
def test_layout_and_accuracy(name):
    t = quant.TYPES[name]
    q = quant.quantize(X, name)
    if t == T.F16:
        assert q.dtype == np.float16 and q.shape == X.shape
    else:
        assert q.dtype == np.uint8 and q.shape == quant_shape_to_byte_shape(X.shape, t)
    back = dequantize(q, t)
    assert back.shape == X.shape
    assert np.sqrt(np.mean((back - X) ** 2)) < TOLERANCE[name] * np.sqrt(np.mean(X ** 2))


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
@pytest.mark.parametrize("data", ["gauss", "f16-grid", "large"])
def test_same_bytes_as_gguf_py(name, data):
    """gguf-py's numpy quantizers are ports of ggml's reference ones: identical bytes expected."""
    x = {"gauss": X, "f16-grid": X.astype(np.float16).astype(np.float32),
         # 2^19 values: quantize() splits the rows over threads
         "large": RNG.standard_normal((512, 1024)).astype(np.float32)}[data]
    t = quant.TYPES[name]
    assert np.array_equal(quant.quantize(x, name), gguf_quantize(x, t))


def test_imatrix_lowers_weighted_error():
    x = RNG.standard_normal((32, 256)).astype(np.float32)
    im = RNG.uniform(0.01, 10, 256).astype(np.float32) ** 2
    plain, weighted = quant.quantize(x, "q4_k"), quant.quantize(x, "q4_k", im)
    assert not np.array_equal(plain, weighted)
    err = lambda q: float(np.sum(im * (dequantize(q, T.Q4_K) - x) ** 2))  # noqa: E731
    assert err(weighted) < err(plain)


def test_k_quant_fallback_is_llama_quantize_s():
    assert quant.type_for_row(T.Q4_K, 896) == T.Q5_0
    assert quant.type_for_row(T.Q6_K, 64) == T.Q8_0
    assert quant.type_for_row(T.Q4_K, 4864) == T.Q4_K
    assert quant.type_for_row(T.Q2_K, 576) == quant.type_for_row(T.Q3_K, 896) == T.IQ4_NL
    assert quant.type_for_row(T.Q3_K, 1536) == T.Q3_K


@pytest.mark.parametrize("call, fragment", [
    (lambda: quant.quantize(X[:, :48], "q4_0"), "multiple of 32"),
    (lambda: quant.quantize(X, "q7_0"), "unknown quantization type 'q7_0'"),
    (lambda: quant.quantize(X, "q4_k", np.ones(7)), "importance matrix has 7 values"),
    (lambda: quant.quantize(np.zeros((0, 32)), "q4_0"), "empty"),
])
def test_errors(call, fragment):
    with pytest.raises(RiverError, match=fragment):
        call()
