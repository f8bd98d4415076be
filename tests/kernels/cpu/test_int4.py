"""graphspec's int4 GEMM (kernels/cpu/int4_gemm.h, the avx512 and avx2 levels) against the same rounding done in torch, and the C++ draft
forward on it (``quantize="int4"``, ``set_gemm("int4")``) against fp32 maths on the same 4-bit weights.

The weights: each int8 weight (symmetric per row, kernels/linear.py quantize_weight) rounded again per group
of 64 inputs to q4 = round(q8 * 7 / m), halves away from zero, m the group's max |q8|, the group's scale
s_row * m / 7. The activations: as the int8 GEMM rounds them (8 bits a row with a zero point). Each group's
integer sum is exact, the groups add in fp32, so the GEMM matches the torch reference to fp32 rounding.
"""

import pytest
import torch

from graphspec.kernels.linear import quantize_weight
from graphspec.kernels import cpu
from graphspec.kernels.cpu import int8_draft
from graphspec.models import load_model
from graphspec.models.transformer import check_quantize
from tests.checkpoints import make_checkpoint
from tests.models._chunks import chunked_steps
from tests.kernels.cpu._int_gemm import INT4_LEVELS, check_gemm_contract, int4_level, round_activations  # noqa: F401 (a fixture)

GROUP = 64
INT4_ROWS = 3  # int8_draft.cpp kInt4Rows: larger products run on the int8 GEMM


def int4_weight(q8: torch.Tensor, row_scales: torch.Tensor):
    """The int4 rounding of an int8 weight, in torch: (q4 [N, K] int64, group scales [N, G] fp32)."""
    n, k = q8.shape
    groups = -(-k // GROUP)
    padded = torch.zeros(n, groups * GROUP, dtype=torch.int64)
    padded[:, :k] = q8.to(torch.int64)
    g = padded.view(n, groups, GROUP)
    m = g.abs().amax(2)
    den = 2 * m.clamp_min(1)[..., None]
    q4 = torch.div(g.abs() * 14 + den // 2, den, rounding_mode="floor") * g.sign()
    return q4.view(n, -1)[:, :k], row_scales.float()[:, None] * m.float() / 7


def reference(x, q4, gscales):
    """y = s_x * sum_g s_g * (exact integer sum over the group), in float64."""
    u, z, s = round_activations(x)
    d = u - z.to(torch.int64)[:, None]
    n, k = q4.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g in range(gscales.shape[1]):
        cols = slice(g * GROUP, min(k, (g + 1) * GROUP))
        acc = d[:, cols] @ q4[:, cols].T  # exact
        out += acc.double() * gscales[:, g].double()[None, :]
    return out * s.double()[:, None]


class _Int4:
    """One weight through the int4 GEMM (``Int8Linear.forward4``)."""

    def __init__(self, qw):
        self.linear = qw.native()  # the level in force

    def forward(self, x):
        return self.linear.forward4(x)


def _gemm(w):
    qw = quantize_weight(w)
    return _Int4(qw), qw.q, qw.scales


@pytest.mark.parametrize("n,k", [(37, 21), (200, 577), (64, 64), (33, 1536), (16, 4), (1, 3), (130, 130)])
def test_int4_gemm_is_its_rounding_done_in_torch(n, k, int4_level):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    w[:, : min(k, 7)] *= 20  # a few large inputs: groups whose scale they set
    gemm, ints, scales = _gemm(w)
    q4, gs = int4_weight(ints, scales)
    assert q4.abs().max() <= 7
    x = torch.randn(13, k, generator=g) * 3
    x[3] = x[3].abs()  # a row without negatives (zero point 0), one without positives (zero point 255)
    x[4] = -x[4].abs()
    x[5] = 0  # and an all-zero row
    ref = reference(x, q4, gs)
    scale = ref.abs().max().item()
    for rows in (1, 2, 3, 4, 5, 7, 13):  # every register tile height (4 at avx512, 3 at avx2) and the chunks past it
        y = gemm.forward(x[:rows])
        assert y.shape == (rows, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref[:rows], rtol=1e-5, atol=1e-6 * scale)
        if rows > 1:  # a row's bits do not depend on the rows beside it
            assert torch.equal(y[rows - 1], gemm.forward(x[rows - 1:rows])[0])
    # 4 bits are coarse: against the int8 weight, an error far above the int8 GEMM's, far below the signal
    int8_y = x.double() @ (ints.double() * scales.double()[:, None]).T
    rel = ((ref - int8_y).norm() / int8_y.norm()).item()
    assert (0.002 if k > 8 else 0) <= rel < 0.25, rel
    check_gemm_contract(gemm, x, n, columns_error="int4 GEMM: x has")


def test_weights_on_a_4_bit_grid_come_back_exactly(int4_level):
    """Weights that are whole numbers in [-7, 7], each group holding a 7: int8 stores them as round(127 / 7 * w)
    steps of 7 / 127 (not exact), and the int4 rounding of that gives w back exactly."""
    g = torch.Generator().manual_seed(5)
    steps = torch.randint(-7, 8, (40, 150), generator=g).float()
    steps[:, ::GROUP] = 7  # every group's max |w| (so every row's too)
    gemm, ints, scales = _gemm(steps)
    assert not torch.allclose(ints.double() * scales.double()[:, None], steps.double(), rtol=0, atol=1e-3)
    q4, gs = int4_weight(ints, scales)
    torch.testing.assert_close(q4.double(), steps.double(), rtol=0, atol=0)
    torch.testing.assert_close(gs.double(), torch.ones_like(gs).double(), rtol=1e-6, atol=0)
    x = torch.randn(3, 150, generator=g)
    torch.testing.assert_close(gemm.forward(x).double(), reference(x, q4, gs), rtol=1e-5, atol=1e-5)


SHAPES = [("llama", 64, 4, 2, 2), ("qwen2", 200, 5, 1, 2)]  # K = 64, 200 (a partial group), 3 * K - 8


@pytest.fixture(scope="module", params=range(len(SHAPES)), ids=lambda i: f"{SHAPES[i][0]}-h{SHAPES[i][1]}")
def model(request, tmp_path_factory, int4_level):
    arch, hidden, heads, kv, layers = SHAPES[request.param]
    d = make_checkpoint(tmp_path_factory.mktemp(f"int4-{request.param}"), arch, tokenizer=None, hidden_size=hidden,
                        heads=heads, kv_heads=kv, layers=layers, tie=arch == "qwen2", seed=10 + request.param,
                        intermediate_size=hidden * 3 - 8)
    return load_model(d, dtype=torch.bfloat16, quantize="int4")


CHUNKS = (7, 1, 2, 1, 3, 1, 5)  # the prefill and the 5-token catch-up run int8, the rest int4


def _dense(model, layer_weights, head):
    """Swap every layer weight for the given dense fp32 tensors (and the head), for the general forward."""
    for layer, ws in zip(model.layers, layer_weights):
        for f, w in ws.items():
            setattr(layer, f, w)
    model.lm_head = head


def test_int4_forward_is_fp32_maths_on_the_4_bit_weights(model):
    """The C++ forward with ``quantize="int4"``, chunk by chunk, against the general fp32 forward on the same
    weights dequantized: int4 for chunks of up to 3 tokens, int8 for larger ones and the head."""
    assert model.quantize == "int4" and int8_draft.draft_for(model).gemm() == "int4"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, sum(CHUNKS)), generator=g)
    native, _ = chunked_steps(model, ids, CHUNKS)
    with int8_draft.using_gemm(model, "int8"):
        int8_out, _ = chunked_steps(model, ids, CHUNKS)
    saved = [{f: getattr(layer, f) for f in ("wqkv", "wo", "w13", "w2")} for layer in model.layers]
    head = model.lm_head
    dense8 = [{f: w.dense() for f, w in ws.items()} for ws in saved]
    dense4 = []
    for ws in saved:
        d4 = {}
        for f, w in ws.items():
            q4, gs = int4_weight(w.q, w.scales)
            d4[f] = q4.float() * gs.repeat_interleave(GROUP, 1)[:, :q4.shape[1]]
        dense4.append(d4)
    cache = model.new_cache(64)
    out, j = [], 0
    try:
        model.native_forward = False
        for n in CHUNKS:
            _dense(model, dense4 if n <= INT4_ROWS else dense8, head.dense())
            logits = model.step(ids[:, j:j + n], cache, logits_for="last" if j == 0 else "all")
            out += [logits] if j else []
            j += n
    finally:
        model.native_forward = True
        _dense(model, saved, head)
    dense = torch.cat(out, dim=1)
    big = dense.abs().max().item()
    assert big > 0.5
    err4, err8 = (native - dense).abs().max().item(), (int8_out - dense).abs().max().item()
    assert err4 < 0.05 * big, (err4, big)  # what the 8-bit activations cost, as on the int8 GEMM ...
    assert err8 > 4 * err4, (err4, err8)  # ... while the int8 weights are much farther from the 4-bit maths


def test_set_gemm_int4_and_drop(model):
    obj = int8_draft.draft_for(model)
    with pytest.raises(RuntimeError, match="gemm must be 'int8' or 'int4', got 'int2'"):
        obj.set_gemm("int2")
    with pytest.raises(RuntimeError, match="runs the int4 GEMM; set_gemm..int8.. first"):
        obj.drop_int4()
    ids = torch.tensor([[1, 2]])  # 2 rows: the int4 GEMM's
    before = model.step(ids, model.new_cache(8))
    try:
        obj.set_gemm("int8")
        assert obj.gemm() == "int8"
        assert not torch.equal(model.step(ids, model.new_cache(8)), before)  # really another GEMM
        obj.drop_int4()  # the copies go; asking for int4 again packs them again, the same
        obj.set_gemm("int4")
        assert obj.gemm() == "int4"
        assert torch.equal(model.step(ids, model.new_cache(8)), before)
    finally:
        obj.set_gemm("int4")


def test_int4_needs_the_avx512_or_avx2_level(tmp_path):
    d = make_checkpoint(tmp_path / "m", "llama", tokenizer=None, hidden_size=64, heads=4, kv_heads=2, layers=1)
    for lower in ("generic", "torch"):
        if lower in cpu.supported_levels():
            with cpu.use_level(lower), pytest.raises(ValueError, match=f"needs the CPU backend's avx512 or avx2 level"
                                                                      f".*here is {lower}.*use quantize='int8'"):
                load_model(d, quantize="int4")
    if "generic" in cpu.supported_levels():  # and the C++ op says so too
        qw = quantize_weight(torch.randn(16, 64))
        with pytest.raises(RuntimeError, match="the 'generic' level has no int4 GEMM"):
            qw.native("generic").forward4(torch.randn(1, 64))
    with pytest.raises(ValueError, match="cannot run on cuda"):
        check_quantize("int4", None, "cuda")


@pytest.mark.skipif(not set(INT4_LEVELS) <= set(cpu.supported_levels()), reason="needs a CPU that executes avx512 "
                    "and avx2")
def test_int4_avx512_and_avx2_give_the_same_bits():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(75, 333, generator=g)
    qw = quantize_weight(w)
    x = torch.randn(7, 333, generator=g) * 2
    for rows in (1, 2, 3, 4, 7):
        got = [qw.native(lv).forward4(x[:rows]) for lv in INT4_LEVELS]
        assert torch.equal(got[0], got[1]), rows
