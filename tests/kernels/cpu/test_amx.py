"""The amx level of the CPU backend: avx512 plus AMX tiles for the bf16 linear (kernels/cpu/linear.cpp).

Its bf16 linear runs every bf16_level test (tests/kernels/cpu/test_linear_attention.py: against the reference on
odd shapes, rows bit-identical whatever the row count and threads) and the model tests of every level
(``model_level``). What is left to check here: that its other kernels are avx512's (the per-level tests do not
run them twice), that the tile path covers the shapes a model has (K a multiple of 32, and not), and that a
kernel which refuses the tile state makes the level unusable with a reason, not a crash.
"""

import warnings

import pytest
import torch

from graphspec.kernels import attention, cpu
from graphspec.kernels.attention import ancestor_mask
from graphspec.kernels.linear import NativeWeight, linear, linear_ref, prepare_weight, quantize_weight
from tests.kernels._compare import assert_close, attention_inputs

pytestmark = pytest.mark.skipif("amx" not in cpu.supported_levels(), reason="this CPU has no AMX bf16 tiles")


def test_amx_attention_and_int8_int4_gemms_are_avx512s_bits():
    """The amx binary compiles the same attention and int8 / int4 GEMM source as avx512 with the tile flags added, which
    emit no tile instruction there: the same bits. The GGUF block GEMMs are avx512's very extension."""
    outs = {}
    g = torch.Generator().manual_seed(1)
    qw = quantize_weight(torch.randn(200, 300, generator=g))
    x = torch.randn(9, 300, generator=g)
    for lv in ("amx", "avx512"):
        with cpu.use_level(lv):
            got = []
            for dtype in (torch.bfloat16, torch.float32):
                torch.manual_seed(2)  # attention_inputs draws from the global generator
                q, k, v = attention_inputs(2, 6, 47, 12, 2, 128, dtype)
                got += [attention(q, k, v), attention(q, k, v, tree=ancestor_mask([-1, 0, 0, 1, 2, 3], device="cpu"))]
            got.append(qw.native(lv).forward(x))
            got.append(qw.native(lv).forward4(x[:3]))  # the int4 GEMM (products of up to 3 rows)
            outs[lv] = got
    assert all(torch.equal(a, b) for a, b in zip(outs["amx"], outs["avx512"]))
    assert cpu.qops("amx").level() == "avx512" and cpu.qops("amx") is cpu.qops("avx512")
    assert cpu.ops("amx").level() == "amx" and cpu.bf16_linear("amx") and cpu.have_int4("amx")


@pytest.mark.parametrize("k", [1536, 8960, 896, 40, 62])
def test_amx_linear_on_model_widths_and_tails(k):
    """K = 1536 / 8960 / 896 (the 1.5B's and 0.5B's widths): whole tile products only; 40 and 62: one tile
    product and a tail of 4 or 15 pairs on vdpbf16ps. 1, 16 and 17 rows: one chunk, a full one, a padded second."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(37, generator=g).bfloat16()
    x = torch.randn(17, k, generator=g).bfloat16()
    with cpu.use_level("amx"):
        nw = prepare_weight(w)
        assert isinstance(nw, NativeWeight)
        y = linear(x, nw, b)
        for rows in (1, 16):
            assert torch.equal(linear(x[:rows], nw, b), y[:rows])
    exact = x.double() @ w.double().T + b.double()
    assert_close(y, linear_ref(x.float(), w.float(), b.float()), 1e-2, 1.6e-2, name=f"amx linear k={k}")
    # fp32 sums, one rounding to bf16 (plus the bias's): within 2 bf16 ulps of the exact value
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-5).all()


def test_a_kernel_that_refuses_the_tile_state_makes_amx_unusable_with_a_reason(monkeypatch):
    """Linux grants AMX's tile state per process on request (5.16+); where it does not, asking for amx by name
    is an error saying so, and auto warns and runs avx512."""

    monkeypatch.setattr(cpu, "_tile_state_granted", lambda: False)
    monkeypatch.setattr(cpu, "_failed", {})
    monkeypatch.setattr(cpu, "_warned", set())
    cpu._load.cache_clear()
    cpu._auto_in.cache_clear()
    cpu._env_level.cache_clear()
    try:
        with pytest.raises(cpu.NativeBuildError, match="did not grant this process the AMX tile state"):
            with cpu.use_level("amx"):
                pass
        monkeypatch.setattr(cpu, "_failed", {})
        with pytest.warns(RuntimeWarning, match="amx level .*cannot be used .*AMX tile state"):
            assert cpu._auto_in("another root") == "avx512"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu._auto_in("yet another root") == "avx512"  # warned once
    finally:
        monkeypatch.undo()
        cpu._load.cache_clear()
        cpu._auto_in.cache_clear()
        cpu._env_level.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_linear_rows_in_pieces_of_k_and_groups_of_rows(threads):
    """17 to 256 rows run k in pieces (sums held in memory between them), more rows in whole-k passes over groups
    of 256: every row of 17, 40, 256, 257 and 300 equals that row's one-row product, K with several pieces and a
    tail (K = 600: 18 tile products and 12 pairs; 1000: 31 and 4) and N off the blocks; both thread counts."""
    g = torch.Generator().manual_seed(3)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with cpu.use_level("amx"):
            for k, n in ((600, 77), (1000, 130)):
                nw = prepare_weight((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16())
                b = torch.randn(n, generator=g).bfloat16()
                x = torch.randn(300, k, generator=g).bfloat16()
                alone = torch.cat([linear(x[i:i + 1], nw, b) for i in range(300)])
                for rows in (17, 40, 256, 257, 300):
                    assert torch.equal(linear(x[:rows], nw, b), alone[:rows]), (k, n, rows)
                assert_close(alone, linear_ref(x.float(), nw.dense().float(), b.float()), 1e-2, 1.6e-2,
                             name=f"amx linear k={k}")
    finally:
        torch.set_num_threads(old)
