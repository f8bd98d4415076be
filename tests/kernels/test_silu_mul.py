"""silu_mul: the Triton kernel (interpreter) against silu_mul_ref, and silu_mul_ref against float64 math."""

import pytest
import torch

from graphspec.kernels import use_backend
from graphspec.kernels.silu_mul import silu_mul, silu_mul_ref
from tests.kernels._compare import assert_close

# fp32 math on both sides, exp from numpy vs torch (~1 ulp), one rounding to the output dtype:
# fp32 a few ulps; fp16 may flip the final rounding (2^-10); bf16: the interpreter truncates where
# torch rounds to nearest (< 1 ulp = 2^-7 relative). atol covers results that cancel to ~0.
TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.bfloat16: (1e-5, 8e-3),
    torch.float16: (1e-5, 1e-3),
}
DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 17), (2, 5, 423), (77, 1)])
def test_triton_matches_reference(shape, dtype):
    gate = (3 * torch.randn(shape)).to(dtype)  # wide range: both tails of the sigmoid
    up = torch.randn(shape).to(dtype)
    with use_backend("triton"):
        out = silu_mul(gate, up)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close(out, silu_mul_ref(gate, up), *TOL[dtype], name=f"silu_mul {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    m, n = 9, 130
    gate_up = torch.randn(m, 2 * n).to(dtype)  # a fused gate_up projection, split into two views
    gate, up = gate_up[:, :n], gate_up[:, n:]
    gate_t = torch.randn(n, m).to(dtype).t()  # column stride m
    assert not (gate.is_contiguous() or up.is_contiguous() or gate_t.is_contiguous())
    with use_backend("triton"):
        out = silu_mul(gate, up)
        out_t = silu_mul(gate_t, up)
    assert_close(out, silu_mul_ref(gate, up), *TOL[dtype], name=f"halves of gate_up {dtype}")
    assert_close(out_t, silu_mul_ref(gate_t, up), *TOL[dtype], name=f"transposed gate {dtype}")


def test_extreme_gates_stay_finite():
    gate = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0]])
    up = torch.ones_like(gate)
    with use_backend("triton"):
        out = silu_mul(gate, up)
    assert_close(out, torch.tensor([[0.0, -20.0 / (1 + torch.e ** 20), 0.0, 20.0, 100.0]]), 1e-6, 1e-6,
                 name="silu at the sigmoid's tails")


def test_empty_input():
    with use_backend("triton"):
        assert silu_mul(torch.randn(0, 5), torch.randn(0, 5)).shape == (0, 5)


def test_reference_matches_float64():
    gate, up = 4 * torch.randn(50, 33), torch.randn(50, 33)
    g, u = gate.double(), up.double()
    assert_close(silu_mul_ref(gate, up), g / (1 + torch.exp(-g)) * u, 1e-6, 1e-6, name="silu_mul_ref vs float64")
    # bf16: computed in fp32 and rounded once, so within one bf16 rounding of the exact value.
    gb, ub = gate.bfloat16(), up.bfloat16()
    gd, ud = gb.double(), ub.double()
    assert_close(silu_mul_ref(gb, ub), gd / (1 + torch.exp(-gd)) * ud, 1e-6, 2 ** -8, name="bf16 silu_mul_ref")


@pytest.mark.parametrize("call,match", [
    (lambda: silu_mul(torch.randn(3, 8), torch.randn(3, 9)), "up"),
    (lambda: silu_mul(torch.randn(3, 8), torch.randn(8)), "up"),
    (lambda: silu_mul(torch.tensor(1.0), torch.tensor(1.0)), "gate"),
    (lambda: silu_mul(torch.randn(3, 8), torch.randn(3, 8).half()), "up"),
    (lambda: silu_mul(torch.randn(3, 8), torch.randn(3, 8, device="meta")), "up"),
    (lambda: silu_mul(torch.randn(3, 8).double(), torch.randn(3, 8).double()), "gate"),
    (lambda: silu_mul(torch.ones(3, 8, dtype=torch.int32), torch.randn(3, 8)), "gate"),
    (lambda: silu_mul(torch.randn(3, 8), None), "up"),
])
def test_bad_input_raises_value_error_naming_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_is_bit_identical_to_reference(dtype):
    gate_up = (3 * torch.randn(7, 2 * 423)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # strided views, as the model passes them
    with use_backend("torch"):
        out = silu_mul(gate, up)
    assert out.dtype == dtype and torch.equal(out, silu_mul_ref(gate, up))
