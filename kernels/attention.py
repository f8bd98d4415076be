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

import functools
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

def causal_mask(t: int, length: int, device=None) -> torch.Tensor:
    """``[t, length]`` bool: the last t of ``length`` positions as queries, each seeing keys up to itself."""
    return torch.arange(length, device=device)[None, :] <= torch.arange(length - t, length, device=device)[:, None]


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
        mask = causal_mask(T, L, q.device).repeat(G, 1)  # [G*T, L]
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
    T, L = q.shape[1], k.shape[1]
    if 1 < T <= _ROWWISE_MAX_T:
        # A verify's query row must come out bit-identical to the one-token step at that position, or bf16
        # greedy speculative output drifts from autoregressive: torch's CPU SDPA rounds a row differently
        # depending on how many rows it is given (measured: ~9% of bf16 rows). So each row runs as its own
        # one-row call over exactly the keys it sees; attention is a few % of a CPU step.
        _validate(q, k, v, scale)
        return torch.cat([attention_ref(q[:, j:j + 1], k[:, :L - T + 1 + j], v[:, :L - T + 1 + j], scale)
                          for j in range(T)], dim=1)
    return attention_ref(q, k, v, scale)


# Verify-sized blocks (K + 1 rows) take the row-by-row CPU path above; prefill keeps one batched call.
_ROWWISE_MAX_T = 16


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The interpreter multiplies bf16 operands wrongly, so there (DOT_FP32) the operands, already
    # rounded to the storage dtype, are widened to fp32: same products, fp32 accumulation as on a GPU.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_base, v_base, n_idx, n_limit, offs_d, mask_d, q_pos,
                 stride_kl, stride_kd, stride_vl, stride_vd, qk_scale,
                 DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax, shared by the prefill and split-KV kernels.

    Keys ``n_idx`` below ``n_limit`` that query row i may see (``n_idx <= q_pos[i]``) update the running
    max ``m_i``, sum ``l_i`` and output ``acc`` (base-2 exponentials; ``qk_scale`` folds in log2 e).
    """
    mask_n = n_idx < n_limit
    kt = tl.load(k_base + n_idx[None, :] * stride_kl + offs_d[:, None] * stride_kd,
                 mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = _dot(q, kt, DOT_FP32, DOT_PRECISION) * qk_scale
    visible = (n_idx[None, :] <= q_pos[:, None]) & mask_n[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + n_idx[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attn_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: [B, T, Hq, D]; k, v: [B, L, Hk, D]
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    T, L, Hq, D, GROUP, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Flash attention for one (query tile, batch, query head); ``qk_scale = scale * log2(e)``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < T
    mask_d = offs_d < D

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh

    # Finite start value: a row whose first tile is fully masked gets exp2(-inf - m) = 0, never nan.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_pos = (L - T) + offs_m  # key position of each query
    # Causal: this tile's last query sees keys up to q_pos[-1]; later key tiles are skipped.
    hi = tl.minimum(L, (L - T) + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, start_n + offs_n, L, offs_d, mask_d, q_pos,
                                     stride_kl, stride_kd, stride_vl, stride_vd, qk_scale, DOT_FP32, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: [B, T, Hq, D]; k, v: [B, L, Hk, D]
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [B*Hk, S, T*GROUP, D], [B*Hk, S, T*GROUP] x2, fp32
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    T, L, Hk, D, GROUP, qk_scale, split_len, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):
    """Flash-decoding: one (batch, kv head, KV split); rows are the T*GROUP queries sharing the kv head.

    Row r is query t = r // GROUP of head hk*GROUP + r % GROUP. With DIRECT (a single split) the
    normalised output is stored at once; otherwise the partial (max, sum, acc) goes to the scratch.
    """
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    rows = tl.arange(0, BLOCK_M)
    t = rows // GROUP
    h = hk * GROUP + rows % GROUP
    n_rows = T * GROUP
    mask_r = rows < n_rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_pos = (L - T) + t
    n_lo = split * split_len
    n_hi = tl.minimum(L, n_lo + split_len)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, start_n + offs_n, n_hi, offs_d, mask_d, q_pos,
                                     stride_kl, stride_kd, stride_vl, stride_vd, qk_scale, DOT_FP32, DOT_PRECISION)

    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(o_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
    else:
        # A split lying wholly after a row's last visible key leaves (m, l, acc) = (-1e30, 0, 0):
        # weight 0 in the combine, since split 0 always holds key 0, visible to every row.
        part = (pid_bh * num_splits + split) * n_rows + rows
        tl.store(part_m_ptr + part, m_i, mask=mask_r)
        tl.store(part_l_ptr + part, l_i, mask=mask_r)
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=mask_r[:, None] & mask_d[None, :])


@triton.jit
def _attn_combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [B*Hk, S, T*GROUP, D], [B*Hk, S, T*GROUP] x2, fp32
    o_ptr,  # [B, T, Hq, D]
    stride_ob, stride_ot, stride_oh, stride_od,
    T, Hk, D, GROUP, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the per-split partials of one query row: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    pid_bh = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    t = row // GROUP
    h = hk * GROUP + row % GROUP
    n_rows = T * GROUP
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < D
    part = (pid_bh * num_splits + offs_s) * n_rows + row
    m_s = tl.load(part_m_ptr + part, mask=mask_s, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, None] * D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    m = tl.max(m_s, 0)
    w = tl.exp2(m_s - m)
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(acc_s * w[:, None], 0) / denom
    tl.store(o_ptr + b * stride_ob + t * stride_ot + h * stride_oh + offs_d * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=mask_d)


# ----------------------------------------------------------------------------- launcher

_LOG2E = 1.4426950408889634
_SPLIT_MAX_ROWS = 128  # T * GROUP rows held by one flash-decoding program
_SPLIT_MAX_T = 16
_MAX_SPLITS = 64


def _launch_config(q):
    """Dot operand handling: widen under the interpreter (bf16 dots are wrong there); fp32 via 3xTF32 on GPU."""
    dot_fp32 = not q.is_cuda
    precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    if dot_fp32:
        precision = "ieee"
    return dot_fp32, precision


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pipeline(q, block_m, block_d):
    """(BLOCK_N, num_stages): fp32 operands (3xTF32 dots) need twice the shared memory of bf16 per stage;
    these keep every configuration under the 227 KiB of an H100/H200 (measured from sm_90 compiles)."""
    if q.dtype != torch.float32:
        return 64, 3
    return 32, (1 if block_m * block_d >= 8192 else 2)


def _default_num_splits(q, B, Hk, L, block_n):
    n_sm = _sm_count(q.device) if q.is_cuda else 4
    want = triton.cdiv(2 * n_sm, max(1, B * Hk))  # about two programs per SM
    return max(1, min(want, triton.cdiv(L, block_n), _MAX_SPLITS))


def _attention_triton(q, k, v, scale, mode: str | None = None, num_splits: int | None = None):
    """Validate, pick the kernel, launch. ``mode`` ("prefill" / "split") and ``num_splits`` are test hooks."""
    scale = _validate(q, k, v, scale)
    B, T, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return out
    block_d = max(16, triton.next_power_of_2(D))
    dot_fp32, precision = _launch_config(q)
    qk_scale = scale * _LOG2E
    if mode is None:
        mode = "split" if (T <= _SPLIT_MAX_T and T * G <= _SPLIT_MAX_ROWS) else "prefill"
    if mode not in ("prefill", "split"):
        raise ValueError(f"mode must be 'prefill', 'split' or None, got {mode!r}")
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride())

    if mode == "prefill":
        block_m = 64
        block_n, stages = _pipeline(q, block_m, block_d)
        grid = (triton.cdiv(T, block_m), B * Hq)
        _attn_prefill_kernel[grid](
            q, k, v, out, *strides, T, L, Hq, D, G, qk_scale,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
            num_warps=4 if block_d <= 64 else 8, num_stages=stages,
        )
        return out

    block_m = max(16, triton.next_power_of_2(T * G))
    block_n, stages = _pipeline(q, block_m, block_d)
    if block_m > _SPLIT_MAX_ROWS:
        raise ValueError(f"mode='split' holds T*Hq/Hk={T * G} query rows in one program; at most "
                         f"{_SPLIT_MAX_ROWS} are supported (use mode='prefill')")
    if num_splits is None:
        num_splits = _default_num_splits(q, B, Hk, L, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(L, num_splits), block_n) * block_n  # whole KV tiles per split
    num_splits = triton.cdiv(L, split_len)
    direct = num_splits == 1
    n_rows = T * G
    if direct:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = torch.empty((B * Hk, num_splits, n_rows, D), dtype=torch.float32, device=q.device)
        part_m = torch.empty((B * Hk, num_splits, n_rows), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    _attn_split_kernel[(B * Hk, num_splits)](
        q, k, v, out, part_acc, part_m, part_l, *strides, T, L, Hk, D, G, qk_scale, split_len, num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
        DIRECT=direct, num_warps=4 if block_m * block_d <= 4096 else 8, num_stages=stages,
    )
    if not direct:
        _attn_combine_kernel[(B * Hk, n_rows)](
            part_acc, part_m, part_l, out, *out.stride(), T, Hk, D, G, num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=4,
        )
    return out
