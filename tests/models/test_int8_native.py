"""The int8 draft forward in C++ (graphspec.models.int8_native) against the TorchScript path it replaces,
and graphspec's int8 GEMM (kernels/_int8_gemm.h) against the same quantization done in torch.

With fbgemm's GEMMs (``set_gemm("fbgemm")``) both paths run the same int8 GEMMs on fp32 activations; the C++ sums norms and attention in another
order and uses a polynomial exp (relative error < 3e-7), so fp32 values differ by ~1e-6 relative, which
can move an activation across an 8-bit rounding step of the next GEMM. On these tiny models that stays
under ATOL; on a real 30-layer model with random ids one such step can grow into a different argmax (so
does a 1e-6 change of the input on the TorchScript path itself, measured), which is why the comparisons
here are on small models and the real-model check is the pipeline's exactness, not the draft's logits.
The VNNI GEMM rounds activations otherwise (8 bits a row, not 7 bits a call), so its forward is checked
against fp32 maths on the same int8 weights, next to the fbgemm forward's distance from them.
"""

import warnings

import pytest
import torch

from graphspec.models import int8_native, load_model
from tests.checkpoints import make_checkpoint
from tests.models._chunks import chunked_steps
from tests.models._int_gemm import check_gemm_contract, round_activations, vnni  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines
                                and "x86" not in torch.backends.quantized.supported_engines,
                                reason="this torch build has no int8 CPU GEMM")

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
    ("llama", 128, 2, 1, 1, None, None),  # head_dim 64, as the real drafts: the attention's AVX-512 dot products
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
    if not int8_native.available():
        pytest.fail("the C++ int8 forward did not build here; CI and this machine have g++ and ninja")
    return m


CHUNKS = (7, 1, 2, 1, 3, 1, 5)  # a prefill, then one-token proposals and multi-token catch-ups


def _run(model, native, ids, positions=None, head=None, logits_for="all", gemm="fbgemm"):
    """Logits of every chunk after the prefill, concatenated on the row axis, and the final cache.

    The C++ forward runs ``gemm`` ("fbgemm": the TorchScript path's GEMMs, for like-for-like comparisons)."""
    model.native_int8_forward = native
    try:
        with int8_native.using_gemm(model, gemm):
            return chunked_steps(model, ids, CHUNKS, positions, head, logits_for)
    finally:
        model.native_int8_forward = True


def _ids(model, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, sum(CHUNKS)), generator=g)


def test_native_forward_matches_torchscript(model, monkeypatch):
    calls = []
    real = int8_native.draft_for
    ids = _ids(model, 0)
    int8_native.draft_for(model)
    monkeypatch.setattr(int8_native, "draft_for", lambda m: calls.append(1) or real(m))
    native, cache_n = _run(model, True, ids)
    assert len(calls) == len(CHUNKS) + 1  # every forward ran in C++ (and _run asked once) ...
    script, cache_s = _run(model, False, ids)
    assert len(calls) == len(CHUNKS) + 2  # ... and none with native_int8_forward=False
    assert native.shape == script.shape == (1, sum(CHUNKS[1:]), model.config.vocab_size)
    torch.testing.assert_close(native, script, rtol=0, atol=ATOL)
    assert script.abs().max() > 0.5  # logits of real size, so the tolerance means something
    n = sum(CHUNKS)
    for i in range(model.config.num_hidden_layers):  # the cache entries it wrote, rope included
        torch.testing.assert_close(cache_n.k[i][:, :n], cache_s.k[i][:, :n], rtol=0, atol=ATOL)
        torch.testing.assert_close(cache_n.v[i][:, :n], cache_s.v[i][:, :n], rtol=0, atol=ATOL)
        assert cache_n.k[i][:, :n].abs().max() > 0.1


def test_native_forward_with_positions_head_and_rows(model):
    n = sum(CHUNKS)
    ids = _ids(model, 1)
    positions = torch.arange(n).view(1, n) * 3 + 2  # rope at positions other than the cache slots
    keep = torch.tensor([0, 3, 7, 11, model.config.vocab_size - 1])
    head = model.head_rows(keep)
    for kw in ({"positions": positions}, {"head": head}, {"logits_for": "last"},
               {"logits_for": torch.tensor([0, 0])}, {"logits_for": torch.tensor([], dtype=torch.int64)}):
        native, _ = _run(model, True, ids, **kw)
        script, _ = _run(model, False, ids, **kw)
        torch.testing.assert_close(native, script, rtol=0, atol=ATOL)
    full, _ = _run(model, True, ids)
    shifted, _ = _run(model, True, ids, positions=positions)
    assert (shifted - full).abs().max() > 1e-2  # positions reach rope: a test of them can fail


def test_vnni_forward_is_as_close_to_fp32_maths_as_fbgemm(model, vnni):
    """The default C++ forward (graphspec's int8 GEMM) against the same int8 weights in fp32 maths, with
    the fbgemm forward's distance from them as the yardstick (both round activations to 8 bits)."""
    ids = _ids(model, 3)
    assert int8_native.draft_for(model).gemm() == int8_native.default_gemm() == "vnni"
    vnni, cache_v = _run(model, True, ids, gemm="vnni")
    fbgemm, _ = _run(model, True, ids, gemm="fbgemm")
    saved = [(layer, {f: getattr(layer, f) for f in ("wqkv", "wo", "w13", "w2")}) for layer in model.layers]
    head = model.lm_head
    try:  # the dequantized int8 weights through the general (fp32) forward
        for layer, ws in saved:
            for f, w in ws.items():
                setattr(layer, f, w.dense())
        model.lm_head = head.dense()
        model.lean_int8_forward = False
        dense, cache_d = chunked_steps(model, ids, CHUNKS)
    finally:
        model.lean_int8_forward = True
        model.lm_head = head
        for layer, ws in saved:
            for f, w in ws.items():
                setattr(layer, f, w)
    err_v, err_f = (vnni - dense).abs().max().item(), (fbgemm - dense).abs().max().item()
    assert dense.abs().max() > 0.5
    assert err_v < 0.05 * dense.abs().max().item()
    assert err_v <= 1.5 * err_f + 1e-4, (err_v, err_f)
    assert (vnni - fbgemm).abs().max() > 0  # really another GEMM
    n = sum(CHUNKS)
    torch.testing.assert_close(cache_v.k[0][:, :n], cache_d.k[0][:, :n], rtol=0.05, atol=0.05)


def _quantized_reference(x, q, scales):
    """kernels/_int8_gemm.h's maths in torch: each row of x to u8 with a zero point over [min(x, 0),
    max(x, 0)] in 255 steps (fp32 as the C++ computes it), exact integer sums, then the two scales."""
    u, z, s = round_activations(x)
    acc = u @ q.to(torch.int64).T - z.to(torch.int64)[:, None] * q.to(torch.int64).sum(1)[None, :]
    return acc.float() * scales.float()[None, :] * s[:, None]


@pytest.mark.parametrize("n,k", [(37, 21), (200, 577), (64, 64), (130, 1536), (16, 4), (1, 3), (2000, 96)])
def test_vnni_gemm_is_its_quantization_done_in_torch(n, k, vnni):
    from graphspec.kernels.linear import quantize_weight
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    qw = quantize_weight(w)
    gemm = torch.classes.graphspec_int8_native.Int8Linear(qw.packed)
    q, _ = torch.ops.quantized.linear_unpack(qw.packed)
    ints, scales = q.int_repr(), q.q_per_channel_scales()
    x = torch.randn(23, k, generator=g) * 3
    x[3] = x[3].abs()  # a row without negatives (zero point 0) and one without positives (zero point 255)
    x[4] = -x[4].abs()
    x[5] = 0  # and an all-zero row
    ref = _quantized_reference(x, ints, scales)
    for rows in (1, 2, 3, 5, 6, 7, 13, 23):  # every register tile height, and the equal chunks past 6
        y = gemm.forward(x[:rows])
        assert y.shape == (rows, n)
        torch.testing.assert_close(y, ref[:rows], rtol=1e-6, atol=1e-5)
        if rows > 1:  # a row's bits do not depend on the rows beside it
            assert torch.equal(y[rows - 1], gemm.forward(x[rows - 1:rows])[0])
    assert (ref - x @ (ints.float() * scales.float()[:, None]).T).abs().max() < 0.05 * ref.abs().max()
    check_gemm_contract(gemm, x, n, columns_error="columns")


def test_set_gemm_refuses_unknown_names(model, vnni):
    obj = int8_native.draft_for(model)
    with pytest.raises(RuntimeError, match="gemm must be 'vnni', 'int4' or 'fbgemm', got 'mkl'"):
        obj.set_gemm("mkl")
    assert obj.gemm() == "vnni"


def test_batches_and_trees_stay_on_torchscript(model, monkeypatch):
    calls = []
    monkeypatch.setattr(int8_native, "draft_for", lambda m: calls.append(1) or pytest.fail("C++ path taken"))
    cache = model.new_cache(16, batch_size=2)
    model.step(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache, logits_for="last")
    cache = model.new_cache(16)
    model.native_int8_forward = False
    model.step(torch.tensor([[1, 2]]), cache, logits_for="last")
    model.native_int8_forward = True
    model.step(torch.tensor([[7, 8, 9]]), cache, positions=torch.tensor([[2, 3, 3]]),
               tree=torch.tensor([[True, False, False], [True, True, False], [True, False, True]]))
    assert calls == []


def test_a_bad_cache_is_an_error_that_says_what(model):
    obj = int8_native.draft_for(model)
    c = model.config
    h = torch.zeros(1, 1, c.hidden_size)
    cos = torch.ones(1, 1, 1, c.head_dim)
    cache = model.new_cache(4)
    with pytest.raises(RuntimeError, match="KV cache must be"):
        obj.forward(h, cos, cos, 4, cache.k, cache.v, model.lm_head.packed, None)  # no room at slot 4
    with pytest.raises(RuntimeError, match="layers but"):
        obj.forward(h, cos, cos, 0, cache.k[:-1], cache.v, model.lm_head.packed, None)
    with pytest.raises(RuntimeError, match="h must be"):
        obj.forward(torch.zeros(2, 1, c.hidden_size), cos, cos, 0, cache.k, cache.v, model.lm_head.packed, None)


def test_draft_for_rebuilds_when_the_weights_change(model):
    a = int8_native.draft_for(model)
    assert int8_native.draft_for(model) is a
    saved = model.layers[0].wo
    try:
        model.layers[0].wo = type(saved)(saved.packed, saved.shape, saved.dtype)
        assert int8_native.draft_for(model) is not a
    finally:
        model.layers[0].wo = saved


def test_mode_env(monkeypatch):
    for value, expect in (("", "auto"), ("auto", "auto"), ("1", "1"), ("on", "1"), ("0", "0"), ("OFF", "0")):
        monkeypatch.setenv(int8_native.ENV, value)
        assert int8_native.mode() == expect
    monkeypatch.setenv(int8_native.ENV, "sometimes")
    with pytest.raises(ValueError, match="GRAPHSPEC_INT8_NATIVE='sometimes'; use auto"):
        int8_native.mode()
    monkeypatch.setenv(int8_native.ENV, "0")
    assert int8_native.available() is False


def test_a_failed_build_warns_once_in_auto_and_is_an_error_when_required(monkeypatch, model):
    def broken():
        raise int8_native.NativeBuildError("no compiler (test)")

    monkeypatch.setattr(int8_native, "_load", broken)
    monkeypatch.setattr(int8_native._gate, "warned", False)
    monkeypatch.setattr(int8_native._gate, "failure", None)
    monkeypatch.setenv(int8_native.ENV, "1")
    with pytest.raises(int8_native.NativeBuildError, match="requires the C.. int8 draft forward.*no compiler"):
        int8_native.available()
    monkeypatch.setenv(int8_native.ENV, "auto")
    with pytest.warns(RuntimeWarning, match="int8 draft forward cannot be used .no compiler .test..; using the TorchScript path"):
        assert int8_native.available() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert int8_native.available() is False  # once per process
    # and the model runs the TorchScript path, with the same logits
    ids = _ids(model, 2)
    fallback, _ = _run(model, True, ids)
    monkeypatch.undo()
    script, _ = _run(model, False, ids)
    torch.testing.assert_close(fallback, script, rtol=0, atol=0)
