"""The Pipeline on real graphspec Transformers loaded from tiny Hugging Face checkpoints.

Greedy speculative decoding must give the autoregressive tokens exactly (and those match
transformers' own greedy generate), for a draft identical to the target, an unrelated random
model with the same tokenizer, and n-gram drafts; sampling must reproduce the target's exact
distribution of the first three tokens (2000 seeded runs, 32-token vocabulary, chi-square).
"""

import numpy as np
import pytest
import torch

import graphspec
from graphspec import SamplingParams
from tests.checkpoints import make_checkpoint
from tests.graphspec.oracle import chi2_pvalue, exact_marginals

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    target = make_checkpoint(root / "target", "llama", tokenizer="bytelevel", chat_template="chatml",
                             hidden_size=64, layers=2, heads=4, kv_heads=2, seed=0)
    # an unrelated model with the same tokenizer (another architecture, padded embedding)
    other = make_checkpoint(root / "other", "qwen2", tokenizer="bytelevel", chat_template="chatml",
                            vocab_size=448, hidden_size=32, layers=1, heads=2, kv_heads=1, seed=7)
    return target, other


@pytest.fixture(scope="module")
def models(dirs):
    target_dir, other_dir = dirs
    return graphspec.load_model(target_dir), graphspec.load_model(other_dir)


def test_greedy_speculative_equals_autoregressive_on_transformers(dirs, models):
    target, other = models
    tok = target.tokenizer
    long_prompt = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 8)
    prompts = [[tok.encode("The")[0]], long_prompt, [{"role": "user", "content": "Write a Stack class."}]]
    ar = graphspec.Pipeline(target)
    for prompt in prompts:
        ref = ar.run(prompt, max_new_tokens=24, ignore_eos=True).token_ids
        for k in (1, 3, 8):
            same = graphspec.Pipeline(target, draft=target, num_speculative_tokens=k, draft_siblings=0)  # a chain
            out = same.run(prompt, max_new_tokens=24, ignore_eos=True)
            assert out.token_ids == ref and out.stats.acceptance_rate == 1.0, (k, prompt)
            unrelated = graphspec.Pipeline(target, draft=other, num_speculative_tokens=k).run(
                prompt, max_new_tokens=24, ignore_eos=True)
            assert unrelated.token_ids == ref and unrelated.stats.acceptance_rate < 0.5, (k, prompt)
            ngram = graphspec.Pipeline(target, draft="ngram", num_speculative_tokens=k).run(
                prompt, max_new_tokens=24, ignore_eos=True)
            assert ngram.token_ids == ref, (k, prompt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_and_bf16_drafts_give_the_autoregressive_tokens(dirs, dtype, model_level):
    """An int8 draft (kernels.linear.Int8Weight) proposes other tokens than its bf16/fp32 self, but the
    output is the target's: greedy token-exact in fp32 and, since verify rows round like one-token
    steps, in bf16 too; at every level of the CPU backend this CPU executes (the bf16 target on each
    level's own linear and attention)."""
    target_dir, other_dir = dirs
    target = graphspec.load_model(target_dir, dtype=dtype)
    tok = target.tokenizer
    prompts = [tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 4), tok.encode("The")[:1]]
    int8_draft = graphspec.load_model(target_dir, dtype=dtype, quantize="int8")  # the target itself, rounded
    assert "quantize=int8" in repr(int8_draft)
    for prompt in prompts:
        ref = graphspec.Pipeline(target).run(prompt, max_new_tokens=24, ignore_eos=True).token_ids
        for draft in (int8_draft, str(other_dir)):
            kw = {"draft_quantize": "int8"} if isinstance(draft, str) else {}
            out = graphspec.Pipeline(target, draft, num_speculative_tokens=4, dtype=dtype, **kw).run(
                prompt, max_new_tokens=24, ignore_eos=True)
            assert out.token_ids == ref, (draft, prompt)
        # a rounded copy of the target agrees with it almost always, but not by construction
        same = graphspec.Pipeline(target, int8_draft, num_speculative_tokens=4, draft_confidence_threshold=None,
                                  draft_siblings=0)  # a chain's acceptance
        assert same.run(prompt, max_new_tokens=24, ignore_eos=True).stats.acceptance_rate > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_drafts_give_the_autoregressive_tokens(dirs, dtype):
    """quantize="int4" (the C++ forward's few-row products in 4 bits, kernels/cpu/int4_gemm.h): the draft
    proposes from coarser weights, the output stays the target's, token for token."""
    from graphspec.kernels import cpu
    from graphspec.kernels.cpu import int8_draft

    if not cpu.have_int4():
        pytest.skip("quantize='int4' needs the CPU backend's avx512 or avx2 level")
    target_dir, other_dir = dirs
    target = graphspec.load_model(target_dir, dtype=dtype)
    tok = target.tokenizer
    int4_draft = graphspec.load_model(target_dir, dtype=dtype, quantize="int4")
    assert "quantize=int4" in repr(int4_draft) and int8_draft.draft_for(int4_draft).gemm() == "int4"
    prompts = [tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 4), tok.encode("The")[:1]]
    for prompt in prompts:
        ref = graphspec.Pipeline(target).run(prompt, max_new_tokens=24, ignore_eos=True).token_ids
        for draft, kw in ((int4_draft, {}), (str(other_dir), {"draft_quantize": "int4"}),
                          (int4_draft, {"draft_siblings": 2})):
            out = graphspec.Pipeline(target, draft, num_speculative_tokens=4, dtype=dtype, **kw).run(
                prompt, max_new_tokens=24, ignore_eos=True)
            assert out.token_ids == ref, (draft, kw, prompt)


def test_pruned_draft_vocabulary(dirs, models):
    from graphspec.drafters import DraftHead, draft_vocab_ids

    target, other = models
    tok = other.tokenizer
    ids = draft_vocab_ids(other, 100)
    specials = set(tok.special_ids) | set(other.config.eos_token_ids)
    assert set(range(100)) | {i for i in specials if i < other.config.vocab_size} == set(ids.tolist())
    assert draft_vocab_ids(other, None) is None and draft_vocab_ids(other, other.config.vocab_size) is None
    assert draft_vocab_ids(other, [5, 3, 5]).tolist() == [3, 5]
    for bad, match in ((0, "at least one"), ([other.config.vocab_size], r"in \[0, "), ("abc", "'auto'"),
                       ([1, "x"], "int token ids"), (True, "positive int")):
        with pytest.raises(ValueError, match=match):
            draft_vocab_ids(other, bad)
    # The kept logits are the full head's logits at those ids; everything else is -inf.
    head = DraftHead.build(other, 100)
    prompt = torch.tensor([tok.encode("def f(x):")])
    full = other.step(prompt, other.new_cache(32), logits_for="last")[:, -1]
    part = head.logits(other, prompt, other.new_cache(32))
    kept = head.ids
    torch.testing.assert_close(part[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    mask = torch.ones(full.shape[-1], dtype=torch.bool)
    mask[kept] = False
    assert bool(torch.isinf(part[:, mask]).all()) and part.shape == full.shape
    # Greedy output is the target's whatever the draft keeps.
    prompt_ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)
    ref = graphspec.Pipeline(target).run(prompt_ids, max_new_tokens=20, ignore_eos=True).token_ids
    for keep in (40, 300):
        pipe = graphspec.Pipeline(target, other, num_speculative_tokens=3, draft_vocab=keep)
        assert pipe.run(prompt_ids, max_new_tokens=20, ignore_eos=True).token_ids == ref
    with pytest.raises(ValueError, match="needs a model draft"):
        graphspec.Pipeline(target, "ngram", draft_vocab=10)
    beyond = [other.config.vocab_size - 1]  # the draft's padded embedding is wider than the target's vocabulary
    assert beyond[0] >= target.config.vocab_size
    with pytest.raises(ValueError, match="no id below the target's vocabulary"):
        graphspec.Pipeline(target, other, draft_vocab=beyond).run(prompt_ids, max_new_tokens=2)


def test_auto_draft_vocabulary_prunes_int8_drafts_only(dirs, models, monkeypatch):
    import graphspec.drafters as drafters

    target, other = models
    other_int8 = graphspec.load_model(dirs[1], quantize="int8")
    assert drafters.draft_vocab_ids(other_int8, "auto") is None  # 448 ids: under AUTO_DRAFT_VOCAB, kept whole
    monkeypatch.setattr(drafters, "AUTO_DRAFT_VOCAB", 100)
    assert drafters.draft_vocab_ids(other, "auto") is None  # not int8: every logit
    assert drafters.draft_vocab_ids(other_int8, "auto").tolist() == drafters.draft_vocab_ids(other_int8, 100).tolist()
    prompt_ids = target.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)
    ref = graphspec.Pipeline(target).run(prompt_ids, max_new_tokens=20, ignore_eos=True).token_ids
    pipe = graphspec.Pipeline(target, str(dirs[1]), num_speculative_tokens=3, draft_quantize="int8", draft_vocab="auto")
    assert len(pipe.graph["draft"].head) == len(drafters.draft_vocab_ids(other_int8, 100))
    assert pipe.run(prompt_ids, max_new_tokens=20, ignore_eos=True).token_ids == ref


def test_draft_quantize_is_checked(dirs, models):
    target_dir, other_dir = dirs
    target, other = models
    with pytest.raises(ValueError, match="already loaded"):
        graphspec.Pipeline(target, other, draft_quantize="int8")
    with pytest.raises(ValueError, match="needs a model draft"):
        graphspec.Pipeline(target, "ngram", draft_quantize="int8")
    with pytest.raises(ValueError, match="quantize='int2' is not one of"):
        graphspec.Pipeline(target, str(other_dir), draft_quantize="int2")
    with pytest.raises(ValueError, match="without quantize"):
        graphspec.load_model(other_dir, quantize="int8", backend="triton")


def test_paths_load_like_models_and_match_transformers(dirs, models):
    transformers = pytest.importorskip("transformers")
    target_dir, other_dir = dirs
    target, _ = models
    pipe = graphspec.Pipeline(str(target_dir), draft=str(other_dir), num_speculative_tokens=4,
                              draft_confidence_threshold=None)
    prompt = "Once upon a time"
    out = pipe.run(prompt, max_new_tokens=20, ignore_eos=True)
    ids = target.tokenizer.encode(prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert out.token_ids == ref[0, len(ids):].tolist()
    assert out.text == target.tokenizer.decode(out.token_ids)
    s = out.stats
    assert s.target_forwards == s.steps + 1 and s.draft_forwards > s.steps


def test_stats_and_stream_on_transformers(models):
    target, _ = models
    k = 3
    pipe = graphspec.Pipeline(target, draft=target, num_speculative_tokens=k, draft_confidence_threshold=None,
                              draft_siblings=0)  # a chain: every proposed token is accepted
    out = pipe.run("Hello, world!", max_new_tokens=24, ignore_eos=True)
    assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_length == k + 1
    assert out.stats.accepted_per_position == [6] * k
    pieces = list(pipe.stream("Hello, world!", max_new_tokens=24, ignore_eos=True))
    assert "".join(pieces) == out.text


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    t = make_checkpoint(root / "t", "llama", tokenizer=None, vocab_size=32, hidden_size=32, layers=2, heads=4,
                        kv_heads=2, seed=0)
    d = make_checkpoint(root / "d", "mistral", tokenizer=None, vocab_size=32, hidden_size=16, layers=1, heads=2,
                        kv_heads=1, seed=3)
    return graphspec.load_model(t), graphspec.load_model(d), graphspec.load_model(d, quantize="int8")


@pytest.mark.parametrize("quantized,draft_vocab", [(False, None), (True, None), (False, 12)],
                         ids=["draft", "int8-draft", "pruned-draft"])
def test_sampling_on_transformers_matches_the_exact_distribution(tiny_vocab, quantized, draft_vocab):
    # The pruned draft proposes 12 of the 32 ids (plus its eos) from q renormalised over them.
    target, plain_draft, int8_draft = tiny_vocab
    draft = int8_draft if quantized else plain_draft
    prompt = [3]  # a one-token prompt: no prefill forwards, so 2000 runs stay cheap
    params = SamplingParams(temperature=0.7, top_k=12)
    exact = exact_marginals(target, prompt, params)
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, draft_vocab=draft_vocab)
    n = 2000
    samples = np.empty((n, 3), dtype=np.int64)
    accepted = proposed = 0
    for seed in range(n):
        r = pipe.run(prompt, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k, seed=seed,
                     ignore_eos=True)
        samples[seed] = r.token_ids
        accepted += r.stats.accepted
        proposed += r.stats.proposed
    pvalues = [chi2_pvalue(samples[:, i], exact[i]) for i in range(3)]
    assert min(pvalues) > 1e-3, pvalues
    assert 0.05 < accepted / proposed < 0.95, accepted / proposed
