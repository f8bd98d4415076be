"""attention: Triton (both kernels, through the interpreter) against the fp32 reference, and the
reference against an independent float64 formula; odd shapes, GQA, strided cache views, errors."""

import importlib
import sys

import pytest
import torch

from graphspec.kernels import attention, attention_ref, use_backend
from graphspec.kernels.attention import _attention_triton
from tests.kernels._compare import assert_close
from tests.kernels._sm90 import compile_main, have_ptxas, run_compile_check


# (atol, rtol) per dtype: bf16/fp16 kernels round the softmax weights to the storage dtype
# before the P @ V product (as flash attention does on a GPU), the reference keeps fp32.
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _inputs(B, T, L, Hq, Hk, D, dtype, s_max=None, q_strided=False):
    """q and k/v as the model passes them: k/v strided slices [:, :L] of a preallocated cache."""
    s_max = s_max or L + 5
    k_cache = torch.randn(B, s_max, Hk, D).to(dtype)
    v_cache = torch.randn(B, s_max, Hk, D).to(dtype)
    if q_strided:  # a slice of a fused [B, T, Hq + 2 Hk, D] projection, as a fused QKV would give
        q = torch.randn(B, T, Hq + 2 * Hk, D).to(dtype)[:, :, :Hq]
    else:
        q = torch.randn(B, T, Hq, D).to(dtype)
    return q, k_cache[:, :L], v_cache[:, :L]


def _naive(q, k, v, scale):
    """Float64 attention written out head by head from the definition."""
    B, T, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    qd, kd, vd = q.double(), k.double(), v.double()
    kd = kd.repeat_interleave(G, dim=2)
    vd = vd.repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,blhd->bhtl", qd, kd) * scale
    qpos = torch.arange(L - T, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return torch.einsum("bhtl,blhd->bthd", s.softmax(-1), vd)


# (B, T, L, Hq, Hk, D): T, L in {1, 3, 17, 77}; (Hq, Hk) in {(4, 4), (8, 2), (6, 1)}; D in {64, 80, 128}
SHAPES = [
    (1, 1, 1, 4, 4, 64),
    (2, 1, 77, 8, 2, 80),
    (1, 3, 3, 6, 1, 128),
    (2, 3, 17, 4, 4, 80),
    (1, 3, 77, 6, 1, 64),
    (2, 17, 17, 8, 2, 64),
    (1, 17, 77, 4, 4, 128),
    (2, 77, 77, 6, 1, 80),
    (1, 1, 17, 6, 1, 80),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}L{}H{}x{}D{}".format(*s))
def test_triton_matches_reference(shape, dtype):
    B, T, L, Hq, Hk, D = shape
    q, k, v = _inputs(B, T, L, Hq, Hk, D, dtype, q_strided=(T == 3))
    expected = attention_ref(q, k, v)
    atol, rtol = TOL[dtype]
    for mode in ("prefill", "split"):
        if mode == "split" and T * (Hq // Hk) > 128:  # one program holds at most 128 query rows
            continue
        # three splits where the cache is long enough exercises the partial/combine path
        out = _attention_triton(q, k, v, None, mode=mode, num_splits=3 if mode == "split" else None)
        assert out.dtype == dtype and out.shape == (B, T, Hq, D)
        assert_close(out, expected, atol, rtol, name=f"attention[{mode}]")


def test_long_prefill_and_split_decode_423():
    q, k, v = _inputs(1, 423, 423, 8, 2, 64, torch.float16, s_max=512)
    assert_close(_attention_triton(q, k, v, None, mode="prefill"), attention_ref(q, k, v), *TOL[torch.float16],
                 name="prefill T=L=423")
    q1 = q[:, -2:]
    assert_close(_attention_triton(q1, k, v, None, mode="split", num_splits=5), attention_ref(q1, k, v),
                 *TOL[torch.float16], name="split T=2 L=423")


def test_dispatch_runs_triton_when_asked_and_picks_a_kernel():
    q, k, v = _inputs(2, 5, 40, 8, 2, 80, torch.float32)
    with use_backend("triton"):
        out = attention(q, k, v, scale=0.05)
    assert_close(out, attention_ref(q, k, v, scale=0.05), *TOL[torch.float32], name="attention(triton)")
    with use_backend("torch"):
        assert torch.equal(attention(q, k, v, scale=0.05), attention_ref(q, k, v, scale=0.05))


@pytest.mark.parametrize("shape", [(2, 1, 9, 8, 2, 80), (1, 5, 12, 6, 1, 64), (2, 7, 7, 4, 4, 128)])
def test_reference_matches_definition(shape):
    B, T, L, Hq, Hk, D = shape
    q, k, v = _inputs(B, T, L, Hq, Hk, D, torch.float32)
    for scale in (None, 0.3):
        expected = _naive(q, k, v, D ** -0.5 if scale is None else scale)
        assert_close(attention_ref(q, k, v, scale), expected, 2e-6, 1e-5, name="attention_ref")


def test_reference_keeps_dtype_and_is_causal():
    q, k, v = _inputs(1, 4, 10, 4, 2, 64, torch.bfloat16)
    out = attention_ref(q, k, v)
    assert out.dtype == torch.bfloat16
    # changing a key after the first query's position must not change the first query's output
    k2 = k.clone()
    k2[:, 7:] = 100.0
    out2 = attention_ref(q, k2, v)
    assert torch.equal(out[:, 0], out2[:, 0])
    assert not torch.equal(out[:, 3], out2[:, 3])


def _bad(**over):
    q, k, v = _inputs(1, 3, 8, 4, 2, 64, torch.float32)
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return args


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("over,match", [
    (dict(q=torch.randn(1, 3, 5, 64)), "multiple"),
    (dict(q=torch.randn(1, 9, 4, 64)), "T=9"),
    (dict(q=torch.randn(1, 3, 4, 80)), "head_dim"),
    (dict(q=torch.randn(1, 3, 4, 64, dtype=torch.float64)), "q has dtype"),
    (dict(k=torch.randn(1, 8, 2, 64).half(), v=torch.randn(1, 8, 2, 64).half()), "one dtype"),
    (dict(q=torch.randn(1, 3, 4, 64, device="meta")), "device"),
    (dict(v=torch.randn(1, 7, 2, 64)), "but v has"),
    (dict(k=torch.randn(2, 8, 2, 64), v=torch.randn(2, 8, 2, 64)), "batch"),
    (dict(q=torch.randn(3, 4, 64)), "q must have 4"),
])
def test_errors_name_the_argument(over, match, backend):
    with use_backend(backend), pytest.raises(ValueError, match=match):
        attention(**_bad(**over))


# ----------------------------------------------------------------------------- sm_90 compile check
# The interpreter accepts programs a GPU compiler rejects (dot shapes, dtype mixes, shared memory),
# so the kernels are also compiled ahead of time to sm_90 cubins with the ptxas inside the triton
# wheel. Kernels must be defined with the interpreter off: the check runs in a subprocess
# (``python -m tests.kernels.test_attention``); the helpers live in tests/kernels/_sm90.py.

def _sm90_specs():
    """The launcher's configurations for D=128 (the largest tiles), fp32 and bf16 (fp16 lowers like bf16)."""
    mod = importlib.import_module("graphspec.kernels.attention")
    specs = []
    for dt, torch_dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        p = "*" + dt
        strides = {f"stride_{t}{c}": "i32" for t, cs in (("q", "bthd"), ("k", "blhd"), ("v", "blhd"), ("o", "bthd"))
                   for c in cs}
        probe = torch.empty(0, dtype=torch_dt)
        precision = "tf32x3" if dt == "fp32" else "tf32"
        block_n, stages = mod._pipeline(probe, 64, 128)
        specs.append((f"prefill {dt}", mod._attn_prefill_kernel,
                      {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, **strides, "T": "i32", "L": "i32", "Hq": "i32",
                       "D": "i32", "GROUP": "i32", "qk_scale": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                       "BLOCK_D": "constexpr", "DOT_FP32": "constexpr", "DOT_PRECISION": "constexpr"},
                      {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_D": 128, "DOT_FP32": False, "DOT_PRECISION": precision},
                      {"num_warps": 8, "num_stages": stages}))
        for block_m, direct in ((16, True), (mod._SPLIT_MAX_ROWS, False)):
            block_n, stages = mod._pipeline(probe, block_m, 128)
            specs.append((f"split {dt} BLOCK_M={block_m}", mod._attn_split_kernel,
                          {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "part_acc_ptr": "*fp32",
                           "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", **strides, "T": "i32", "L": "i32",
                           "Hk": "i32", "D": "i32", "GROUP": "i32", "qk_scale": "fp32", "split_len": "i32",
                           "num_splits": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                           "BLOCK_D": "constexpr", "DOT_FP32": "constexpr", "DOT_PRECISION": "constexpr",
                           "DIRECT": "constexpr"},
                          {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": 128, "DOT_FP32": False,
                           "DOT_PRECISION": precision, "DIRECT": direct},
                          {"num_warps": 4 if block_m * 128 <= 4096 else 8, "num_stages": stages}))
        specs.append((f"combine {dt}", mod._attn_combine_kernel,
                      {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "o_ptr": p,
                       **{f"stride_o{c}": "i32" for c in "bthd"}, "T": "i32", "Hk": "i32", "D": "i32",
                       "GROUP": "i32", "num_splits": "i32", "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"},
                      {"BLOCK_S": mod._MAX_SPLITS, "BLOCK_D": 128}, {"num_warps": 4}))
    return specs


@pytest.mark.skipif(not have_ptxas(), reason="this triton wheel ships no ptxas; cannot compile for sm_90 here")
def test_attention_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.test_attention")


if __name__ == "__main__":
    sys.exit(compile_main(_sm90_specs()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_verify_rows_equal_one_token_steps_bitwise(dtype):
    """On the CPU path, row j of a T-row verify is exactly the one-token step at that position.

    Greedy speculative output can only equal autoregressive output bit for bit if each verify row
    rounds like the one-token step did; torch's SDPA alone does not guarantee that (it rounds a row
    differently depending on how many rows it gets), hence the row-by-row path for small T.
    """
    g = torch.Generator().manual_seed(0)
    mismatches = 0
    for trial in range(12):
        L, T = 20 + 9 * trial, 1 + trial % 8
        q = torch.randn(1, T, 9, 64, generator=g).to(dtype)
        k = torch.randn(1, L, 3, 64, generator=g).to(dtype)
        v = torch.randn(1, L, 3, 64, generator=g).to(dtype)
        full = attention(q, k, v)
        for j in range(T):
            one = attention(q[:, j:j + 1], k[:, :L - T + 1 + j], v[:, :L - T + 1 + j])
            mismatches += not torch.equal(one, full[:, j:j + 1])
    assert mismatches == 0
