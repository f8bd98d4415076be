"""Rotary position embedding (RoPE) in the Hugging Face rotate-half convention.

- Convention, stated once for graphspec: a head vector ``x[D]`` is split into halves
  ``x1 = x[:D/2]``, ``x2 = x[D/2:]``; with ``f = position * inv_freq`` (``[D/2]``),
  ``c = cos(f) * attention_scaling`` and ``s = sin(f) * attention_scaling``,
  ``out = (x1 * c - x2 * s, x2 * c + x1 * s)``. HF writes this as
  ``x * cos + rotate_half(x) * sin`` with ``cos = cat(c, c)``, ``sin = cat(s, s)``.
- Positions are per token (``[B, T]`` int64), so rows need not be contiguous or equal
  across the batch (speculative verify, left padding, trees).
- ``rope_inv_freq`` reproduces transformers' ``ROPE_INIT_FUNCTIONS`` for rope_type
  "default", "linear" and "llama3" op for op, so the frequencies are bit-identical;
  any other rope_type is an error rather than a silent default.
- cos/sin and the rotation are computed in fp32, rounded once to the input dtype.
  Out of place: returns new contiguous ``q``/``k`` tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, use_triton

__all__ = ["rope", "rope_ref", "rope_inv_freq", "rope_tables"]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` fp32 and the attention scaling for cos/sin.

    ``scaling`` is config.json's ``rope_scaling`` (or ``rope_parameters``) dict or None.
    Supported ``rope_type`` (also read from the legacy key ``type``): "default", "linear"
    (``factor``), "llama3" (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). All three have attention scaling 1.0.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"theta (rope_theta) must be a positive number, got {theta!r}")
    rope_type = "default"
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"scaling (rope_scaling) must be a dict or None, got {type(scaling).__name__}")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        prf = scaling.get("partial_rotary_factor", 1.0)
        if prf != 1.0:
            raise ValueError(f"rope_scaling has partial_rotary_factor={prf}; graphspec rotates the whole head "
                             "(partial rotary embeddings are not supported)")

    # Same expression as transformers (int64 arange cast to fp32, python-float base), so that
    # the result is bit-identical to ROPE_INIT_FUNCTIONS, not merely close.
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        factor = _scaling_number(scaling, "factor", rope_type)
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        factor, low_ff, high_ff, old_ctx = (_scaling_number(scaling, key, rope_type) for key in _LLAMA3_KEYS)
        if not high_ff > low_ff:
            raise ValueError(f"rope_scaling has high_freq_factor={high_ff} <= low_freq_factor={low_ff}; "
                             "llama3 scaling needs high_freq_factor > low_freq_factor")
        low_freq_wavelen = old_ctx / low_ff
        high_freq_wavelen = old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band
        # between them interpolated smoothly (Llama 3.1's context extension).
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling has rope_type={rope_type!r}; supported: 'default', 'linear', 'llama3'")


def _scaling_number(scaling: dict, key: str, rope_type: str) -> float:
    if key not in scaling:
        raise ValueError(f"rope_scaling with rope_type={rope_type!r} needs the key {key!r}; got keys {sorted(scaling)}")
    value = scaling[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"rope_scaling[{key!r}] must be a positive number, got {value!r}")
    return value


@triton.jit
def _rope_kernel(
    q_ptr,  # [B, T, Hq, D]
    k_ptr,  # [B, T, Hk, D]
    pos_ptr,  # [B, T] int
    inv_freq_ptr,  # [D // 2] fp32
    qo_ptr,  # [B, T, Hq, D], contiguous
    ko_ptr,  # [B, T, Hk, D], contiguous
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_pb, stride_pt,
    T, HQ, HK,
    attention_scaling,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate every head of one token: out = (x1 c - x2 s, x2 c + x1 s); grid (B * T,)."""
    tok = tl.program_id(0).to(tl.int64)
    b = tok // T
    t = tok % T
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.float32)
    freq = pos * tl.load(inv_freq_ptr + d, mask=d_mask, other=0.0)  # fp32, rounded exactly as torch rounds it
    # Reduce the angle to [-pi, pi] in fp64 before the fp32 cos/sin: angles reach thousands of radians
    # (position * inv_freq[0] = position), where an approximate sin/cos (a backend is free to lower
    # tl.cos to one) loses accuracy. After the reduction cos/sin match torch's to ~1 ulp at any position.
    two_pi = tl.full([BLOCK_HALF], 6.283185307179586, tl.float64)  # tl.full keeps all 53 bits
    f64 = freq.to(tl.float64)
    angle = (f64 - tl.floor(f64 / two_pi + 0.5) * two_pi).to(tl.float32)
    cos = (tl.cos(angle) * attention_scaling)[None, :]
    sin = (tl.sin(angle) * attention_scaling)[None, :]
    heads = tl.arange(0, BLOCK_H)

    q_tok = q_ptr + b * stride_qb + t * stride_qt
    qo_tok = qo_ptr + tok * HQ * 2 * HALF
    for h0 in range(0, HQ, BLOCK_H):
        h = h0 + heads
        mask = (h < HQ)[:, None] & d_mask[None, :]
        src = q_tok + h[:, None] * stride_qh + d[None, :] * stride_qd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF * stride_qd, mask=mask, other=0.0).to(tl.float32)
        dst = qo_tok + h[:, None] * (2 * HALF) + d[None, :]
        tl.store(dst, (x1 * cos - x2 * sin).to(qo_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(qo_ptr.dtype.element_ty), mask=mask)

    k_tok = k_ptr + b * stride_kb + t * stride_kt
    ko_tok = ko_ptr + tok * HK * 2 * HALF
    for h0 in range(0, HK, BLOCK_H):
        h = h0 + heads
        mask = (h < HK)[:, None] & d_mask[None, :]
        src = k_tok + h[:, None] * stride_kh + d[None, :] * stride_kd
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF * stride_kd, mask=mask, other=0.0).to(tl.float32)
        dst = ko_tok + h[:, None] * (2 * HALF) + d[None, :]
        tl.store(dst, (x1 * cos - x2 * sin).to(ko_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ko_ptr.dtype.element_ty), mask=mask)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path and test oracle; same contract as :func:`rope`."""
    freqs = positions[..., None].float() * inv_freq.float()  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D], broadcast over heads
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling

    def apply(x):
        xf = x.float()
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

    return apply(q), apply(k)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and signed sin ``[B, T, 1, D]`` fp32 for the torch path of :func:`rope`, or None.

    Every layer of a forward rotates at the same positions, so a model computes these once per
    forward and passes them as ``rope(..., tables=...)``. Where the Triton kernel runs this returns
    None and computes nothing: the kernel computes cos/sin in registers, cheaper than loading them.
    ``sin`` carries the rotate-half sign: ``cat(-s, s)``.
    """
    if use_triton(positions):
        return None
    freqs = positions[..., None].float() * inv_freq.float()  # [B, T, D/2]
    cos = freqs.cos() * attention_scaling
    sin = freqs.sin() * attention_scaling
    return (torch.cat((cos, cos), dim=-1)[:, :, None, :].contiguous(),
            torch.cat((-sin, sin), dim=-1)[:, :, None, :].contiguous())


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., D]`` by :func:`rope_tables`' ``cos, signed_sin`` (torch, no checks), in x's dtype.

    The torch path of :func:`rope` for one tensor (``graphspec.kernels.cpu.int8_draft`` writes the same
    two lines for q and k together).
    """
    # x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) written as
    # cat(x2, x1) * cat(-s, s) = roll(x, D/2) * cat(-s, s): the same products and sums as rope_ref,
    # so the same bits (tested); the swap is one op (roll) instead of three (unflatten, flip, flatten).
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * signed_sin).to(x.dtype)


def _rope_triton(q, k, positions, inv_freq, attention_scaling):
    bsz, t, hq, d = q.shape
    hk = k.shape[2]
    q_out = torch.empty((bsz, t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((bsz, t, hk, d), dtype=k.dtype, device=k.device)
    if bsz * t == 0:
        return q_out, k_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    # Enough heads per tile to give each program ~2K elements of work; fewer for long heads.
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), 2048 // block_half))
    _rope_kernel[(bsz * t,)](
        q, k, positions, inv_freq, q_out, k_out,
        *q.stride(), *k.stride(), *positions.stride(),
        t, hq, hk,
        float(attention_scaling),
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
    )
    return q_out, k_out


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         attention_scaling: float = 1.0, tables: tuple[torch.Tensor, torch.Tensor] | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to queries and keys at per-token positions (out of place).

    q: ``[B, T, Hq, D]``; k: ``[B, T, Hk, D]`` (same dtype); positions: ``[B, T]`` int64 (int32 accepted);
    inv_freq: ``[D // 2]`` fp32 (from :func:`rope_inv_freq`). Returns ``(q_out, k_out)`` with
    ``x_out = x * cos(emb) + rotate_half(x) * sin(emb)``, ``emb = cat(f, f)``, ``f = positions * inv_freq``,
    cos and sin multiplied by ``attention_scaling``. ``tables``: optional
    ``rope_tables(positions, inv_freq, attention_scaling)``, computed once and shared by the layers
    (None where Triton runs, which needs none).
    """
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("positions", positions, ndim=2, dtypes=(torch.int64, torch.int32), device=q.device)
    check_tensor("inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,), device=q.device)
    bsz, t, _, d = q.shape
    if k.dtype != q.dtype:
        raise ValueError(f"k has dtype {k.dtype} but q has dtype {q.dtype}; cast them to one dtype")
    if k.shape[0] != bsz or k.shape[1] != t or k.shape[3] != d:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}; "
                         "batch, tokens and head_dim must match ([B, T, H, D])")
    if d % 2:
        raise ValueError(f"q has head_dim {d}; rotary embeddings need an even head_dim")
    if tuple(positions.shape) != (bsz, t):
        raise ValueError(f"positions has shape {tuple(positions.shape)} but q has [B, T] = {(bsz, t)}; "
                         "pass one position per token")
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"inv_freq has {inv_freq.shape[0]} elements but head_dim {d} needs {d // 2}; "
                         "build it with rope_inv_freq(head_dim, ...)")
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, (int, float)):
        raise ValueError(f"attention_scaling must be a float, got {attention_scaling!r}")
    if use_triton(q):
        return _rope_triton(q, k, positions, inv_freq, attention_scaling)
    if tables is None:
        tables = rope_tables(positions, inv_freq, attention_scaling)
    else:
        cos, sin = tables
        for name, tab in (("cos", cos), ("sin", sin)):
            if tab.shape != (bsz, t, 1, d) or tab.dtype != torch.float32:
                raise ValueError(f"tables' {name} has {tab.dtype} {tuple(tab.shape)}; expected fp32 "
                                 f"{(bsz, t, 1, d)}: pass rope_tables(positions, inv_freq, attention_scaling)")
    return rope_rotate(q, *tables), rope_rotate(k, *tables)
