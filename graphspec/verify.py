"""The verify stage: one target forward over [pending token, draft tokens].

- The target's KV cache always holds every committed token but the last ("pending"). ``begin``
  allocates it and prefills ``prompt[:-1]`` with no logits at all (a one-token prompt has no
  prefill); a step first rolls the cache back to ``len(tokens) - 1`` (dropping the entries of
  drafts the last step rejected), then feeds ``[pending, d_1 .. d_k]`` and keeps all ``k + 1``
  logits rows: row i is the target's distribution for the token after ``d_i`` (row 0: after
  the pending token), row k gives the bonus token.
- With no drafts (autoregressive decoding, or a drafter that found nothing) this is a plain
  one-token decode step, so baselines run the very same code.
- ``TreeVerify`` checks a draft tree (a chain plus sibling leaves) in the same single forward, each
  row attending to its own ancestors only, and keeps the accepted branch in the cache.
"""

from __future__ import annotations

import torch

from graphspec.drafters import start_cache, store_rows, storing_rows
from graphspec.graph import Stage
from graphspec.kernels.attention import ancestor_mask
from graphspec.state import tree_children, tree_depths

__all__ = ["Verify", "TreeVerify"]


class Verify(Stage):
    reads = ("tokens", "token_buffer", "draft_ids")
    writes = ("target_logits",)

    def __init__(self, model, name: str = "verify"):
        super().__init__(name)
        self.model = model

    def begin(self, state) -> None:
        cache, forwards = start_cache(self.model, state)
        state.run.target_forwards += forwards
        state.scratch(self)["cache"] = cache

    def end(self, state) -> None:
        """After a generation: the committed tokens' rows go to the run's prefix cache, if it has one."""
        if not storing_rows(state):
            return
        scratch = state.scratch(self)
        cache = scratch.get("cache")
        if cache is None:
            return
        self._settle(state, scratch, cache)
        store_rows(self.model, cache, state, min(cache.length, len(state.tokens) - 1))

    def _settle(self, state, scratch: dict, cache) -> None:
        """Leave the cache holding committed tokens only (a chain's rejected rows lie past them already)."""

    def run(self, state) -> None:
        cache = state.scratch(self)["cache"]
        n = len(state.tokens)
        cache.truncate(n - 1)
        draft = state.draft_ids
        pending = state.token_buffer[n - 1:n].view(1, 1)
        ids = torch.cat([pending, draft], dim=1) if draft.shape[1] else pending
        state.target_logits = self.model.step(ids, cache, logits_for="all")  # [1, k+1, V] fp32
        state.run.target_forwards += 1


class TreeVerify(Verify):
    """Verify a draft tree in one forward: ``[pending, d_1 .. d_k]`` where ``d_j`` hangs under row ``draft_parents[j]``.

    ``draft_parents`` (a tuple of k ints) names each draft's parent row: 0 is the pending token, j + 1 is
    ``d_j``; a parent comes before its children. Each row attends to the cache, its ancestors and itself
    (``ancestor_mask``) at position ``len(tokens) - 1 + depth``, so row i's logits are exactly the
    target's for the path to it. Every branch lands in the cache; at the next step, before verifying
    again, the branch the acceptance took (read back from the committed tokens, which is unambiguous
    since siblings differ) is moved down with ``KVCache.keep`` and the rest dropped. A chain (each
    parent the previous row) runs the plain causal forward of ``Verify``.
    """

    reads = Verify.reads + ("draft_parents",)

    def _settle(self, state, scratch: dict, cache) -> None:
        """Keep the accepted branch of the last step's tree, if one is still in the cache."""
        tokens = state.tokens
        n = len(tokens)
        last = scratch.pop("tree", None)
        if last is not None:
            base, row_tokens, parents = last
            children = tree_children(parents)
            path, cur = [0], 0
            for t in tokens[base + 1:n - 1]:
                nxt = [r for r in children.get(cur, ()) if row_tokens[r] == t]
                if not nxt:
                    raise RuntimeError(f"committed token {t} is not a child of tree row {cur}: the accept stage "
                                       f"emitted a token the draft tree does not hold")
                cur = nxt[0]
                path.append(cur)
            cache.keep(base, [base + r for r in path])

    def run(self, state) -> None:
        scratch = state.scratch(self)
        cache = scratch["cache"]
        tokens = state.tokens
        n = len(tokens)
        self._settle(state, scratch, cache)
        cache.truncate(n - 1)
        draft = state.draft_ids
        k = draft.shape[1]
        parents = tuple(state.draft_parents)
        if len(parents) != k or any(not 0 <= p <= j for j, p in enumerate(parents)):
            raise ValueError(f"draft_parents={parents} must give each of the {k} drafts a parent row in "
                             f"[0, its own row): 0 is the pending token, j + 1 is draft j")
        pending = state.token_buffer[n - 1:n].view(1, 1)
        ids = torch.cat([pending, draft], dim=1) if k else pending
        if parents == tuple(range(k)):  # a chain: the plain causal forward
            state.target_logits = self.model.step(ids, cache, logits_for="all")
        else:
            depth = tree_depths(parents)
            positions = (n - 1 + torch.tensor(depth, dtype=torch.int64)).to(state.run.device).view(1, -1)
            tree = ancestor_mask([-1] + list(parents), device=state.run.device)
            state.target_logits = self.model.step(ids, cache, positions=positions, logits_for="all", tree=tree)
        state.run.target_forwards += 1
        scratch["tree"] = (n - 1, [tokens[-1]] + draft[0].tolist(), parents)
