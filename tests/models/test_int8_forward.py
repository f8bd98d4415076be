"""int8 models (drafts on a CPU): fp32 between the GEMMs, and cached forwards on the lean path.

``Transformer._forward_int8`` is ``_forward``'s math written in fewer torch ops for the steps a
draft runs (prefill, one-token proposals, multi-token catch-ups); here it must give ``_forward``'s
logits (same int8 GEMMs, same fp32 math, only the op boundaries differ) on every architecture,
with biases, a batch, explicit positions, a pruned head and each ``logits_for``, and it must
really be what runs.
"""

import pytest
import torch

from graphspec.kernels.linear import Int8Weight
from graphspec.models import load_model
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines
                                and "x86" not in torch.backends.quantized.supported_engines,
                                reason="this torch build has no int8 CPU GEMM")

# Both paths run the same int8 GEMMs on fp32 activations; only where fp32 sums round differs
# (rms_norm and SDPA calls split differently), ~1e-6 relative, which can move one activation
# across an 8-bit rounding step. Measured on these models: < 1e-6 absolute, logits up to ~3.
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


CHUNKS = (7, 1, 2, 1, 3)  # a prefill, then one-token steps and multi-token catch-ups


def _steps(model, fast, ids, positions=None, head=None, logits_for="all"):
    """Logits of every chunk after the prefill, concatenated on the row axis."""
    model.lean_int8_forward = fast
    try:
        cache = model.new_cache(64, batch_size=ids.shape[0])
        out, j = [], 0
        for n in CHUNKS:
            pos = None if positions is None else positions[:, j:j + n]
            logits = model.step(ids[:, j:j + n], cache, positions=pos, head=head,
                                logits_for="last" if j == 0 else logits_for)
            out += [logits] if j else []
            j += n
        assert cache.length == j == ids.shape[1]
        return torch.cat(out, dim=1)
    finally:
        model.lean_int8_forward = True


def test_lean_forward_matches_the_general_forward(model, monkeypatch):
    calls = []
    lean = type(model)._forward_int8
    monkeypatch.setattr(type(model), "_forward_int8", lambda self, *a: calls.append(1) or lean(self, *a))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, sum(CHUNKS)), generator=g)
    fast = _steps(model, True, ids)
    assert len(calls) == len(CHUNKS)  # every cached forward took the lean path ...
    general = _steps(model, False, ids)
    assert len(calls) == len(CHUNKS)  # ... and lean_int8_forward=False none
    assert fast.shape == general.shape == (2, sum(CHUNKS[1:]), model.config.vocab_size)
    torch.testing.assert_close(fast, general, rtol=0, atol=ATOL)
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
        torch.testing.assert_close(fast, general, rtol=0, atol=ATOL)
    full = _steps(model, True, ids, head=None)
    torch.testing.assert_close(_steps(model, True, ids, head=head), full[..., keep], rtol=0, atol=ATOL)
    shifted = _steps(model, True, ids, positions=positions)
    assert (shifted - full).abs().max() > 1e-2  # positions reach rope: a test of them can fail


def test_lean_forward_runs_as_torchscript(model, monkeypatch):
    """The lean path's layers run in TorchScript (graphspec.models.lean_int8), not in Python."""
    import graphspec.models.transformer as transformer

    calls = []
    scripted = transformer.scripted_forward()
    assert isinstance(scripted, torch.jit.ScriptFunction)
    monkeypatch.setattr(transformer, "scripted_forward", lambda: calls.append(1) or scripted)
    cache = model.new_cache(16)
    model.step(torch.tensor([[1, 2, 3]]), cache, logits_for="last")
    model.step(torch.tensor([[4]]), cache, logits_for="last")
    assert len(calls) == 2 and cache.length == 4
