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
from graphspec.kernels.qlinear import (A8_TILE_ROWS, FORMATS, TYPE_IDS, BlockWeight, pack_a8, pack_a8_ref, qlinear,
                                       qlinear_a8_ref, qlinear_ref, quantize_activations_ref, unpack_a8)
from tests.conftest import ALL_C_LEVELS, C_LEVELS
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
    _check_rows_exact(level, type_name, _weight(type_name, n, k), torch.randn(13, k, device="cpu"))


def _check_rows_exact(level, type_name, w, x):
    """A row's bits alone, inside every block of 1..8 rows and inside all 13, with 1 or 2 threads."""
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


# ---------------------------------------------------------------------------------------------------------------
# int8 activations (activations="int8": the k-quants' a8 GEMM). The oracle is kernels.qlinear.qlinear_a8_ref: x
# rounded per 256 exactly as the kernel rounds it, times the dequantized weight, summed in float64. The kernel
# sums integers exactly and rounds only in its fp32 combination, so the bound is the fp32 summation error of the
# rounded x: 1e-5 * (|q dx| @ |w|^T).

A8 = ["Q4_K", "Q5_K", "Q6_K"]


def _a8_weight(type_name: str, n: int, k: int, seed: int = 0) -> BlockWeight:
    return BlockWeight(type_name, torch.from_numpy(random_blocks(type_name, n, k, seed=seed)), (n, k), "int8")


def _a8_bound(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    q, dx = quantize_activations_ref(x)
    xr = (q.double() * dx.double()[..., None]).reshape(x.shape)
    return 1e-5 * (xr.abs() @ w.dense().abs().double().t()) + 1e-30


def _with_outliers(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, ::97] *= 300.0  # real activations' few large channels: they set dx for their whole super-block
    return x


@pytest.mark.parametrize("type_name", A8)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 20, 33])
def test_a8_matches_its_reference(block_level, type_name, m):
    n, k = 37, 768
    w = _a8_weight(type_name, n, k, seed=m)
    x = _with_outliers(m, k, seed=m)
    bias = torch.randn(n)
    y = qlinear(x, w, bias)
    err = (y.double() - qlinear_a8_ref(x, w, bias).double()).abs()
    bound = _a8_bound(x, w)
    assert (err <= bound).all(), f"{block_level} {type_name}: worst {float((err / bound).max()):.2f}x the bound"
    # and it is not the fp32-activation product: the rounding of x shows
    exact = qlinear(x, BlockWeight(type_name, w.blocks, w.shape), bias)
    assert not torch.allclose(y, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("type_name", A8)
def test_a8_rounds_ties_to_even(block_level, type_name):
    # amax 127 makes 127 / amax exactly 1, so x = j + 0.5 is a tie: rounding half away from zero instead of to
    # even moves about half of the 256 values a super-block by one step, far outside the bound
    n, k = 11, 512
    w = _a8_weight(type_name, n, k)
    x = (torch.arange(k, dtype=torch.float32) % 200 - 100 + 0.5).reshape(1, k)
    x[0, ::256] = 127.0
    q, dx = quantize_activations_ref(x)
    assert torch.equal(q.reshape(1, k)[0, 1:5], torch.tensor([-98.0, -98.0, -96.0, -96.0]))  # -98.5 .. -95.5
    err = (qlinear(x, w).double() - qlinear_a8_ref(x, w).double()).abs()
    assert (err <= _a8_bound(x, w)).all()


@pytest.mark.parametrize("type_name", A8)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a8_largest_quants_and_activations_stay_exact(block_level, type_name, sign):
    # every quant, sub-scale and min at its largest and every x at +-127: the avx2 path sums vpmaddubsw pairs in
    # int16 over several quads before scaling (kChunk in qgemm.cpp), and one quad too many wraps a lane here
    n, k = 9, 512
    blocks = random_blocks(type_name, n, k, seed=3).reshape(n * k // 256, -1)
    if type_name == "Q6_K":
        blocks[:, :192] = 0xFF  # ql, qh: quants 63
        blocks[:, 192:208] = 0x7F  # int8 sub-scales 127
    else:
        blocks[:, 4:] = 0xFF  # 6-bit scales and mins 63, (Q5_K: high bits,) nibbles 15: quants 15 / 31
    w = BlockWeight(type_name, torch.from_numpy(blocks.reshape(n, -1).copy()), (n, k), "int8")
    x = torch.full((20, k), sign)  # 20 rows: amx runs 16 or all of them on tiles
    err = (qlinear(x, w).double() - qlinear_a8_ref(x, w).double()).abs()
    worst = float((err / _a8_bound(x, w)).max())
    assert (err <= _a8_bound(x, w)).all(), f"{block_level} {type_name}: worst {worst:.2f}x"


@pytest.mark.parametrize("type_name", A8)
def test_a8_rows_are_exact_whatever_the_row_count_and_threads(block_level, type_name):
    w = _a8_weight(type_name, 29, 512)
    _check_rows_exact(block_level, type_name, w, _with_outliers(13, 512, seed=1))
    # wide verifies and prefills (amx: whole 16-row chunks on tiles, a last part chunk padded or on vectors)
    x = _with_outliers(45, 512, seed=4)
    alone = torch.cat([qlinear(x[i:i + 1], w) for i in range(45)])
    for m in (12, 15, 16, 17, 20, 24, 28, 33, 45):
        assert torch.equal(qlinear(x[45 - m:], w), alone[45 - m:]), (block_level, type_name, m)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(qlinear(x, w), alone), (block_level, type_name)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(ALL_C_LEVELS) < 2, reason="needs a CPU that executes two C++ levels")
@pytest.mark.parametrize("type_name", A8)
def test_a8_every_level_gives_the_same_bits(type_name):
    n, k = 19, 768
    w = _a8_weight(type_name, n, k)
    x = _with_outliers(40, k, seed=2)
    for m in (1, 4, 11, 12, 16, 17, 20, 28, 40):
        got = [cpu.qops(lv).qlinear_a8(x[:m].contiguous(), w.tiles, TYPE_IDS[type_name], n, k, None)
               for lv in ALL_C_LEVELS]
        for lv, g in zip(ALL_C_LEVELS[1:], got[1:]):
            assert torch.equal(got[0], g), (type_name, m, ALL_C_LEVELS[0], lv)


@pytest.mark.parametrize("type_name", A8)
def test_a8_zero_and_non_finite_rows(block_level, type_name):
    n, k = 7, 512
    w = _a8_weight(type_name, n, k)
    bias = torch.randn(n)
    x = torch.randn(4, k)
    x[0] = 0.0
    x[1, 300] = float("nan")
    x[2, 3] = float("inf")
    y = qlinear(x, w, bias)
    assert torch.equal(y[0], bias)  # all-zero activations: exactly the bias
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.isfinite(y[3]).all() and torch.equal(y[3:], qlinear(x[3:], w, bias))


def test_a8_applies_to_the_k_quants_only(block_level):
    # a legacy format asked for int8 activations keeps fp32 ones: the same bits as without the setting
    w = BlockWeight("Q8_0", torch.from_numpy(random_blocks("Q8_0", 9, 256)), (9, 256), "int8")
    assert not w.int8_activations
    x = torch.randn(3, 256)
    assert torch.equal(qlinear(x, w), qlinear(x, BlockWeight("Q8_0", w.blocks, w.shape)))
    with pytest.raises(ValueError, match="activations='int4' is not one of"):
        BlockWeight("Q4_K", w.blocks, w.shape, "int4")
    k = _a8_weight("Q4_K", 5, 256)
    with pytest.raises(RuntimeError, match="int8 activations run Q4_K, Q5_K and Q6_K"):
        cpu.qops().qlinear_a8(x, w.blocks, TYPE_IDS["Q8_0"], 9, 256, None)
    assert "activations=int8" in repr(k) and k.select(torch.tensor([0, 2])).int8_activations


def test_a8_at_the_torch_level_is_the_reference_and_agrees_with_the_kernels():
    w = _a8_weight("Q4_K", 13, 512)
    x = _with_outliers(3, 512, seed=3)
    with cpu.use_level("torch"):
        y = qlinear(x, w)
    assert torch.equal(y, qlinear_a8_ref(x, w))
    for lv in ALL_C_LEVELS:
        with cpu.use_level(lv):
            assert ((qlinear(x, w).double() - y.double()).abs() <= _a8_bound(x, w)).all(), lv


# The tiles the a8 GEMM reads (kernels.qlinear.pack_a8): a lossless rearrangement of the GGUF bytes.

@pytest.mark.parametrize("type_name", A8)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40])
def test_a8_tiles_give_the_gguf_bytes_back(type_name, n):
    k = 768
    blocks = torch.from_numpy(random_blocks(type_name, n, k, seed=n))
    ref = pack_a8_ref(type_name, blocks, n, k)
    assert ref.shape == (-(-n // A8_TILE_ROWS), k // 256 * {"Q4_K": 2368, "Q5_K": 2880, "Q6_K": 3360}[type_name])
    assert torch.equal(unpack_a8(type_name, ref, n, k), blocks)
    for lv in C_LEVELS:  # the C++ packing, at every level: the same bytes as the torch one
        assert torch.equal(cpu.qops(lv).pack_a8(blocks, TYPE_IDS[type_name], n, k), ref), lv
    with cpu.use_level(C_LEVELS[0] if C_LEVELS else "torch"):
        assert torch.equal(pack_a8(type_name, blocks, n, k), ref)


def test_a8_packed_weight_keeps_its_values(level):
    n, k = 37, 512
    blocks = torch.from_numpy(random_blocks("Q6_K", n, k, seed=5))
    w = BlockWeight("Q6_K", blocks, (n, k), "int8")
    dense = w.dense()
    assert w.pack() is w and w._blocks is None and w.nbytes == 3 * 2 * 3360  # the GGUF layout is dropped
    assert torch.equal(w.blocks, blocks) and torch.equal(w.dense(), dense)
    ids = torch.tensor([[36, 0], [17, 17]])
    assert torch.equal(w.rows(ids), dense[ids])
    part = w.select(torch.tensor([3, 20, 36]))
    assert part._tiles is not None and torch.equal(part.dense(), dense[[3, 20, 36]])
    x = _with_outliers(2, k, seed=4)
    assert torch.equal(qlinear(x, part), qlinear(x, w)[:, [3, 20, 36]])
    if level != "torch":
        with pytest.raises(RuntimeError, match="tiles must be a contiguous CPU uint8 tensor of 4736 bytes"):
            cpu.qops().qlinear_a8(x, w.tiles[:1, :4032], TYPE_IDS["Q4_K"], 5, 512, None)


def test_a8_weight_packs_once_under_concurrent_first_calls():
    # the server's workers may make a weight's first product at the same time: each must see whole tiles
    from concurrent.futures import ThreadPoolExecutor

    n, k = 33, 512
    blocks = torch.from_numpy(random_blocks("Q4_K", n, k, seed=7))
    x = _with_outliers(2, k, seed=7)
    want = qlinear(x, BlockWeight("Q4_K", blocks, (n, k), "int8"))
    for _ in range(5):
        w = BlockWeight("Q4_K", blocks, (n, k), "int8")
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda _: qlinear(x, w), range(16)))
        assert all(torch.equal(g, want) for g in got) and w._blocks is None
