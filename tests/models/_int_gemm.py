"""Shared by the tests of graphspec's int8 and int4 GEMMs (kernels/_int8_gemm.h, _int4_gemm.h): the fixture
that needs them built, their rounding of the activations redone in torch, and what each GEMM owes its callers
beyond its numbers."""

import pytest
import torch

from graphspec.models import int8_native


@pytest.fixture(scope="module")
def vnni():
    """Skips where graphspec's GEMMs are not built (no AVX-512 VNNI); fails where the C++ forward did not build."""
    if not int8_native.available():
        pytest.fail("the C++ int8 forward did not build here; CI and this machine have g++ and ninja")
    if not int8_native.have_vnni():
        pytest.skip("graphspec's int8 and int4 GEMMs need AVX-512 VNNI")


def round_activations(x: torch.Tensor):
    """Each row of x as the GEMMs round it: to u8 with a zero point over [min(x, 0), max(x, 0)] in 255 steps
    (fp32, as the C++ computes it). Returns u (int64), the zero points z and the row scales s: x ~ s * (u - z)."""
    lo, hi = x.amin(1).clamp_max(0), x.amax(1).clamp_min(0)
    s = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    inv = 1 / s
    z = torch.round(-lo * inv)
    u = (torch.round(x * inv[:, None]) + z[:, None]).clamp(0, 255).to(torch.int64)
    return u, z, s


def check_gemm_contract(gemm, x: torch.Tensor, n: int, columns_error: str) -> None:
    """``gemm.forward``: the same bits with 1 and 2 threads, an empty result for no rows, and errors that say
    what was wrong for a wrong column count (``columns_error``, a regex) and a non-fp32 x."""
    k = x.shape[1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = gemm.forward(x)
        torch.set_num_threads(1)
        assert torch.equal(gemm.forward(x), two)  # a row's result does not depend on the thread count
    finally:
        torch.set_num_threads(threads)
    assert gemm.forward(x[:0]).shape == (0, n)
    with pytest.raises(RuntimeError, match=columns_error):
        gemm.forward(torch.zeros(1, k + 1))
    with pytest.raises(RuntimeError, match="fp32"):
        gemm.forward(torch.zeros(1, k, dtype=torch.float64))
