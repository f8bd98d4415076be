"""Move probability rows between two vocabularies (draft and target with different tokenizers).

Used by token-level intersection (TLI) speculative decoding, where the draft may only propose
tokens that also exist in the target's vocabulary:

- ``vocab_mask_logits(logits[N, V], table[V])``: logits with ``-inf`` wherever ``table == -1``
  (tokens outside the intersection). Masking the *logits* before temperature / top-k / top-p
  keeps the draft's distribution well defined even when its favourite tokens have no
  counterpart (greedy then picks the best token inside the intersection).
- ``vocab_map(probs_src[N, Vs], src_to_dst[Vs], dst_size) -> probs_dst[N, Vd]`` fp32:
  ``probs_dst[n, src_to_dst[i]] += probs_src[n, i]`` for every ``i`` with ``src_to_dst[i] >= 0``,
  then (``renormalize=True``) each row divided by the mass that was moved, so the result is a
  distribution over the destination vocabulary that is zero outside the intersection.
  A row that moves no mass comes out all zero (callers mask the logits first so that cannot
  happen). Several source ids may share one destination: their mass is summed.

Triton: one program per row, looping over vocabulary tiles twice (mass inside the intersection,
then a scatter with ``atomic_add`` so shared destinations sum exactly like the reference's
``index_add``). Destination indices outside ``[0, dst_size)`` are refused by the launcher (checked
once per table tensor) and additionally masked inside the kernel so a bad table can never write
out of bounds. The torch references are vectorised (``masked_fill`` / ``index_add_``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, use_triton

__all__ = ["vocab_map", "vocab_map_ref", "vocab_mask_logits", "vocab_mask_logits_ref"]

_BLOCK = 1024

# Tables already checked against a destination size: (data_ptr, version, numel, device, dst_size).
# Checking needs a device->host sync, so a table is checked once, not on every decoding step.
_checked_tables: set[tuple] = set()


# ----------------------------------------------------------------------------- validation

def _check_table(name: str, table, length: int, device, *, dst_size: int | None = None) -> None:
    check_tensor(name, table, ndim=1, dtypes=(torch.int64, torch.int32), device=device)
    if table.shape[0] != length:
        raise ValueError(f"{name} has {table.shape[0]} entries but the rows have {length} columns; "
                         f"size the table by the model's vocab_size (padding rows map to -1)")
    if dst_size is None or table.numel() == 0:
        return
    key = (table.data_ptr(), table._version, table.numel(), str(table.device), dst_size)
    if key in _checked_tables:
        return
    lo, hi = int(table.min()), int(table.max())
    if lo < -1 or hi >= dst_size:
        raise ValueError(f"{name} holds ids in [{lo}, {hi}] but must hold -1 (no counterpart) or ids "
                         f"in [0, {dst_size}) (dst_size={dst_size})")
    if len(_checked_tables) > 64:
        _checked_tables.clear()
    _checked_tables.add(key)


def _validate_map(probs_src, src_to_dst, dst_size):
    check_tensor("probs_src", probs_src, ndim=2, dtypes=FLOAT_DTYPES)
    if not isinstance(dst_size, int) or isinstance(dst_size, bool) or dst_size < 1:
        raise ValueError(f"dst_size must be a positive int (the destination model's vocab_size), got {dst_size!r}")
    _check_table("src_to_dst", src_to_dst, probs_src.shape[1], probs_src.device, dst_size=dst_size)


def _validate_mask(logits, table):
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    _check_table("table", table, logits.shape[1], logits.device)


# ----------------------------------------------------------------------------- torch references

def vocab_map_ref(probs_src: torch.Tensor, src_to_dst: torch.Tensor, dst_size: int,
                  renormalize: bool = True) -> torch.Tensor:
    """Reference for :func:`vocab_map` (fp32, vectorised)."""
    _validate_map(probs_src, src_to_dst, dst_size)
    p = probs_src.float()
    keep = src_to_dst >= 0
    src_idx = keep.nonzero().squeeze(1)
    dst_idx = src_to_dst[src_idx].long()
    moved = p.index_select(1, src_idx)  # [N, n_kept]
    out = torch.zeros(p.shape[0], dst_size, dtype=torch.float32, device=p.device)
    out.index_add_(1, dst_idx, moved)
    if renormalize:
        total = moved.sum(dim=1, keepdim=True)
        out = out * torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    return out


def vocab_mask_logits_ref(logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`vocab_mask_logits`."""
    _validate_mask(logits, table)
    return logits.masked_fill((table < 0).unsqueeze(0), float("-inf"))


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _vocab_map_kernel(
    src_ptr,    # [N, Vs] probabilities, any float dtype
    table_ptr,  # [Vs] int64/int32 destination id or -1
    dst_ptr,    # [N, Vd] fp32, zero-initialised
    stride_src_row, stride_src_col,
    stride_dst_row,
    V_SRC, V_DST,
    RENORMALIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src_row = src_ptr + row * stride_src_row
    dst_row = dst_ptr + row * stride_dst_row

    scale = 1.0
    if RENORMALIZE:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V_SRC, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < V_SRC
            p = tl.load(src_row + offs * stride_src_col, mask=inb, other=0.0).to(tl.float32)
            t = tl.load(table_ptr + offs, mask=inb, other=-1).to(tl.int64)
            acc += tl.where((t >= 0) & (t < V_DST), p, 0.0)
        total = tl.sum(acc, axis=0)
        scale = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)

    for start in range(0, V_SRC, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < V_SRC
        p = tl.load(src_row + offs * stride_src_col, mask=inb, other=0.0).to(tl.float32)
        t = tl.load(table_ptr + offs, mask=inb, other=-1).to(tl.int64)
        ok = inb & (t >= 0) & (t < V_DST)
        safe_t = tl.where(ok, t, 0)
        tl.atomic_add(dst_row + safe_t, p * scale, mask=ok)


@triton.jit
def _vocab_mask_kernel(
    x_ptr,      # [N, V] logits
    table_ptr,  # [V] int64/int32 counterpart id or -1
    out_ptr,    # [N, V] same dtype as x, contiguous
    stride_x_row, stride_x_col,
    stride_out_row,
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < V
        x = tl.load(x_ptr + row * stride_x_row + offs * stride_x_col, mask=inb, other=0.0).to(tl.float32)
        t = tl.load(table_ptr + offs, mask=inb, other=-1)
        y = tl.where(t >= 0, x, float("-inf"))
        tl.store(out_ptr + row * stride_out_row + offs, y.to(out_ptr.dtype.element_ty), mask=inb)


def _block_for(v: int) -> int:
    return min(_BLOCK, max(16, triton.next_power_of_2(max(v, 1))))


def _vocab_map_triton(probs_src, src_to_dst, dst_size, renormalize):
    _validate_map(probs_src, src_to_dst, dst_size)
    src_to_dst = src_to_dst.contiguous()  # the kernel reads the table with unit stride
    n, vs = probs_src.shape
    out = torch.zeros(n, dst_size, dtype=torch.float32, device=probs_src.device)
    if n == 0 or vs == 0:
        return out
    _vocab_map_kernel[(n,)](
        probs_src, src_to_dst, out,
        probs_src.stride(0), probs_src.stride(1),
        out.stride(0),
        vs, dst_size,
        RENORMALIZE=bool(renormalize),
        BLOCK=_block_for(vs),
    )
    return out


def _vocab_mask_triton(logits, table):
    _validate_mask(logits, table)
    table = table.contiguous()  # the kernel reads the table with unit stride
    n, v = logits.shape
    out = torch.empty(n, v, dtype=logits.dtype, device=logits.device)
    if n == 0 or v == 0:
        return out
    _vocab_mask_kernel[(n,)](
        logits, table, out,
        logits.stride(0), logits.stride(1),
        out.stride(0),
        v,
        BLOCK=_block_for(v),
    )
    return out


# ----------------------------------------------------------------------------- public ops

def vocab_map(probs_src: torch.Tensor, src_to_dst: torch.Tensor, dst_size: int,
              renormalize: bool = True) -> torch.Tensor:
    """Scatter ``probs_src[N, Vs]`` into ``[N, dst_size]`` fp32 through ``src_to_dst[Vs]`` (-1: dropped).

    With ``renormalize`` each row is divided by the mass that was moved (rows moving no mass
    stay all zero). Accepts fp32/bf16/fp16 and non-contiguous rows; always returns fp32.
    """
    if use_triton(probs_src):
        return _vocab_map_triton(probs_src, src_to_dst, dst_size, renormalize)
    return vocab_map_ref(probs_src, src_to_dst, dst_size, renormalize)


def vocab_mask_logits(logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``logits[N, V]`` with ``-inf`` where ``table[V] == -1``; same dtype, out-of-place."""
    if use_triton(logits):
        return _vocab_mask_triton(logits, table)
    return vocab_mask_logits_ref(logits, table)
