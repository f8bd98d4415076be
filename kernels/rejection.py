"""Speculative-decoding acceptance: the lossless rejection sampler (Leviathan et al. 2023, Chen et al. 2023).

Glossary (per sequence, K draft tokens ``x_0 .. x_{K-1}``, draft distributions ``q_i``, target
distributions ``p_0 .. p_K`` from one verify pass):

- accepted tokens: the longest prefix ``x_0 .. x_{n-1}`` with ``uniform_i < min(1, p_i(x_i) / q_i(x_i))``
  for every i < n; ``n = num_accepted``. (Evaluated as ``uniform_i * q_i(x_i) < p_i(x_i)``: the same
  test for q > 0 without a division, so both backends decide it bit for bit alike.)
- recovered token: at the first rejection j = n < K, the token drawn from the residual
  ``norm(max(0, p_j - q_j))``; it replaces the rejected draft token. This correction is what makes the
  emitted token distributed exactly as ``p_j``.
- bonus token: when all K drafts are accepted (n == K), the extra token drawn from ``p_K``, which the
  verify pass computed anyway.

Exactly one recovered-or-bonus token is emitted per sequence, so each row uses one noise row:
the draw is the exponential race ``argmax(r / noise)`` (``noise ~ Exp(1)``), which samples from
``r / sum(r)`` without normalising and without a host sync. ``tokens[b, :n+1]`` are
``x_0 .. x_{n-1}`` then the recovered/bonus token; the rest of the row is -1.

``draft_probs=None`` means every q_i is one-hot at x_i (n-gram / prompt-lookup drafts): accept with
probability ``p_i(x_i)``, and the residual is p_j with x_j removed.

If a residual is all zero although a draft was rejected (possible only through rounding when
p_j and q_j nearly coincide), the recovered token is drawn from p_j instead.

Triton: one program per sequence; a scalar loop finds n, then one pass over vocabulary tiles runs
the race; a constexpr flag switches draft probabilities off (nothing is specialised on K or V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphspec.kernels._dispatch import check_tensor, use_triton

__all__ = ["rejection_sample", "rejection_sample_ref"]


# ----------------------------------------------------------------------------- validation

def _validate(draft_ids, draft_probs, target_probs, uniform, noise):
    check_tensor("target_probs", target_probs, ndim=3, dtypes=(torch.float32,))
    dev = target_probs.device
    check_tensor("draft_ids", draft_ids, ndim=2, dtypes=(torch.int64,), device=dev)
    B, K = draft_ids.shape
    Bt, K1, V = target_probs.shape
    if Bt != B or K1 != K + 1:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)} but draft_ids has {tuple(draft_ids.shape)}; "
                         f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V] (one row per draft token plus the bonus row)")
    if K < 1:
        raise ValueError("draft_ids must hold at least one draft token per sequence (K >= 1)")
    if V == 0:
        raise ValueError("target_probs has an empty vocabulary axis")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=3, dtypes=(torch.float32,), device=dev)
        if tuple(draft_probs.shape) != (B, K, V):
            raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}; expected [B, K, V] = [{B}, {K}, {V}] "
                             f"(pass None for drafts without probabilities)")
    check_tensor("uniform", uniform, ndim=2, dtypes=(torch.float32,), device=dev)
    if tuple(uniform.shape) != (B, K):
        raise ValueError(f"uniform has shape {tuple(uniform.shape)}; expected [B, K] = [{B}, {K}]")
    check_tensor("noise", noise, ndim=2, dtypes=(torch.float32,), device=dev)
    if tuple(noise.shape) != (B, V):
        raise ValueError(f"noise has shape {tuple(noise.shape)}; expected [B, V] = [{B}, {V}] (one Exp(1) row per sequence)")
    return B, K, V


# ----------------------------------------------------------------------------- torch reference

def rejection_sample_ref(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                         uniform: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised reference (no loop over sequences or vocabulary)."""
    B, K, V = _validate(draft_ids, draft_probs, target_probs, uniform, noise)
    dev = target_probs.device
    if B == 0:
        return draft_ids.new_empty(0, K + 1), draft_ids.new_empty(0)
    if bool(((draft_ids < 0) | (draft_ids >= V)).any()):
        raise ValueError(f"draft_ids holds ids outside [0, {V}) of the target vocabulary; map them first")
    idx = draft_ids.unsqueeze(-1)
    p_x = target_probs[:, :K].gather(2, idx).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(2, idx).squeeze(-1) if draft_probs is not None else torch.ones_like(p_x)
    accept = uniform * q_x < p_x
    n = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix

    rows = torch.arange(B, device=dev)
    p_j = target_probs[rows, n]  # [B, V]; n == K picks the bonus row
    j = n.clamp(max=K - 1)
    if draft_probs is not None:
        q_j = draft_probs[rows, j]
    else:
        q_j = torch.zeros(B, V, dtype=torch.float32, device=dev)
        q_j.scatter_(1, draft_ids[rows, j].unsqueeze(1), 1.0)
    rejected = (n < K).unsqueeze(1)
    residual = torch.where(rejected, torch.clamp(p_j - q_j, min=0.0), p_j)
    # a rounding-only all-zero residual falls back to p_j (see the module docstring)
    empty = (residual.amax(dim=1, keepdim=True) <= 0)
    residual = torch.where(empty, p_j, residual)
    emitted = torch.argmax(residual / noise, dim=1)

    pos = torch.arange(K + 1, device=dev).unsqueeze(0)
    padded = torch.cat([draft_ids, draft_ids.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(pos < n.unsqueeze(1), padded, torch.full_like(padded, -1))
    tokens = torch.where(pos == n.unsqueeze(1), emitted.unsqueeze(1), tokens)
    return tokens, n


# ----------------------------------------------------------------------------- public op

def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniform: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of the K drafts and emit one recovered or bonus token per sequence.

    ``draft_ids[B, K]`` int64, ``draft_probs[B, K, V]`` fp32 or None (one-hot drafts),
    ``target_probs[B, K+1, V]`` fp32, ``uniform[B, K]`` fp32 in [0, 1), ``noise[B, V]`` fp32 Exp(1).
    Returns ``tokens[B, K+1]`` int64 (valid up to ``num_accepted + 1``, then -1) and ``num_accepted[B]`` int64.
    """
    if use_triton(target_probs):
        return _rejection_triton(draft_ids, draft_probs, target_probs, uniform, noise)
    return rejection_sample_ref(draft_ids, draft_probs, target_probs, uniform, noise)


# ----------------------------------------------------------------------------- Triton kernel

@triton.jit
def _rejection_kernel(
    draft_ids_ptr,  # [B, K] int64
    draft_probs_ptr,  # [B, K, V] fp32 (unused without HAS_DRAFT_PROBS)
    target_probs_ptr,  # [B, K+1, V] fp32
    uniform_ptr,  # [B, K] fp32
    noise_ptr,  # [B, V] fp32
    tokens_ptr,  # [B, K+1] int64 (out)
    num_accepted_ptr,  # [B] int64 (out)
    stride_ib, stride_ik,
    stride_db, stride_dk, stride_dv,
    stride_tb, stride_tk, stride_tv,
    stride_ub, stride_uk,
    stride_nb, stride_nv,
    stride_ob, stride_ok,
    K, V,
    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One sequence: find the accepted prefix n, race over the residual (or p_K) by vocabulary tiles, write."""
    b = tl.program_id(0).to(tl.int64)
    ids_row = draft_ids_ptr + b * stride_ib
    p_rows = target_probs_ptr + b * stride_tb
    q_rows = draft_probs_ptr + b * stride_db

    n = 0
    alive = 1
    for i in range(0, K):
        x = tl.load(ids_row + i * stride_ik)
        # an id outside the vocabulary is rejected (p = 0) instead of being read out of bounds
        valid = (x >= 0) & (x < V)
        p = tl.load(p_rows + i * stride_tk + x * stride_tv, mask=valid, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_rows + i * stride_dk + x * stride_dv, mask=valid, other=1.0)
        else:
            q = 1.0
        u = tl.load(uniform_ptr + b * stride_ub + i * stride_uk)
        alive = alive & (u * q < p).to(tl.int32)
        n += alive

    bonus = n == K
    j = tl.minimum(n, K - 1)  # the rejected position (unused when bonus)
    x_j = tl.load(ids_row + j * stride_ik)
    p_row = p_rows + n * stride_tk  # p_n: the residual's p, or p_K for the bonus token
    best_r = float("-inf")
    arg_r = 0
    best_p = float("-inf")
    arg_p = 0
    for start in range(0, V, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        mask = idx < V
        p = tl.load(p_row + idx * stride_tv, mask=mask, other=0.0)
        e = tl.load(noise_ptr + b * stride_nb + idx * stride_nv, mask=mask, other=1.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_rows + j * stride_dk + idx * stride_dv, mask=mask, other=0.0)
        else:
            q = tl.where(idx == x_j, 1.0, 0.0)
        r = tl.where(bonus, p, tl.maximum(p - q, 0.0))
        s_r = tl.where(mask, tl.div_rn(r, e), float("-inf"))
        s_p = tl.where(mask, tl.div_rn(p, e), float("-inf"))
        # running argmax of each race, lowest index on ties
        tile_max = tl.max(s_r, 0)
        tile_arg = tl.min(tl.where((s_r == tile_max) & mask, idx, V), 0)
        arg_r = tl.where(tile_max > best_r, tile_arg, arg_r)
        best_r = tl.maximum(best_r, tile_max)
        tile_max = tl.max(s_p, 0)
        tile_arg = tl.min(tl.where((s_p == tile_max) & mask, idx, V), 0)
        arg_p = tl.where(tile_max > best_p, tile_arg, arg_p)
        best_p = tl.maximum(best_p, tile_max)
    # an all-zero residual (rounding only) falls back to p_n, as the reference does
    emitted = tl.where(best_r > 0.0, arg_r, arg_p).to(tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    drafts = tl.load(ids_row + offs_k * stride_ik, mask=offs_k < K, other=-1)
    tok = tl.where(offs_k < n, drafts, -1)
    tok = tl.where(offs_k == n, emitted, tok)
    tl.store(tokens_ptr + b * stride_ob + offs_k * stride_ok, tok, mask=offs_k < K + 1)
    tl.store(num_accepted_ptr + b, n.to(tl.int64))


def _rejection_triton(draft_ids, draft_probs, target_probs, uniform, noise):
    B, K, V = _validate(draft_ids, draft_probs, target_probs, uniform, noise)
    tokens = torch.empty((B, K + 1), dtype=torch.int64, device=target_probs.device)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=target_probs.device)
    if B == 0:
        return tokens, num_accepted
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_probs  # placeholder pointer, never read
    q_strides = draft_probs.stride() if has_q else (0, 0, 0)
    block_v = max(16, min(4096 if not target_probs.is_cuda else 2048, triton.next_power_of_2(V)))
    _rejection_kernel[(B,)](
        draft_ids, q, target_probs, uniform, noise, tokens, num_accepted,
        *draft_ids.stride(), *q_strides, *target_probs.stride(), *uniform.stride(), *noise.stride(),
        *tokens.stride(), K, V,
        HAS_DRAFT_PROBS=has_q, BLOCK_V=block_v, BLOCK_K=max(2, triton.next_power_of_2(K + 1)), num_warps=8,
    )
    return tokens, num_accepted
