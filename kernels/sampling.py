"""Logit warping (temperature, top-k, top-p) and host-sync-free sampling.

- ``warp_logits(logits[N, V], temperature, top_k, top_p) -> probs[N, V] fp32``:
  ``z = logits / temperature``; keep the tokens with ``z >= threshold`` where the threshold is
  * top-k: the k-th largest z (ties with it are kept; k = 0 or k >= V switches it off), then
  * top-p: among the top-k survivors, the largest z value ``t`` such that the renormalised mass of
    ``{z >= t}`` is at least top_p (the smallest most-probable set reaching top_p, ties kept);
  and return ``softmax(z)`` restricted to the kept set and renormalised.
  ``temperature == 0`` is greedy: a one-hot at the argmax (lowest index on ties).
  Ties are decided on z (not on rounded probabilities), so both backends agree on the kept set.
- ``sample(probs, noise) = argmax(probs / noise)`` with ``noise ~ Exp(1)``: the exponential race,
  an exact categorical draw that needs no cumulative sum and no host synchronisation; the noise
  comes from a seeded ``torch.Generator`` (``exponential_noise``), so both backends draw the same ids.
- Triton: one program per row, always looping over vocabulary tiles. The warp never sorts: the
  top-k / top-p thresholds are found by bisection over the 32-bit ordered integer image of z
  (at most 32 counting / mass passes each, exact: the result is an actual z value), then one pass
  writes the renormalised probabilities.
- Divisions that decide a discrete outcome use IEEE round-to-nearest (``tl.div_rn``), matching torch
  bit for bit, so the same noise gives the same token on both backends.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, use_triton

__all__ = ["warp_logits", "warp_logits_ref", "sample", "sample_ref", "exponential_noise"]

# Smallest positive normal fp32: noise is clamped to it so probs / noise never divides by zero.
_TINY = torch.finfo(torch.float32).tiny


# ----------------------------------------------------------------------------- validation

def _validate_warp(logits, temperature, top_k, top_p):
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}") from None
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0 means greedy), got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 switches top-k off), got {top_k!r}")
    try:
        top_p = float(top_p)
    except (TypeError, ValueError):
        raise ValueError(f"top_p must be a float in (0, 1], got {top_p!r}") from None
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1.0 switches top-p off), got {top_p}")
    if logits.shape[1] == 0:
        raise ValueError("logits has an empty vocabulary axis (shape [N, 0])")
    return temperature, top_k, top_p


def _validate_sample(probs, noise):
    check_tensor("probs", probs, ndim=2, dtypes=(torch.float32,))
    check_tensor("noise", noise, ndim=2, dtypes=(torch.float32,), device=probs.device)
    if noise.shape != probs.shape:
        raise ValueError(f"noise has shape {tuple(noise.shape)} but probs has {tuple(probs.shape)}; "
                         f"draw it with exponential_noise(probs.shape, generator, probs.device)")
    if probs.shape[1] == 0:
        raise ValueError("probs has an empty vocabulary axis (shape [N, 0])")


# ----------------------------------------------------------------------------- torch references

def warp_logits_ref(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sort-based reference of ``warp_logits`` (same threshold semantics, fp32)."""
    temperature, top_k, top_p = _validate_warp(logits, temperature, top_k, top_p)
    N, V = logits.shape
    x = logits.float()
    if temperature == 0.0:
        out = torch.zeros(N, V, dtype=torch.float32, device=logits.device)
        if N:
            out.scatter_(1, torch.argmax(x, dim=-1, keepdim=True), 1.0)
        return out
    z = x / temperature
    if N == 0:
        return z.clone()
    zs, _ = torch.sort(z, dim=-1, descending=True)
    zmax = zs[:, :1]
    thr = zs[:, -1:]
    e = torch.exp(zs - zmax)
    if 0 < top_k < V:
        thr = zs[:, top_k - 1:top_k]
        e = torch.where(zs >= thr, e, torch.zeros_like(e))
    if top_p < 1.0:
        total = e.sum(dim=-1, keepdim=True)
        cum = torch.cumsum(e, dim=-1)
        # first sorted position whose cumulative mass reaches top_p; its value is the threshold
        pos = (cum < top_p * total).sum(dim=-1, keepdim=True).clamp(max=V - 1)
        thr = torch.maximum(thr, zs.gather(1, pos))
    kept = torch.where(z >= thr, torch.exp(z - zmax), torch.zeros_like(z))
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_ref(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(probs / noise)`` per row (first index on ties)."""
    _validate_sample(probs, noise)
    return torch.argmax(probs / noise, dim=-1)


# ----------------------------------------------------------------------------- public ops

def exponential_noise(shape, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """``Exp(1)`` noise in fp32 for ``sample`` / ``rejection_sample``, drawn on ``device`` from ``generator``.

    The generator must live on the same device type (a CUDA generator for CUDA noise), so the draw
    stays on the device and is reproducible for a given seed. Values are clamped away from 0.
    """
    device = torch.device(device) if device is not None else (
        generator.device if generator is not None else torch.device("cpu"))
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator lives on {generator.device} but the noise is asked for on {device}; "
                         f"create the generator with torch.Generator(device={str(device)!r})")
    noise = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    noise.exponential_(generator=generator)
    return noise.clamp_(min=_TINY)


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, top-k then top-p on ``logits[N, V]``; returns renormalised ``probs[N, V]`` fp32.

    ``temperature == 0`` returns a one-hot at the argmax (lowest index on ties).
    """
    if use_triton(logits):
        return _warp_logits_triton(logits, temperature, top_k, top_p)
    return warp_logits_ref(logits, temperature, top_k, top_p)


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one id per row of ``probs[N, V]`` as ``argmax(probs / noise)``, noise ~ Exp(1); returns ``ids[N]`` int64."""
    if use_triton(probs):
        return _sample_triton(probs, noise)
    return sample_ref(probs, noise)


def _warp_logits_triton(logits, temperature, top_k, top_p):
    raise NotImplementedError("the Triton sampling kernels are being written; use backend='torch'")


def _sample_triton(probs, noise):
    raise NotImplementedError("the Triton sampling kernels are being written; use backend='torch'")
