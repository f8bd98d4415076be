"""attention: Triton (both kernels, through the interpreter) against the fp32 reference, and the
reference against an independent float64 formula; odd shapes, GQA, strided cache views, errors;
tree attention (draft trees verified in one forward) against per-row attention over each node's path."""

import importlib
import sys

import pytest
import torch

from graphspec.kernels import EXACT_CHAIN_ROWS_MAX, attention, attention_ref, batched_rows, cpu, use_backend
from graphspec.kernels.attention import _AMX_HEAD_DIMS, _EXACT_MAX_T, _attention_triton, ancestor_mask
from tests.kernels._compare import assert_close
from tests.kernels._compare import attention_inputs as _inputs
from tests.kernels._sm90 import compile_main, have_ptxas, run_compile_check


# (atol, rtol) per dtype: bf16/fp16 kernels round the softmax weights to the storage dtype
# before the P @ V product (as flash attention does on a GPU), the reference keeps fp32.
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


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
    with use_backend("torch"):  # the CPU path: C++ rows (kernels/cpu/attention.cpp) or one-row SDPA calls
        assert_close(attention(q, k, v, scale=0.05), attention_ref(q, k, v, scale=0.05), *TOL[torch.float32],
                     name="attention(torch)")


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


# ----------------------------------------------------------------------------- tree attention
# A tree row must equal plain causal attention of that one query over the keys on its path:
# the cache prefix, then its ancestors and itself, root first (the context it would have had
# if its branch had been decoded token by token).

def test_ancestor_mask_examples():
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ancestor_mask([-1, 0, 1, 0]), expected)
    assert torch.equal(ancestor_mask([-1, 0, 1, 2, 3]), torch.ones(5, 5, dtype=torch.bool).tril())  # chain: causal
    assert torch.equal(ancestor_mask([-1, -1, -1]), torch.eye(3, dtype=torch.bool))  # three roots
    assert torch.equal(ancestor_mask(torch.tensor([-1, 0, 0, 2])),  # tensor entries are ints too
                       torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))
    empty = ancestor_mask([])
    assert empty.shape == (0, 0) and empty.dtype == torch.bool
    assert ancestor_mask([-1, 0], device="cpu").device.type == "cpu"


@pytest.mark.parametrize("parents,match", [
    ([0], r"parents\[0\] = 0 must be -1"),
    ([-1, 1], r"parents\[1\] = 1 must be -1 .* \[0, 1\)"),
    ([-1, 0, 3, 0], r"parents\[2\] = 3"),
    ([-1, -2], r"parents\[1\] = -2"),
    ([-1, 0.0], r"parents\[1\] = 0.0 is not an int"),
])
def test_ancestor_mask_errors(parents, match):
    with pytest.raises(ValueError, match=match):
        ancestor_mask(parents)


def _random_parents(T, g):
    """A random draft tree: node i hangs under a random earlier node, or starts a new root (p = 1/4)."""
    return [-1 if i == 0 or torch.rand(1, generator=g, device="cpu").item() < 0.25
            else int(torch.randint(0, i, (1,), generator=g, device="cpu")) for i in range(T)]


def _path(parents, j):
    """Node j's ancestors and j itself, root first (walked up from the parent list, not read off the mask)."""
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


def _path_cache(x, T, path, s_max=None):
    """What a token-by-token decode of node j's branch would hold: the L - T cached keys, then the path's
    new keys, written into a fresh preallocated cache and sliced to that length (a strided view)."""
    B, L = x.shape[:2]
    idx = torch.cat([torch.arange(L - T, device=x.device), (L - T) + torch.tensor(path, device=x.device)])
    cache = torch.zeros(B, s_max or L + 7, *x.shape[2:], dtype=x.dtype, device=x.device)
    cache[:, :len(idx)] = x[:, idx]
    return cache[:, :len(idx)]


# (B, cached L - T, Hq, Hk, D): no cache (a new root sees only itself), odd caches, GQA, D in {64, 80, 128}
TREE_REF_SHAPES = [(2, 0, 8, 2, 80), (1, 13, 6, 1, 64), (2, 31, 4, 4, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 5, 9, 17])
@pytest.mark.parametrize("shape", TREE_REF_SHAPES, ids=lambda s: "B{}C{}H{}x{}D{}".format(*s))
def test_reference_tree_rows_match_path_attention(shape, T, dtype):
    B, cached, Hq, Hk, D = shape
    L = cached + T
    g = torch.Generator().manual_seed(T + cached)
    parents = _random_parents(T, g)
    q, k, v = _inputs(B, T, L, Hq, Hk, D, dtype)
    tree = ancestor_mask(parents, device=q.device)
    out = attention_ref(q, k, v, tree=tree)
    assert out.dtype == dtype and out.shape == (B, T, Hq, D)
    atol, rtol = (2e-6, 1e-5) if dtype == torch.float32 else TOL[dtype]
    for j in range(T):
        path = _path(parents, j)
        expected = _naive(q[:, j:j + 1], _path_cache(k, T, path), _path_cache(v, T, path), D ** -0.5)
        assert_close(out[:, j:j + 1], expected, atol, rtol, name=f"attention_ref(tree) row {j}, path {path}")


def _deep_parents(T):
    """Two roots; every later node hangs under the one before it, from the second root: deep rows whose
    path is not the chain, so every slot after the cache holds another node than in place."""
    return [-1, -1] + list(range(1, T - 1))


# (T, cached keys, parents, (B, Hq, Hk, D)): no cache; short and odd caches; a cache past flash attention's
# 512-key blocks; deep trees; one kv head with one query head; MHA; GQA with D=80; batch 2; one row; more
# than 64 rows (the masked reference).
EXACT_TRIALS = [
    (2, 0, None, (2, 9, 3, 64)),
    (3, 13, None, (1, 1, 1, 64)),
    (5, 27, None, (2, 9, 3, 80)),
    (8, 40, None, (1, 4, 4, 128)),
    (11, 59, None, (2, 6, 1, 64)),
    (16, 91, None, (1, 1, 1, 80)),
    (5, 300, None, (1, 1, 1, 64)),
    (1, 200, None, (1, 1, 1, 128)),
    (9, 530, None, (1, 12, 2, 128)),
    (1, 70, None, (2, 9, 3, 80)),
    (1, 47, None, (1, 1, 1, 64)),
    (4, 33, None, (1, 4, 2, 72)),  # a head dim off the C++ kernel's 16-float vectors: its scalar loop
    (20, 37, "deep", (1, 6, 2, 64)),
    (40, 101, "deep", (2, 3, 1, 80)),
    (33, 16, None, (1, 2, 2, 64)),
    (66, 30, None, (1, 4, 2, 64)),
    # Query heads per kv head past the C++ kernel's P @ V tiles (7 = 6 + 1, 5, 4), head dims of 1, 3 and 16 of its
    # 16-float chunks (bf16 scores take 32 at a time: 16 and 48 end on a half block).
    (3, 21, None, (1, 14, 2, 64)),
    (2, 45, None, (1, 5, 1, 256)),
    (6, 17, None, (1, 8, 2, 16)),
    (7, 35, None, (1, 10, 2, 48)),
]


def _exact_trial(trial, dtype, g):
    """One trial's q and its k, v as the model passes them (strided slices of a cache), and its tree."""
    T, cached, kind, (B, Hq, Hk, D) = trial
    q, k, v = _inputs(B, T, cached + T, Hq, Hk, D, dtype)
    parents = _deep_parents(T) if kind == "deep" else _random_parents(T, g)
    return q, k, v, parents


@pytest.fixture
def cpu_rows(attention_level):
    """The CPU row-exact path under test: C++ (kernels/cpu/attention.cpp) at each level this CPU executes (amx: bf16
    on tiles), or, at the torch level, TorchScript SDPA rows."""
    return attention_level


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_tree_rows_equal_one_token_steps_bitwise(dtype, cpu_rows):
    """On the CPU path, row j of a tree verify is exactly a one-token step over the prefix and j's path.

    Greedy tree verification is lossless only if each row rounds as the token-by-token decode of its
    branch would; a chain (the causal lower triangle) must give exactly the plain causal verify.
    """
    g = torch.Generator().manual_seed(0)
    mismatches = []
    for trial in EXACT_TRIALS:
        q, k, v, parents = _exact_trial(trial, dtype, g)
        T = q.shape[1]
        tree = ancestor_mask(parents, device="cpu")
        with use_backend("torch"):
            full = attention(q, k, v, tree=tree)
            chain = attention(q, k, v, tree=ancestor_mask(range(-1, T - 1), device="cpu"))
            causal = attention(q, k, v)
            # (past _EXACT_MAX_T a chain with tree=None is row-exact in C++ while a tree takes the masked reference)
            if T <= _EXACT_MAX_T and not torch.equal(chain, causal):
                mismatches.append(f"{trial}: causal tree != tree=None")
            if T > _EXACT_MAX_T:
                if not torch.equal(full, attention_ref(q, k, v, tree=tree)):
                    mismatches.append(f"{trial}: not the masked reference")
                continue
            for j in range(T):
                path = _path(parents, j)
                one = attention(q[:, j:j + 1], _path_cache(k, T, path), _path_cache(v, T, path))
                if not torch.equal(one, full[:, j:j + 1]):
                    mismatches.append(f"{trial} row {j} path {path}")
                seen = k.shape[1] - T + j + 1  # the causal verify's row j: the one-token step at its position
                if not torch.equal(attention(q[:, j:j + 1], k[:, :seen], v[:, :seen]), causal[:, j:j + 1]):
                    mismatches.append(f"{trial} chain row {j}")
    assert not mismatches, mismatches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_exact_rows_match_definition(dtype, cpu_rows):
    """The CPU verify path is attention: each row against float64 attention over exactly its keys."""
    g = torch.Generator().manual_seed(1)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else TOL[dtype]
    for trial in EXACT_TRIALS:
        q, k, v, parents = _exact_trial(trial, dtype, g)
        T, D = q.shape[1], q.shape[3]
        with use_backend("torch"):
            full = attention(q, k, v, tree=ancestor_mask(parents, device="cpu"))
        for j in range(T):
            path = _path(parents, j)
            expected = _naive(q[:, j:j + 1], _path_cache(k, T, path), _path_cache(v, T, path), D ** -0.5)
            assert_close(full[:, j:j + 1], expected, atol, rtol, name=f"attention {trial} row {j}")


# (B, T, L, Hq, Hk, D): L == T (no cache), GQA + D=80, T*G=102 rows (BLOCK_M=128), T=64 (bit 63 is the sign bit)
TREE_TRITON_SHAPES = [
    (1, 5, 5, 4, 4, 64),
    (2, 9, 30, 8, 2, 80),
    (1, 17, 77, 6, 1, 64),
    (1, 64, 70, 2, 2, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", TREE_TRITON_SHAPES, ids=lambda s: "B{}T{}L{}H{}x{}D{}".format(*s))
def test_triton_tree_matches_reference(shape, dtype):
    B, T, L, Hq, Hk, D = shape
    q, k, v = _inputs(B, T, L, Hq, Hk, D, dtype, q_strided=(T == 9))
    parents = _random_parents(T, torch.Generator().manual_seed(T))
    if T == 64:
        parents[63] = 62  # a deep last row: bits 62 and 63 both set
    tree = ancestor_mask(parents, device=q.device)
    expected = attention_ref(q, k, v, tree=tree)
    atol, rtol = TOL[dtype]
    for mode, num_splits in (("prefill", None), ("split", 1), ("split", 3)):
        out = _attention_triton(q, k, v, None, mode=mode, num_splits=num_splits, tree=tree)
        assert out.dtype == dtype and out.shape == (B, T, Hq, D)
        assert_close(out, expected, atol, rtol, name=f"attention[{mode}, splits={num_splits}](tree)")
    with use_backend("triton"):  # the launcher's own choice of kernel
        assert_close(attention(q, k, v, tree=tree), expected, atol, rtol, name="attention(triton, tree)")


def _tree_call(backend, T, tree, L=8):
    q, k, v = _inputs(1, T, L, 4, 2, 64, torch.float32)
    q, k, v = q.cpu(), k.cpu(), v.cpu()  # content checks run on CPU trees only (no host sync on a GPU)
    if backend == "torch":
        with use_backend("torch"):
            return attention(q, k, v, tree=tree)
    return _attention_triton(q, k, v, None, tree=tree)  # these all fail validation, before any launch


def _causal(T, at=()):
    """The causal tree (a chain) on the CPU, with the entries ``(i, j, value)`` of ``at`` overwritten."""
    tree = torch.ones(T, T, dtype=torch.bool, device="cpu").tril()
    for i, j, value in at:
        tree[i, j] = value
    return tree


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tree,match", [
    (_causal(3).long(), "torch.bool"),
    (torch.ones(3, 9, dtype=torch.bool, device="cpu"), r"shape \(3, 9\) .* must be \(3, 3\)"),
    (torch.ones(2, 3, dtype=torch.bool, device="cpu"), r"shape \(2, 3\) .* must be \(3, 3\)"),
    (torch.ones(3, dtype=torch.bool, device="cpu"), r"shape \(3,\)"),
    ([[True]], "torch.Tensor"),
    (_causal(3, at=[(0, 2, True)]), r"tree\[0, 2\] is True above the diagonal"),
    (_causal(3, at=[(1, 1, False)]), r"tree\[1, 1\] is False"),
    (torch.ones(3, 3, dtype=torch.bool, device="meta"), "device"),
])
def test_tree_errors_say_what_to_fix(tree, match, backend):
    with pytest.raises(ValueError, match=match):
        _tree_call(backend, 3, tree)


def _wide_tree(T, m, g):
    """A ``[T, m]`` mask as a beam draft passes it: m - T cached tree nodes, then T new ones, each new row
    seeing a random set of the cached nodes and earlier new ones, and itself."""
    tree = torch.rand(T, m, generator=g) < 0.5
    for i in range(T):
        tree[i, m - T + i] = True
        tree[i, m - T + i + 1:] = False
    return tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,m,L", [(1, 4, 9), (3, 7, 13), (5, 5, 11), (2, 11, 11)])
def test_wide_tree_rows_see_exactly_their_keys(T, m, L, dtype):
    """tree [T, m]: row i sees the L - m keys before the tree and key L - m + j iff tree[i, j] (a beam's level)."""
    g = torch.Generator().manual_seed(T * 100 + m)
    q, k, v = _inputs(2, T, L, 6, 2, 64, dtype)
    tree = _wide_tree(T, m, g)
    with use_backend("torch"):
        out = attention(q, k, v, tree=tree)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = (2e-6, 1e-5) if dtype == torch.float32 else TOL[dtype]
    for i in range(T):
        idx = torch.tensor([*range(L - m), *(L - m + j for j in range(m) if tree[i, j])])
        expected = _naive(q[:, i:i + 1], k[:, idx], v[:, idx], 64 ** -0.5)
        assert_close(out[:, i:i + 1], expected, atol, rtol, name=f"wide tree row {i} over keys {idx.tolist()}")


@pytest.mark.parametrize("tree,match", [
    (torch.ones(2, 5, dtype=torch.bool), r"tree\[0, 4\] is True above the diagonal"),
    (torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 1, 0]], dtype=torch.bool), r"tree\[1, 4\] is False"),
])
def test_wide_tree_errors(tree, match):
    with pytest.raises(ValueError, match=match):
        _tree_call("torch", 2, tree)


def test_wide_tree_is_cpu_torch_only():
    tree = torch.tril(torch.ones(2, 5, dtype=torch.bool), diagonal=3)  # a chain through 3 cached nodes: causal
    torch.manual_seed(0)
    wide = _tree_call("torch", 2, tree)
    torch.manual_seed(0)
    causal = _tree_call("torch", 2, None)
    torch.testing.assert_close(wide, causal, atol=2e-6, rtol=1e-5)
    q, k, v = _inputs(1, 2, 8, 4, 2, 64, torch.float32)
    with use_backend("triton"), pytest.raises(ValueError, match="CPU torch path only"):
        attention(q.cpu(), k.cpu(), v.cpu(), tree=tree)


def test_tree_over_64_tokens_is_torch_only():
    tree = ancestor_mask(range(-1, 64), device="cpu")
    with pytest.raises(ValueError, match="at most 64 new tokens"):
        _tree_call("triton", 65, tree, L=70)
    out = _tree_call("torch", 65, tree, L=70)
    assert out.shape == (1, 65, 4, 64) and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- sm_90 compile check
# The interpreter accepts programs a GPU compiler rejects (dot shapes, dtype mixes, shared memory),
# so the kernels are also compiled ahead of time to sm_90 cubins with the ptxas inside the triton
# wheel. Kernels must be defined with the interpreter off: the check runs in a subprocess
# (``python -m tests.kernels.test_attention``); the helpers live in tests/kernels/_sm90.py.

def _sm90_specs():
    """The launcher's configurations for D=128 (the largest tiles), fp32 and bf16 (fp16 lowers like bf16);
    the largest prefill and split tiles also with a tree (HAS_TREE, an int64 bitmask per query)."""
    mod = importlib.import_module("graphspec.kernels.attention")
    specs = []
    for dt, torch_dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        p = "*" + dt
        strides = {f"stride_{t}{c}": "i32" for t, cs in (("q", "bthd"), ("k", "blhd"), ("v", "blhd"), ("o", "bthd"))
                   for c in cs}
        probe = torch.empty(0, dtype=torch_dt)
        precision = "tf32x3" if dt == "fp32" else "tf32"
        block_n, stages = mod._pipeline(probe, 64, 128)
        for tree in (False, True):  # without a tree the launcher passes o_ptr as the unused tree_ptr
            specs.append((f"prefill {dt}" + (" tree" if tree else ""), mod._attn_prefill_kernel,
                          {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "tree_ptr": "*i64" if tree else p,
                           **strides, "T": "i32", "L": "i32", "Hq": "i32", "D": "i32", "GROUP": "i32",
                           "qk_scale": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr",
                           "DOT_FP32": "constexpr", "DOT_PRECISION": "constexpr", "HAS_TREE": "constexpr"},
                          {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_D": 128, "DOT_FP32": False,
                           "DOT_PRECISION": precision, "HAS_TREE": tree},
                          {"num_warps": 8, "num_stages": stages}))
        for block_m, direct, tree in ((16, True, False), (mod._SPLIT_MAX_ROWS, False, False),
                                      (mod._SPLIT_MAX_ROWS, False, True)):
            block_n, stages = mod._pipeline(probe, block_m, 128)
            specs.append((f"split {dt} BLOCK_M={block_m}" + (" tree" if tree else ""), mod._attn_split_kernel,
                          {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "part_acc_ptr": "*fp32",
                           "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "tree_ptr": "*i64" if tree else p,
                           **strides, "T": "i32", "L": "i32",
                           "Hk": "i32", "D": "i32", "GROUP": "i32", "qk_scale": "fp32", "split_len": "i32",
                           "num_splits": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                           "BLOCK_D": "constexpr", "DOT_FP32": "constexpr", "DOT_PRECISION": "constexpr",
                           "DIRECT": "constexpr", "HAS_TREE": "constexpr"},
                          {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": 128, "DOT_FP32": False,
                           "DOT_PRECISION": precision, "DIRECT": direct, "HAS_TREE": tree},
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
def test_cpu_verify_rows_equal_one_token_steps_bitwise(dtype, cpu_rows):
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_long_chains_are_row_exact_in_cpp(dtype, cpu_rows):
    """Where the C++ attention runs (any C++ level), a chain of up to EXACT_CHAIN_ROWS_MAX rows (a prefix cache's
    row-exact prefill block) gives each row the one-token step's bits; past it (but on the amx level's bf16 tiles,
    row-exact at any length), and at the torch level past EXACT_ROWS_MAX, the block is one batched call (the
    reference)."""
    g = torch.Generator().manual_seed(5)
    native = cpu.available()
    for T, cached, (Hq, Hk, D) in ((65, 3, (6, 2, 64)), (131, 40, (4, 1, 80)), (EXACT_CHAIN_ROWS_MAX, 9, (2, 2, 64)),
                                    (EXACT_CHAIN_ROWS_MAX + 1, 0, (2, 1, 64))):
        L = cached + T
        q = torch.randn(1, T, Hq, D, generator=g).to(dtype)
        k = torch.randn(1, L, Hk, D, generator=g).to(dtype)
        v = torch.randn(1, L, Hk, D, generator=g).to(dtype)
        with use_backend("torch"):
            full = attention(q, k, v)
            # the amx level's bf16 tile path takes chains of any length (tests/kernels/cpu/test_amx.py)
            tiles = cpu_rows == "amx" and dtype == torch.bfloat16 and D in _AMX_HEAD_DIMS
            if not native or (T > EXACT_CHAIN_ROWS_MAX and not tiles):
                assert torch.equal(full, attention_ref(q, k, v)), (T, cpu_rows)
                continue
            bad = [j for j in range(T) if not torch.equal(
                attention(q[:, j:j + 1], k[:, :cached + j + 1], v[:, :cached + j + 1]), full[:, j:j + 1])]
        assert not bad, (T, cpu_rows, bad[:5])


def test_batched_rows_runs_a_block_as_one_call(monkeypatch):
    """Inside batched_rows() (a prefill) a verify-sized block is one batched call, not row by row."""
    import importlib

    from graphspec.kernels import cpu

    cpu_mod = importlib.import_module("graphspec.kernels._attention_cpu")
    rowwise = []
    real = cpu_mod.attend
    monkeypatch.setattr(cpu_mod, "attend", lambda *a, **kw: rowwise.append(1) or real(*a, **kw))
    monkeypatch.setattr(cpu, "available", lambda: False)  # the C++ rows: tests/kernels/cpu
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 12, 4, 64, generator=g)
    k = torch.randn(1, 30, 2, 64, generator=g)
    v = torch.randn(1, 30, 2, 64, generator=g)
    with use_backend("torch"):
        exact = attention(q, k, v)
        assert rowwise == [1]
        with batched_rows():
            batched = attention(q, k, v)
    assert rowwise == [1]
    assert torch.equal(batched, attention_ref(q, k, v))
    assert_close(exact, batched, *TOL[torch.float32], name="row-exact vs batched")
