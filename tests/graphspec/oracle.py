"""Exact output distributions by enumeration, and the chi-square test against them.

``exact_marginals(model, prompt, params)`` gives the target's exact distribution of each of the
first three generated tokens: it enumerates every prefix of one and two generated tokens (V and V^2
rows, one batched forward without a cache) and chains the warped next-token distributions. That
is the ground truth a lossless speculative sampler must reproduce.

``chi2_pvalue(samples, probs)`` pools categories whose expected count is below 5 (the usual
validity condition of the chi-square approximation) into one bin.

``sample_first_three(pipe, prompt, params, n)`` runs a pipeline with seeds 0..n-1 and returns the
first three tokens of every run and the acceptance rate; ``marginal_pvalues`` compares them with
``exact_marginals``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from graphspec.kernels.sampling import warp_logits


def _warped_last(model, seqs: torch.Tensor, params) -> torch.Tensor:
    with torch.no_grad():
        logits = model(seqs)[:, -1].float()
    return warp_logits(logits, params.temperature, params.top_k, params.top_p).double()


def exact_marginals(model, prompt: list[int], params) -> list[torch.Tensor]:
    """[P(x1), P(x2), P(x3)], each [V] float64, for the target alone with ``params``."""
    V = model.config.vocab_size
    base = torch.tensor(prompt, dtype=torch.int64)
    p1 = _warped_last(model, base.view(1, -1), params)[0]  # [V]
    one = torch.arange(V).view(V, 1)
    seq1 = torch.cat([base.expand(V, -1), one], dim=1)
    p2_given = _warped_last(model, seq1, params)  # [V(x1), V(x2)]
    x1 = one.repeat_interleave(V, 0)
    x2 = torch.arange(V).repeat(V).view(-1, 1)
    seq2 = torch.cat([base.expand(V * V, -1), x1, x2], dim=1)
    p3_given = _warped_last(model, seq2, params).view(V, V, V)  # [x1, x2, x3]
    joint12 = p1[:, None] * p2_given  # [x1, x2]
    m2 = joint12.sum(0)
    m3 = (joint12[:, :, None] * p3_given).sum((0, 1))
    return [p1, m2, m3]


def chi2_pvalue(samples, probs: torch.Tensor) -> float:
    """p-value of ``samples`` (ids) coming from ``probs`` [V]; a sample of a zero-probability id gives 0."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    n = len(samples)
    observed = np.bincount(np.asarray(samples, dtype=np.int64), minlength=len(probs)).astype(np.float64)
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = list(observed[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def sample_first_three(pipe, prompt: list[int], params, n: int) -> tuple[np.ndarray, float]:
    """The first 3 generated tokens of ``n`` seeded runs (seeds 0..n-1, deterministic) and the acceptance rate."""
    out = np.empty((n, 3), dtype=np.int64)
    accepted = proposed = 0
    for seed in range(n):
        r = pipe.run(prompt, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                     top_p=params.top_p, seed=seed, ignore_eos=True)
        out[seed] = r.token_ids
        accepted += r.stats.accepted
        proposed += r.stats.proposed
    return out, accepted / max(proposed, 1)


def marginal_pvalues(pipe, prompt: list[int], params, n: int) -> tuple[list[float], float]:
    """Chi-square p-value of each of the first 3 tokens against the target's exact marginal, and the acceptance."""
    exact = exact_marginals(pipe.target, prompt, params)
    samples, rate = sample_first_three(pipe, prompt, params, n)
    return [chi2_pvalue(samples[:, i], exact[i]) for i in range(3)], rate
