"""graphspec's block-format GEMMs (kernels/cpu/qgemm.cpp) at every C++ level this CPU executes.

- Against the torch reference (dequantize, then an fp32 matmul: ``kernels.qlinear.qlinear_ref``) on odd shapes,
  every format, 1..8 rows (the in-register decode/verify path) and 13 (the prefill path), with a bias. The
  tolerance is the fp32 summation error of a K-term dot product: ``|y - ref| <= 1e-5 * (|x| @ |w|^T)`` (the two
  sum in different orders; the weights are the same values).
- Row-exact: a row's result is bit-identical alone, inside every block of 1..8 rows, inside 13 rows, and with 1
  or 2 threads; avx512 and avx2 (the same FMA order) give the same bits.
"""

import pytest
import torch

from graphspec.kernels import cpu
from graphspec.kernels.linear import linear
from graphspec.kernels.qlinear import FORMATS, TYPE_IDS, BlockWeight, qlinear, qlinear_ref
from tests.conftest import C_LEVELS
from tests.kernels._qblocks import random_blocks

TYPES = list(FORMATS)


def _weight(type_name: str, n: int, k: int, seed: int = 0) -> BlockWeight:
    return BlockWeight(type_name, torch.from_numpy(random_blocks(type_name, n, k, seed=seed)), (n, k))


def _k(type_name: str, blocks: int) -> int:
    return max(FORMATS[type_name][0], 32) * blocks


def _bound(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    return 1e-5 * (x.abs().double() @ w.dense().abs().double().t()) + 1e-30


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_qgemm_matches_the_dequantized_matmul(level, type_name, m):
    n, k = 37, _k(type_name, 3)
    w = _weight(type_name, n, k, seed=m)
    x = torch.randn(m, k, device="cpu")
    bias = torch.randn(n, device="cpu")
    y = qlinear(x, w, bias)
    ref = qlinear_ref(x, w, bias)
    err = (y.double() - ref.double()).abs()
    bound = _bound(x, w)
    assert (err <= bound).all(), f"{level} {type_name}: worst {float((err / bound).max()):.2f}x the bound"


@pytest.mark.parametrize("type_name", ["F32", "F16"])
def test_qgemm_float_tensors_take_any_k(level, type_name):
    n, k = 5, 45  # no multiple of the 16 lanes
    w = _weight(type_name, n, k)
    x = torch.randn(3, k, device="cpu")
    err = (qlinear(x, w).double() - qlinear_ref(x, w).double()).abs()
    assert (err <= _bound(x, w)).all()


@pytest.mark.parametrize("type_name", TYPES)
def test_qgemm_rows_are_exact_whatever_the_row_count_and_threads(level, type_name):
    n, k = 29, _k(type_name, 2)
    w = _weight(type_name, n, k)
    x = torch.randn(13, k, device="cpu")
    alone = torch.cat([qlinear(x[i:i + 1], w) for i in range(13)])
    for m in range(1, 9):
        for start in (0, 13 - m):
            assert torch.equal(qlinear(x[start:start + m], w), alone[start:start + m]), (level, type_name, m)
    assert torch.equal(qlinear(x, w), alone)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(qlinear(x[:5], w), alone[:5]), (level, type_name, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not {"avx512", "avx2"} <= set(C_LEVELS), reason="needs a CPU that executes avx512 and avx2")
@pytest.mark.parametrize("type_name", TYPES)
def test_qgemm_avx512_and_avx2_give_the_same_bits(type_name):
    n, k = 19, _k(type_name, 2)
    w = _weight(type_name, n, k)
    x = torch.randn(11, k, device="cpu")
    for m in (1, 4, 11):
        got = [cpu.qops(lv).qlinear(x[:m].contiguous(), w.blocks, TYPE_IDS[type_name], n, k, None)
               for lv in ("avx512", "avx2")]
        assert torch.equal(got[0], got[1]), (type_name, m)


def test_qgemm_through_linear_and_its_checks(level):
    w = _weight("Q4_K", 7, 256)
    x = torch.randn(2, 3, 256, device="cpu")
    y = linear(x, w)
    assert y.shape == (2, 3, 7)
    assert torch.equal(y.reshape(6, 7), qlinear(x.reshape(6, 256), w))
    with pytest.raises(RuntimeError, match="bytes for a"):
        cpu.qops().qlinear(x.reshape(6, 256), w.blocks[:3], TYPE_IDS["Q4_K"], 7, 256, None)
