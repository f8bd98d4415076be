"""rejection_sample: Triton (interpreter) == reference exactly on ids and counts; losslessness (the first
emitted token is distributed as p_0, chi-square) with real and one-hot drafts; edge cases; errors."""

import importlib
import sys

import pytest
import torch
from scipy.stats import chisquare

from graphspec.kernels import exponential_noise, rejection_sample, rejection_sample_ref, use_backend
from graphspec.kernels.rejection import _rejection_triton
from tests.kernels._sm90 import compile_main, have_ptxas, run_compile_check


def _dist(shape, gen, sharp=2.0, zero_frac=0.0):
    logits = torch.randn(shape, generator=gen) * sharp
    if zero_frac:
        logits[torch.rand(shape, generator=gen) < zero_frac] = float("-inf")
        logits[..., 0] = 0.0  # keep every row normalisable
    return logits.softmax(-1)


def _case(B, K, V, seed, with_q=True, zero_frac=0.0, from_q=True):
    """Draft ids drawn from q (so all acceptance lengths occur), probabilities partly zero."""
    gen = torch.Generator().manual_seed(seed)
    p = _dist((B, K + 1, V), gen, zero_frac=zero_frac)
    q = _dist((B, K, V), gen, zero_frac=zero_frac)
    if from_q:
        ids = torch.multinomial(q.reshape(B * K, V), 1, generator=gen).reshape(B, K)
    else:
        ids = torch.randint(0, V, (B, K), generator=gen)
    u = torch.rand(B, K, generator=gen)
    noise = exponential_noise((B, V), gen)
    return ids, (q if with_q else None), p, u, noise


def _check_format(tokens, n, ids):
    B, K = ids.shape
    assert tokens.shape == (B, K + 1) and tokens.dtype == torch.int64
    assert n.shape == (B,) and n.dtype == torch.int64
    pos = torch.arange(K + 1)[None, :]
    valid = pos <= n[:, None]
    assert bool((tokens[~valid] == -1).all()), "positions after the emitted token must be -1"
    assert bool((tokens[valid] >= 0).all())
    acc = pos[:, :K] < n[:, None]
    assert torch.equal(tokens[:, :K][acc], ids[acc]), "accepted tokens must be the draft tokens"


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("B,K,V,zero_frac", [(24, 1, 5, 0.0), (24, 4, 37, 0.3), (16, 7, 1000, 0.0), (6, 3, 4099, 0.5)])
def test_triton_equals_reference(B, K, V, zero_frac, with_q):
    for seed in range(2):
        ids, q, p, u, noise = _case(B, K, V, seed, with_q, zero_frac, from_q=(seed == 0))
        tokens, n = _rejection_triton(ids, q, p, u, noise)
        ref_tokens, ref_n = rejection_sample_ref(ids, q, p, u, noise)
        assert torch.equal(n, ref_n), f"num_accepted {n.tolist()} != {ref_n.tolist()}"
        assert torch.equal(tokens, ref_tokens), f"tokens differ:\n{tokens}\n{ref_tokens}"
        _check_format(tokens, n, ids)
    if with_q and K > 1:
        assert len(set(ref_n.tolist())) > 1, "the cases should cover several acceptance lengths"


def test_triton_handles_strided_inputs():
    B, K, V = 5, 3, 300
    ids, q, p, u, noise = _case(B, K, V, 3)
    big_p = torch.zeros(B, K + 1, 2 * V)
    big_p[:, :, ::2] = p
    p_strided = big_p[:, :, ::2]
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, batch-minor strides
    ids_s = torch.stack([ids, ids], dim=2)[:, :, 0]
    expected = rejection_sample_ref(ids, q, p, u, noise)
    got = _rejection_triton(ids_s, q_t, p_strided, u.t().contiguous().t(), noise)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _first_token_counts(V, p0, q0, with_q, n_trials, seed, fixed_draft=None):
    """Vectorised trials of one speculation step (K=2) with drafts sampled from q; counts of the first token."""
    K = 2
    gen = torch.Generator().manual_seed(seed)
    p = torch.stack([p0, _dist((V,), gen), _dist((V,), gen)])  # p_0, p_1, p_2
    q = torch.stack([q0, _dist((V,), gen)])
    if fixed_draft is not None:
        ids = torch.full((n_trials, K), fixed_draft, dtype=torch.int64)
    else:
        ids = torch.multinomial(q, n_trials, replacement=True, generator=gen).t().contiguous()
    u = torch.rand(n_trials, K, generator=gen)
    noise = exponential_noise((n_trials, V), gen)
    target = p.expand(n_trials, K + 1, V)
    draft = q.expand(n_trials, K, V) if with_q else None
    tokens, n = rejection_sample_ref(ids, draft, target, u, noise)
    # the Triton kernel takes the same decisions on a slice of the trials
    t_tokens, t_n = _rejection_triton(ids[:64], None if draft is None else draft[:64], target[:64], u[:64], noise[:64])
    assert torch.equal(t_tokens, tokens[:64]) and torch.equal(t_n, n[:64])
    return torch.bincount(tokens[:, 0], minlength=V).double()


def _assert_follows(counts, p0, what):
    nz = p0 > 0
    assert counts[~nz].sum() == 0, f"{what}: drew a token with p_0 = 0: {counts.tolist()}"
    expected = p0[nz].double() / p0[nz].double().sum() * counts.sum()
    pvalue = chisquare(counts[nz].numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3, f"{what}: first token not distributed as p_0 (p={pvalue:.2g}): {counts.tolist()}"


P0 = torch.tensor([0.35, 0.05, 0.0, 0.25, 0.15, 0.2])
Q0 = torch.tensor([0.1, 0.3, 0.2, 0.3, 0.1, 0.0])


def test_first_token_is_distributed_as_target_with_draft_probs():
    _assert_follows(_first_token_counts(6, P0, Q0, True, 30000, seed=1), P0, "q drafts")


def test_first_token_is_distributed_as_target_with_one_hot_drafts():
    # one-hot rejection is lossless whatever the drafts are: random ones, and a fixed (n-gram like) one
    _assert_follows(_first_token_counts(6, P0, Q0, False, 30000, seed=2), P0, "one-hot drafts from q")
    _assert_follows(_first_token_counts(6, P0, Q0, False, 30000, seed=3, fixed_draft=3), P0, "fixed draft")


def test_the_statistical_check_can_fail():
    # feeding the sampler a q that is not the draft distribution breaks losslessness; the check sees it
    wrong_q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    gen = torch.Generator().manual_seed(4)
    n_trials, V = 30000, 6
    ids = torch.multinomial(Q0, n_trials, replacement=True, generator=gen)[:, None]
    tokens, _ = rejection_sample_ref(ids, wrong_q.expand(n_trials, 1, V), P0.expand(n_trials, 2, V),
                                     torch.rand(n_trials, 1, generator=gen), exponential_noise((n_trials, V), gen))
    with pytest.raises(AssertionError, match="not distributed as p_0"):
        _assert_follows(torch.bincount(tokens[:, 0], minlength=V).double(), P0, "wrong q")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_q_equal_p_always_accepts_and_emits_bonus(backend):
    B, K, V = 8, 4, 50
    ids, q, p, _, noise = _case(B, K, V, 5)
    p[:, :K] = q
    u = torch.full((B, K), 0.999999)
    with use_backend(backend):
        tokens, n = rejection_sample(ids, q, p, u, noise)
    assert n.tolist() == [K] * B
    assert torch.equal(tokens[:, :K], ids)
    assert torch.equal(tokens[:, K], torch.argmax(p[:, K] / noise, dim=1)), "bonus token must come from p_K"


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_target_probability_always_rejects(backend, with_q):
    B, K, V = 8, 3, 40
    ids, q, p, _, noise = _case(B, K, V, 6, with_q)
    p[torch.arange(B), 0, ids[:, 0]] = 0.0
    u = torch.zeros(B, K)  # the most accepting uniforms there are
    with use_backend(backend):
        tokens, n = rejection_sample(ids, q, p, u, noise)
    assert n.tolist() == [0] * B
    assert bool((tokens[:, 0] != ids[:, 0]).all())
    assert bool((p[torch.arange(B), 0, tokens[:, 0]] > 0).all())
    if with_q:  # recovered from max(0, p_0 - q_0): only tokens where p_0 > q_0
        assert bool((p[torch.arange(B), 0, tokens[:, 0]] > q[torch.arange(B), 0, tokens[:, 0]]).all())
    assert bool((tokens[:, 1:] == -1).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_k1_accept_and_reject(backend):
    V = 10
    p = torch.zeros(2, 2, V)
    p[:, 0, 3] = 1.0  # target is certain of token 3
    p[:, 1, 7] = 1.0  # bonus distribution
    ids = torch.tensor([[3], [4]])
    noise = torch.ones(2, V)
    with use_backend(backend):
        tokens, n = rejection_sample(ids, None, p, torch.tensor([[0.5], [0.5]]), noise)
    assert n.tolist() == [1, 0]
    assert tokens.tolist() == [[3, 7], [3, -1]]


def _args():
    ids, q, p, u, noise = _case(2, 3, 11, 0)
    return dict(draft_ids=ids, draft_probs=q, target_probs=p, uniform=u, noise=noise)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("over,match", [
    (dict(target_probs=torch.rand(2, 3, 11)), "K\\+1"),
    (dict(draft_probs=torch.rand(2, 3, 12)), "draft_probs has shape"),
    (dict(uniform=torch.rand(2, 4)), "uniform has shape"),
    (dict(noise=torch.rand(2, 10)), "noise has shape"),
    (dict(draft_ids=torch.zeros(2, 3, dtype=torch.int32)), "draft_ids has dtype"),
    (dict(target_probs=torch.rand(2, 4, 11, dtype=torch.float64)), "target_probs has dtype"),
    (dict(uniform=torch.rand(2, 3, device="meta")), "uniform is on"),
    (dict(draft_ids=torch.zeros(2, 0, dtype=torch.int64), draft_probs=None,
          target_probs=torch.rand(2, 1, 11), uniform=torch.rand(2, 0)), "K >= 1"),
])
def test_errors(over, match, backend):
    args = _args()
    args.update(over)
    with use_backend(backend), pytest.raises(ValueError, match=match):
        rejection_sample(**args)


def test_reference_rejects_out_of_vocabulary_draft_ids():
    args = _args()
    args["draft_ids"] = args["draft_ids"].clone()
    args["draft_ids"][1, 2] = 11
    with pytest.raises(ValueError, match="outside"):
        rejection_sample_ref(**args)


def _sm90_specs():
    mod = importlib.import_module("graphspec.kernels.rejection")
    signature = {"draft_ids_ptr": "*i64", "draft_probs_ptr": "*fp32", "target_probs_ptr": "*fp32",
                 "uniform_ptr": "*fp32", "noise_ptr": "*fp32", "tokens_ptr": "*i64", "num_accepted_ptr": "*i64",
                 **{f"stride_{s}": "i32" for s in ("ib", "ik", "db", "dk", "dv", "tb", "tk", "tv", "ub", "uk",
                                                    "nb", "nv", "ob", "ok")},
                 "K": "i32", "V": "i32", "HAS_DRAFT_PROBS": "constexpr", "BLOCK_V": "constexpr", "BLOCK_K": "constexpr"}
    return [(f"rejection has_draft_probs={has_q}", mod._rejection_kernel, signature,
             {"HAS_DRAFT_PROBS": has_q, "BLOCK_V": 2048, "BLOCK_K": 8}, {"num_warps": 8}) for has_q in (True, False)]


@pytest.mark.skipif(not have_ptxas(), reason="this triton wheel ships no ptxas; cannot compile for sm_90 here")
def test_rejection_kernel_compiles_for_sm90():
    run_compile_check("tests.kernels.test_rejection")


if __name__ == "__main__":
    sys.exit(compile_main(_sm90_specs()))
