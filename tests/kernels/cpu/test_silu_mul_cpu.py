"""The C++ silu_mul (kernels/cpu/silu_mul.cpp) at every C++ level this CPU executes: against float64 maths within
its stated rounding, rows independent of the row count and threads, strided halves of a fused gate/up product,
the tails of the sigmoid, and which inputs ``graphspec.kernels.silu_mul`` hands it."""

import pytest
import torch

from graphspec.kernels import cpu
from graphspec.kernels.silu_mul import silu_mul, silu_mul_ref

needs_kernels = pytest.mark.usefixtures("level")  # each C++ level this CPU executes


def _exact(g, u):
    gd, ud = g.double(), u.double()
    return gd * torch.sigmoid(gd) * ud


def _within(out, g, u, rel, name):
    """fp32 maths off by at most 2e-6 relative (fast_exp < 3e-7, a division, two products), then one rounding to
    out's dtype (bf16: 2^-8 relative); an absolute 1e-30 for results near fp32's smallest normals."""
    exact = _exact(g, u)
    err = (out.double() - exact).abs()
    bound = exact.abs() * rel + 1e-30
    assert bool((err <= bound).all()), f"{name}: worst error {(err - bound).max().item():.3g} past the bound"


@needs_kernels
@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2 ** -8 + 2e-6), (torch.float32, 2e-6)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,n", [(1, 1), (1, 8960), (3, 17), (16, 33), (37, 100)])
def test_cpu_silu_mul_matches_float64(m, n, dtype, rel):
    """Odd widths (vector loops' tails), one and many rows, the fused product's halves as strided views."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    fused = (torch.randn(m, 2 * n, generator=g) * 4).to(dtype)
    gate, up = fused.chunk(2, dim=-1)
    out = cpu.ops().silu_mul(gate, up)
    assert out.dtype == dtype and out.shape == (m, n) and out.is_contiguous()
    _within(out, gate, up, rel, f"{m}x{n} {dtype}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpu_silu_mul_tails_and_specials(dtype):
    """Far tails (silu -> 0 below, -> g above; no overflow in exp), zeros, and NaN / inf passed on as torch does."""
    gate = torch.tensor([[-200.0, -90.0, -87.5, -20.0, -1e-3, 0.0, -0.0, 1e-3, 20.0, 87.5, 90.0, 3e38]]).to(dtype)
    up = torch.ones_like(gate)
    out = cpu.ops().silu_mul(gate, up)
    finite = torch.isfinite(gate)
    assert bool((out.double()[finite] - _exact(gate, up)[finite]).abs().le(
        _exact(gate, up)[finite].abs() * (2 ** -8) + 1e-30).all())
    specials = torch.tensor([[float("nan"), float("inf"), 1.0, 2.0]]).to(dtype)
    got = cpu.ops().silu_mul(specials, torch.tensor([[1.0, 1.0, float("nan"), float("inf")]]).to(dtype))
    assert torch.isnan(got[0, 0]) and torch.isnan(got[0, 2]) and got[0, 3] == float("inf")
    assert got[0, 1] == float("inf") or torch.isnan(got[0, 1])  # inf * sigmoid(inf): torch gives nan (inf / inf)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_silu_mul_rows_independent_of_row_count_and_threads(threads):
    g = torch.Generator().manual_seed(7)
    fused = (torch.randn(300, 2 * 8960, generator=g) * 3).bfloat16()
    gate, up = fused.chunk(2, dim=-1)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu.ops().silu_mul(gate[i:i + 1], up[i:i + 1]) for i in range(300)])
        torch.set_num_threads(threads)
        assert torch.equal(cpu.ops().silu_mul(gate, up), alone)
    finally:
        torch.set_num_threads(old)


def test_cpu_silu_mul_refuses_what_it_cannot_run():
    if not cpu.available():
        pytest.skip("no C++ level here")
    op = cpu.ops().silu_mul
    with pytest.raises(RuntimeError, match="alike"):
        op(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="one dtype"):
        op(torch.randn(3, 4), torch.randn(3, 4).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(4, 3).t(), torch.randn(4, 3).t())
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        op(torch.randn(3, 4).half(), torch.randn(3, 4).half())


@pytest.mark.usefixtures("any_level")
def test_silu_mul_takes_the_cpp_kernel_for_bf16_at_vector_levels(monkeypatch):
    """bf16 at amx / avx512 / avx2 goes to the C++ kernel (a 3-d input, halves of a product: its calls counted);
    fp32, and bf16 at the generic and torch levels, keep the torch path (silu_mul_ref's bits)."""
    calls = []
    real_ops = cpu.ops

    class Counted:
        def __init__(self, ops):
            self._ops = ops

        def silu_mul(self, g, u):
            calls.append(tuple(g.shape))
            return self._ops.silu_mul(g, u)

    monkeypatch.setattr(cpu, "ops", lambda name=None: Counted(real_ops(name)))
    g = torch.Generator().manual_seed(3)
    fused = (torch.randn(2, 5, 2 * 77, generator=g) * 4).bfloat16()
    gate, up = fused.chunk(2, dim=-1)
    out = silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == torch.bfloat16
    if cpu.bf16_linear():
        assert calls == [(10, 77)]
        assert torch.equal(out, real_ops().silu_mul(gate.reshape(-1, 77), up.reshape(-1, 77)).reshape(gate.shape))
    else:
        assert calls == [] and torch.equal(out, silu_mul_ref(gate, up))
    assert torch.equal(silu_mul(gate.float(), up.float()), silu_mul_ref(gate.float(), up.float()))
    assert len(calls) == (1 if cpu.bf16_linear() else 0)
