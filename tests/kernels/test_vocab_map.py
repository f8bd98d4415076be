"""vocab_map / vocab_mask_logits: Triton (interpreter) against the torch references, and the references by hand."""

from __future__ import annotations

import sys

import pytest
import torch

from graphspec.kernels import use_backend
from graphspec.kernels.vocab_map import vocab_map, vocab_map_ref, vocab_mask_logits, vocab_mask_logits_ref
from tests.kernels._compare import assert_close
from tests.kernels._sm90 import compile_main, have_ptxas, run_compile_check

TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-6, 1e-5), torch.float16: (1e-6, 1e-5)}


def _table(vs: int, vd: int, frac: float, injective: bool, gen: torch.Generator) -> torch.Tensor:
    t = torch.full((vs,), -1, dtype=torch.int64)
    keep = torch.rand(vs, generator=gen) < frac
    n = int(keep.sum())
    if injective:
        dst = torch.randperm(vd, generator=gen)[:n]
        keep_idx = keep.nonzero().squeeze(1)[: len(dst)]
        t[keep_idx] = dst
    else:
        t[keep] = torch.randint(0, vd, (n,), generator=gen)
    return t


def test_vocab_map_ref_by_hand():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.5, 0.0]])
    table = torch.tensor([2, -1, 0, 2])  # ids 0 and 3 share destination 2
    out = vocab_map_ref(probs, table, 3)
    expected = torch.tensor([[0.3 / 0.8, 0.0, 0.5 / 0.8], [1.0, 0.0, 0.0]])
    assert_close(out, expected, 1e-7, 1e-6)
    raw = vocab_map_ref(probs, table, 3, renormalize=False)
    assert_close(raw, torch.tensor([[0.3, 0.0, 0.5], [0.5, 0.0, 0.0]]), 1e-7, 1e-6)
    # A row whose mass lies entirely outside the table comes out zero, not NaN.
    zero = vocab_map_ref(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), table, 3)
    assert zero.abs().sum() == 0 and not zero.isnan().any()


def test_vocab_mask_logits_ref_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.0, 5.0]], dtype=torch.bfloat16)
    out = vocab_mask_logits_ref(logits, torch.tensor([4, -1, 0]))
    assert out.dtype == torch.bfloat16
    assert out[:, 1].isneginf().all() and out[:, [0, 2]].equal(logits[:, [0, 2]])


@pytest.mark.parametrize("n, vs, vd", [(1, 1, 1), (3, 37, 50), (2, 1000, 423), (1, 4099, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("injective", [True, False])
def test_vocab_map_triton_matches_ref(n, vs, vd, dtype, injective):
    gen = torch.Generator().manual_seed(n * 7919 + vs)
    table = _table(vs, vd, 0.6, injective, gen)
    # Non-contiguous rows: every other column of a wider buffer.
    wide = torch.softmax(torch.randn(n, 2 * vs, generator=gen), dim=-1).to(dtype)
    probs = wide[:, ::2]
    for renorm in (True, False):
        expected = vocab_map_ref(probs, table, vd, renorm)
        with use_backend("triton"):
            got = vocab_map(probs, table, vd, renorm)
        assert got.dtype == torch.float32 and got.shape == (n, vd)
        atol, rtol = TOL[dtype]
        assert_close(got, expected, atol, rtol, name=f"vocab_map renormalize={renorm}")
        if renorm and bool((table >= 0).any()):
            sums = got.sum(dim=1)
            assert_close(sums, torch.ones_like(sums), 1e-5, 0)


@pytest.mark.parametrize("n, v", [(1, 1), (3, 37), (2, 1000), (1, 4099)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vocab_mask_logits_triton_matches_ref(n, v, dtype):
    gen = torch.Generator().manual_seed(v)
    table = _table(v, v, 0.5, True, gen).to(torch.int32)
    logits = (3 * torch.randn(n, v + 3, generator=gen)).to(dtype)[:, 3:]
    expected = vocab_mask_logits_ref(logits, table)
    with use_backend("triton"):
        got = vocab_mask_logits(logits, table)
    assert got.dtype == dtype
    assert got.equal(expected)


def test_strided_tables():
    gen = torch.Generator().manual_seed(3)
    wide = _table(2 * 301, 90, 0.7, True, gen)
    table = wide[::2]  # a strided view: every other entry
    probs = torch.softmax(torch.randn(2, 301, generator=gen), dim=-1)
    logits = torch.randn(2, 301, generator=gen)
    with use_backend("triton"):
        got_map = vocab_map(probs, table, 90)
        got_mask = vocab_mask_logits(logits, table)
    assert_close(got_map, vocab_map_ref(probs, table.contiguous(), 90), 1e-6, 1e-5)
    assert got_mask.equal(vocab_mask_logits_ref(logits, table.contiguous()))


def test_validation_errors():
    probs = torch.rand(2, 10)
    good = torch.arange(10)
    with pytest.raises(ValueError, match="src_to_dst has 9 entries"):
        vocab_map(probs, torch.arange(9), 10)
    with pytest.raises(ValueError, match=r"src_to_dst holds ids in \[1, 10\]"):
        vocab_map(probs, torch.arange(11)[1:], 10)
    with pytest.raises(ValueError, match="src_to_dst holds ids in"):
        vocab_map(probs, torch.full((10,), -2), 10)
    with pytest.raises(ValueError, match="src_to_dst has dtype"):
        vocab_map(probs, good.float(), 10)
    with pytest.raises(ValueError, match="probs_src must have 2 dimensions"):
        vocab_map(probs[0], good, 10)
    with pytest.raises(ValueError, match="dst_size must be a positive int"):
        vocab_map(probs, good, 0)
    with pytest.raises(ValueError, match="probs_src has dtype"):
        vocab_map(probs.double(), good, 10)
    with pytest.raises(ValueError, match="table has 9 entries"):
        vocab_mask_logits(probs, torch.arange(9))
    with pytest.raises(ValueError, match="is on meta"):
        vocab_mask_logits(probs, torch.arange(10, device="meta"))
    with use_backend("triton"):
        with pytest.raises(ValueError, match="src_to_dst holds ids in"):
            vocab_map(probs, torch.arange(11)[1:], 10)


# ----------------------------------------------------------------------------- sm_90 compile check
# The interpreter accepts programs the GPU compiler rejects, so both kernels are also compiled
# ahead of time to sm_90 cubins (with the interpreter off: in a subprocess running main()).

def _specs():
    vm = __import__("graphspec.kernels.vocab_map", fromlist=["_vocab_map_kernel"])
    specs = []
    for dt in ("fp32", "bf16"):  # fp16 lowers like bf16; int32 tables like int64 (left out for time)
        for table in ("*i64",):
            for renorm in (True, False):
                specs.append((f"vocab_map {dt} {table} renormalize={renorm}", vm._vocab_map_kernel,
                              {"src_ptr": "*" + dt, "table_ptr": table, "dst_ptr": "*fp32", "stride_src_row": "i64",
                               "stride_src_col": "i64", "stride_dst_row": "i64", "V_SRC": "i32", "V_DST": "i32",
                               "RENORMALIZE": "constexpr", "BLOCK": "constexpr"},
                              {"RENORMALIZE": renorm, "BLOCK": 1024}))
            specs.append((f"vocab_mask_logits {dt} {table}", vm._vocab_mask_kernel,
                          {"x_ptr": "*" + dt, "table_ptr": table, "out_ptr": "*" + dt, "stride_x_row": "i64",
                           "stride_x_col": "i64", "stride_out_row": "i64", "V": "i32", "BLOCK": "constexpr"},
                          {"BLOCK": 1024}))
    return specs


@pytest.mark.skipif(not have_ptxas(), reason="this triton wheel ships no ptxas; cannot compile for sm_90 here")
def test_vocab_map_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.test_vocab_map")


if __name__ == "__main__":
    sys.exit(compile_main(_specs()))
