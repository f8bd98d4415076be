"""SwiGLU activation: ``silu(gate) * up``, the nonlinearity of the Llama MLP.

- Math in fp32, one rounding to the input dtype at the end.
- Elementwise over ``[..., N]``; the Triton kernel takes row and column strides, so
  ``gate``/``up`` may be the two halves of one fused ``gate_up`` projection (strided views).
- Output is a new contiguous tensor of the input's shape and dtype.
- On the CPU, bf16 takes graphspec's C++ kernel (kernels/cpu/silu_mul.cpp) at the levels with vector kernels
  (amx, avx512, avx2): one pass over each row, where the torch path writes three fp32 temporaries (a quarter of a
  1024-token prefill's time; perf/RESULTS.md). Its exp is ``fast_exp`` (relative error < 3e-7), so an output may
  differ from the reference by one bf16 rounding step. fp32 and the other levels keep the torch path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from graphspec.kernels import cpu
from graphspec.kernels._dispatch import FLOAT_DTYPES, check_tensor, use_triton

__all__ = ["silu_mul", "silu_mul_ref"]


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [M, N]
    up_ptr,  # [M, N]
    out_ptr,  # [M, N], contiguous
    stride_gm, stride_gn,
    stride_um, stride_un,
    N,
    BLOCK_N: tl.constexpr,
):
    """out[m, n] = gate[m, n] * sigmoid(gate[m, n]) * up[m, n]; grid (M, cdiv(N, BLOCK_N))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    g = tl.load(gate_ptr + row * stride_gm + offs * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_um + offs * stride_un, mask=mask, other=0.0).to(tl.float32)
    # exp of a non-positive number never overflows, whatever the sign of g
    e = tl.exp(-tl.abs(g))
    sigmoid = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    y = g * sigmoid * u
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Torch path and test oracle: ``silu(gate) * up`` in fp32, cast to ``gate.dtype``."""
    g = gate.float()
    return (torch.nn.functional.silu(g) * up.float()).to(gate.dtype)


def _silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    n = gate.shape[-1]
    g2 = gate.reshape(math.prod(gate.shape[:-1]), n)  # a view whenever the strides allow, a copy otherwise
    u2 = up.reshape(g2.shape)
    m = g2.shape[0]
    out = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out.reshape(gate.shape)
    block_n = min(triton.next_power_of_2(n), 1024)
    grid = (m, triton.cdiv(n, block_n))
    _silu_mul_kernel[grid](
        g2, u2, out,
        g2.stride(0), g2.stride(1),
        u2.stride(0), u2.stride(1),
        n,
        BLOCK_N=block_n,
    )
    return out.reshape(gate.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up: [..., N]`` (same shape, dtype, device) -> ``[..., N]``.

    silu(g) = g * sigmoid(g); computed in fp32, returned in the input dtype.
    """
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    if gate.ndim < 1:
        raise ValueError("gate must have at least 1 dimension ([..., N]), got a 0-d tensor")
    check_tensor("up", up, dtypes=FLOAT_DTYPES, device=gate.device)
    if up.shape != gate.shape:
        raise ValueError(f"up has shape {tuple(up.shape)} but gate has shape {tuple(gate.shape)}; they must match")
    if up.dtype != gate.dtype:
        raise ValueError(f"up has dtype {up.dtype} but gate has dtype {gate.dtype}; cast them to one dtype")
    if use_triton(gate):
        return _silu_mul_triton(gate, up)
    if gate.dtype == torch.bfloat16 and gate.device.type == "cpu" and cpu.bf16_linear():
        n = gate.shape[-1]
        g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)  # views whenever the strides allow
        if n > 1 and (g2.stride(1) != 1 or u2.stride(1) != 1):
            g2, u2 = g2.contiguous(), u2.contiguous()
        return cpu.ops().silu_mul(g2, u2).reshape(gate.shape)
    # Torch path: silu_mul_ref's values (tested bit for bit) with one temporary fewer.
    return torch.nn.functional.silu(gate.float()).mul_(up).to(gate.dtype)
