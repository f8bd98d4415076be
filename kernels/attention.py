"""Causal attention of T new queries against L cached keys (prefill, decode and verify in one op).

- Layout: ``q[B, T, Hq, D]``, ``k, v[B, L, Hk, D]`` (usually strided views ``cache[:, :L]`` of a
  preallocated ``[B, S_max, Hk, D]`` cache, so every stride is honoured, nothing is copied).
- Positions: the T queries are the *last* T of the L keys, query i sits at key position
  ``L - T + i`` and sees keys ``0 .. L - T + i``. Prefill is ``T == L``; decode is ``T == 1``;
  speculative verify is a small T > 1 (causal inside the new block).
- GQA: query head h reads key/value head ``h // (Hq // Hk)``.
- Triton, two kernels chosen by the launcher:
  * many queries (prefill): flash attention, one program per (query tile, batch, query head),
    online softmax in base 2 (log2(e) folded into the scale), causal tiles skipped;
  * few queries (decode / verify): flash-decoding, one program per (batch, kv head, KV split)
    handling all ``T * Hq/Hk`` query rows of the group so each K/V tile is read once per group;
    each split writes a partial (max, sum, acc) and a combine kernel merges the splits, so a
    long cache keeps every SM busy even at batch 1.
  Head dims that are not powers of two (80, 96) are padded to the next power of two with masks.
- Torch path (``attention_ref``, also the CPU fast path): fp32 math through
  ``scaled_dot_product_attention`` with an explicit boolean causal mask at offset ``L - T``;
  GQA by folding the query heads of a group into the query axis, so k/v are never repeated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, use_triton

__all__ = ["attention", "attention_ref"]


# ----------------------------------------------------------------------------- validation

def _validate(q, k, v, scale):
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype} "
                         f"(cast the cache or the queries to the model dtype)")
    B, T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match [B, L, Hk, D]")
    Bk, L, Hk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k has batch size {Bk} but q has {B}")
    if Dk != D:
        raise ValueError(f"k has head_dim {Dk} but q has head_dim {D}; they must match")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"q has {Hq} heads, which is not a multiple of the {Hk} key/value heads of k "
                         f"(grouped-query attention needs Hq % Hk == 0)")
    if T > L:
        raise ValueError(f"q has T={T} queries but k holds only L={L} keys; the queries must be the last T "
                         f"of the L cached positions (append them to the cache first)")
    if scale is None:
        scale = D ** -0.5
    else:
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite float, got {scale}")
    return scale


# ----------------------------------------------------------------------------- torch reference

def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Plain fp32 attention: the oracle for the Triton kernels and the CPU path of the model."""
    scale = _validate(q, k, v, scale)
    B, T, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    if T == 0 or B == 0:
        return q.new_empty(q.shape)
    # Fold the G query heads of a group into the query axis: [B, Hk, G*T, D] (row g*T + t).
    qf = q.float().reshape(B, T, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * T, D)
    kf = k.float().transpose(1, 2)  # [B, Hk, L, D]
    vf = v.float().transpose(1, 2)
    mask = None
    if T > 1:
        qpos = torch.arange(L - T, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]  # [T, L]
        mask = mask.repeat(G, 1)  # [G*T, L]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)  # [B, Hk, G*T, D]
    out = out.reshape(B, Hk, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------- public op

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the last T positions (``q[B, T, Hq, D]``) over ``k, v[B, L, Hk, D]``.

    Returns ``[B, T, Hq, D]`` in q's dtype. ``scale`` defaults to ``D ** -0.5``.
    """
    if use_triton(q):
        return _attention_triton(q, k, v, scale)
    return attention_ref(q, k, v, scale)


def _attention_triton(q, k, v, scale, mode: str | None = None, num_splits: int | None = None):
    raise NotImplementedError("the Triton attention kernels are being written; use backend='torch'")
