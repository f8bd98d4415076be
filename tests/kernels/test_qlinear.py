"""GGUF block formats in memory (kernels/qlinear.py): the torch dequantization against the gguf package's, bit
for bit, on random blocks, on blocks the gguf package quantizes, and on real blocks of the zoo's GGUF files; the
BlockWeight / StackedWeight containers and their dispatch through ``kernels.linear``."""

from pathlib import Path

import numpy as np
import pytest
import torch

from graphspec.kernels import cpu
from graphspec.kernels.linear import linear
from graphspec.kernels.qlinear import FORMATS, BlockWeight, StackedWeight, dequantize_ref, qlinear_ref, stack
from tests.kernels._qblocks import QUANT_TYPES, random_blocks

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

Q = gguf.GGMLQuantizationType
GGUF_DIR = Path.home() / ".cache" / "graphspec" / "gguf"


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("type_name", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_dequantize_matches_gguf_on_random_blocks(type_name, rows):
    size = FORMATS[type_name][0]
    cols = max(size, 32) * 3
    raw = random_blocks(type_name, rows, cols, seed=rows)
    want = dequantize(raw, Q[type_name]).reshape(-1)
    got = dequantize_ref(type_name, torch.from_numpy(raw)).numpy()
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_matches_gguf_on_quantized_values(type_name):
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, Q[type_name])
    want = dequantize(raw, Q[type_name]).reshape(-1)
    got = dequantize_ref(type_name, torch.from_numpy(np.ascontiguousarray(raw))).numpy()
    assert np.array_equal(_bits(got), _bits(want))
    assert np.abs(got - x.reshape(-1)).max() < 0.3  # and it is a dequantization of x, not of something else


def _real_tensors():
    """(file, tensor) of one 2-d tensor per quantized type in each zoo GGUF that is cached here."""
    out = []
    for path in sorted(GGUF_DIR.glob("*.gguf")):
        seen = set()
        for t in gguf.GGUFReader(path).tensors:
            if t.tensor_type.name in QUANT_TYPES and t.tensor_type.name not in seen and len(t.shape) == 2:
                seen.add(t.tensor_type.name)
                out.append((path.name, t))
    return out


def test_dequantize_matches_gguf_on_real_blocks():
    tensors = _real_tensors()
    if not tensors:
        pytest.skip(f"no zoo GGUF in {GGUF_DIR} (graphspec.models.zoo.fetch keeps them)")
    for name, t in tensors:
        raw = np.asarray(t.data)[:13]  # 13 rows: an odd count
        want = dequantize(raw, t.tensor_type).reshape(-1)
        got = dequantize_ref(t.tensor_type.name, torch.from_numpy(np.array(raw))).numpy()
        assert np.array_equal(_bits(got), _bits(want)), f"{name}: {t.name} ({t.tensor_type.name})"


def test_block_weight_checks_its_bytes_and_shape():
    raw = torch.from_numpy(random_blocks("Q4_K", 3, 256))
    w = BlockWeight("Q4_K", raw, (3, 256))
    assert w.shape == (3, 256) and w.nbytes == 3 * 144 and w.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 256"):
        BlockWeight("Q4_K", raw, (6, 128))
    with pytest.raises(ValueError, match="432 uint8 bytes"):
        BlockWeight("Q4_K", raw[:2], (3, 256))
    with pytest.raises(ValueError, match="not a block format"):
        BlockWeight("IQ2_XS", raw, (3, 256))
    ids = torch.tensor([[2, 0]])
    assert torch.equal(w.rows(ids), w.dense()[ids])
    assert torch.equal(w.select(torch.tensor([2, 1])).dense(), w.dense()[[2, 1]])


def test_stack_concatenates_one_format_and_keeps_mixed_ones_apart():
    a = BlockWeight("Q8_0", torch.from_numpy(random_blocks("Q8_0", 3, 64, seed=1)), (3, 64))
    b = BlockWeight("Q8_0", torch.from_numpy(random_blocks("Q8_0", 5, 64, seed=2)), (5, 64))
    c = BlockWeight("Q5_0", torch.from_numpy(random_blocks("Q5_0", 2, 64, seed=3)), (2, 64))
    same = stack([a, b])
    assert isinstance(same, BlockWeight) and torch.equal(same.dense(), torch.cat([a.dense(), b.dense()]))
    mixed = stack([a, c, b])
    assert isinstance(mixed, StackedWeight) and mixed.shape == (10, 64)
    x = torch.randn(3, 64, device="cpu")
    bias = torch.randn(10, device="cpu")
    with cpu.use_level("torch"):
        y = linear(x, mixed, bias)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, mixed.dense(), bias), rtol=1e-5, atol=1e-5)


def test_linear_dispatches_block_weights_and_checks_inputs():
    w = BlockWeight("Q6_K", torch.from_numpy(random_blocks("Q6_K", 7, 256)), (7, 256))
    x = torch.randn(2, 3, 256, device="cpu")
    with cpu.use_level("torch"):
        assert torch.equal(linear(x, w), qlinear_ref(x, w))
    with pytest.raises(ValueError, match="fp32 activations"):
        linear(x.bfloat16(), w)
    with pytest.raises(ValueError, match="K must match"):
        linear(torch.randn(2, 128, device="cpu"), w)
    with pytest.raises(ValueError, match="bias has 3 elements"):
        linear(torch.randn(2, 256, device="cpu"), w, torch.randn(3, device="cpu"))


# ----------------------------------------------------------------------------------------------
# Triton (under TRITON_INTERPRET=1 here; compiled for sm_90 in test_compile_sm90.py)

from graphspec.kernels.qlinear import SKINNY_MAX_M, qlinear_triton  # noqa: E402

DEVICE = torch.empty(0).device  # cuda under perf/gpu_check.py (GRAPHSPEC_TEST_DEVICE), else the interpreter's cpu


def _bw(type_name: str, n: int, k: int, seed: int = 0) -> BlockWeight:
    return BlockWeight(type_name, torch.from_numpy(random_blocks(type_name, n, k, seed=seed)).to(DEVICE), (n, k))


def _k(type_name: str, blocks: int) -> int:
    return max(FORMATS[type_name][0], 32) * blocks


@pytest.mark.parametrize("type_name", list(FORMATS))
@pytest.mark.parametrize("m", [1, 5, SKINNY_MAX_M, 33])  # skinny launches, then the tiled one
def test_triton_qlinear_matches_the_reference(type_name, m):
    n, k = 37, _k(type_name, 3) + (13 if FORMATS[type_name][0] == 1 else 0)  # float tensors: a ragged K
    w = _bw(type_name, n, k, seed=m)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    y = qlinear_triton(x, w, bias)
    ref = qlinear_ref(x, w, bias)
    bound = 1e-5 * (x.abs().double() @ w.dense().abs().double().t())
    err = (y.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{type_name} m={m}: worst {float((err / bound).max()):.2f}x the bound"


@pytest.mark.parametrize("type_name", list(FORMATS))
def test_triton_dequantizes_each_weight_exactly(type_name):
    # x = identity: each output is one weight times 1 plus zeros, so y^T is the kernel's dequantized weight
    n, k = 21, _k(type_name, 1)
    w = _bw(type_name, n, k, seed=5)
    eye = torch.eye(k)
    for rows in (eye[:SKINNY_MAX_M], eye):
        got = qlinear_triton(rows, w).t()
        assert torch.equal(got, w.dense()[:, :rows.shape[0]]), type_name


def test_linear_runs_block_weights_through_triton_when_asked():
    from graphspec.kernels import use_backend

    w = _bw("Q5_K", 9, 256)
    x = torch.randn(2, 256)
    with use_backend("triton"):
        y = linear(x, w)
    assert torch.equal(y, qlinear_triton(x, w))
