"""graphspec's int8 GEMM (kernels/cpu/int8_gemm.h) and the int8 draft forward in C++ (kernels/cpu/int8_draft.cpp),
at every C++ level this CPU executes.

- The GEMM (int8 weights widened to fp32, fp32 activations and sums) against its definition in torch
  (``kernels.linear.int8_linear_ref``) at every level, on odd shapes, with activation outliers; rows independent
  of the rows beside them and of the thread count; avx512 and avx2 (the same FMA order) bit for bit.
- The C++ forward against the general forward (``native_forward = False``), which runs the same int8 GEMM on
  the same level through ``kernels.linear``: they differ only in fp32 rounding order (norms, attention, a
  polynomial exp with relative error < 3e-7), so logits agree within ATOL on these small models; batches and
  draft trees included. A real draft's quality is tested on real text in tests/models/test_draft_quality.py.
"""

import pytest
import torch

from graphspec.kernels import cpu
from graphspec.kernels.cpu import int8_draft
from graphspec.kernels.linear import Int8Weight, int8_linear_ref, linear, quantize_weight
from graphspec.models import load_model
from tests.checkpoints import make_checkpoint
from tests.conftest import C_LEVELS
from tests.kernels.cpu._int_gemm import assert_rows_close, check_gemm_contract
from tests.models._chunks import chunked_steps

ATOL = 1e-3

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# (arch, hidden, heads, kv_heads, layers, rope_scaling, extra config): GQA groups 1, 2 and 3, odd head counts,
# head_dim 8..24 and 64, q/k/v biases (qwen2), an o_proj bias (llama attention_bias), llama3 rope scaling, a tied head
SHAPES = [
    ("llama", 64, 4, 2, 2, None, None),
    ("qwen2", 72, 3, 1, 3, None, None),
    ("mistral", 48, 6, 6, 2, None, None),
    ("llama", 120, 5, 5, 1, None, {"attention_bias": True}),
    ("llama", 96, 6, 2, 2, LLAMA3, None),
    ("llama", 128, 2, 1, 1, None, None),  # head_dim 64, as the real drafts: the attention's vector dot products
]


def _shape_id(i):
    arch, hidden, heads, kv, *_ = SHAPES[i]
    return f"{arch}-h{hidden}-{heads}q{kv}kv"


@pytest.fixture(scope="module", params=range(len(SHAPES)), ids=_shape_id)
def model(request, tmp_path_factory):
    arch, hidden, heads, kv, layers, rope, extra = SHAPES[request.param]
    d = make_checkpoint(tmp_path_factory.mktemp(f"native{request.param}"), arch, tokenizer=None, hidden_size=hidden,
                        heads=heads, kv_heads=kv, layers=layers, tie=arch == "qwen2", rope_scaling=rope,
                        extra_config=extra, seed=request.param, intermediate_size=hidden * 3 - 8)
    m = load_model(d, dtype=torch.bfloat16, quantize="int8")
    if extra:
        assert m.layers[0].bo is not None  # the o_proj bias is really there
    return m


CHUNKS = (7, 1, 2, 1, 3, 1, 5)  # a prefill, then one-token proposals and multi-token catch-ups


def _run(model, cpp, ids, positions=None, head=None, logits_for="all", chunks=CHUNKS):
    """Logits of every chunk after the prefill, concatenated on the row axis, and the final cache: through the
    C++ forward (``cpp``) or the general one."""
    model.native_forward = cpp
    try:
        return chunked_steps(model, ids, chunks, positions, head, logits_for)
    finally:
        model.native_forward = True


def _ids(model, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, sum(CHUNKS)), generator=g)


def test_cpp_forward_matches_the_general_forward(model, level, monkeypatch):
    calls = []
    real = int8_draft.draft_for
    ids = _ids(model, 0)
    monkeypatch.setattr(int8_draft, "draft_for", lambda m: calls.append(1) or real(m))
    native, cache_n = _run(model, True, ids)
    assert len(calls) == len(CHUNKS)  # every forward ran in C++ ...
    general, cache_g = _run(model, False, ids)
    assert len(calls) == len(CHUNKS)  # ... and none with native_forward=False
    assert native.shape == general.shape == (1, sum(CHUNKS[1:]), model.config.vocab_size)
    assert_rows_close(native, general, ATOL, flip_share=0.25)
    assert general.abs().max() > 0.5  # logits of real size, so the tolerance means something
    n = sum(CHUNKS)
    for i in range(model.config.num_hidden_layers):  # the cache entries it wrote, rope included
        assert_rows_close(cache_n.k[i][:, :n], cache_g.k[i][:, :n], ATOL)
        assert_rows_close(cache_n.v[i][:, :n], cache_g.v[i][:, :n], ATOL)
        assert cache_n.k[i][:, :n].abs().max() > 0.1


def test_cpp_forward_with_positions_head_and_rows(model, level):
    n = sum(CHUNKS)
    ids = _ids(model, 1)
    positions = torch.arange(n).view(1, n) * 3 + 2  # rope at positions other than the cache slots
    keep = torch.tensor([0, 3, 7, 11, model.config.vocab_size - 1])
    head = model.head_rows(keep)
    for kw in ({"positions": positions}, {"head": head}, {"logits_for": "last"},
               {"logits_for": torch.tensor([0, 0])}, {"logits_for": torch.tensor([], dtype=torch.int64)}):
        native, _ = _run(model, True, ids, **kw)
        general, _ = _run(model, False, ids, **kw)
        assert_rows_close(native, general, ATOL)
    full, _ = _run(model, True, ids)
    shifted, _ = _run(model, True, ids, positions=positions)
    assert (shifted - full).abs().max() > 1e-2  # positions reach rope: a test of them can fail


def test_cpp_forward_runs_batches_and_draft_trees(model, level, monkeypatch):
    """A batch of 3 and a draft tree (a mask) in C++ too, against the general forward."""
    calls = []
    real = int8_draft.draft_for
    monkeypatch.setattr(int8_draft, "draft_for", lambda m: calls.append(1) or real(m))
    ids = _ids(model, 4, batch=3)
    native, _ = _run(model, True, ids)
    general, _ = _run(model, False, ids)
    assert_rows_close(native, general, ATOL)
    assert (native[0] - native[1]).abs().max() > 1e-2  # the rows are different sequences
    tree = torch.tensor([[True, False, False, False], [True, True, False, False], [True, False, True, False],
                         [True, False, True, True]])
    out = []
    for cpp in (True, False):
        model.native_forward = cpp
        try:
            cache = model.new_cache(32)
            model.step(ids[:1, :9], cache, logits_for="last")
            out.append(model.step(ids[:1, 9:13], cache, positions=torch.tensor([[9, 10, 10, 11]]), tree=tree))
            # a wider mask over cached tree nodes, as a draft growing its tree passes
            wide = torch.tensor([[True, False, True, False, True], [True, True, False, False, True]])
            out.append(model.step(ids[:1, 13:15], cache, positions=torch.tensor([[11, 12]]),
                                  tree=torch.cat([wide[:, :3], torch.tensor([[True, False], [True, True]])], 1)))
        finally:
            model.native_forward = True
    assert len(calls) == len(CHUNKS) + 3
    for a, b in zip(out[:2], out[2:]):
        assert_rows_close(a, b, ATOL)


def test_cpp_forward_is_close_to_fp32_maths_on_the_same_int8_weights(model, level):
    """The C++ forward against the dequantized int8 weights through the general fp32 forward: what rounding the
    activations to 8 bits a row costs."""
    ids = _ids(model, 3)
    native, cache_n = _run(model, True, ids)
    saved = [(layer, {f: getattr(layer, f) for f in ("wqkv", "wo", "w13", "w2")}) for layer in model.layers]
    head = model.lm_head
    try:
        for layer, ws in saved:
            for f, w in ws.items():
                setattr(layer, f, w.dense())
        model.lm_head = head.dense()
        dense, cache_d = _run(model, False, ids)
    finally:
        model.lm_head = head
        for layer, ws in saved:
            for f, w in ws.items():
                setattr(layer, f, w)
    assert dense.abs().max() > 0.5
    assert (native - dense).abs().max() < 0.05 * dense.abs().max()
    n = sum(CHUNKS)
    torch.testing.assert_close(cache_n.k[0][:, :n], cache_d.k[0][:, :n], rtol=0.05, atol=0.05)


def _gemm_inputs(n, k, rows=23):
    g = torch.Generator().manual_seed(n * 1000 + k)
    qw = quantize_weight(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g) * 3
    x[3] = x[3].abs()  # a row without negatives (zero point 0) and one without positives (zero point 255)
    x[4] = -x[4].abs()
    x[5] = 0  # an all-zero row
    x[6, k // 2] = 486.0  # activation outliers, as real drafts have (a maximum of 486 against a median of 0.3)
    x[7, 0] = -300.0
    return qw, x


def _close(y, x, qw, ref):
    """A sequential fp32 sum of k products, each rounded once, is within (k + 1) * 2^-24 of the sum of the terms'
    absolute values of the exact result; the scale adds one more rounding."""
    k = x.shape[1]
    bound = (k + 2) * 2.0 ** -24 * (x.abs().double() @ qw.q.abs().double().t() * qw.scales.double())
    return bool(((y.double() - ref.double()).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("n,k", [(37, 21), (200, 577), (64, 64), (130, 1536), (16, 4), (1, 3), (2000, 96), (17, 8960)])
def test_int8_gemm_is_its_definition_in_torch(n, k, level):
    qw, x = _gemm_inputs(n, k)
    gemm = qw.native()
    ref = (x.double() @ qw.q.double().t() * qw.scales.double()).float()  # the exact products and sums, rounded once
    for rows in (1, 2, 3, 5, 6, 7, 13, 23):  # every register tile height, and the equal chunks past them
        y = gemm.forward(x[:rows])
        assert y.shape == (rows, n)
        assert _close(y, x[:rows], qw, ref[:rows]), (rows, (y - ref[:rows]).abs().max())
        if rows > 1:  # a row's bits do not depend on the rows beside it
            assert torch.equal(y[rows - 1], gemm.forward(x[rows - 1:rows])[0])
    torch.testing.assert_close(int8_linear_ref(x, qw), ref, rtol=1e-4, atol=1e-3)
    assert (ref - x @ qw.dense().T).abs().max() <= 1e-3 * ref.abs().max()  # it is x @ the dequantized weight
    check_gemm_contract(gemm, x, n, columns_error="columns")


def _has_prefill_gemm(level):
    return bool(cpu.classes(level).Int8Linear.has_prefill_gemm())


@pytest.mark.parametrize("n,k", [(37, 21), (200, 577), (130, 1536), (1, 3), (2000, 96), (17, 8960)])
def test_the_prefill_gemm_is_its_definition_on_bf16_activations(n, k, level):
    """Where the level has one (avx512), the prefill GEMM is the int8 GEMM of x rounded to bf16: every product of a
    bf16 and an int8 value is exact in fp32, so the sums are within the sequential bound of that exact result.
    Elsewhere it is the fp32 GEMM itself."""
    qw, x = _gemm_inputs(n, k, rows=41)
    gemm = qw.native()
    xb = x.bfloat16().float()
    assert not torch.equal(xb, x)  # x is not bf16 already, so the rounding shows
    ref = (xb.double() @ qw.q.double().t() * qw.scales.double()).float()
    for rows in (1, 5, 6, 7, 16, 41):  # every register tile height, and the equal chunks past them
        y = gemm.forward_prefill(x[:rows])
        assert y.shape == (rows, n)
        if not _has_prefill_gemm(level):
            assert torch.equal(y, gemm.forward(x[:rows]))
            continue
        assert _close(y, xb[:rows], qw, ref[:rows]), (rows, (y - ref[:rows]).abs().max())
        if rows > 1:  # a row's bits do not depend on the rows beside it
            assert torch.equal(y[rows - 1], gemm.forward_prefill(x[rows - 1:rows])[0])
    if _has_prefill_gemm(level):
        assert not torch.equal(gemm.forward_prefill(x), gemm.forward(x))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = gemm.forward_prefill(x)
        torch.set_num_threads(1)
        assert torch.equal(gemm.forward_prefill(x), two)  # nor on the thread count
    finally:
        torch.set_num_threads(threads)
    assert gemm.forward_prefill(x[:0]).shape == (0, n)
    with pytest.raises(RuntimeError, match="columns"):
        gemm.forward_prefill(torch.zeros(1, k + 1))


def test_a_long_prefill_runs_the_prefill_gemm_and_stays_close(model, level):
    """A forward of 8 or more tokens without a tree takes the prefill GEMM where the level has one: close to the
    general forward (fp32 activations), and the same bits as shorter chunks (the fp32 GEMM) only where the level
    has none. Shorter forwards, trees and batches of sequences are tested above on the fp32 GEMM's bits."""
    ids = _ids(model, 6)[:, :20]  # a prefill of 19 tokens, then one step (the fp32 GEMM everywhere)
    native, cache_n = _run(model, True, ids, chunks=(19, 1))
    general, cache_g = _run(model, False, ids, chunks=(19, 1))
    chunked, cache_c = _run(model, True, ids, chunks=(7, 7, 5, 1))
    n = ids.shape[1]
    for i in range(model.config.num_hidden_layers):
        for a, b, c in ((cache_n.k[i], cache_g.k[i], cache_c.k[i]), (cache_n.v[i], cache_g.v[i], cache_c.v[i])):
            a, b, c = a[:, :n], b[:, :n], c[:, :n]
            assert b.abs().max() > 0.1
            # bf16 activations: relative error 2^-9 an input, a few layers deep
            assert (a - b).abs().max() <= 0.03 * b.abs().max(), (i, (a - b).abs().max())
            assert_rows_close(c, b, ATOL)  # the chunks' fp32 GEMM
            assert torch.equal(a, c) != _has_prefill_gemm(level)
    assert (native - general).abs().max() <= 0.05 * general.abs().max()


def test_avx512_and_avx2_give_the_same_int8_bits_and_generic_is_close():
    """Both add the products in the same order with FMAs, so a draft proposes the same tokens on either."""
    qw, x = _gemm_inputs(300, 1000, rows=9)
    outs = {lv: qw.native(lv).forward(x) for lv in C_LEVELS}
    if "avx512" in outs and "avx2" in outs:
        assert torch.equal(outs["avx512"], outs["avx2"]), (outs["avx512"] - outs["avx2"]).abs().max()
    ref = int8_linear_ref(x, qw)
    for lv, y in outs.items():
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3, msg=lv)
    with cpu.use_level("torch"):
        torch.testing.assert_close(linear(x, qw), ref, rtol=0, atol=0)  # the torch level is the reference itself


def test_int8_weight_rounds_per_row_and_refuses_other_devices():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-3.0, 2.0, 1.0]])
    qw = quantize_weight(w)
    assert isinstance(qw, Int8Weight) and qw.q.dtype == torch.int8 and qw.shape == (3, 3)
    assert qw.q[0].tolist() == [127, -64, 32] and qw.q[1].tolist() == [0, 0, 0] and qw.q[2, 0] == -127
    torch.testing.assert_close(qw.dense(), w, rtol=0, atol=3 / 127 / 2 + 1e-6)
    with pytest.raises(ValueError, match="int8 weights are a CPU path"):
        quantize_weight(torch.randn(2, 2, device="meta"))


def test_set_gemm_refuses_unknown_names(model, level):
    obj = int8_draft.draft_for(model)
    with pytest.raises(RuntimeError, match="gemm must be 'int8' or 'int4', got 'mkl'"):
        obj.set_gemm("mkl")
    assert obj.gemm() == "int8"
    if not cpu.have_int4():
        with pytest.raises(RuntimeError, match=f"the '{level}' level has no int4 GEMM"):
            obj.set_gemm("int4")
        assert obj.gemm() == "int8"


def test_the_torch_level_runs_the_general_forward(model, monkeypatch):
    monkeypatch.setattr(int8_draft, "draft_for", lambda m: pytest.fail("C++ path taken at the torch level"))
    ids = _ids(model, 5)
    with cpu.use_level("torch"):
        general, _ = _run(model, True, ids)
    monkeypatch.undo()
    with cpu.use_level(C_LEVELS[0]):
        native, _ = _run(model, True, ids)
    assert_rows_close(native, general, ATOL)


def test_a_bad_cache_is_an_error_that_says_what(model, level):
    obj = int8_draft.draft_for(model)
    c = model.config
    h = torch.zeros(1, 1, c.hidden_size)
    cos = torch.ones(1, 1, 1, c.head_dim)
    cache = model.new_cache(4)
    head = model.lm_head.native()
    with pytest.raises(RuntimeError, match="KV cache must be"):
        obj.forward(h, cos, cos, 4, cache.k, cache.v, head, None, None)  # no room at slot 4
    with pytest.raises(RuntimeError, match="layers but"):
        obj.forward(h, cos, cos, 0, cache.k[:-1], cache.v, head, None, None)
    with pytest.raises(RuntimeError, match="h must be"):
        obj.forward(torch.zeros(1, 1, c.hidden_size + 1), cos, cos, 0, cache.k, cache.v, head, None, None)
    with pytest.raises(RuntimeError, match="KV cache must be"):  # a batch of 2 against a cache of 1
        obj.forward(torch.zeros(2, 1, c.hidden_size), cos.expand(2, 1, 1, -1).contiguous(),
                    cos.expand(2, 1, 1, -1).contiguous(), 0, cache.k, cache.v, head, None, None)
    with pytest.raises(RuntimeError, match="the mask must be bool"):
        obj.forward(h, cos, cos, 0, cache.k, cache.v, head, None, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="attends to nothing"):
        obj.forward(h, cos, cos, 0, cache.k, cache.v, head, None, torch.zeros(1, 1, dtype=torch.bool))


def test_draft_for_rebuilds_when_the_weights_change(model, level):
    a = int8_draft.draft_for(model)
    assert int8_draft.draft_for(model) is a
    saved = model.layers[0].wo
    try:
        model.layers[0].wo = Int8Weight(saved.q.clone(), saved.scales.clone(), saved.dtype)
        assert int8_draft.draft_for(model) is not a
    finally:
        model.layers[0].wo = saved
