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


CHUNKS = (7, 1, 2, 1, 3)  # a prefill, then one-token steps and multi-token catch-ups


def native_steps(model, native, ids, chunks=CHUNKS, **kw):
    """The logits of every chunk after the prefill (``chunked_steps``), with ``model.native_forward = native``
    for these steps (True again after them)."""
    model.native_forward = native
    try:
        return chunked_steps(model, ids, chunks, **kw)[0]
    finally:
        model.native_forward = True


def tree_levels(model, fast, prompt, levels):
    """A beam draft's forwards: the prompt, then each level's rows under ``tree [T, m]`` masks, as the beam
    passes them; returns each level's logits. ``levels``: lists of (token, parent node or -1) per level.
    ``fast``: the model's ``native_forward`` for these steps."""
    model.native_forward = fast
    try:
        cache = model.new_cache(64)
        model.step(prompt, cache, logits_for="last")
        base = cache.length
        slot, depth, out = [], [], []
        for level in levels:
            first = cache.length
            m = first - base + len(level)
            tree = torch.zeros(len(level), m, dtype=torch.bool)
            pos = []
            for r, (_, parent) in enumerate(level):
                tree[r, m - len(level) + r] = True
                d, a = 0, parent
                while a >= 0:
                    tree[r, slot[a] - base] = True
                    a, d = _parent(levels, a), d + 1
                pos.append(base + d)
            ids = torch.tensor([[t for t, _ in level]])
            out.append(model.step(ids, cache, positions=torch.tensor([pos]), tree=tree))
            slot += [first + r for r in range(len(level))]
        return out
    finally:
        model.native_forward = True


def _parent(levels, node):
    """The parent of flat node index ``node`` over all levels (-1: the root)."""
    flat = [p for level in levels for _, p in level]
    return flat[node]


# (token, parent) per level: nodes 0 1 | 2 3 4 | 5 6
TREE_LEVELS = [[(6, -1), (5, -1)], [(3, 0), (5, 1), (8, 0)], [(9, 2), (7, 4)]]
