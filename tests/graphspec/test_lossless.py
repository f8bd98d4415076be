"""Speculative sampling is lossless: the first three generated tokens follow the target's exact distribution.

Each check runs the full Pipeline 2000 times with seeds 0..1999 (deterministic) on toy models with
a 16-token vocabulary, and compares the marginal of each of the first three tokens with the exact
distribution from enumerating all prefixes with the target alone (chi-square). The real stages
must pass (p > 1e-3 for each token); each known way of breaking losslessness is built as a
deliberately broken stage and must be detected (smallest p < 1e-6) by the very same test.
"""

import pytest
import torch

import graphspec
from graphspec import ModelDrafter, RejectionSampling, SamplingParams, Stage
from graphspec.kernels.sampling import exponential_noise, sample, warp_logits
from tests.graphspec.oracle import marginal_pvalues, sample_first_three
from tests.graphspec.toy import ToyLM

pytestmark = pytest.mark.usefixtures("single_thread")

N_RUNS = 2000
V = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the n-gram drafter has proposals too


def _target():
    t = ToyLM(V, seed=0, scale=1.5)
    # the target likes to continue the prompt's cycle 1 2 3, so n-gram drafts get accepted too
    for a, b, c in ((1, 2, 3), (2, 3, 1), (3, 1, 2)):
        t.table[a, b, c] += 4.5
    return t


def _draft(offset: float = 0.0):
    d = _target()
    d.table += 1.2 * torch.randn(d.table.shape, generator=torch.Generator().manual_seed(7))
    d.table += offset  # softmax is shift invariant: the fp32 distribution does not change
    return d


def _sample_runs(pipe, params: SamplingParams, n: int = N_RUNS):
    return sample_first_three(pipe, PROMPT, params, n)


def _pvalues(pipe, params):
    return marginal_pvalues(pipe, PROMPT, params, N_RUNS)


T1 = SamplingParams(temperature=1.0)
T07K = SamplingParams(temperature=0.7, top_k=5)


@pytest.mark.parametrize("draft, params, k, threshold", [
    ("model", T1, 2, None),
    ("model", T07K, 3, 0.4),
    ("ngram", T1, 2, None),
    ("model", SamplingParams(temperature=1.3, top_p=0.8), 2, 0.4),
    ("model", T1, 4, 0.7),
], ids=["model-T1", "model-T0.7-top5-conf0.4", "ngram-T1", "model-T1.3-topp0.8-conf0.4", "model-T1-K4-conf0.7"])
def test_speculative_sampling_matches_the_target_distribution(draft, params, k, threshold):
    pipe = graphspec.Pipeline(_target(), draft=_draft() if draft == "model" else "ngram", num_speculative_tokens=k,
                              draft_confidence_threshold=threshold)
    pvalues, rate = _pvalues(pipe, params)
    assert min(pvalues) > 1e-3, pvalues
    assert 0.1 < rate < 0.99  # drafts are both accepted and rejected: every path of the rule is exercised


def test_a_low_confidence_draft_stops_early():
    """The threshold really shortens drafts (its losslessness is the conf0.7 case above; greedy in test_pipeline)."""

    def proposed_per_step(threshold):
        pipe = graphspec.Pipeline(_target(), draft=_draft(), num_speculative_tokens=4,
                                  draft_confidence_threshold=threshold, draft_siblings=0)  # a chain's length
        runs = [pipe.run(PROMPT, max_new_tokens=12, temperature=1.0, seed=seed, ignore_eos=True).stats
                for seed in range(100)]
        return sum(r.proposed for r in runs) / sum(r.steps for r in runs)

    full, short = proposed_per_step(None), proposed_per_step(0.7)
    assert full > 3.0 and short < 0.8 * full, (full, short)


# --------------------------------------------------------------------------------- the pitfalls


def _softmax(x):
    # by hand: torch.softmax goes multi-threaded even on tiny rows, which costs milliseconds on a busy CPU
    e = (x.float() - x.float().amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


class ArgmaxDrafter(ModelDrafter):
    """Pitfall: drafts by argmax but hands the softmax q to the ratio."""

    def draw(self, logits, params, generator):
        q = warp_logits(logits, params.temperature, params.top_k, params.top_p)
        return q.argmax(dim=-1), q


class Bf16Drafter(ModelDrafter):
    """Pitfall: samples from a distribution computed in bf16, but the ratio uses the fp32 q."""

    def draw(self, logits, params, generator):
        q32 = warp_logits(logits, params.temperature, params.top_k, params.top_p)
        q16 = warp_logits(logits.bfloat16(), params.temperature, params.top_k, params.top_p)
        return sample(q16, exponential_noise(q16.shape, generator, q16.device)), q32


class NoTemperatureDrafter(ModelDrafter):
    """Pitfall: samples from the raw softmax (ignores temperature / top-k) but reports the warped q."""

    def draw(self, logits, params, generator):
        raw = _softmax(logits)
        q = warp_logits(logits, params.temperature, params.top_k, params.top_p)
        return sample(raw, exponential_noise(raw.shape, generator, raw.device)), q


class UnwarpedTarget(RejectionSampling):
    """Pitfall: the target's p in the ratio is the raw softmax, without temperature / top-k / top-p."""

    def target_probs(self, logits, params):
        return _softmax(logits)


class EqualityWithTargetSample(Stage):
    """Verifying by equality with a target sample: keep drafts while d_i == s_i ~ p_i, then emit s_m.

    Listed as a pitfall in the issue; it is in fact lossless (every emitted token is a fresh
    sample of the target given the committed prefix), but it accepts far less often than
    rejection sampling (sum_x p(x) q(x) instead of sum_x min(p(x), q(x))).
    """

    reads = ("draft_ids", "target_logits", "params", "generator")
    writes = ("emitted",)

    def __init__(self):
        super().__init__("accept")

    def run(self, state):
        p = RejectionSampling().target_probs(state.target_logits, state.params)[0]  # [k+1, V]
        s = sample(p, exponential_noise(p.shape, state.generator, p.device)).view(1, -1)
        k = state.draft_ids.shape[1]
        m = (state.draft_ids == s[:, :k]).long().cumprod(1).sum(1, keepdim=True)
        state.emitted = torch.where(torch.arange(k + 1) <= m, s, torch.full_like(s, -1))


@pytest.mark.parametrize("broken, params, offset", [
    (ArgmaxDrafter, T1, 0.0),
    (Bf16Drafter, T1, 300.0),   # large logits (a constant offset): bf16 rounding visibly shifts q
    (NoTemperatureDrafter, T07K, 0.0),
    (UnwarpedTarget, T07K, 0.0),
], ids=["argmax-draft", "bf16-draft", "draft-ignores-temperature", "target-not-warped"])
def test_each_pitfall_is_detected_and_the_real_stage_passes(broken, params, offset):
    target, draft = _target(), _draft(offset)
    # chains: the broken stages are chain stages (a drafter without draft_parents, a chain rule)
    real = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, draft_siblings=0)
    bad = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, draft_siblings=0)
    if issubclass(broken, ModelDrafter):
        bad.replace_stage("draft", broken(draft))
    else:
        bad.replace_stage("accept", broken())
    bad_p, _ = _pvalues(bad, params)
    assert min(bad_p) < 1e-6, f"{broken.__name__} was not detected: p-values {bad_p}"
    if offset == 0.0:
        return  # the real stage ran on these exact models and parameters in the test above
    real_p, _ = _pvalues(real, params)
    assert min(real_p) > 1e-3, real_p


def test_equality_with_a_target_sample_is_lossless_but_accepts_less():
    target, draft = _target(), _draft()
    eq = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, draft_siblings=0).replace_stage(
        "accept", EqualityWithTargetSample())  # a chain rule, against chain rejection sampling
    eq_p, eq_rate = _pvalues(eq, T1)
    assert min(eq_p) > 1e-3, eq_p
    _, rs_rate = _sample_runs(graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, draft_siblings=0),
                              T1, n=400)
    assert eq_rate < 0.75 * rs_rate, (eq_rate, rs_rate)


def test_a_draft_identical_to_the_target_is_always_accepted_when_sampling():
    target = _target()
    pipe = graphspec.Pipeline(target, draft=ToyLM(table=target.table.clone()), num_speculative_tokens=4,
                              draft_confidence_threshold=None)
    for params in (T1, T07K):
        r = pipe.run(PROMPT, max_new_tokens=20, temperature=params.temperature, top_k=params.top_k, seed=3,
                     ignore_eos=True)
        assert r.stats.acceptance_rate == 1.0 and r.stats.mean_accepted_length == 5.0


def test_same_seed_same_output_different_seeds_differ():
    pipe = graphspec.Pipeline(_target(), draft=_draft(), num_speculative_tokens=3)
    runs = [pipe.run(PROMPT, max_new_tokens=24, temperature=1.0, seed=s).token_ids for s in (11, 11, 12, 13)]
    assert runs[0] == runs[1]
    assert runs[2] != runs[0] and runs[3] != runs[0]
    ar = graphspec.Pipeline(_target())
    assert ar.run(PROMPT, max_new_tokens=24, temperature=1.0, seed=5).token_ids == \
        ar.run(PROMPT, max_new_tokens=24, temperature=1.0, seed=5).token_ids
