"""Feeding a model its ids in chunks, as a draft does: a prefill, then one-token steps and catch-ups."""

import torch


def chunked_steps(model, ids, chunks, positions=None, head=None, logits_for="all"):
    """``model.step`` over ``ids [B, sum(chunks)]`` chunk by chunk in one new cache; returns the logits of
    every chunk after the first (the prefill, which asks for its last row only), concatenated on the row
    axis, and the cache."""
    cache = model.new_cache(64, batch_size=ids.shape[0])
    out, j = [], 0
    for n in chunks:
        pos = None if positions is None else positions[:, j:j + n]
        logits = model.step(ids[:, j:j + n], cache, positions=pos, head=head,
                            logits_for="last" if j == 0 else logits_for)
        out += [logits] if j else []
        j += n
    assert cache.length == j == ids.shape[1]
    return torch.cat(out, dim=1), cache
