"""The part-A kernels compile for a real GPU (sm_90, H100/H200), checked on a machine without one.

The interpreter accepts programs the GPU compiler rejects (dot shapes, dtype mixes, fp64 ops,
shared-memory limits), so each kernel is also compiled ahead of time down to a cubin with the
ptxas that ships inside the triton wheel. That needs the kernels defined with the interpreter
off, so the check runs in a subprocess (``python -m tests.kernels.test_compile_sm90``).
One config per kernel, fp32 and bf16, keeps it to ~16 kernels; Triton's cache makes reruns cheap.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from tests.kernels._sm90 import compile_main, have_ptxas, run_compile_check



def _specs():
    """(name, kernel, signature, constexprs, options) for every kernel in linear, rmsnorm, rope, silu_mul."""
    lin = importlib.import_module("graphspec.kernels.linear")
    rms = importlib.import_module("graphspec.kernels.rmsnorm")
    rope = importlib.import_module("graphspec.kernels.rope")
    silu = importlib.import_module("graphspec.kernels.silu_mul")
    specs = []
    for dt in ("fp32", "bf16"):  # fp16 lowers like bf16 (same tensor-core path); left out for time
        p = "*" + dt
        specs.append((f"silu_mul {dt}", silu._silu_mul_kernel,
                      {"gate_ptr": p, "up_ptr": p, "out_ptr": p, "stride_gm": "i64", "stride_gn": "i64",
                       "stride_um": "i64", "stride_un": "i64", "N": "i32", "BLOCK_N": "constexpr"},
                      {"BLOCK_N": 1024}, {}))
        for single in (True, False):
            specs.append((f"rmsnorm {dt} single_tile={single}", rms._rmsnorm_kernel,
                          {"x_ptr": p, "res_ptr": p, "w_ptr": p, "y_ptr": p, "h_ptr": p, "stride_xm": "i64",
                           "stride_xh": "i64", "stride_rm": "i64", "stride_rh": "i64", "stride_w": "i64", "H": "i32",
                           "eps": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK_H": "constexpr",
                           "SINGLE_TILE": "constexpr"},
                          {"HAS_RESIDUAL": True, "BLOCK_H": 4096 if single else 1024, "SINGLE_TILE": single},
                          {"num_warps": 8}))
        specs.append((f"rope {dt}", rope._rope_kernel,
                      {"q_ptr": p, "k_ptr": p, "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "qo_ptr": p, "ko_ptr": p,
                       **{f"stride_q{c}": "i64" for c in "bthd"}, **{f"stride_k{c}": "i64" for c in "bthd"},
                       "stride_pb": "i64", "stride_pt": "i64", "T": "i32", "HQ": "i32", "HK": "i32",
                       "attention_scaling": "fp32", "HALF": "constexpr", "BLOCK_HALF": "constexpr",
                       "BLOCK_H": "constexpr"},
                      {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 32}, {}))
        common = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "stride_xm": "i64", "stride_xk": "i64", "stride_wn": "i64",
                  "stride_wk": "i64", "stride_b": "i64", "M": "i32", "N": "i32", "K": "i32"}
        big = max(lin._tiled_configs(), key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])
        specs.append((f"linear tiled {dt} {big.kwargs}", lin._linear_tiled_kernel,
                      {**common, "y_ptr": p, "M_BUCKET": "i32", "HAS_BIAS": "constexpr", "UPCAST": "constexpr",
                       "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr"},
                      {"HAS_BIAS": True, "UPCAST": False, **big.kwargs},
                      {"num_warps": big.num_warps, "num_stages": big.num_stages}))
        big = max(lin._skinny_configs(), key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])
        for split in (1, 4):
            specs.append((f"linear skinny {dt} split_k={split} {big.kwargs}", lin._linear_skinny_kernel,
                          {**common, "out_ptr": p if split == 1 else "*fp32", "K_SPLIT": "i32", "M_BUCKET": "i32",
                           "SPLIT_K": "constexpr", "HAS_BIAS": "constexpr", "UPCAST": "constexpr",
                           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                          {"SPLIT_K": split, "HAS_BIAS": True, "UPCAST": False, "BLOCK_M": lin.SKINNY_MAX_M,
                           **big.kwargs},
                          {"num_warps": big.num_warps, "num_stages": big.num_stages}))
        specs.append((f"linear split_k_reduce {dt}", lin._split_k_reduce_kernel,
                      {"part_ptr": "*fp32", "b_ptr": p, "y_ptr": p, "stride_b": "i64", "MN": "i32", "N": "i32",
                       "SPLIT_K": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"},
                      {"SPLIT_K": 4, "HAS_BIAS": True, "BLOCK": 1024}, {}))
    specs.extend(_qlinear_specs())
    return specs


def _qlinear_specs():
    """The GGUF block GEMM (kernels/qlinear.py): every format at the skinny launch, the k-quants at the tiled one."""
    q = importlib.import_module("graphspec.kernels.qlinear")
    sig = {"x_ptr": "*fp32", "w_ptr": "*u8", "b_ptr": "*fp32", "y_ptr": "*fp32", "stride_xm": "i64",
           "stride_xk": "i64", "M": "i32", "N": "i32", "K": "i32", "row_bytes": "i32", "TYPE": "constexpr",
           "HAS_BIAS": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    specs = []
    for name, tid in q.TYPE_IDS.items():
        for m in (1, 64) if name in ("Q4_K", "Q5_K", "Q6_K") else (1,):
            cfg = dict(q._qconfig(m))
            warps = cfg.pop("num_warps")
            specs.append((f"qlinear {name} {'skinny' if m == 1 else 'tiled'} {cfg}", q._qlinear_kernel, sig,
                          {"TYPE": tid, "HAS_BIAS": True, **cfg}, {"num_warps": warps, "enable_fp_fusion": False}))
    return specs


@pytest.mark.skipif(not have_ptxas(), reason="this triton wheel ships no ptxas; cannot compile for sm_90 here")
def test_part_a_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.test_compile_sm90")


if __name__ == "__main__":
    sys.exit(compile_main(_specs()))
