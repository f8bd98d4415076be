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
- ``TreeAcceptance``: the same two rules along a draft tree (``draft_siblings``): the longest path of
  accepted nodes, siblings tried by recursive rejection sampling when sampling.
"""

from __future__ import annotations

import torch

from graphspec.graph import Stage
from graphspec.kernels.rejection import rejection_sample
from graphspec.kernels.sampling import exponential_noise, sample, warp_logits
from graphspec.state import tree_children

__all__ = ["GreedyAcceptance", "RejectionSampling", "TreeAcceptance", "greedy_accept"]


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


class TreeAcceptance(Stage):
    """Accept along a draft tree (``draft_parents``, see ``graphspec.verify.TreeVerify``); lossless at every temperature.

    From the pending row, the children of the current row are tried in row order (a chain token
    first, then its siblings, in the order the drafter drew them):

    - greedy: the child equal to the target's argmax is accepted and the walk goes on from it; when
      none is, the argmax is the recovered token (the bonus token at a leaf);
    - sampling: recursive rejection sampling (multi-draft speculative sampling without replacement,
      Jeon et al. 2024, "Recursive Speculative Decoding"). Child x, drawn from q, is accepted with
      probability ``min(1, p(x) / q(x))``; on a rejection the target's distribution becomes the
      residual ``p <- norm(max(0, p - q))`` and q drops x and renormalises (the next sibling was drawn
      from exactly that q). Each test is one speculative-sampling step for the current p, so the
      emitted token follows p whatever the drafter chose to branch; when every child is rejected
      the recovered token is drawn from the last residual.

    ``draft_probs[0, j]`` is the distribution child j's *parent context* gave the drafter (the same
    q for a chain token and its siblings); None means greedy (one-hot) drafts. Writes ``emitted
    [1, k + 1]``: the accepted path, then the recovered or bonus token, then -1.
    """

    reads = ("draft_ids", "draft_probs", "draft_parents", "target_logits", "params", "generator")
    writes = ("emitted",)

    def __init__(self, name: str = "accept"):
        super().__init__(name)

    def run(self, state) -> None:
        params = state.params
        logits = state.target_logits  # [1, k + 1, V]
        draft = state.draft_ids[0].tolist()
        parents = tuple(state.draft_parents)
        k = len(draft)
        # children[row]: the drafts hanging under that row, as draft indices (draft j is row j + 1)
        children = {row: [r - 1 for r in rows] for row, rows in tree_children(parents).items()}
        out: list[int] = []
        cur = 0
        extra = state.run.extra.setdefault("tree", {"siblings_proposed": 0, "siblings_accepted": 0})
        extra["siblings_proposed"] += sum(1 for j, p in enumerate(parents) if p != j)
        if params.greedy:
            best = logits[0].argmax(dim=-1).tolist()
            while True:
                hit = [j for j in children.get(cur, ()) if draft[j] == best[cur]]
                out.append(best[cur])
                if not hit:
                    break
                extra["siblings_accepted"] += int(parents[hit[0]] != hit[0])
                cur = hit[0] + 1
        else:
            p_rows = warp_logits(logits[0], params.temperature, params.top_k, params.top_p)  # [k + 1, V]
            q_all = state.draft_probs
            if k and (q_all is None or q_all.dtype != torch.float32):
                raise ValueError("a sampled draft tree needs draft_probs: the fp32 distributions its tokens were "
                                 "drawn from")
            gen = state.generator
            while True:
                p = p_rows[cur]
                taken = None
                kids = children.get(cur, ())
                q = q_all[0, kids[0]].clone() if kids else None
                for j in kids:
                    x = draft[j]
                    u = float(torch.rand((), generator=gen, device=p.device))
                    px, qx = float(p[x]), float(q[x])
                    if qx > 0 and u * qx < px:  # u < p(x) / q(x)
                        taken = j
                        break
                    residual = torch.clamp(p - q, min=0.0)
                    mass = float(residual.sum())
                    p = residual / mass if mass > 0 else p  # mass 0 only if p == q, where x was always kept
                    q[x] = 0.0
                    total = float(q.sum())
                    if total <= 0:
                        break
                    q = q / total
                if taken is None:
                    noise = exponential_noise((1, p.shape[-1]), gen, p.device)
                    out.append(int(sample(p.view(1, -1), noise)[0]))
                    break
                out.append(draft[taken])
                extra["siblings_accepted"] += int(parents[taken] != taken)
                cur = taken + 1
        row = out + [-1] * (k + 1 - len(out))
        state.emitted = torch.tensor([row], dtype=torch.int64, device=logits.device)
