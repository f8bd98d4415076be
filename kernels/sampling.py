"""Logit warping (temperature, top-k, top-p) and host-sync-free sampling.

- ``warp_logits(logits[N, V], temperature, top_k, top_p) -> probs[N, V] fp32``:
  ``z = logits * (1 / temperature)`` (the reciprocal rounded to fp32 once); keep the tokens with ``z >= threshold`` where the threshold is
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
- Arithmetic that decides a discrete outcome is bit-identical in both backends: the temperature is
  one fp32 multiply, the race divides with IEEE round-to-nearest (``tl.div_rn``, as torch does), so
  the same noise gives the same token on both backends.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, interpreter_enabled, use_triton

__all__ = ["warp_logits", "warp_logits_ref", "sample", "sample_ref", "exponential_noise", "seeded_generator",
           "check_seed", "SEED_LIMIT"]

# Seeds are integers in [0, SEED_LIMIT): every one of them names its own random stream.
SEED_LIMIT = 1 << 64

# Smallest positive normal fp32: noise is clamped to it so probs / noise never divides by zero.
_TINY = torch.finfo(torch.float32).tiny
_INTERPRETING = interpreter_enabled()


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


def _inv_temperature(temperature: float) -> float:
    """1 / temperature rounded to fp32 once: both backends then scale by one exact fp32 multiply
    (torch on CUDA turns a division by a scalar into such a multiply anyway), so z is bit-identical."""
    return (torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32)).item()


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
    z = x * _inv_temperature(temperature)
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


def check_seed(seed, what: str = "seed") -> int:
    """``seed`` if it is an int in [0, 2**64), else ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        text = repr(seed) if len(repr(seed)) <= 40 else repr(seed)[:30] + "..."
        raise ValueError(f"{what}={text} is not a valid seed; use an integer with 0 <= {what} < 2**64")
    return seed


# Byte offsets in torch's CPU generator state (the legacy THGeneratorState layout): the initial seed, then
# ``left``, ``seeded`` and ``next``, then the 624 Mersenne Twister words, one uint64 each.
_MT_WORDS_AT, _MT_N = 24, 624


def seeded_generator(seed: int, device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` whose stream is a function of all 64 bits of ``seed``.

    CUDA's Philox generator takes a 64-bit seed as is. torch's CPU Mersenne Twister is seeded from the low
    32 bits only (seeds 1 and 2**32 + 1 would draw the same numbers), so for seeds of 2**32 and above its
    624-word state is filled with the reference MT19937 ``init_by_array`` of the seed's two 32-bit halves.
    Seeds below 2**32 keep torch's own seeding, so their streams are unchanged.
    """
    seed = check_seed(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if gen.device.type != "cpu" or seed < (1 << 32):
        return gen
    state = gen.get_state()
    words = torch.tensor(_mt_init_by_array([seed & 0xFFFFFFFF, seed >> 32]), dtype=torch.int64)
    end = _MT_WORDS_AT + 8 * _MT_N
    if state.numel() < end or int.from_bytes(bytes(state[:8].tolist()), "little") != seed:
        raise RuntimeError("torch's CPU generator state has an unknown layout; seeds of 2**32 and above cannot be "
                           "given their own stream with this torch version")
    state = state.clone()
    state[_MT_WORDS_AT:end] = words.view(torch.uint8)
    gen.set_state(state)
    return gen


def _mt_init_by_array(key: list[int]) -> list[int]:
    """MT19937's reference ``init_by_array`` (Matsumoto and Nishimura, 2002): the 624 state words for a key."""
    m = 0xFFFFFFFF
    mt = [0] * _MT_N
    mt[0] = 19650218
    for i in range(1, _MT_N):
        mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & m
    i, j = 1, 0
    for _ in range(max(_MT_N, len(key))):
        mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525)) + key[j] + j) & m
        i, j = i + 1, j + 1
        if i >= _MT_N:
            mt[0], i = mt[_MT_N - 1], 1
        if j >= len(key):
            j = 0
    for _ in range(_MT_N - 1):
        mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941)) - i) & m
        i += 1
        if i >= _MT_N:
            mt[0], i = mt[_MT_N - 1], 1
    mt[0] = 0x80000000  # a non-zero state is guaranteed
    return mt


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


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _scaled_tile(l_row, stride_lv, idx, mask, inv_temperature):
    x = tl.load(l_row + idx * stride_lv, mask=mask, other=0.0).to(tl.float32)
    # + 0.0 turns -0.0 into +0.0 so that equal values get equal ordered keys
    return x * inv_temperature + 0.0


@triton.jit
def _ordered_key(z):
    """Monotone map fp32 -> int32 (flip the magnitude bits of negatives), so float order == int order."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _mass_at_or_above(l_row, stride_lv, V, inv_temperature, zmax, key_thr, BLOCK_V: tl.constexpr):
    """Sum of exp(z - zmax) over the tokens whose key is >= key_thr (unnormalised probability mass)."""
    mass = 0.0
    for start in range(0, V, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        mask = idx < V
        z = _scaled_tile(l_row, stride_lv, idx, mask, inv_temperature)
        keep = (_ordered_key(z) >= key_thr) & mask
        mass += tl.sum(tl.where(keep, tl.exp(z - zmax), 0.0), 0)
    return mass


@triton.jit
def _search_threshold(l_row, stride_lv, V, inv_temperature, zmax, lo, hi, target,
                      USE_MASS: tl.constexpr, BLOCK_V: tl.constexpr, NPROBE: tl.constexpr):
    """Largest key in [lo, hi) whose count (or mass) of tokens at or above it is still >= target.

    Needs f(lo) >= target > f(hi). Each pass over the vocabulary evaluates NPROBE evenly spaced probe
    keys at once and keeps the sub-interval where f crosses the target, so a 2^32-wide key range
    takes 8 passes (NPROBE = 16) instead of 32 for a plain bisection. Exact: it ends on a real key.
    """
    j = tl.arange(0, NPROBE)
    while hi - lo > 1:
        step = (hi - lo + NPROBE - 1) // NPROBE
        probes = lo + j.to(tl.int64) * step  # [NPROBE]
        acc = tl.zeros([NPROBE], tl.float32)  # counts are exact in fp32 up to 2^24 tokens
        for start in range(0, V, BLOCK_V):
            idx = start + tl.arange(0, BLOCK_V)
            mask = idx < V
            z = _scaled_tile(l_row, stride_lv, idx, mask, inv_temperature)
            above = (_ordered_key(z)[:, None] >= probes[None, :]) & mask[:, None]  # [BLOCK_V, NPROBE]
            if USE_MASS:
                acc += tl.sum(tl.where(above, tl.exp(z - zmax)[:, None], 0.0), 0)
            else:
                acc += tl.sum(above.to(tl.float32), 0)
        ok = (acc >= target) & (probes < hi)
        last = tl.max(tl.where(ok, j, 0), 0).to(tl.int64)  # probe 0 (= lo) holds by the invariant
        new_lo = lo + last * step
        hi = tl.minimum(new_lo + step, hi)
        lo = new_lo
    return lo


@triton.jit
def _warp_kernel(
    logits_ptr, out_ptr,  # [N, V] (fp32/bf16/fp16), [N, V] fp32
    stride_ln, stride_lv, stride_on, stride_ov,
    V, inv_temperature, top_k, top_p,
    GREEDY: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK_V: tl.constexpr, NPROBE: tl.constexpr,
):
    """One row: thresholds by a multi-probe bisection over ordered keys (no sort), then the renormalised write.

    Search invariant for top-k: count(key >= lo) >= k > count(key >= hi); for top-p the same with
    the mass and the target ``top_p * mass(top-k set)``. Both end on an actual key, so ties are kept.
    """
    row = tl.program_id(0).to(tl.int64)
    l_row = logits_ptr + row * stride_ln
    o_row = out_ptr + row * stride_on
    offs = tl.arange(0, BLOCK_V)
    if GREEDY:
        best = float("-inf")
        best_idx = 0
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            mask = idx < V
            x = tl.load(l_row + idx * stride_lv, mask=mask, other=float("-inf")).to(tl.float32)
            tile_max = tl.max(x, 0)
            tile_arg = tl.min(tl.where((x == tile_max) & mask, idx, V), 0)  # lowest index on ties
            best_idx = tl.where(tile_max > best, tile_arg, best_idx)
            best = tl.maximum(best, tile_max)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            tl.store(o_row + idx * stride_ov, tl.where(idx == best_idx, 1.0, 0.0), mask=idx < V)
    else:
        zmax = float("-inf")
        zmin = float("inf")
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            mask = idx < V
            z = _scaled_tile(l_row, stride_lv, idx, mask, inv_temperature)
            zmax = tl.maximum(zmax, tl.max(tl.where(mask, z, float("-inf")), 0))
            zmin = tl.minimum(zmin, tl.min(tl.where(mask, z, float("inf")), 0))
        key_top = _ordered_key(zmax).to(tl.int64) + 1  # nothing lies at or above it
        thr = _ordered_key(zmin).to(tl.int64)  # everything lies at or above it
        if (top_k > 0) & (top_k < V):
            thr = _search_threshold(l_row, stride_lv, V, inv_temperature, zmax, thr, key_top, top_k,
                                    False, SEARCH_BLOCK_V, NPROBE)
        if top_p < 1.0:
            target = top_p * _mass_at_or_above(l_row, stride_lv, V, inv_temperature, zmax, thr, BLOCK_V)
            thr = _search_threshold(l_row, stride_lv, V, inv_temperature, zmax, thr, key_top, target,
                                    True, SEARCH_BLOCK_V, NPROBE)
        total = _mass_at_or_above(l_row, stride_lv, V, inv_temperature, zmax, thr, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            mask = idx < V
            z = _scaled_tile(l_row, stride_lv, idx, mask, inv_temperature)
            keep = _ordered_key(z) >= thr
            tl.store(o_row + idx * stride_ov, tl.where(keep, tl.exp(z - zmax) / total, 0.0), mask=mask)


@triton.jit
def _race_kernel(
    probs_ptr, noise_ptr, out_ptr,  # [N, V] fp32, [N, V] fp32, [N] int64
    stride_pn, stride_pv, stride_nn, stride_nv,
    V,
    BLOCK_V: tl.constexpr,
):
    """Exponential race: argmax over the row of probs / noise (lowest index on ties)."""
    row = tl.program_id(0).to(tl.int64)
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        mask = idx < V
        p = tl.load(probs_ptr + row * stride_pn + idx * stride_pv, mask=mask, other=0.0)
        e = tl.load(noise_ptr + row * stride_nn + idx * stride_nv, mask=mask, other=1.0)
        score = tl.where(mask, tl.div_rn(p, e), float("-inf"))
        tile_max = tl.max(score, 0)
        tile_arg = tl.min(tl.where((score == tile_max) & mask, idx, V), 0)
        best_idx = tl.where(tile_max > best, tile_arg, best_idx)
        best = tl.maximum(best, tile_max)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


# ----------------------------------------------------------------------------- launchers

_NPROBE = 16


def _block_v(V: int, search: bool = False) -> int:
    # The search holds a [tile, NPROBE] block: smaller tiles on a GPU keep it in registers;
    # under the interpreter larger tiles mean fewer (slow) interpreted iterations.
    cap = 4096 if (not search or _INTERPRETING) else 512
    return max(16, min(cap, triton.next_power_of_2(V)))


def _warp_logits_triton(logits, temperature, top_k, top_p):
    temperature, top_k, top_p = _validate_warp(logits, temperature, top_k, top_p)
    N, V = logits.shape
    out = torch.empty((N, V), dtype=torch.float32, device=logits.device)
    if N == 0:
        return out
    greedy = temperature == 0.0
    _warp_kernel[(N,)](
        logits, out, *logits.stride(), *out.stride(), V,
        # top_k travels as a float (exact below 2^24) so that k == 1 is not specialised into a constant
        1.0 if greedy else _inv_temperature(temperature), float(top_k), top_p,
        GREEDY=greedy, BLOCK_V=_block_v(V), SEARCH_BLOCK_V=_block_v(V, search=True), NPROBE=_NPROBE, num_warps=8,
    )
    return out


def _sample_triton(probs, noise):
    _validate_sample(probs, noise)
    N, V = probs.shape
    out = torch.empty((N,), dtype=torch.int64, device=probs.device)
    if N == 0:
        return out
    _race_kernel[(N,)](probs, noise, out, *probs.stride(), *noise.stride(), V,
                       BLOCK_V=_block_v(V), num_warps=8)
    return out
