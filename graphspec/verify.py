"""The verify stage: one target forward over [pending token, draft tokens].

- The target's KV cache always holds every committed token but the last ("pending"). ``begin``
  allocates it and prefills ``prompt[:-1]`` with no logits at all (a one-token prompt has no
  prefill); a step first rolls the cache back to ``len(tokens) - 1`` (dropping the entries of
  drafts the last step rejected), then feeds ``[pending, d_1 .. d_k]`` and keeps all ``k + 1``
  logits rows: row i is the target's distribution for the token after ``d_i`` (row 0: after
  the pending token), row k gives the bonus token.
- With no drafts (autoregressive decoding, or a drafter that found nothing) this is a plain
  one-token decode step, so baselines run the very same code.
"""

from __future__ import annotations

import torch

from graphspec.drafters import start_cache
from graphspec.graph import Stage

__all__ = ["Verify"]


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

    def run(self, state) -> None:
        cache = state.scratch(self)["cache"]
        n = len(state.tokens)
        cache.truncate(n - 1)
        draft = state.draft_ids
        pending = state.token_buffer[n - 1:n].view(1, 1)
        ids = torch.cat([pending, draft], dim=1) if draft.shape[1] else pending
        state.target_logits = self.model.step(ids, cache, logits_for="all")  # [1, k+1, V] fp32
        state.run.target_forwards += 1
