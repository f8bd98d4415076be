"""Shared by the tests of graphspec's int8 and int4 GEMMs (kernels/cpu/int8_gemm.h, int4_gemm.h): the fixture
that puts each level with an int4 GEMM in force, the activations' rounding redone in torch, and what each
GEMM owes its callers beyond its numbers."""

import pytest
import torch

from graphspec.kernels import cpu


# the levels with an int4 GEMM, but amx: its int4 GEMM is avx512's source (tests/kernels/cpu/test_amx.py)
INT4_LEVELS = tuple(lv for lv in cpu.LEVELS if cpu.have_int4(lv) and lv != "amx")


@pytest.fixture(scope="module", params=INT4_LEVELS)
def int4_level(request):
    """Each level with the int4 GEMM in force (avx512's vpdpbusd, avx2's vpmaddubsw), by name; skips a level this
    CPU cannot execute, fails where one does not build."""
    if request.param not in cpu.supported_levels():
        pytest.skip(f"this CPU cannot execute the {request.param} level")
    with cpu.use_level(request.param):
        yield request.param


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


def assert_rows_close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-3, flip_share: float = 1.0) -> None:
    """Logits of two int8 forwards that run the same GEMMs but sum fp32 in other orders: rows within ``atol``,
    except (at most ``flip_share`` of them) where a ~1e-7 difference moved one activation across a step of the
    next GEMM's 8-bit rounding (one step of a row's range / 255; measured: up to 0.06 on logits of about 2), and
    once such a step lands in the KV cache every later row of the sequence differs by as much. Those stay within
    5% of the largest logit, which a wrong rope, mask or cache slot would not."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return
    rows = (a - b).abs().reshape(-1, a.shape[-1]).amax(dim=1)
    far = rows > atol
    assert far.float().mean() <= flip_share, f"{int(far.sum())} of {rows.numel()} rows differ by more than {atol}: {rows}"
    assert rows.max() <= 0.05 * b.abs().max(), f"a row differs by {rows.max()} (logits up to {b.abs().max()})"
