"""The model asks the kernels side for its weight layout once, at load: packed on CPU, plain for Triton.

Parity of the packed path with transformers is covered by test_parity (which runs the default
CPU path); here: which layout each backend gets, that a verify over K+1 rows gives the same
greedy tokens as one-row steps (fp32), and that tied embeddings stay usable for the embedding.
"""

import pytest
import torch

from graphspec.kernels.linear import PackedWeight, _can_pack
from graphspec.models import load_model
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not _can_pack(torch.zeros(1, 1)), reason="oneDNN is not available in this torch")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prep"), "qwen2", tokenizer=None, tie=True)


def test_cpu_model_holds_packed_weights_and_triton_model_plain(ckpt):
    m = load_model(ckpt, dtype=torch.float32)
    layer = m.layers[0]
    assert all(isinstance(w, PackedWeight) for w in (layer.wqkv, layer.wo, layer.w13, layer.w2, m.lm_head))
    assert isinstance(m.embed, torch.Tensor) and not isinstance(m.embed, PackedWeight)  # tied: embed stays plain
    assert torch.equal(m.lm_head.dense(), m.embed)
    tri = load_model(ckpt, dtype=torch.float32, backend="triton")
    assert all(isinstance(w, torch.Tensor) for w in (tri.layers[0].wqkv, tri.lm_head))


def test_packed_matches_plain_weights(ckpt):
    packed = load_model(ckpt, dtype=torch.float32)
    plain = load_model(ckpt, dtype=torch.float32, backend="torch")
    for layer in plain.layers:  # undo the packing: the same model on F.linear
        for name in ("wqkv", "wo", "w13", "w2"):
            setattr(layer, name, getattr(layer, name).dense())
    plain.lm_head = plain.lm_head.dense()
    ids = torch.randint(0, packed.config.vocab_size, (2, 11))
    torch.testing.assert_close(packed(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_verify_rows_give_the_greedy_tokens_of_single_steps(ckpt):
    m = load_model(ckpt, dtype=torch.float32)
    prompt = torch.randint(0, m.config.vocab_size, (1, 7))
    cache = m.new_cache(64)
    logits = m.step(prompt, cache, logits_for="last")
    greedy = []
    for _ in range(8):  # autoregressive, one row per step
        greedy.append(int(logits[0, -1].argmax()))
        logits = m.step(torch.tensor([[greedy[-1]]]), cache, logits_for="last")
    cache.truncate(7)
    verify = m.step(torch.tensor([greedy]), cache, logits_for="all")  # all 8 rows in one forward
    assert verify.argmax(-1)[0, :-1].tolist() == greedy[1:]


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    # Qwen2.5-0.5B's MLP shapes (a [896, 4864] down projection), where oneDNN sums one row in another order
    # than several unless linear pads it.
    return make_checkpoint(tmp_path_factory.mktemp("wide"), "qwen2", tokenizer=None, hidden_size=896,
                           intermediate_size=4864, layers=1, heads=14, kv_heads=2)


@pytest.fixture(scope="module")
def mlp_1_5b_ckpt(tmp_path_factory):
    # Qwen2.5-1.5B's MLP shapes (a [1536, 8960] down projection), which oneDNN rounds differently from 12 rows
    # up on the AMX Xeon machines unless linear splits the product (INVARIANT_MAX_ROWS).
    return make_checkpoint(tmp_path_factory.mktemp("wide15"), "qwen2", tokenizer=None, hidden_size=1536,
                           intermediate_size=8960, layers=1, heads=12, kv_heads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which, rows", [("wide_ckpt", 6), ("mlp_1_5b_ckpt", 12), ("mlp_1_5b_ckpt", 20)])
def test_verify_rows_are_bit_identical_to_single_steps(which, rows, dtype, monkeypatch, request):
    """Each row of a K+1-token verify equals the one-token step at that position, bit for bit.

    This is what makes greedy speculative output equal autoregressive output in bf16 too
    (kernels.linear.MIN_ROWS and INVARIANT_MAX_ROWS; the CPU attention path runs verify rows one by one).
    With both turned off the rows differ wherever this CPU's oneDNN rounds by row count.
    """
    import importlib

    linear_mod = importlib.import_module("graphspec.kernels.linear")
    m = load_model(request.getfixturevalue(which), dtype=dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, m.config.vocab_size, (1, 9), generator=g)
    block = torch.randint(0, m.config.vocab_size, (1, rows), generator=g)
    differing = {}
    for setting in ("default", "off"):
        if setting == "off":
            monkeypatch.setattr(linear_mod, "MIN_ROWS", 1)
            monkeypatch.setattr(linear_mod, "INVARIANT_MAX_ROWS", 0)
        cache = m.new_cache(64)
        m.step(prompt, cache, logits_for=torch.empty(0, dtype=torch.long))
        steps = torch.cat([m.step(block[:, j:j + 1], cache) for j in range(block.shape[1])], dim=1)
        cache.truncate(prompt.shape[1])
        verify = m.step(block, cache)
        differing[setting] = [j for j in range(block.shape[1]) if not torch.equal(steps[0, j], verify[0, j])]
    assert differing["default"] == [], differing
    if not differing["off"]:
        pytest.skip("one-row and several-row products round alike on this CPU: nothing to show")
