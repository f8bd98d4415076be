"""Linear layer ``y = x @ W^T (+ bias)`` with fp32 accumulation: every projection of the model.

- Two Triton kernels, chosen by the number of rows ``M`` (tokens):
  * tiled GEMM (``M > 16``, prefill): ``BLOCK_M x BLOCK_N`` output tiles in grouped order
    so neighbouring programs reuse weight tiles from L2;
  * skinny GEMM (``M <= 16``, decode and verify): bound by reading the weight once, so the
    weight read is spread over many programs: split over N, and over K when N alone gives
    too few programs; split-K partials (fp32) are summed by a second small kernel in a
    fixed order, so results are deterministic (no atomics).
- Block sizes come from ``triton.autotune`` over configs made by a generator and pruned
  by shape; the key buckets M to a power of two so a new prompt length does not retune.
  Under Triton's interpreter there is exactly one config (the interpreter is slow and
  benchmarks nothing).
- fp32 inputs use ``input_precision="ieee"`` (no TF32: fp32 models are the accuracy
  reference); bf16/fp16 feed tensor cores directly. Under the interpreter bf16 operands
  are upcast first, because its bf16 ``dot`` is wrong.
- The torch path is ``torch.nn.functional.linear``, except for weights made by
  ``prepare_weight``: on a CPU with oneDNN, fp32 and bf16 weights are reordered once, at load,
  into oneDNN's blocked layout and run by ``torch.ops.mkldnn._linear_pointwise``: ``F.linear``
  re-packs the weight on every call and, for fp32, runs a few rows on the plain layout at well over
  the cost of one row, while the blocked, pre-packed weight makes a few rows cost about one row (so a
  speculative verify costs about one decode step; the timings are in perf/RESULTS.md). ``prepare_weight`` is a no-op on CUDA
  and wherever Triton is requested. Products of fewer than ``MIN_ROWS`` rows on packed weights run
  as that many, and products of up to ``INVARIANT_MAX_ROWS`` rows run in blocks of the row counts
  measured to round each row as one row does: so a row comes out bit-identical inside a verify and
  alone (see both), and a prefill inside ``batched_rows()`` runs in one product.
- bf16 weights on a CPU take graphspec's own C++ kernel where the CPU backend's level has one (amx, avx512,
  avx2: :class:`NativeWeight`, ``graphspec.kernels.cpu``): it reads the weights at about the memory
  bandwidth with one thread, costs about the same for 1..8 rows (1..16 on AMX tiles), and gives every row the bits it gets
  alone, whatever the row count, with no padding or splitting. ``GRAPHSPEC_CPU=generic`` or ``torch`` (or
  ``layout="onednn"``) keeps oneDNN.
- GGUF block-format weights (``graphspec.kernels.qlinear.BlockWeight``: Q4_0 ... Q6_K as the file stores them)
  take fp32 activations and run by ``qlinear`` (the CPU backend's block GEMMs, or Triton on CUDA).
- Draft models on a CPU may use ``quantize_weight`` instead: int8 weights (``Int8Weight``) run by
  graphspec's int8 GEMM (the CPU backend's, at every C++ level; ``int8_linear_ref`` at the torch level),
  half the bytes of bf16; approximate, so for drafts only.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from graphspec.kernels import cpu
from graphspec.kernels.qlinear import BlockWeight, StackedWeight, qlinear
from graphspec.kernels._dispatch import (EXACT_ROWS_MAX, FLOAT_DTYPES, check_tensor, interpreter_enabled, rows_exact,
                                        use_triton)

__all__ = ["Int8Weight", "NativeWeight", "PackedWeight", "int8_linear_ref", "linear", "linear_ref", "prepare_weight",
           "quantize_weight"]

SKINNY_MAX_M = 16
"""Rows up to this count take the skinny (memory-bound) kernel; tl.dot needs 16 rows anyway."""

_INTERPRET = interpreter_enabled()


# ----------------------------------------------------------------------------------------------
# Tiled GEMM (prefill)


def _tiled_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=1)]
    # A dozen tile shapes around the Triton tutorial's: enough to adapt to fp32 (FMA) vs bf16
    # (tensor cores) and to N, few enough that the first call of a new shape compiles quickly.
    configs = []
    for (bm, bn), bk in itertools.product(((128, 128), (128, 64), (64, 128), (64, 64), (32, 64), (32, 128)), (32, 64)):
        configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                     num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3))
    return configs


def _prune_tiled(configs, named_args, **kwargs):
    m_bucket, n = named_args["M_BUCKET"], named_args["N"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(32, m_bucket) and c.kwargs["BLOCK_N"] <= max(64, n)]
    return kept or configs[:1]


@triton.jit
def _dot_k_range(x_rows, w_cols, stride_xk, stride_wk, m_mask, n_mask, offs_k, k_start, k_end,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """sum over k in [k_start, k_end) of x[rows, k] * w[cols, k] as a [BLOCK_M, BLOCK_N] fp32 tile.

    Shared by the tiled and skinny kernels; UPCAST widens operands to fp32 first (the interpreter's bf16
    ``tl.dot`` is wrong).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
    return acc


@triton.autotune(configs=_tiled_configs(), key=["M_BUCKET", "N", "K", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune_tiled})
@triton.jit
def _linear_tiled_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (only read when HAS_BIAS)
    y_ptr,  # [M, N], contiguous
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_b,
    M, N, K,
    M_BUCKET,  # autotune key only
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), fp32 accumulator; grid (cdiv(M, BM) * cdiv(N, BN),)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row-tiles walk the N tiles together, sharing weight tiles in L2.
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]

    acc = _dot_k_range(x_rows, w_cols, stride_xk, stride_wk, m_mask, n_mask, offs_k, 0, K,
                       BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n * stride_b, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Skinny GEMM (decode / verify)


def _skinny_configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=3)
            for bn, bk in itertools.product((32, 64, 128), (64, 128, 256)) if bn * bk <= 128 * 128]


def _prune_skinny(configs, named_args, **kwargs):
    n, k_split = named_args["N"], named_args["K_SPLIT"]
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= max(32, n) and c.kwargs["BLOCK_K"] <= max(64, k_split)]
    return kept or configs[:1]


@triton.autotune(configs=_skinny_configs(), key=["M_BUCKET", "N", "K", "SPLIT_K", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune_skinny})
@triton.jit
def _linear_skinny_kernel(
    x_ptr,  # [M, K], M <= 16
    w_ptr,  # [N, K]
    b_ptr,  # [N] (only read when HAS_BIAS and SPLIT_K == 1)
    out_ptr,  # SPLIT_K == 1: y [M, N] contiguous; else fp32 partials [SPLIT_K, M, N]
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_b,
    M, N, K,
    K_SPLIT,  # K elements per split (the last split may be shorter)
    M_BUCKET,  # autotune key only
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Partial y over one K range: out[s, m, n] = sum_{k in split s} x[m, k] * w[n, k]; grid (cdiv(N, BN), SPLIT_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)

    acc = _dot_k_range(x_rows, w_cols, stride_xk, stride_wk, m_mask, n_mask, offs_k, k_start, k_end,
                       BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n * stride_b, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # [SPLIT_K, M * N] fp32
    b_ptr,  # [N] (only read when HAS_BIAS)
    y_ptr,  # [M * N], contiguous
    stride_b,
    MN, N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y = sum_s part[s] (+ bias), summed in split order so every run rounds the same way; grid (cdiv(M*N, BLOCK),)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + (offs % N) * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_split_k(n: int, k: int, device: torch.device) -> int:
    """Split K until there are ~4 programs per SM, keeping >= 512 of K per split.

    Off CUDA (the interpreter) it assumes an H100-sized device (132 SMs), so CPU runs take the
    same split decisions a GPU would.
    """
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132
    n_programs = triton.cdiv(n, 64)
    want = triton.cdiv(4 * sms, n_programs)
    return max(1, min(want, k // 512, 16))


def _linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   split_k: int | None = None) -> torch.Tensor:
    """Triton launcher; ``split_k`` overrides the skinny kernel's K split (tests use it)."""
    n, k = weight.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k)  # a view whenever the strides allow
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out_shape = (*x.shape[:-1], n)
    if m == 0 or n == 0:
        return y.reshape(out_shape)
    if k == 0:
        y.zero_()
        if bias is not None:
            y += bias
        return y.reshape(out_shape)
    has_bias = bias is not None
    b = bias if has_bias else y  # placeholder pointer, never read
    b_stride = bias.stride(0) if has_bias else 0
    upcast = _INTERPRET and x.dtype == torch.bfloat16
    m_bucket = triton.next_power_of_2(m)

    if m > SKINNY_MAX_M and split_k is None:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _linear_tiled_kernel[grid](
            x2, weight, b, y,
            x2.stride(0), x2.stride(1),
            weight.stride(0), weight.stride(1),
            b_stride,
            m, n, k, m_bucket,
            HAS_BIAS=has_bias, UPCAST=upcast,
        )
        return y.reshape(out_shape)

    if m > SKINNY_MAX_M:
        raise ValueError(f"split_k applies to the skinny kernel (M <= {SKINNY_MAX_M}), got M={m}")
    if split_k is None:
        split_k = _choose_split_k(n, k, x.device)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    k_split = triton.cdiv(k, split_k)
    split_k = triton.cdiv(k, k_split)  # no empty splits
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split_k)  # noqa: E731
    _linear_skinny_kernel[grid](
        x2, weight, b, out,
        x2.stride(0), x2.stride(1),
        weight.stride(0), weight.stride(1),
        b_stride,
        m, n, k, k_split, m_bucket,
        SPLIT_K=split_k, HAS_BIAS=has_bias, UPCAST=upcast, BLOCK_M=SKINNY_MAX_M,
    )
    if split_k > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            out, b, y, b_stride, m * n, n, SPLIT_K=split_k, HAS_BIAS=has_bias, BLOCK=block,
        )
    return y.reshape(out_shape)


class PackedWeight:
    """A ``[N, K]`` weight reordered into oneDNN's blocked layout for the CPU torch path.

    Made by :func:`prepare_weight`; ``linear`` accepts it wherever it accepts a weight tensor.
    The original tensor is not kept (it would double the memory of a model); ``dense()``
    rebuilds it (a copy, for tests and for the rare caller that needs plain values).
    """

    __slots__ = ("packed", "shape", "dtype", "device", "rows_hint")

    def __init__(self, packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, rows_hint: int):
        self.packed = packed  # opaque mkldnn tensor
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.rows_hint = rows_hint  # the blocking oneDNN chose from (part of what picks its kernels)

    @property
    def ndim(self) -> int:
        return 2

    def dense(self) -> torch.Tensor:
        return self.packed.to_dense()

    def __repr__(self) -> str:
        return f"PackedWeight(shape={tuple(self.shape)}, dtype={self.dtype})"


class NativeWeight:
    """A bf16 ``[N, K]`` weight in the blocked layout of graphspec's C++ CPU kernel (``kernels/cpu/linear.cpp``).

    Made by :func:`prepare_weight` where the CPU backend's level has a bf16 linear (amx, avx512, avx2); ``linear``
    accepts it wherever it accepts a weight, and runs it at the level in force (at a level without that kernel,
    which only a later ``use_level`` can cause, as ``F.linear`` on ``dense()``). ``packed`` is
    ``[ceil(N/16), ceil(K/2), 16, 2]`` bf16 (zero padded), the same at every level; the original tensor is not
    kept; ``dense()`` rebuilds it (a copy).
    """

    __slots__ = ("packed", "shape", "dtype", "device")

    def __init__(self, packed: torch.Tensor, shape: torch.Size):
        self.packed = packed
        self.shape = torch.Size(shape)
        self.dtype = torch.bfloat16
        self.device = torch.device("cpu")

    @property
    def ndim(self) -> int:
        return 2

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` -> ``[ceil(N/16), ceil(K/2), 16, 2]``: for each block of 16 outputs and pair of inputs, the
        16 outputs' two weights side by side."""
        n, k = weight.shape
        nb, kp = -(-n // 16), -(-k // 2)
        padded = weight.new_zeros((nb * 16, kp * 2))
        padded[:n, :k] = weight
        return padded.view(nb, 16, kp, 2).permute(0, 2, 1, 3).contiguous()

    def dense(self) -> torch.Tensor:
        nb, kp = self.packed.shape[:2]
        full = self.packed.permute(0, 2, 1, 3).reshape(nb * 16, kp * 2)
        return full[:self.shape[0], :self.shape[1]].contiguous()

    def __repr__(self) -> str:
        return f"NativeWeight(shape={tuple(self.shape)}, dtype={self.dtype})"


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.is_cuda or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    if weight.dtype == torch.bfloat16:
        # Without AVX-512 BF16 (or AMX) oneDNN emulates bf16 and loses to F.linear.
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False  # fp16 needs AVX512-FP16 / AVX-NE-CONVERT; F.linear it is


# oneDNN picks the weight's blocking from the expected row count. fp32: hint 1 keeps the plain [N, K]
# layout, where one row is fastest but each extra row costs nearly another; hint 8 blocks the weight
# (AB16b64a), where up to 8 rows cost about one. A speculative verify needs that flat curve.
# bf16 blocks the weight (AB16b64a2b) whatever the hint.
_ROWS_HINT = {torch.float32: 8, torch.bfloat16: 1}


LAYOUTS = ("auto", "native", "onednn")
"""``prepare_weight``'s layouts on a CPU: auto (native for bf16 where it runs, else oneDNN), or either one."""


def prepare_weight(weight: torch.Tensor, rows_hint: int | None = None, layout: str = "auto"):
    """The layout ``linear`` runs fastest with on ``weight``'s device; call once, at load time.

    CPU, torch path: bf16 weights become a :class:`NativeWeight` where graphspec's C++ kernel runs (the CPU
    backend's amx, avx512 or avx2 level; ``graphspec.kernels.cpu``), else, like fp32 weights, a :class:`PackedWeight`
    (oneDNN available; bf16 only with hardware bf16). Everywhere else (CUDA, the Triton backend, fp16 on CPU):
    ``weight`` itself, unchanged. ``layout`` ("auto", "native", "onednn") picks one of the two CPU layouts;
    "native" is an error where that kernel cannot run. ``rows_hint`` (oneDNN only) is the number of rows ``x``
    is expected to have, from which oneDNN picks its blocking; the default is tuned for decode and verify
    (1..9 rows) per dtype.
    """
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
    if rows_hint is not None and (isinstance(rows_hint, bool) or not isinstance(rows_hint, int) or rows_hint < 1):
        raise ValueError(f"rows_hint={rows_hint!r}; expected a positive int (rows per call)")
    if use_triton(weight) or weight.device.type != "cpu" or weight.numel() == 0:
        if layout == "native":
            raise ValueError("layout='native' is graphspec's CPU kernel for bf16 weights, but this weight is "
                             f"{'empty' if weight.numel() == 0 else 'for the Triton backend or not on the CPU'}")
        return weight
    if layout == "native" or (layout == "auto" and weight.dtype == torch.bfloat16):
        if weight.dtype == torch.bfloat16 and cpu.bf16_linear():
            return NativeWeight(NativeWeight.pack(weight), weight.shape)
        if layout == "native":
            raise ValueError(f"layout='native' needs a bf16 weight (got {weight.dtype}) at a CPU level with a bf16 "
                             f"linear (amx, avx512 or avx2; this one is {cpu.level()}); use layout='auto' or 'onednn'")
    if not _can_pack(weight):
        return weight
    if rows_hint is None:
        rows_hint = _ROWS_HINT[weight.dtype]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
    return PackedWeight(packed, weight.shape, weight.dtype, rows_hint)


def _linear_native(x: torch.Tensor, weight: NativeWeight, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    if not cpu.bf16_linear():  # the level changed since the weight was prepared
        return torch.nn.functional.linear(x, weight.dense(), bias)
    y = cpu.ops().linear(x.reshape(-1, k), weight.packed, n, bias)
    return y.reshape(*x.shape[:-1], n)


def _linear_packed(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    # oneDNN reads the bias as contiguous whatever its strides (measured: wrong values otherwise).
    b = bias.contiguous() if bias is not None else None
    m = x2.shape[0]
    c = _consistent_rows(weight) if MIN_ROWS < m <= INVARIANT_MAX_ROWS and rows_exact() else m
    if m > c:  # split into equal blocks of at most c rows: see INVARIANT_MAX_ROWS
        n_blocks = -(-m // c)
        size = -(-m // n_blocks)
        y = torch.cat([_pointwise(x2[i:i + size], weight, b) for i in range(0, m, size)])
    else:
        y = _pointwise(x2, weight, b)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _pointwise(x2: torch.Tensor, weight: PackedWeight, b: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN product ``x2 [m, K] @ W^T``; fewer than MIN_ROWS rows run as MIN_ROWS (the last one repeated)."""
    m, k = x2.shape
    if m < MIN_ROWS:  # repeat the last row: see MIN_ROWS
        x2 = x2.expand(MIN_ROWS, k) if m == 1 else torch.cat([x2, x2[-1:].expand(MIN_ROWS - m, k)])
    return torch.ops.mkldnn._linear_pointwise(x2, weight.packed, b, "none", [], "")[:m]


MIN_ROWS = 4
"""Products on a packed weight with fewer rows run as this many (the last row repeated), for two
reasons. Exactness: for many weights (wide N like an lm_head or a fused gate/up, long K like a down
projection) oneDNN may run one row on another kernel than a few rows, and sum it in another order,
while a few rows agree bit for bit; a speculative verify runs K+1 rows and a decode step one, so
without this a bf16 near-tie flips and speculative output drifts from autoregressive. Speed: oneDNN's
1-, 2- and 3-row kernels can read the weight slower than its 4-row one (perf/RESULTS.md). 1 turns it
off (perf/cpu_step.py --min-rows)."""

INVARIANT_MAX_ROWS = EXACT_ROWS_MAX
"""Products of up to this many rows on a packed weight give every row exactly the bits of its one-row
product, whatever the row count (0 turns this off). oneDNN picks its kernel, and with it the order
of the sums, from the row count as well as the shape and the thread count, and where that changes
is a property of the CPU (on some CPUs a wide verify of a down projection already rounds rows unlike
one row, and greedy speculative output then drifts: perf/RESULTS.md). So the row counts that agree
are probed, once per weight shape, dtype, layout
and thread count (``_consistent_rows``), and a longer product of up to this many rows (a verify
block; a short prompt) runs as equal blocks within them: exact, and reading the weight once per
block. Longer products, and any inside ``batched_rows()`` (prefills), run whole: their rows are never
compared with single steps (``graphspec.kernels._dispatch.EXACT_ROWS_MAX``)."""

_PROBE_ROWS = 16  # the row counts probed: MIN_ROWS..16
_consistent: dict[tuple, int] = {}


def _consistent_rows(weight: PackedWeight) -> int:
    """The largest c <= _PROBE_ROWS such that every product of MIN_ROWS..c rows on ``weight`` rounds each
    row as its one-row product does (at least MIN_ROWS, where one row runs by construction).

    Measured on random inputs the first time a (shape, dtype, layout, threads) is seen, from the weight
    itself (the kernel depends on those, never on the values): about 28 products, once per process.
    """
    key = (tuple(weight.shape), weight.dtype, weight.rows_hint, torch.get_num_threads(), MIN_ROWS)
    c = _consistent.get(key)
    if c is None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(_PROBE_ROWS, weight.shape[1], generator=g).to(weight.dtype)
        alone = torch.cat([_pointwise(x[j:j + 1], weight, None) for j in range(_PROBE_ROWS)])
        c = max(MIN_ROWS, 1)
        for m in range(c + 1, _PROBE_ROWS + 1):
            if not torch.equal(_pointwise(x[:m], weight, None), alone[:m]):
                break
            c = m
        _consistent[key] = c
    return c


class Int8Weight:
    """A ``[N, K]`` weight rounded to int8 per output row, for a *draft* model on the CPU.

    Made by :func:`quantize_weight`: ``q`` int8 ``[N, K]``, ``scales`` fp32 ``[N]`` (w ~ q * scale, symmetric).
    ``linear`` multiplies fp32 activations by the int8 weights widened in registers (graphspec's int8 GEMM at
    the CPU level in force, ``kernels/cpu/int8_gemm.h``; at the torch level :func:`int8_linear_ref`): a step
    reads one byte a weight, half of bf16. The activations are not rounded: with outliers in them, 8-bit
    activations made a poor draft of SmolLM2 (tests/models/test_draft_quality.py). Approximate all the same
    (the weights), which is fine for a draft (speculative decoding stays lossless whatever the draft computes)
    and wrong for a target: ``Pipeline`` never quantizes a target. ``native(level)`` is the weight packed for that
    level's C++ (made once, shared with the draft's C++ forward); ``dense()`` gives the dequantized fp32 values.
    """

    __slots__ = ("q", "scales", "shape", "dtype", "device", "_native")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.q = q
        self.scales = scales
        self.shape = torch.Size(q.shape)
        self.dtype = dtype  # the activations' dtype: linear takes and returns it
        self.device = torch.device("cpu")
        self._native: dict[str, object] = {}

    @property
    def ndim(self) -> int:
        return 2

    def native(self, level: str | None = None):
        """This weight as level ``level``'s ``Int8Linear`` (default: the level in force; packed on first use)."""
        level = cpu.level() if level is None else level
        obj = self._native.get(level)
        if obj is None:
            obj = self._native[level] = cpu.classes(level).Int8Linear(self.q, self.scales)
        return obj

    def dense(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]

    def __repr__(self) -> str:
        return f"Int8Weight(shape={tuple(self.shape)}, activations={self.dtype})"


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8 rounding of a CPU ``[N, K]`` weight: scale = max |row| / 127, q = round(w / scale).

    For draft models only (see :class:`Int8Weight`). Errors, rather than falling back, where the weight is not
    on the CPU.
    """
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    if weight.device.type != "cpu":
        raise ValueError(f"int8 weights are a CPU path, but the weight is on {weight.device}; "
                         "load the draft without quantize on a GPU")
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous(), weight.dtype)


def int8_linear_ref(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``x [M, K]`` fp32 times an :class:`Int8Weight` as graphspec's int8 GEMM defines it: ``(x @ q^T) * scale``,
    fp32 (the C++ sums in its own fixed order). The torch level's int8 path and the tests' oracle; it widens the
    int8 weight to fp32 on every call, so it is slow."""
    return (x.float() @ weight.q.t().float()) * weight.scales


def _linear_int8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, weight.shape[1]).float()
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    if cpu.available():
        y = weight.native().forward(x2.contiguous())
    else:
        y = int8_linear_ref(x2, weight)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _linear_blocks(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A GGUF block-format weight (``graphspec.kernels.qlinear``): fp32 activations, fp32 result."""
    if x.dtype != torch.float32:
        raise ValueError(f"a {type(weight).__name__} ({weight!r}) multiplies fp32 activations, but x is {x.dtype}; "
                         "load a GGUF-weights model with dtype float32")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} ([N, K]) but x's last dimension is {x.shape[-1]}; "
                         "K must match")
    if x.device != weight.device:
        raise ValueError(f"weight is a {type(weight).__name__} on {weight.device} but x is on {x.device}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(torch.float32,), device=x.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} elements but weight has N={weight.shape[0]} rows")
    return qlinear(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch path and test oracle: ``torch.nn.functional.linear``."""
    return torch.nn.functional.linear(x, weight, bias)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[..., N] = x[..., K] @ weight[N, K]^T (+ bias[N])``, accumulated in fp32, returned in x.dtype.

    x, weight and bias share one float dtype (fp32/bf16/fp16) and one device; any strides.
    ``weight`` may also be what :func:`prepare_weight` returned for it.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim < 1:
        raise ValueError("x must have at least 1 dimension ([..., K]), got a 0-d tensor")
    if isinstance(weight, (BlockWeight, StackedWeight)):
        return _linear_blocks(x, weight, bias)
    packed = isinstance(weight, (PackedWeight, NativeWeight, Int8Weight))
    if not packed:
        check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    elif x.device != weight.device:
        raise ValueError(f"weight is a CPU {type(weight).__name__} but x is on {x.device}; prepare weights on "
                         "x's device")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype} but x has dtype {x.dtype}; load the model in one dtype")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} ([N, K]) but x's last dimension is {x.shape[-1]}; "
                         "K must match")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        if bias.dtype != x.dtype:
            raise ValueError(f"bias has dtype {bias.dtype} but x has dtype {x.dtype}; load the model in one dtype")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} elements but weight has N={weight.shape[0]} rows")
    if packed:
        if use_triton(x):
            raise ValueError(f"weight is a {type(weight).__name__} (a layout for the CPU torch path) but the "
                             "Triton backend is requested; load the model with backend='triton' (weights stay "
                             "plain, no quantize) or use backend='torch'")
        if isinstance(weight, Int8Weight):
            return _linear_int8(x, weight, bias)
        if isinstance(weight, NativeWeight):
            return _linear_native(x, weight, bias)
        return _linear_packed(x, weight, bias)
    if use_triton(x):
        return _linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)
