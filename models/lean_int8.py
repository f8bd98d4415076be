"""The cached forward of an int8 model (a draft on the CPU) as one TorchScript function.

Why: a small model's draft step was largely per-op cost. SmolLM2-135M in int8 reads about 134 MB
a token (its int8 GEMMs take about 8.4 ms of that on one core) but took 16.4 ms a forward in eager
PyTorch: its 30 layers run about 20 Python-level torch calls each, and each costs microseconds of
interpreter and dispatch work on top of its arithmetic. TorchScript runs the same ops from its C++
interpreter: the same kernels, the same order, the same bits (tested:
``tests/models/test_int8_forward.py``), in 11.3-12.5 ms (perf/RESULTS.md). torch.compile cannot
take this path: dynamo cannot trace the int8 GEMM's packed-weight object (a TorchScript class),
and routing the GEMM through a Python custom op costs more than fusion saves (measured).

``Transformer._forward_int8`` gathers the per-layer lists (``Int8Layers``) on each call and calls
:func:`scripted_forward`'s function, scripted on first use (well under a second) and then shared by
every int8 model in the process. No annotations from ``__future__`` here: TorchScript reads these
annotations as written.
"""

import functools
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F


class Int8Layers:
    """An int8 model's per-layer weights as the flat lists the scripted forward takes."""

    def __init__(self, layers, norm: torch.Tensor):
        self.wqkv = [layer.wqkv.packed for layer in layers]
        self.bqkv = [layer.bqkv for layer in layers]
        self.wo = [layer.wo.packed for layer in layers]
        self.bo = [layer.bo for layer in layers]
        self.w13 = [layer.w13.packed for layer in layers]
        self.w2 = [layer.w2.packed for layer in layers]
        self.input_norm = [layer.input_norm for layer in layers]
        self.post_norm = [layer.post_norm for layer in layers]
        self.norm = norm


def _forward(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor], start: int,
             k_cache: List[torch.Tensor], v_cache: List[torch.Tensor],
             wqkv: List[torch.classes.quantized.LinearPackedParamsBase], bqkv: List[Optional[torch.Tensor]],
             wo: List[torch.classes.quantized.LinearPackedParamsBase], bo: List[Optional[torch.Tensor]],
             w13: List[torch.classes.quantized.LinearPackedParamsBase],
             w2: List[torch.classes.quantized.LinearPackedParamsBase],
             input_norm: List[torch.Tensor], post_norm: List[torch.Tensor], norm: torch.Tensor,
             head: torch.classes.quantized.LinearPackedParamsBase, rows: Optional[torch.Tensor],
             num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float) -> torch.Tensor:
    """Logits ``[B, n, V]`` fp32 of ``h [B, T, H]`` (fp32 embeddings) after ``start`` cached positions.

    Writes each layer's keys and values into slots ``start .. start+T-1`` of ``k_cache[i]``,
    ``v_cache[i]`` (``[B, S, Hk, D]``); the caller advances the cache. ``cos, sin``: the rope
    tables ``[B, T, 1, D]`` (sin signed, ``rope_tables``); ``mask``: None for T = 1, else the
    causal ``[T, start+T]`` bool mask; ``rows``: the rows whose logits are wanted, or None for all.
    """
    b, t, hidden = h.shape[0], h.shape[1], h.shape[2]
    hq, hk, d = num_heads, num_kv_heads, head_dim
    qk_cols = (hq + hk) * d
    for i in range(len(wqkv)):
        qkv = torch.ops.quantized.linear_dynamic(F.rms_norm(h, [hidden], input_norm[i], eps), wqkv[i], False)
        bias = bqkv[i]
        if bias is not None:
            qkv += bias
        qk = qkv.narrow(2, 0, qk_cols).view(b, t, hq + hk, d)
        # rope_rotate's math: x * cos + cat(x2, x1) * cat(-s, s), the same products and sums, so the same bits
        qk = qk * cos + qk.roll(d // 2, -1) * sin
        k_cache[i].narrow(1, start, t).copy_(qk.narrow(2, hq, hk))
        v_cache[i].narrow(1, start, t).copy_(qkv.narrow(2, qk_cols, hk * d).view(b, t, hk, d))
        k, v = k_cache[i].narrow(1, 0, start + t), v_cache[i].narrow(1, 0, start + t)
        o = F.scaled_dot_product_attention(qk.narrow(2, 0, hq).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=True)  # [B, Hq, T, D]
        o = torch.ops.quantized.linear_dynamic(o.transpose(1, 2).reshape(b, t, hq * d), wo[i], False)
        bias = bo[i]
        if bias is not None:
            o += bias
        h = h + o
        gate_up = torch.ops.quantized.linear_dynamic(F.rms_norm(h, [hidden], post_norm[i], eps), w13[i], False)
        inter = gate_up.shape[-1] // 2
        h = h + torch.ops.quantized.linear_dynamic(F.silu(gate_up.narrow(2, 0, inter)) * gate_up.narrow(2, inter, inter),
                                                   w2[i], False)
    if rows is not None:
        h = h[:, rows]
    return torch.ops.quantized.linear_dynamic(F.rms_norm(h, [hidden], norm, eps), head, False)


@functools.cache
def scripted_forward():
    """:func:`_forward` compiled by TorchScript (once per process)."""
    with warnings.catch_warnings():
        # torch 2.13 marks torch.jit.script deprecated in favour of torch.compile, which cannot trace
        # this function (see above); torch is pinned, so the warning is not the user's to act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_forward)
