"""Kernel benchmark cases shared by perf/test_kernels.py (pytest-benchmark) and perf/gpu_check.py.

Each case builds its inputs once and offers one callable per provider:

- ``triton``: the graphspec op with the Triton backend (compiled on CUDA; never run on CPU here,
  where only the interpreter exists);
- ``torch``: the best plain-torch equivalent: ``F.linear`` (cuBLAS / oneDNN), SDPA, and the
  ``<op>_ref`` references for the small ops;
- ``packed`` (CPU only): ``linear`` with ``prepare_weight`` (graphspec's CPU fast path: for bf16 on
  AVX-512 and AVX2 CPUs its own C++ kernel, kernels/cpu/linear.cpp; else oneDNN's packed layout);
- ``onednn`` (CPU only, bf16 linears where ``packed`` is the C++ kernel): oneDNN's packed layout;
- ``native`` (CPU only, attention): graphspec's C++ decode/verify attention (kernels/cpu/attention.cpp).

Figures from stated formulas, per call of median time t:
- matmul ``[M, K] x [K, N]``: TFLOP/s = 2 M N K / t; bytes = (M K + N K + M N) * element size.
- attention (causal, T queries at the end of L keys): FLOPs = 4 B Hq D * sum_i (L - T + i + 1);
  bytes = (q + k + v + out) * element size (decode: the KV cache read dominates).
- elementwise / row ops: bytes = inputs read + outputs written; no FLOP figure.
Shapes are Qwen2.5-Coder-1.5B's (hidden 1536, intermediate 8960, 12/2 heads of 128, vocab 151936).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

H, I, HQ, HK, D, V = 1536, 8960, 12, 2, 128, 151936


@dataclasses.dataclass
class Case:
    name: str
    providers: dict[str, Callable[[], object]]
    flops: float = 0.0
    bytes: float = 0.0
    kind: str = "memory"  # "compute" (report TFLOP/s) or "memory" (report GB/s)


def _esize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _triton(fn):
    from graphspec.kernels import use_backend

    def run():
        with use_backend("triton"):
            return fn()
    return run


def linear_case(m: int, n: int, k: int, dtype, device, tag: str = "") -> Case:
    from graphspec.kernels.linear import linear, prepare_weight, quantize_weight

    x = torch.randn(m, k, dtype=dtype, device=device)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    providers = {"torch": lambda: F.linear(x, w), "triton": _triton(lambda: linear(x, w))}
    if torch.device(device).type == "cpu":
        pw = prepare_weight(w)
        if pw is not w:
            providers["packed"] = lambda: linear(x, pw)
        dw = prepare_weight(w, layout="onednn")
        if type(dw) is not type(pw):
            providers["onednn"] = lambda: linear(x, dw)
        if m <= 16 and torch.backends.quantized.engine in ("x86", "fbgemm"):
            qw = quantize_weight(w)  # draft weights; GB/s below counts the dtype's bytes, not int8's
            providers["int8"] = lambda: linear(x, qw)
    return Case(f"linear{tag} M={m} N={n} K={k}", providers, flops=2.0 * m * n * k,
                bytes=float((m * k + n * k + m * n) * _esize(dtype)), kind="compute" if m >= 64 else "memory")


def attention_case(t: int, length: int, dtype, device, b: int = 1) -> Case:
    from graphspec.kernels.attention import attention

    q = torch.randn(b, t, HQ, D, dtype=dtype, device=device)
    # A strided view of a preallocated cache, as the model passes it.
    cache_k = torch.randn(b, length + 64, HK, D, dtype=dtype, device=device)
    cache_v = torch.randn(b, length + 64, HK, D, dtype=dtype, device=device)
    k, v = cache_k[:, :length], cache_v[:, :length]
    scale = D ** -0.5
    g = HQ // HK
    mask = None
    if t > 1:
        qpos = torch.arange(length - t, length, device=device)
        mask = torch.arange(length, device=device)[None, :] <= qpos[:, None]

    def sdpa():
        # Standard layout [B, H, T, D]; GQA by repeating KV heads (what an unfused stack does).
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2).repeat_interleave(g, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=False, scale=scale)

    seen = sum(length - t + i + 1 for i in range(t))
    flops = 4.0 * b * HQ * D * seen
    nbytes = float((q.numel() * 2 + k.numel() + v.numel()) * _esize(dtype))
    providers = {"torch": sdpa, "triton": _triton(lambda: attention(q, k, v, scale))}
    if torch.device(device).type == "cpu":
        import importlib

        from graphspec.kernels import cpu

        attention_mod = importlib.import_module("graphspec.kernels.attention")  # the package exports the function

        # where attention's dispatch takes the C++ rows (kernels/attention.py)
        if t <= attention_mod._EXACT_MAX_T and dtype in attention_mod._NATIVE_DTYPES and cpu.available():
            providers["native"] = lambda: attention(q, k, v, scale)
    return Case(f"attention T={t} L={length}", providers, flops=flops, bytes=nbytes,
                kind="compute" if t >= 64 else "memory")


def rmsnorm_case(m: int, dtype, device) -> Case:
    from graphspec.kernels.rmsnorm import rmsnorm, rmsnorm_ref

    x = torch.randn(m, H, dtype=dtype, device=device)
    r = torch.randn(m, H, dtype=dtype, device=device)
    w = torch.randn(H, dtype=dtype, device=device)
    nbytes = float(4 * m * H * _esize(dtype))  # read x, residual; write y, h
    return Case(f"rmsnorm+residual M={m} H={H}", {"torch": lambda: rmsnorm_ref(x, w, 1e-6, residual=r),
                                                 "triton": _triton(lambda: rmsnorm(x, w, 1e-6, residual=r))},
                bytes=nbytes)


def silu_mul_case(m: int, dtype, device) -> Case:
    from graphspec.kernels.silu_mul import silu_mul, silu_mul_ref

    gu = torch.randn(m, 2 * I, dtype=dtype, device=device)
    gate, up = gu.chunk(2, dim=-1)  # strided halves, as the model passes them
    nbytes = float(3 * m * I * _esize(dtype))
    return Case(f"silu_mul M={m} N={I}", {"torch": lambda: silu_mul_ref(gate, up),
                                         "triton": _triton(lambda: silu_mul(gate, up))}, bytes=nbytes)


def rope_case(t: int, dtype, device) -> Case:
    from graphspec.kernels.rope import rope, rope_inv_freq, rope_ref

    q = torch.randn(1, t, HQ, D, dtype=dtype, device=device)
    k = torch.randn(1, t, HK, D, dtype=dtype, device=device)
    pos = torch.arange(1000, 1000 + t, device=device)[None]
    inv, scaling = rope_inv_freq(D, 1e6, None)
    inv = inv.to(device)
    nbytes = float(2 * (q.numel() + k.numel()) * _esize(dtype))
    return Case(f"rope T={t}", {"torch": lambda: rope_ref(q, k, pos, inv, scaling),
                                "triton": _triton(lambda: rope(q, k, pos, inv, scaling))}, bytes=nbytes)


def warp_case(n: int, device, top_k: int = 50, top_p: float = 0.9) -> Case:
    from graphspec.kernels.sampling import warp_logits, warp_logits_ref

    logits = torch.randn(n, V, device=device) * 3
    nbytes = float(2 * n * V * 4)
    return Case(f"warp_logits N={n} V={V} top_k={top_k} top_p={top_p}",
                {"torch": lambda: warp_logits_ref(logits, 0.8, top_k, top_p),
                 "triton": _triton(lambda: warp_logits(logits, 0.8, top_k, top_p))}, bytes=nbytes)


def rejection_case(k: int, device, with_q: bool = True) -> Case:
    from graphspec.kernels.rejection import rejection_sample, rejection_sample_ref

    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.softmax(torch.randn(1, k + 1, V, device=device, generator=gen), -1)
    q = torch.softmax(torch.randn(1, k, V, device=device, generator=gen), -1) if with_q else None
    ids = torch.randint(0, V, (1, k), device=device, generator=gen)
    u = torch.rand(1, k, device=device, generator=gen)
    noise = torch.empty(1, V, device=device).exponential_(generator=gen)
    nbytes = float(((k + 1) * V + (k * V if with_q else 0) + V) * 4)
    return Case(f"rejection_sample K={k} V={V} q={'yes' if with_q else 'one-hot'}",
                {"torch": lambda: rejection_sample_ref(ids, q, p, u, noise),
                 "triton": _triton(lambda: rejection_sample(ids, q, p, u, noise))}, bytes=nbytes)


def all_cases(device, dtype=torch.bfloat16, small: bool = False) -> list[tuple[str, Callable[[], Case]]]:
    """(short id, case factory) pairs; built lazily, each allocates its own inputs. ``small``: tiny shapes."""
    if small:
        return [
            ("linear-decode", lambda: linear_case(1, 96, 64, dtype, device, " (decode)")),
            ("linear-prefill", lambda: linear_case(70, 96, 64, dtype, device, " (prefill)")),
            ("attn-decode", lambda: attention_case(1, 40, dtype, device)),
            ("attn-prefill", lambda: attention_case(20, 20, dtype, device)),
            ("rmsnorm", lambda: rmsnorm_case(3, dtype, device)),
            ("silu_mul", lambda: silu_mul_case(3, dtype, device)),
            ("rope", lambda: rope_case(3, dtype, device)),
        ]
    return [
        ("linear-w13-m1", lambda: linear_case(1, 2 * I, H, dtype, device, " w13 (decode)")),
        ("linear-w13-m8", lambda: linear_case(8, 2 * I, H, dtype, device, " w13 (verify)")),
        ("linear-w2-m1", lambda: linear_case(1, H, I, dtype, device, " w2 (decode)")),
        ("linear-w2-m8", lambda: linear_case(8, H, I, dtype, device, " w2 (verify)")),
        ("linear-lmhead-m1", lambda: linear_case(1, V, H, dtype, device, " lm_head (decode)")),
        ("linear-w13-m512", lambda: linear_case(512, 2 * I, H, dtype, device, " w13 (prefill)")),
        ("attn-t1-l2048", lambda: attention_case(1, 2048, dtype, device)),
        ("attn-t8-l2048", lambda: attention_case(8, 2048, dtype, device)),
        ("attn-t1024", lambda: attention_case(1024, 1024, dtype, device)),
        ("rmsnorm-m8", lambda: rmsnorm_case(8, dtype, device)),
        ("rmsnorm-m4096", lambda: rmsnorm_case(4096, dtype, device)),
        ("silu_mul-m8", lambda: silu_mul_case(8, dtype, device)),
        ("silu_mul-m4096", lambda: silu_mul_case(4096, dtype, device)),
        ("rope-t8", lambda: rope_case(8, dtype, device)),
        ("rope-t4096", lambda: rope_case(4096, dtype, device)),
        ("warp-n8", lambda: warp_case(8, device)),
        ("rejection-k8", lambda: rejection_case(8, device)),
    ]


def figures(case: Case, seconds: float) -> dict:
    """TFLOP/s and GB/s of one call that took ``seconds``."""
    out = {"ms": seconds * 1e3}
    if case.flops:
        out["tflops"] = case.flops / seconds / 1e12
    if case.bytes:
        out["gbps"] = case.bytes / seconds / 1e9
    return out
