"""GGUF block-weight models' cached forwards in C++ (graphspec.kernels.cpu.block_model, on layer_stack.h).

``Transformer._forward_native`` runs ``_forward``'s math as loops around the same block GEMMs for every cached
forward of a ``weights="gguf"`` / ``"gguf-a8"`` model on the CPU. It must be what runs, give the general
forward's logits (fp32 activations: within 1e-5 relative, only the order of fp32 sums and the exp differ) on
every C++ level with a batch, explicit positions, a pruned head, each ``logits_for`` and a wide tree, keep the
rows of ``step_many`` bit-identical to each sequence's own step, and reject what it cannot run with a message.
"""

from __future__ import annotations

import pytest
import torch

from graphspec.kernels import cpu
from graphspec.models import load_model
from tests.kernels.cpu._int_gemm import assert_rows_close
from tests.models._chunks import CHUNKS, TREE_LEVELS, tree_levels
from tests.models._chunks import native_steps as _steps
from tests.models.test_gguf_target import _rel, write_block_gguf

pytestmark = pytest.mark.usefixtures("block_level")  # every C++ level this CPU executes, amx included

RTOL = 1e-5  # fp32 activations: only the order of fp32 sums (norms, attention) and a polynomial exp differ


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def path(request, tmp_path_factory):
    """A tiny GGUF of every block format the kernels run, mixed within the fused q/k/v (StackedWeights)."""
    return write_block_gguf(tmp_path_factory.mktemp("gguf_native") / f"{request.param}.gguf", request.param)


def test_the_native_forward_runs_and_matches_the_general_forward(path, monkeypatch):
    model = load_model(path, weights="gguf")
    calls = []
    native = type(model)._forward_native
    monkeypatch.setattr(type(model), "_forward_native", lambda self, *a: calls.append(1) or native(self, *a))
    ids = torch.randint(0, model.config.vocab_size, (2, sum(CHUNKS)), generator=torch.Generator().manual_seed(0))
    fast = _steps(model, True, ids)
    assert len(calls) == len(CHUNKS)  # every cached forward took the C++ path ...
    general = _steps(model, False, ids)
    assert len(calls) == len(CHUNKS)  # ... and native_forward=False none
    assert fast.shape == general.shape == (2, sum(CHUNKS[1:]), model.config.vocab_size)
    assert _rel(fast, general) <= RTOL, _rel(fast, general)
    assert general.abs().max() > 0.5  # logits of real size, so the tolerance means something


def test_positions_head_rows_and_trees(path):
    model = load_model(path, weights="gguf")
    n = sum(CHUNKS)
    ids = torch.randint(0, model.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(n).expand(2, n) * 3 + torch.tensor([[0], [5]])
    keep = torch.tensor([0, 3, 7, 11, model.config.vocab_size - 1])
    head = model.head_rows(keep)
    for kw in ({"positions": positions}, {"head": head}, {"logits_for": "last"}, {"logits_for": torch.tensor([0, 0])}):
        fast, general = _steps(model, True, ids, **kw), _steps(model, False, ids, **kw)
        assert _rel(fast, general) <= RTOL, (kw, _rel(fast, general))
    full = _steps(model, True, ids)
    torch.testing.assert_close(_steps(model, True, ids, head=head), full[..., keep], rtol=1e-5, atol=1e-5)
    assert (_steps(model, True, ids, positions=positions) - full).abs().max() > 1e-2  # positions reach rope
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    for fast, general in zip(tree_levels(model, True, prompt, TREE_LEVELS),
                             tree_levels(model, False, prompt, TREE_LEVELS)):
        assert _rel(fast, general) <= RTOL


@pytest.mark.parametrize("weights", ["gguf", "gguf-a8"])
def test_step_many_gives_each_sequence_its_own_bits(path, weights, monkeypatch):
    model = load_model(path, weights=weights)
    calls = []
    many = type(model)._forward_native_many
    monkeypatch.setattr(type(model), "_forward_native_many", lambda self, *a: calls.append(1) or many(self, *a))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (1, n), generator=g) for n in (5, 9, 3)]
    blocks = [torch.randint(0, model.config.vocab_size, (1, n), generator=g) for n in (1, 4, 2)]
    alone, caches = [], []
    for p, b in zip(prompts, blocks):
        cache = model.new_cache(32)
        model.step(p, cache, logits_for="last")
        alone.append(model.step(b, cache))
        cache = model.new_cache(32)
        model.step(p, cache, logits_for="last")
        caches.append(cache)
    together = model.step_many([{"token_ids": b, "cache": c} for b, c in zip(blocks, caches)])
    assert calls == [1]
    for a, t in zip(alone, together):
        assert torch.equal(a, t)
    assert [c.length for c in caches] == [p.shape[1] + b.shape[1] for p, b in zip(prompts, blocks)]


def test_int8_activations_stay_close_to_the_general_forward(path):
    """gguf-a8 rounds each product's activations to int8, so a 1e-7 difference can move one across a rounding
    step; the two forwards must still agree row by row as the int8 draft's do (assert_rows_close)."""
    model = load_model(path, weights="gguf-a8")
    ids = torch.randint(0, model.config.vocab_size, (2, sum(CHUNKS)), generator=torch.Generator().manual_seed(3))
    assert_rows_close(_steps(model, True, ids), _steps(model, False, ids), atol=1e-3)


def test_what_it_cannot_run_is_said(path):
    model = load_model(path, weights="gguf")
    with pytest.raises(ValueError, match="C\\+\\+ level"):
        model.lm_head.native("torch")
    qcls = cpu.qclasses()
    part = model.layers[0].wo
    with pytest.raises(RuntimeError, match="block_native: a BlockLinear needs one type"):
        qcls.BlockLinear([part.blocks], [], [part.shape[0]], [0], part.shape[1])
    with pytest.raises(RuntimeError, match="bytes for a"):  # a part whose bytes do not fit its shape
        qcls.BlockLinear([part.blocks[:-1]], [3], [part.shape[0]], [0], part.shape[1])
    with pytest.raises(RuntimeError, match="block_native: a layer's weights do not fit"):
        obj = qcls.BlockModel(4, 2, 64, 256, 1e-6, 0.125, model.norm.float())
        layer = model.layers[0]
        obj.add_layer(layer.wo.native(), None, layer.wo.native(), None, layer.w13.native(), layer.w2.native(),
                      layer.input_norm.float(), layer.post_norm.float())


@pytest.mark.parametrize("weights", ["gguf", "gguf-a8"])
def test_logits_keep_their_bits_at_any_thread_count(path, weights):
    """The GEMMs split output rows and attention splits (rows, kv head) items between the threads; nothing a row
    computes depends on the split, so greedy output does not change with --threads."""
    model = load_model(path, weights=weights)
    ids = torch.randint(0, model.config.vocab_size, (2, sum(CHUNKS)), generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got.append(_steps(model, True, ids))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_a_model_pinned_to_triton_keeps_its_kernels(path, monkeypatch):
    """backend="triton" on a CPU (the interpreter) means the Triton block GEMMs, not the C++ forward."""
    model = load_model(path, weights="gguf", backend="triton")
    assert model._native_model() is None
    assert load_model(path, weights="gguf")._native_model() is not None


@pytest.mark.parametrize("weights", ["gguf", "gguf-a8"])
def test_rows_of_a_long_verify_and_a_tree_are_their_own_steps_bits(path, weights):
    """Attention takes a sequence's rows together (their common slots read once, layer_stack.h attend_rows), past
    several 16-key blocks: each row of a causal verify and of a tree must still be the bits of its own one-token
    steps, at 1, 2 and 3 threads (3: more threads than kv heads, so a sequence's rows are split between them;
    what greedy speculation on a GGUF target rests on)."""
    model = load_model(path, weights=weights)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.config.vocab_size, (1, 37), generator=g)
    block = torch.randint(0, model.config.vocab_size, (1, 19), generator=g)

    def steps(path_ids):  # the prompt, then path_ids one token at a time; every step's logits
        cache = model.new_cache(96)
        model.step(prompt, cache, logits_for="last")
        return torch.cat([model.step(path_ids[:, i:i + 1], cache) for i in range(path_ids.shape[1])], dim=1)

    chain = steps(block)
    # rows 0-9 a chain; row 10 + j a second child of row j, so the rows share the prompt and row 0 only
    parents = list(range(-1, 9)) + list(range(9))
    tree = torch.zeros(19, 19, dtype=torch.bool)
    depth = []
    for r, p in enumerate(parents):
        tree[r, r], d = True, 0
        while p >= 0:
            tree[r, p], p, d = True, parents[p], d + 1
        depth.append(d)
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cache = model.new_cache(96)
            model.step(prompt, cache, logits_for="last")
            assert torch.equal(model.step(block, cache), chain)
            cache = model.new_cache(96)
            model.step(prompt, cache, logits_for="last")
            out = model.step(block, cache, positions=37 + torch.tensor([depth]), tree=tree)
            assert torch.equal(out[:, :10], chain[:, :10])
            for j in range(9):
                alone = steps(torch.cat([block[:, :j + 1], block[:, 10 + j:11 + j]], dim=1))
                assert torch.equal(out[:, 10 + j], alone[:, -1]), j
    finally:
        torch.set_num_threads(before)


def test_a_long_prefill_splits_its_rows_and_keeps_their_bits(tmp_path):
    """Attention splits a sequence's rows into parts whose scores fit a bounded scratch (900 rows here: two parts);
    the caches and logits must be those of the same prompt fed in two halves (one part each)."""
    model = load_model(write_block_gguf(tmp_path / "long.gguf", "qwen2", context=1024), weights="gguf-a8")
    ids = torch.randint(0, model.config.vocab_size, (1, 900), generator=torch.Generator().manual_seed(6))
    whole, halves = model.new_cache(904), model.new_cache(904)
    last = model.step(ids, whole, logits_for="last")
    model.step(ids[:, :450], halves, logits_for="last")
    assert torch.equal(model.step(ids[:, 450:], halves, logits_for="last"), last)
    assert all(torch.equal(a[:, :900], b[:, :900]) for a, b in zip(whole.k + whole.v, halves.k + halves.v))
