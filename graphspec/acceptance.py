"""Acceptance rules: which draft tokens the target keeps, and the one token it adds.

Glossary (one step, drafts ``d_1 .. d_k``, target rows ``p_0 .. p_k`` from one verify forward):

- accepted tokens: the longest prefix of the drafts the rule keeps (``m`` of them, ``0 <= m <= k``).
- recovered token: when draft ``d_{m+1}`` is rejected, the token the target emits in its place.
  Greedy: the target's argmax. Sampling: a draw from the residual ``norm(max(0, p_m - q_m))``,
  the correction that makes the emitted token distributed exactly as ``p_m``.
- bonus token: when all k drafts are accepted, the token drawn from ``p_k`` (the verify forward
  computed that row anyway), so a step always emits ``m + 1`` tokens.

Both rules read ``draft_ids``, ``target_logits`` and ``params`` and write ``emitted [1, k + 1]``:
the accepted drafts, then the recovered/bonus token, then -1. No host sync happens here; the
pipeline reads ``emitted`` once per step.

- ``GreedyAcceptance``: exact match against the target's argmax. Only valid at temperature 0.
- ``RejectionSampling``: Leviathan et al. 2023 / Chen et al. 2023 through
  ``graphspec.kernels.rejection.rejection_sample``. p and q are the *warped* distributions
  (temperature, top-k, top-p applied to both, fp32): the target's through ``warp_logits`` here, the
  draft's by the drafter that sampled from it. ``draft_probs=None`` means one-hot q (n-gram
  drafts). At temperature 0 every distribution is one-hot and the rule reduces to exact match,
  so it takes the cheaper greedy path; that makes it the default rule for every temperature.
"""

from __future__ import annotations

import torch

from graphspec.graph import Stage
from graphspec.kernels.rejection import rejection_sample
from graphspec.kernels.sampling import exponential_noise, sample, warp_logits

__all__ = ["GreedyAcceptance", "RejectionSampling", "greedy_accept"]


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """``emitted [B, k+1]``: drafts while they equal the target's argmax, then the target's own token, then -1."""
    best = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_ids.shape[1]
    if k == 0:  # plain decoding: nothing to compare
        return best
    m = (draft_ids == best[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)  # [B, 1]
    pos = torch.arange(k + 1, device=best.device)
    # where the drafts match, best already equals them, so keeping best[:, :m+1] is "drafts + target token"
    return torch.where(pos <= m, best, torch.full_like(best, -1))


class GreedyAcceptance(Stage):
    """Keep drafts while they equal the target's argmax (temperature 0 only)."""

    reads = ("draft_ids", "target_logits", "params")
    writes = ("emitted",)

    def __init__(self, name: str = "accept"):
        super().__init__(name)

    def check(self, params) -> None:
        if not params.greedy:
            raise ValueError(f"temperature={params.temperature}: GreedyAcceptance compares with the target's argmax, "
                             f"which is not lossless when sampling; use RejectionSampling (the default) "
                             f"or temperature=0")

    def run(self, state) -> None:
        state.emitted = greedy_accept(state.draft_ids, state.target_logits)


class RejectionSampling(Stage):
    """Lossless speculative sampling; exact match at temperature 0."""

    reads = ("draft_ids", "draft_probs", "target_logits", "params", "generator")
    writes = ("emitted",)

    def __init__(self, name: str = "accept"):
        super().__init__(name)

    def target_probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        """``p [B, k+1, V]`` fp32: the target logits warped with the run's sampling parameters."""
        B, R, V = logits.shape
        return warp_logits(logits.reshape(B * R, V), params.temperature, params.top_k, params.top_p).view(B, R, V)

    def run(self, state) -> None:
        params = state.params
        draft_ids = state.draft_ids
        logits = state.target_logits
        if params.greedy:
            state.emitted = greedy_accept(draft_ids, logits)
            return
        p = self.target_probs(logits, params)
        B, R, V = p.shape
        gen = state.generator
        if R == 1:  # nothing to verify: a plain sample from p_0
            state.emitted = sample(p[:, 0], exponential_noise((B, V), gen, p.device)).view(B, 1)
            return
        q = state.draft_probs
        if q is not None and q.dtype != torch.float32:
            raise ValueError(f"draft_probs has dtype {q.dtype}; the acceptance ratio needs the fp32 distribution "
                             f"the draft tokens were sampled from")
        uniform = torch.rand((B, R - 1), generator=gen, device=p.device, dtype=torch.float32)
        noise = exponential_noise((B, V), gen, p.device)
        state.emitted, _ = rejection_sample(draft_ids, q, p, uniform, noise)
