"""int8 models (drafts on a CPU): fp32 between the GEMMs, and cached forwards on the C++ path.

``Transformer._forward_native`` (graphspec.kernels.cpu.int8_draft) is ``_forward``'s math as C++ loops for the
steps a draft runs (prefill, one-token proposals, multi-token catch-ups, a beam's tree levels); here it must give
``_forward``'s logits (same int8 GEMMs, same fp32 math, only the order of fp32 sums differs) on every
architecture and every C++ level, with biases, a batch, explicit positions, a pruned head and each
``logits_for``, and it must really be what runs.
"""

import pytest
import torch

from graphspec.kernels.linear import Int8Weight
from graphspec.models import load_model
from tests.checkpoints import make_checkpoint
from tests.kernels.cpu._int_gemm import assert_rows_close
from tests.models._chunks import TREE_LEVELS as LEVELS
from tests.models._chunks import CHUNKS, tree_levels
from tests.models._chunks import native_steps as _steps

pytestmark = pytest.mark.usefixtures("level")  # every C++ level this CPU executes

# Both paths run the same int8 GEMMs on fp32 activations; only where fp32 sums round differs
# (norms and attention), ~1e-6 relative, which can move one activation across an 8-bit rounding step.
ATOL = 1e-3


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def model(request, tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tokenizer=None,
                        tie=request.param == "qwen2")
    return load_model(d, dtype=torch.bfloat16, quantize="int8")


def test_int8_model_computes_in_fp32(model):
    assert model.dtype == torch.float32 and model.embed.dtype == torch.bfloat16  # the embedding stays as loaded
    layer = model.layers[0]
    assert all(isinstance(w, Int8Weight) and w.dtype == torch.float32 for w in (layer.wqkv, layer.w13, model.lm_head))
    assert layer.input_norm.dtype == model.norm.dtype == torch.float32
    assert model.new_cache(8).dtype == torch.float32


def test_lean_forward_matches_the_general_forward(model, monkeypatch):
    calls = []
    lean = type(model)._forward_native
    monkeypatch.setattr(type(model), "_forward_native", lambda self, *a: calls.append(1) or lean(self, *a))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, sum(CHUNKS)), generator=g)
    fast = _steps(model, True, ids)
    assert len(calls) == len(CHUNKS)  # every cached forward took the lean path ...
    general = _steps(model, False, ids)
    assert len(calls) == len(CHUNKS)  # ... and native_forward=False none
    assert fast.shape == general.shape == (2, sum(CHUNKS[1:]), model.config.vocab_size)
    assert_rows_close(fast, general, ATOL)
    assert general.abs().max() > 0.5  # logits of real size, so the tolerance means something


def test_lean_forward_with_positions_head_and_rows(model):
    g = torch.Generator().manual_seed(1)
    n = sum(CHUNKS)
    ids = torch.randint(0, model.config.vocab_size, (2, n), generator=g)
    positions = torch.arange(n).expand(2, n) * 3 + torch.tensor([[0], [5]])  # rows at their own positions
    keep = torch.tensor([0, 3, 7, 11, model.config.vocab_size - 1])
    head = model.head_rows(keep)
    for kw in ({"positions": positions}, {"head": head}, {"logits_for": "last"}, {"logits_for": torch.tensor([0, 0])}):
        fast, general = _steps(model, True, ids, **kw), _steps(model, False, ids, **kw)
        assert_rows_close(fast, general, ATOL)
    full = _steps(model, True, ids, head=None)
    assert_rows_close(_steps(model, True, ids, head=head), full[..., keep], ATOL)
    shifted = _steps(model, True, ids, positions=positions)
    assert (shifted - full).abs().max() > 1e-2  # positions reach rope: a test of them can fail




def test_lean_forward_with_a_wide_tree_matches_the_general_forward(model):
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]]) % model.config.vocab_size
    lean, general = tree_levels(model, True, prompt, LEVELS), tree_levels(model, False, prompt, LEVELS)
    for fast, slow in zip(lean, general):
        assert_rows_close(fast, slow, ATOL)
    assert lean[-1].abs().max() > 0.5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_wide_tree_rows_equal_their_paths_fed_in_order(arch, tmp_path):
    """A beam's level rows (``tree [T, m]`` over cached nodes) equal feeding each row's path as a sequence.

    In fp32 (int8 quantizes each call's activations with one scale, so its rows depend on the batch)."""
    model = load_model(make_checkpoint(tmp_path, arch, tokenizer=None), dtype=torch.float32)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]]) % model.config.vocab_size
    flat = [(t, p) for level in LEVELS for t, p in level]
    n = 0
    for lv, out in enumerate(tree_levels(model, False, prompt, LEVELS)):
        for r in range(len(LEVELS[lv])):
            path, a = [], n + r
            while a >= 0:
                path.append(flat[a][0])
                a = flat[a][1]
            seq = model.step(torch.cat([prompt, torch.tensor([path[::-1]])], dim=1), model.new_cache(64),
                             logits_for="last")
            torch.testing.assert_close(out[:, r], seq[:, 0], rtol=1e-4, atol=1e-4)
        n += len(LEVELS[lv])
    swapped = tree_levels(model, False, prompt, [LEVELS[0], [(3, 1), (5, 0), (8, 1)]])  # other parents
    assert (swapped[1] - tree_levels(model, False, prompt, LEVELS[:2])[1]).abs().max() > 1e-3  # the mask matters


def test_lean_forward_with_an_mlp_width_past_whole_vectors(tmp_path):
    """An intermediate size that is not a multiple of 16: the C++ silu(gate) * up runs 16 lanes at a time (avx512,
    avx2) and its last 7 elements a row in scalar steps; both parts must give the general forward's logits."""
    d = make_checkpoint(tmp_path, "llama", tokenizer=None, intermediate_size=16 * 7 + 7)
    model = load_model(d, dtype=torch.float32, quantize="int8")
    ids = torch.randint(0, model.config.vocab_size, (2, sum(CHUNKS)), generator=torch.Generator().manual_seed(2))
    fast, general = _steps(model, True, ids), _steps(model, False, ids)
    assert_rows_close(fast, general, ATOL)
    assert general.abs().max() > 0.5
