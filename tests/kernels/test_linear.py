"""linear: the Triton kernels (tiled and skinny/split-K, run by Triton's interpreter) against linear_ref."""

import importlib

import pytest
import torch

from graphspec.kernels import batched_rows, use_backend
from graphspec.kernels.linear import (SKINNY_MAX_M, Int8Weight, PackedWeight, _can_pack, _choose_split_k,
                                      _linear_triton, linear, linear_ref, prepare_weight, quantize_weight)
from tests.kernels._compare import assert_close

linear_mod = importlib.import_module("graphspec.kernels.linear")  # the package re-exports `linear` the function

# Both paths accumulate exactly-representable products in fp32 and differ only in summation
# order (~1e-6 relative here) and in the final rounding: the interpreter truncates fp32 -> bf16
# where torch rounds to nearest, so bf16 may be 1 ulp (2^-7 relative) apart; fp16 rounds to
# nearest on both sides but a summation-order difference can flip it, again 1 ulp (2^-10).
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 2e-3),
}
DTYPES = list(TOL)


def _inputs(m, k, n, dtype, bias=True):
    # Scaled so outputs are O(1): absolute tolerances then mean the same thing at every K.
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 77])
@pytest.mark.parametrize("k,n", [(130, 423), (17, 3)])
def test_triton_matches_reference(m, k, n, dtype):
    x, w, b = _inputs(m, k, n, dtype, bias=(m % 2 == 1))
    with use_backend("triton"):
        y = linear(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close(y, linear_ref(x, w, b), *TOL[dtype], name=f"linear m={m} k={k} n={n} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 40])  # skinny and tiled
def test_non_contiguous_inputs(m, dtype):
    k, n = 96, 77
    x = torch.randn(k, m).to(dtype).t()  # [M, K] with stride (1, M)
    w = (torch.randn(k, n) / k ** 0.5).to(dtype).t()  # [N, K] with stride (1, N)
    b = torch.randn(2 * n).to(dtype)[::2]  # stride 2
    assert not x.is_contiguous() and not w.is_contiguous() and not b.is_contiguous()
    with use_backend("triton"):
        y = linear(x, w, b)
    assert_close(y, linear_ref(x, w, b), *TOL[dtype], name=f"linear strided m={m} {dtype}")


def test_leading_dims_and_sliced_batch():
    x = torch.randn(2, 9, 5, 64)[:, 1:8:2]  # [2, 4, 5, 64], not viewable as 2-D without a copy
    w = torch.randn(33, 64) / 8
    with use_backend("triton"):
        y = linear(x, w)
        y1 = linear(x[0, 0, 0], w)  # 1-D input: one row
    assert y.shape == (2, 4, 5, 33) and y1.shape == (33,)
    assert_close(y, linear_ref(x, w), *TOL[torch.float32], name="linear 4-D")
    assert_close(y1, linear_ref(x[0, 0, 0], w), *TOL[torch.float32], name="linear 1-D")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2, 3, 7])
def test_skinny_split_k(split_k, dtype):
    x, w, b = _inputs(5, 300, 70, dtype)
    y = _linear_triton(x, w, b, split_k=split_k)
    assert_close(y, linear_ref(x, w, b), *TOL[dtype], name=f"linear split_k={split_k} {dtype}")
    # Fixed-order reduction: running again gives bit-identical results.
    assert torch.equal(y, _linear_triton(x, w, b, split_k=split_k))


def test_split_k_heuristic_spreads_skinny_work():
    cpu = torch.device("cpu")  # pretends to be a 132-SM device
    assert _choose_split_k(151936, 1536, cpu) == 1  # the lm_head already has thousands of N tiles
    assert _choose_split_k(1536, 8960, cpu) > 1  # few N tiles, long K: split
    assert _choose_split_k(64, 300, cpu) == 1  # each split keeps >= 512 of K


def test_empty_rows_and_zero_k():
    w = torch.randn(5, 8)
    with use_backend("triton"):
        assert linear(torch.randn(0, 8), w).shape == (0, 5)
        b = torch.randn(5)
        assert_close(linear(torch.randn(3, 0), torch.randn(5, 0), b), b.expand(3, 5), 0, 0, name="K=0")


def test_reference_matches_float64():
    x, w, b = _inputs(7, 130, 50, torch.float32)
    expected = x.double() @ w.double().t() + b.double()
    assert_close(linear_ref(x, w, b), expected, 1e-5, 1e-5, name="linear_ref vs float64")
    # bf16 reference accumulates in fp32: far better than a bf16 running sum would be.
    xb, wb = x.bfloat16(), w.bfloat16()
    assert_close(linear_ref(xb, wb), xb.double() @ wb.double().t(), 1e-2, 8e-3, name="bf16 linear_ref vs float64")


def test_skinny_threshold_is_a_tl_dot_size():
    assert SKINNY_MAX_M == 16  # tl.dot needs at least 16 rows; the skinny kernel pads M up to it


@pytest.mark.parametrize("call,match", [
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 9)), "weight"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8, 1)), "weight"),
    (lambda: linear(torch.tensor(1.0), torch.randn(5, 1)), "x"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(4)), "bias"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(5, 1)), "bias"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8, device="meta")), "weight"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(5, device="meta")), "bias"),
    (lambda: linear(torch.randn(3, 8).double(), torch.randn(5, 8).double()), "x"),
    (lambda: linear(torch.ones(3, 8, dtype=torch.int32), torch.randn(5, 8)), "x"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8).bfloat16()), "weight"),
    (lambda: linear(torch.randn(3, 8), torch.randn(5, 8), torch.randn(5).half()), "bias"),
    (lambda: linear([[1.0]], torch.randn(1, 1)), "x"),
])
def test_bad_input_raises_value_error_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- prepare_weight: the oneDNN-packed CPU layout (bf16 weights at a level with a bf16 linear: tests/kernels/cpu) ------------

needs_pack = pytest.mark.skipif(not _can_pack(torch.zeros(1, 1)), reason="oneDNN is not available in this torch")
# oneDNN and F.linear accumulate in fp32 in different orders: fp32 ~1e-6 relative; bf16 outputs may
# round to neighbouring values (1 ulp = 2^-7 relative).
PACK_DTYPES = [torch.float32] + ([torch.bfloat16] if _can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)) else [])


@needs_pack
@pytest.mark.parametrize("dtype", PACK_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 9, 33])
def test_packed_weight_matches_reference(m, dtype):
    x, w, b = _inputs(m, 130, 423, dtype, bias=(m % 2 == 1))
    pw = prepare_weight(w, layout="onednn")  # bf16 "auto" may be the native kernel: tests/kernels/cpu
    assert isinstance(pw, PackedWeight) and pw.shape == w.shape and pw.dtype == dtype
    y = linear(x, pw, b)
    assert y.dtype == dtype and y.shape == (m, 423)
    assert_close(y, linear_ref(x, w, b), *TOL[dtype], name=f"packed linear m={m} {dtype}")
    assert torch.equal(pw.dense(), w)  # the layout changes, the values do not


@needs_pack
def test_packed_weight_strided_inputs_and_leading_dims():
    w = torch.randn(77, 96) / 10
    pw = prepare_weight(w.t().contiguous().t())  # a column-major weight packs the same
    x = torch.randn(2, 9, 3, 96)[:, 1:8:2]  # [2, 4, 3, 96], not viewable as 2-D
    b = torch.randn(154)[::2]  # stride 2: oneDNN itself would read it as contiguous
    assert_close(linear(x, pw, b), linear_ref(x, w, b), *TOL[torch.float32], name="packed 4-D strided")
    assert_close(linear(x[0, 0, 0], pw), linear_ref(x[0, 0, 0], w), *TOL[torch.float32], name="packed 1-D")
    assert linear(torch.randn(0, 96), pw).shape == (0, 77)


def test_prepare_weight_leaves_other_layouts_alone():
    w16 = torch.randn(8, 4).half()
    if not _can_pack(w16):
        assert prepare_weight(w16) is w16  # fp16 on a CPU without AVX512-FP16: F.linear
    w = torch.randn(8, 4)
    with use_backend("triton"):
        assert prepare_weight(w) is w  # Triton kernels read plain [N, K] tensors
    with use_backend("torch"):
        assert isinstance(prepare_weight(w), PackedWeight) == _can_pack(w)


def _refuses_triton_and_bad_shapes(prepared, kind: str):
    with use_backend("triton"), pytest.raises(ValueError, match=kind):
        linear(torch.randn(2, 4), prepared)
    with pytest.raises(ValueError, match="K must match"):
        linear(torch.randn(2, 5), prepared)
    with pytest.raises(ValueError, match="dtype"):
        linear(torch.randn(2, 4).bfloat16(), prepared)
    with pytest.raises(ValueError, match="bias"):
        linear(torch.randn(2, 4), prepared, torch.randn(7))


@needs_pack
def test_packed_weight_refuses_triton_and_bad_shapes():
    _refuses_triton_and_bad_shapes(prepare_weight(torch.randn(8, 4)), "PackedWeight")
    with pytest.raises(ValueError, match="weight"):
        prepare_weight(torch.randn(8))
    with pytest.raises(ValueError, match="rows_hint"):
        prepare_weight(torch.randn(8, 4), rows_hint=0)


@needs_pack
@pytest.mark.parametrize("rows_hint", [1, 8, 64])
def test_every_rows_hint_gives_the_same_product(rows_hint):
    x, w, b = _inputs(5, 96, 77, torch.float32)
    y = linear(x, prepare_weight(w, rows_hint=rows_hint), b)
    assert_close(y, linear_ref(x, w, b), *TOL[torch.float32], name=f"packed rows_hint={rows_hint}")


@needs_pack
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", PACK_DTYPES)
def test_packed_rows_are_bit_identical_whatever_the_row_count(dtype, threads, monkeypatch):
    """Row i of an M-row product equals the one-row product of that row, for M = 1..24.

    A decode step multiplies one row, a speculative verify K+1: greedy speculative output can only
    equal autoregressive output bit for bit if those agree. oneDNN picks another kernel (and another
    order of the sums) by row count: one row on another kernel for some weights (the long-K [896, 4864]
    one on the AVX-512 AMD machines), 8+ or 12+ rows on others (a bf16 [4096, 11008] / [1536, 8960]
    on the AMX Xeon machines, by thread count). ``linear`` pads products of fewer than MIN_ROWS rows
    and splits those longer than the measured consistent row count (INVARIANT_MAX_ROWS); with both
    off (MIN_ROWS=1, INVARIANT_MAX_ROWS=0) the mismatches appear wherever this CPU has them.
    """
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        weights = [prepare_weight((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype), layout="onednn")
                   for n, k in ((896, 4864), (4000, 600), (77, 130), (1536, 8960), (4096, 11008))]
        xs = [torch.randn(24, w.shape[1], generator=g).to(dtype) for w in weights]
        mismatches = {}
        for setting in ("default", "off"):
            if setting == "off":
                monkeypatch.setattr(linear_mod, "MIN_ROWS", 1)
                monkeypatch.setattr(linear_mod, "INVARIANT_MAX_ROWS", 0)
            mismatches[setting] = []
            for w, x in zip(weights, xs):
                alone = [linear(x[i:i + 1], w)[0] for i in range(x.shape[0])]
                for m in range(2, x.shape[0] + 1):
                    part = linear(x[:m], w)
                    mismatches[setting] += [(tuple(w.shape), m, i) for i in range(m)
                                            if not torch.equal(part[i], alone[i])]
    finally:
        torch.set_num_threads(old_threads)
    assert mismatches["default"] == [], mismatches["default"][:10]
    if not mismatches["off"]:
        pytest.skip("this CPU's oneDNN rounds every row count alike here: padding and splitting are not needed")


@needs_pack
def test_long_products_split_only_where_rows_disagree(monkeypatch):
    """Products of MIN_ROWS < M <= INVARIANT_MAX_ROWS rows run in blocks of at most the consistent row count
    (values as the one-call product's, close, not equal, where the kernels differ); longer ones, and any
    inside batched_rows(), run whole."""
    calls = []
    real = linear_mod._pointwise
    monkeypatch.setattr(linear_mod, "_pointwise", lambda x2, w, b: calls.append(x2.shape[0]) or real(x2, w, b))
    x, w, b = _inputs(40, 96, 33, torch.float32)
    pw = prepare_weight(w)
    c = linear_mod._consistent_rows(pw)  # measured (and cached) before the calls are counted
    monkeypatch.setitem(linear_mod._consistent, next(k for k in linear_mod._consistent if k[0] == (33, 96)), 5)
    calls.clear()
    y = linear(x[:12], pw, b)
    assert calls == [4, 4, 4]  # 12 rows in three blocks of at most 5
    assert_close(y, linear_ref(x[:12], w, b), *TOL[torch.float32], name="split product")
    calls.clear()
    linear(x[:5], pw, b)
    assert calls == [5]
    calls.clear()
    with batched_rows():  # a prefill: one product whatever the rows
        linear(x[:12], pw, b)
    assert calls == [12]
    monkeypatch.setattr(linear_mod, "INVARIANT_MAX_ROWS", 16)
    calls.clear()
    linear(x, pw, b)  # 40 rows: beyond INVARIANT_MAX_ROWS, one product
    assert calls == [40] and c >= linear_mod.MIN_ROWS


INT8_REL = 0.03  # per-row int8 weights and per-row 8-bit activations: ~1% relative error, bounded at 3%


def _rel_err(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_weight_approximates_reference(m, dtype, any_level):
    x, w, b = _inputs(m, 130, 423, dtype, bias=(m != 3))
    qw = quantize_weight(w)
    assert isinstance(qw, Int8Weight) and qw.shape == w.shape and qw.dtype == dtype
    y = linear(x, qw, b)
    assert y.dtype == dtype and y.shape == (m, 423)
    assert _rel_err(y, linear_ref(x.float(), w.float(), None if b is None else b.float())) < INT8_REL
    # the stored weight is the per-row rounding of w: within half a step (max|row| / 254) of it
    step = w.float().abs().amax(dim=1, keepdim=True) / 127
    assert ((qw.dense() - w.float()).abs() <= step / 2 + 1e-6).all()
    assert linear(torch.randn(2, 0, 130).to(dtype), qw).shape == (2, 0, 423)


def test_int8_weight_refuses_what_it_cannot_run():
    _refuses_triton_and_bad_shapes(quantize_weight(torch.randn(8, 4)), "Int8Weight")
    with pytest.raises(ValueError, match="CPU path"):
        quantize_weight(torch.randn(8, 4, device="meta"))
