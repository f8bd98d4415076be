"""rmsnorm (plain and fused with the residual add): the Triton kernel under the interpreter against rmsnorm_ref,
and rmsnorm_ref against transformers' LlamaRMSNorm and a float64 formula."""

import importlib

import pytest
import torch

from graphspec.kernels import use_backend
from graphspec.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from tests.kernels._compare import assert_close

# graphspec.kernels re-exports the function under the module's own name, so attribute access
# (`import graphspec.kernels.rmsnorm as m`) finds the function; ask the module registry instead.
rmsnorm_mod = importlib.import_module("graphspec.kernels.rmsnorm")

# Output: two roundings to the input dtype (normalised value, then times weight), as in HF.
# fp32: only the sum-of-squares order differs (a few ulps). fp16: both sides round to nearest,
# but an fp32 difference can flip the first rounding: <= ~2 ulps (2^-9). bf16: the interpreter
# truncates fp32 -> bf16 where torch rounds to nearest, so each rounding may be 1 ulp off: 2^-6.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 4e-3),
}
# The new residual h = x + residual is one rounding of an exact fp32 sum: identical, except for the
# interpreter's bf16 truncation (< 1 ulp = 2^-7 relative).
TOL_H = {torch.float32: (0.0, 0.0), torch.bfloat16: (0.0, 8e-3), torch.float16: (0.0, 0.0)}
DTYPES = list(TOL)


def _case(shape, dtype):
    x = torch.randn(shape).to(dtype)
    residual = torch.randn(shape).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(shape[-1])).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 17), (2, 5, 300), (77, 423)])
def test_triton_matches_reference(shape, dtype):
    x, residual, weight = _case(shape, dtype)
    with use_backend("triton"):
        y = rmsnorm(x, weight, 1e-6)
        y2, h = rmsnorm(x, weight, 1e-5, residual=residual)
    ry = rmsnorm_ref(x, weight, 1e-6)
    ry2, rh = rmsnorm_ref(x, weight, 1e-5, residual=residual)
    assert y.dtype == dtype and y.shape == x.shape and h.shape == x.shape
    assert_close(y, ry, *TOL[dtype], name=f"rmsnorm {shape} {dtype}")
    assert_close(h, rh, *TOL_H[dtype], name=f"rmsnorm residual h {shape} {dtype}")
    # Normalise the kernel's own h: under the interpreter a bf16 h may already be 1 ulp off, and
    # that ulp should not be charged to the norm a second time.
    assert_close(y2, rmsnorm_ref(h, weight, 1e-5), *TOL[dtype], name=f"rmsnorm fused {shape} {dtype}")
    if dtype != torch.bfloat16:
        assert_close(y2, ry2, *TOL[dtype], name=f"rmsnorm fused end to end {shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_rows_wider_than_one_block(monkeypatch, fused, dtype):
    monkeypatch.setattr(rmsnorm_mod, "_MAX_BLOCK", 64)  # 300 columns -> 5 tiles with a masked tail
    x, residual, weight = _case((4, 300), dtype)
    with use_backend("triton"):
        out = rmsnorm(x, weight, 1e-6, residual=residual if fused else None)
    expected = rmsnorm_ref(x, weight, 1e-6, residual=residual if fused else None)
    if fused:
        assert_close(out[1], expected[1], *TOL_H[dtype], name="multi-tile h")
        out, expected = out[0], rmsnorm_ref(out[1], weight, 1e-6)  # see test_triton_matches_reference
    assert_close(out, expected, *TOL[dtype], name=f"multi-tile rmsnorm fused={fused} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    m, hdim = 9, 130
    x = torch.randn(m, 2 * hdim).to(dtype)[:, ::2]  # column stride 2
    residual = torch.randn(hdim, m).to(dtype).t()  # column stride m
    weight = (1.0 + torch.randn(2 * hdim)).to(dtype)[::2]
    assert not (x.is_contiguous() or residual.is_contiguous() or weight.is_contiguous())
    with use_backend("triton"):
        # A large eps (mean(h^2) is ~2 here) so that a kernel dropping or misplacing eps fails.
        y, h = rmsnorm(x, weight, 0.5, residual=residual)
    _, rh = rmsnorm_ref(x, weight, 0.5, residual=residual)
    assert_close(h, rh, *TOL_H[dtype], name=f"strided h {dtype}")
    assert_close(y, rmsnorm_ref(h, weight, 0.5), *TOL[dtype], name=f"strided rmsnorm {dtype}")


def test_weight_dtype_may_differ_output_keeps_input_dtype():
    x = torch.randn(3, 40).bfloat16()
    weight = 1.0 + torch.randn(40)  # fp32 weight on bf16 activations
    with use_backend("triton"):
        y = rmsnorm(x, weight, 1e-6)
    assert y.dtype == torch.bfloat16
    assert_close(y, rmsnorm_ref(x, weight, 1e-6), *TOL[torch.bfloat16], name="fp32 weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_hf_llama_rmsnorm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, weight = _case((5, 64), dtype)
    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
        expected_fused = hf(x + residual)
    # Same operations in the same order: bit-identical, not merely close.
    assert torch.equal(rmsnorm_ref(x, weight, 1e-6), expected)
    assert torch.equal(rmsnorm_ref(x, weight, 1e-6, residual=residual)[0], expected_fused)


def test_reference_matches_float64_formula():
    x, _, weight = _case((6, 200), torch.float32)
    xd = x.double()
    expected = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert_close(rmsnorm_ref(x, weight, 1e-6), expected, 1e-6, 1e-6, name="rmsnorm_ref vs float64")


@pytest.mark.parametrize("call,match", [
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(9), 1e-6), "weight"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8, 1), 1e-6), "weight"),
    (lambda: rmsnorm(torch.tensor(1.0), torch.randn(1), 1e-6), "x"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8), -1.0), "eps"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8), None), "eps"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8), 1e-6, residual=torch.randn(3, 9)), "residual"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8), 1e-6, residual=torch.randn(3, 8).half()), "residual"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8, device="meta"), 1e-6), "weight"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.randn(8), 1e-6, residual=torch.randn(3, 8, device="meta")), "residual"),
    (lambda: rmsnorm(torch.randn(3, 8).double(), torch.randn(8), 1e-6), "x"),
    (lambda: rmsnorm(torch.randn(3, 8), torch.ones(8, dtype=torch.int32), 1e-6), "weight"),
])
def test_bad_input_raises_value_error_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 17), (2, 5, 300), (300, 1536)])
def test_torch_path_is_bit_identical_to_reference(shape, dtype):
    # The CPU path (F.rms_norm, then the weight in x's dtype) must round exactly where the
    # reference does: rows 1e-3 .. 1e2 in scale, plain, fused, and a strided view.
    x, residual, weight = _case(shape, dtype)
    rows = x.numel() // shape[-1]
    x = (x.float() * torch.logspace(-3, 2, rows).reshape(*shape[:-1], 1)).to(dtype)
    wide = torch.cat([x, x], dim=-1)[..., 1:shape[-1] + 1]  # same shape, not contiguous
    with use_backend("torch"):
        y = rmsnorm(x, weight, 1e-6)
        y2, h = rmsnorm(x, weight, 1e-5, residual=residual)
        ys = rmsnorm(wide, weight, 1e-6)
    assert torch.equal(y, rmsnorm_ref(x, weight, 1e-6))
    ry2, rh = rmsnorm_ref(x, weight, 1e-5, residual=residual)
    assert torch.equal(y2, ry2) and torch.equal(h, rh)
    assert torch.equal(ys, rmsnorm_ref(wide, weight, 1e-6))
