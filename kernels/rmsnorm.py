"""RMSNorm, optionally fused with the residual add that precedes it in every Llama block.

- Hugging Face semantics (LlamaRMSNorm): normalise in fp32, cast to the input dtype,
  then multiply by ``weight`` and round once more to the input dtype. Keeping that
  intermediate rounding is what lets bf16 logits track transformers' closely.
- Fused form: ``h = x + residual`` (rounded to the input dtype, as HF's separate add
  is), then ``(rmsnorm(h), h)``; one pass over memory instead of two.
- The output dtype is always the input dtype (HF would promote to fp32 when the
  weight is fp32 and the input bf16; graphspec keeps activations in one dtype).
- Triton: one program per row. Rows up to ``_MAX_BLOCK`` wide stay in registers; wider
  rows take a second pass over the input (re-read, mostly from L2) instead of one block
  the size of the row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, use_triton

__all__ = ["rmsnorm", "rmsnorm_ref"]

_MAX_BLOCK = 8192


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [M, H]
    res_ptr,  # [M, H] (only read when HAS_RESIDUAL)
    w_ptr,  # [H]
    y_ptr,  # [M, H], contiguous
    h_ptr,  # [M, H], contiguous (only written when HAS_RESIDUAL)
    stride_xm, stride_xh,
    stride_rm, stride_rh,
    stride_w,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
):
    """y[m] = weight * cast(h[m] * rsqrt(mean(h[m]^2) + eps)), h = x (+ residual, rounded); grid (M,)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    x_row = x_ptr + row * stride_xm
    r_row = res_ptr + row * stride_rm
    y_row = y_ptr + row * H
    h_row = h_ptr + row * H
    dt = y_ptr.dtype.element_ty

    if SINGLE_TILE:
        mask = cols < H
        h = tl.load(x_row + cols * stride_xh, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_row + cols * stride_rh, mask=mask, other=0.0).to(tl.float32)
            h = h.to(dt)  # the residual stream is stored in the input dtype: normalise what is stored
            tl.store(h_row + cols, h, mask=mask)
            h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd).to(dt).to(tl.float32) * w
        tl.store(y_row + cols, y.to(dt), mask=mask)
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = c < H
            h = tl.load(x_row + c * stride_xh, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(r_row + c * stride_rh, mask=mask, other=0.0).to(tl.float32)
                h = h.to(dt)
                tl.store(h_row + c, h, mask=mask)
                h = h.to(tl.float32)
            acc += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = c < H
            # Recompute h from the inputs rather than re-reading h_ptr: a program reading back
            # its own stores is not guaranteed to see them under a different thread layout.
            h = tl.load(x_row + c * stride_xh, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(r_row + c * stride_rh, mask=mask, other=0.0).to(tl.float32)
                h = h.to(dt).to(tl.float32)
            w = tl.load(w_ptr + c * stride_w, mask=mask, other=0.0).to(tl.float32)
            y = (h * rstd).to(dt).to(tl.float32) * w
            tl.store(y_row + c, y.to(dt), mask=mask)


def _norm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (weight.float() * normed.float()).to(h.dtype)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Torch path and test oracle; same contract as :func:`rmsnorm`."""
    if residual is None:
        return _norm_ref(x, weight, eps)
    h = x + residual
    return _norm_ref(h, weight, eps), h


def _rmsnorm_torch(x, weight, eps, residual):
    # The CPU fast path: the same values as rmsnorm_ref bit for bit (tested), in 2-3 torch ops
    # instead of ~10. F.rms_norm computes in fp32 and rounds once to x's dtype, which is the
    # reference's first rounding; a product of two bf16 (or fp16) values is exact in fp32, so
    # multiplying by the weight in x's dtype rounds exactly where the reference does.
    h = x if residual is None else x + residual
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), eps=float(eps)) * weight
    return y if residual is None else (y, h)


def _rmsnorm_triton(x, weight, eps, residual):
    hdim = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), hdim)
    m = x2.shape[0]
    y = torch.empty((m, hdim), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(x2.shape)
        h = torch.empty((m, hdim), dtype=x.dtype, device=x.device)
    else:
        r2, h = x2, y  # placeholders; the kernel neither reads nor writes them
    if m > 0 and hdim > 0:
        block = min(triton.next_power_of_2(hdim), _MAX_BLOCK)
        _rmsnorm_kernel[(m,)](
            x2, r2, weight, y, h,
            x2.stride(0), x2.stride(1),
            r2.stride(0), r2.stride(1),
            weight.stride(0),
            hdim,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=block,
            SINGLE_TILE=block >= hdim,
            num_warps=4 if block <= 2048 else 8,
        )
    if residual is None:
        return y.reshape(x.shape)
    return y.reshape(x.shape), h.reshape(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension.

    x: ``[..., H]``; weight: ``[H]`` (any float dtype); eps >= 0.
    residual None: returns ``y = weight * cast(x * rsqrt(mean(x^2) + eps))`` in x.dtype.
    residual ``[..., H]`` (x's shape and dtype): ``h = x + residual``; returns ``(rmsnorm(h), h)``,
    where ``h`` is the new residual stream.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim < 1:
        raise ValueError("x must have at least 1 dimension ([..., H]), got a 0-d tensor")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} elements but x's last dimension is {x.shape[-1]}; "
                         "pass the norm weight of this hidden size")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float (rms_norm_eps), got {eps!r}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES, device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}; "
                             "they must match")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual has dtype {residual.dtype} but x has dtype {x.dtype}; "
                             "keep the residual stream in the activation dtype")
    if use_triton(x):
        return _rmsnorm_triton(x, weight, eps, residual)
    if weight.dtype != x.dtype:
        return rmsnorm_ref(x, weight, eps, residual)
    return _rmsnorm_torch(x, weight, eps, residual)
