"""Acceptance rules on hand-made logits (no model): greedy match, and the rejection-sampling stage."""

import pytest
import torch

from graphspec import GreedyAcceptance, RejectionSampling, SamplingParams
from graphspec.acceptance import greedy_accept
from graphspec.state import RunInfo, State

pytestmark = pytest.mark.usefixtures("single_thread")


def _logits_with_argmax(best, V=8):
    """[1, len(best), V] logits whose row i has its maximum at best[i]."""
    x = torch.randn(1, len(best), V)
    x[0, torch.arange(len(best)), torch.tensor(best)] = 10.0
    return x


@pytest.mark.parametrize("draft, best, expected", [
    ([3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6]),      # all accepted + bonus
    ([3, 4, 5], [3, 1, 5, 6], [3, 1, -1, -1]),    # first mismatch replaced by the target's token
    ([3, 4, 5], [0, 4, 5, 6], [0, -1, -1, -1]),   # nothing accepted
    ([], [7], [7]),                                # no draft: plain decode
])
def test_greedy_accept(draft, best, expected):
    ids = torch.tensor([draft], dtype=torch.int64).view(1, len(draft))
    assert greedy_accept(ids, _logits_with_argmax(best)).tolist() == [expected]


def _state(**fields):
    s = State(RunInfo(target=None, vocab_size=8, device=torch.device("cpu"), capacity=1, prompt_len=1,
                      num_speculative_tokens=3))
    s.generator = torch.Generator().manual_seed(0)
    for k, v in fields.items():
        setattr(s, k, v)
    return s


def test_rejection_sampling_at_temperature_zero_is_greedy_match():
    ids = torch.tensor([[3, 4, 5]])
    logits = _logits_with_argmax([3, 1, 5, 6])
    for rule in (RejectionSampling(), GreedyAcceptance()):
        s = _state(draft_ids=ids, draft_probs=None, target_logits=logits, params=SamplingParams())
        rule.run(s)
        assert s.emitted.tolist() == [[3, 1, -1, -1]]


def test_rejection_sampling_emits_a_valid_prefix_and_accepts_identical_distributions():
    V = 8
    logits = torch.randn(1, 4, V) * 2
    params = SamplingParams(temperature=0.8, top_k=5)
    rule = RejectionSampling()
    q = rule.target_probs(logits, params)[:, :3]
    ids = torch.multinomial(q[0], 1).view(1, 3)
    s = _state(draft_ids=ids, draft_probs=q.clone(), target_logits=logits, params=params)
    rule.run(s)
    out = s.emitted[0].tolist()
    # q == p: every draft is accepted (u * q < p for u < 1), then a bonus token from p_3's top-5
    assert out[:3] == ids[0].tolist()
    assert logits[0, 3].topk(5).indices.tolist().count(out[3]) == 1


def test_rejection_sampling_without_drafts_samples_the_warped_target():
    V = 8
    logits = torch.randn(1, 1, V)
    params = SamplingParams(temperature=0.5, top_k=2)
    allowed = set(logits[0, 0].topk(2).indices.tolist())
    seen = set()
    for seed in range(40):
        s = _state(draft_ids=torch.empty(1, 0, dtype=torch.int64), draft_probs=None, target_logits=logits,
                   params=params)
        s.generator = torch.Generator().manual_seed(seed)
        RejectionSampling().run(s)
        assert s.emitted.shape == (1, 1)
        seen.add(s.emitted.item())
    assert seen == allowed


def test_rejection_sampling_refuses_low_precision_draft_probs():
    logits = torch.randn(1, 3, 8)
    q = torch.softmax(torch.randn(1, 2, 8), -1).bfloat16()
    s = _state(draft_ids=torch.tensor([[1, 2]]), draft_probs=q, target_logits=logits,
               params=SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="draft_probs has dtype torch.bfloat16"):
        RejectionSampling().run(s)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=-3), "seed"),
])
def test_sampling_params_name_the_bad_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
