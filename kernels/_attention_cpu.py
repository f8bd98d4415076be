"""The CPU verify path of ``graphspec.kernels.attention`` as one TorchScript function.

A speculative verify's query row must come out bit-identical to the one-token step at its position,
or bf16 greedy speculative output drifts from autoregressive. Torch's CPU SDPA rounds a row
differently depending on how many query rows share its call, so each row of a verify block runs as
its own one-row call, the call a one-token step makes (``attention_ref``): fp32 q, k, v, the row's
query heads grouped per kv head, over exactly the keys it sees, laid out as that step's cache has
them. A chain row (it sees the new keys 0..j) reads a slice of the cache; any other tree row first
has its path's keys written into the slots after the cache of a working fp32 copy.

Why TorchScript: from Python a row took about a dozen torch calls (slices, reshapes, casts, the SDPA),
and their per-call cost was larger than the arithmetic. Here a row is its slices and its SDPA, run
by TorchScript's interpreter: the same kernels on the same values, so the same bits (tested against
one-token calls, ``tests/kernels/test_attention.py``), with the interpreter's per-call cost in place of
Python's (the timings are in perf/RESULTS.md).

A batched recipe was tried first and not kept: every row split at a multiple of 16 keys into two flash
calls batched over rows and merged by log-sum-exp, the same recipe for one-token steps. It was exact
(it passed the same bitwise tests) and made verify trees cheaper, but it made the one-token step slower,
and a one-token step is every token of autoregressive decoding.

The row plan (which slots each row rewrites) depends only on the tree, so it is made once per forward
and shared by the layers. No ``__future__`` annotations in this file: TorchScript reads them as written.
"""

import functools
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lengths: List[int],
          writes: List[List[int]], rewrites: bool, aliased: bool) -> torch.Tensor:
    """Row j of ``q [B, T, Hq, D]`` over its ``base + lengths[j]`` keys of ``k, v [B, L, Hk, D]``.

    ``writes[j]``: pairs (slot offset i, new node n) to write before row j, so that slots
    ``base .. base + lengths[j] - 1`` hold row j's path; ``rewrites``: whether any row writes;
    ``aliased``: k and v are fp32 already (so the working copy must be a copy, never the cache).
    """
    b, t, hq, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    hk = k.shape[2]
    base = k.shape[1] - t
    qf = q.float().reshape(b, t, hk, hq // hk, d).permute(0, 2, 1, 3, 4)  # [B, Hk, T, G, D]
    kt = k.float().transpose(1, 2)  # [B, Hk, L, D]
    vt = v.float().transpose(1, 2)
    new_k, new_v = kt, vt
    if rewrites:
        new_k = kt[:, :, base:].clone()  # the new block, before any write
        new_v = vt[:, :, base:].clone()
        if aliased:
            kt, vt = kt.clone(), vt.clone()
    outs: List[torch.Tensor] = []
    for j in range(t):
        pairs = writes[j]
        for w in range(0, len(pairs), 2):
            kt[:, :, base + pairs[w]] = new_k[:, :, pairs[w + 1]]
            vt[:, :, base + pairs[w]] = new_v[:, :, pairs[w + 1]]
        n = base + lengths[j]
        outs.append(F.scaled_dot_product_attention(qf[:, :, j], kt[:, :, :n], vt[:, :, :n], scale=scale))
    return torch.stack(outs, 1).reshape(b, t, hq, d).to(q.dtype)  # [B, Hk, G, D] each -> [B, T, Hq, D]


class RowPlan:
    """Per row: how many new keys it sees, and the slot writes that lay its path out after the cache.

    Rows go in order; slot i after the cache holds new node i until a row needs another node there,
    and a later row needing node i back (a chain row after a branched one) writes it back.
    """

    def __init__(self, paths: List[List[int]]):
        self.lengths = [len(path) for path in paths]
        self.nodes = [node for path in paths for node in path]  # the paths end to end (the C++ kernel's input)
        held = list(range(len(paths)))
        self.writes: List[List[int]] = []
        for path in paths:
            pairs: List[int] = []
            for i, node in enumerate(path):
                if held[i] != node:
                    pairs += [i, node]
                    held[i] = node
            self.writes.append(pairs)
        self.rewrites = any(self.writes)


def plan(tree: Optional[torch.Tensor], T: int) -> RowPlan:
    """The ``RowPlan`` of T rows: a chain (``tree`` None) or the checked CPU ``tree [T, T]``; cached, since
    every layer of a forward asks for the same one."""
    return _plan(T, None if tree is None else tree.numpy().tobytes())


@functools.lru_cache(maxsize=32)
def _plan(T: int, tree: Optional[bytes]) -> RowPlan:
    if tree is None:
        return RowPlan([list(range(j + 1)) for j in range(T)])
    return RowPlan([[j for j in range(T) if tree[i * T + j]] for i in range(T)])  # bool bytes: 0 or 1


@functools.cache
def scripted_rows():
    """:func:`_rows` compiled by TorchScript (once per process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.script; torch is pinned
        return torch.jit.script(_rows)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           tree: Optional[torch.Tensor]) -> torch.Tensor:
    """Row-exact attention of checked CPU inputs ``q [B, T, Hq, D]``, ``k, v [B, L, Hk, D]``, ``tree [T, T]``."""
    p = plan(tree, q.shape[1])
    return scripted_rows()(q, k, v, scale, p.lengths, p.writes, p.rewrites, k.dtype == torch.float32)
