"""Causal attention of T new queries against L cached keys (prefill, decode and verify in one op).

- Layout: ``q[B, T, Hq, D]``, ``k, v[B, L, Hk, D]`` (usually strided views ``cache[:, :L]`` of a
  preallocated ``[B, S_max, Hk, D]`` cache, so every stride is honoured, nothing is copied).
- Positions: the T queries are the *last* T of the L keys, query i sits at key position
  ``L - T + i`` and sees keys ``0 .. L - T + i``. Prefill is ``T == L``; decode is ``T == 1``;
  speculative verify is a small T > 1 (causal inside the new block).
- Trees: ``tree`` (bool ``[T, T]``, see ``ancestor_mask``) replaces causality inside the new block,
  so a draft tree is verified in one forward: query i sees every cached key ``0 .. L - T - 1`` and
  new key ``L - T + j`` iff ``tree[i, j]``. Nodes are in topological order (True on the diagonal,
  False above it), so causal tile skipping stays valid. The Triton kernels read the tree as one
  int64 bitmask per query (hence T <= 64), behind a constexpr flag: no-tree kernels are unchanged.
  A draft that grows its tree over several forwards (a beam, ``graphspec.vocab_stages``) passes a
  wider ``tree`` ``[T, m]``: a mask over the last m keys (earlier tree nodes already cached, then the
  T new ones), so each new node sees only its own ancestors among them. CPU only, one batched call
  (a draft's rows need not round like one-row steps).
- GQA: query head h reads key/value head ``h // (Hq // Hk)``.
- Triton, two kernels chosen by the launcher:
  * many queries (prefill): flash attention, one program per (query tile, batch, query head),
    online softmax in base 2 (log2(e) folded into the scale), causal tiles skipped;
  * few queries (decode / verify): flash-decoding, one program per (batch, kv head, KV split)
    handling all ``T * Hq/Hk`` query rows of the group so each K/V tile is read once per group;
    each split writes a partial (max, sum, acc) and a combine kernel merges the splits, so a
    long cache keeps every SM busy even at batch 1.
  Head dims that are not powers of two (80, 96) are padded to the next power of two with masks.
- Torch path: ``attention_ref`` (the oracle, and the CPU path of prefills) is fp32 math through
  ``scaled_dot_product_attention`` with an explicit boolean causal mask at offset ``L - T``;
  GQA by folding the query heads of a group into the query axis, so k/v are never repeated.
  Decode steps and verify-sized blocks on the CPU run in C++ (``graphspec.kernels.cpu``,
  kernels/cpu/attention.cpp: each row over exactly its keys by one loop), or, without it, each verify
  row as that one-row SDPA call, all rows in one TorchScript call (``graphspec.kernels._attention_cpu``):
  either way every row bit-identical to the one-token step at its position.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphspec.kernels import _attention_cpu, cpu
from graphspec.kernels._dispatch import (EXACT_CHAIN_ROWS_MAX, EXACT_ROWS_MAX, FLOAT_DTYPES, check_tensor, rows_exact,
                                        use_triton)

__all__ = ["attention", "attention_ref", "ancestor_mask", "check_tree", "tree_mask"]


# ----------------------------------------------------------------------------- validation

def _validate(q, k, v, scale, tree=None):
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("v", v, ndim=4, dtypes=FLOAT_DTYPES, device=q.device)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype} "
                         f"(cast the cache or the queries to the model dtype)")
    B, T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match [B, L, Hk, D]")
    Bk, L, Hk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k has batch size {Bk} but q has {B}")
    if Dk != D:
        raise ValueError(f"k has head_dim {Dk} but q has head_dim {D}; they must match")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"q has {Hq} heads, which is not a multiple of the {Hk} key/value heads of k "
                         f"(grouped-query attention needs Hq % Hk == 0)")
    if T > L:
        raise ValueError(f"q has T={T} queries but k holds only L={L} keys; the queries must be the last T "
                         f"of the L cached positions (append them to the cache first)")
    if scale is None:
        scale = D ** -0.5
    else:
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite float, got {scale}")
    if tree is not None:
        check_tree(tree, T, L, q.device)
    return scale


def check_tree(tree, T: int, L: int, device) -> None:
    """Raise a ValueError unless ``tree`` is a valid mask for T new tokens after ``L - T`` cached keys."""
    if not isinstance(tree, torch.Tensor):
        raise ValueError(f"tree must be a bool torch.Tensor of shape ({T}, {T}) or None, got {type(tree).__name__} "
                         f"(build one with ancestor_mask(parents))")
    if tree.dtype != torch.bool:
        raise ValueError(f"tree has dtype {tree.dtype}; it must be torch.bool (tree[i, j] is True iff new query i "
                         f"sees new key j): pass tree.bool() or build it with ancestor_mask(parents)")
    if tree.ndim != 2 or tree.shape[0] != T or not T <= tree.shape[1] <= L:
        raise ValueError(f"tree has shape {tuple(tree.shape)} but q has T={T} new tokens and k holds L={L} keys; it "
                         f"must be ({T}, {T}), one row and one column per new token, or ({T}, m) with {T} <= m <= {L} "
                         f"over the last m keys")
    if tree.device != torch.device(device):
        raise ValueError(f"tree is on {tree.device} but q is on {device}; move the tree to q's device")
    # Content checks read the values, which on an accelerator would cost a host sync per call.
    if tree.device.type == "cpu" and T > 0:
        off = tree.shape[1] - T  # new token i is column off + i
        missing = (~tree.diagonal(off)).nonzero()
        if len(missing):
            i = int(missing[0, 0])
            raise ValueError(f"tree[{i}, {i + off}] is False; every new token must see itself (set it True)")
        above = torch.triu(tree, diagonal=off + 1).nonzero()
        if len(above):
            i, j = int(above[0, 0]), int(above[0, 1])
            raise ValueError(f"tree[{i}, {j}] is True above the diagonal; a token may only see earlier tokens, so "
                             f"order the tree's nodes with every ancestor before its descendants")


# ----------------------------------------------------------------------------- torch reference

def causal_mask(t: int, length: int, device=None) -> torch.Tensor:
    """``[t, length]`` bool: the last t of ``length`` positions as queries, each seeing keys up to itself."""
    return torch.arange(length, device=device)[None, :] <= torch.arange(length - t, length, device=device)[:, None]


def tree_mask(tree: torch.Tensor, length: int) -> torch.Tensor:
    """The ``[T, length]`` mask of a checked ``tree [T, m]``: every key before the last m visible, then ``tree``."""
    return torch.cat([tree.new_ones(tree.shape[0], length - tree.shape[1]), tree], dim=1)


def ancestor_mask(parents, device=None) -> torch.Tensor:
    """The ``[T, T]`` bool tree mask of a draft tree given as parent indices (T = ``len(parents)``).

    ``parents[i]`` is -1 (a root, which sees only the cache and itself) or an earlier node in ``[0, i)``;
    row i is True at i and at every ancestor of i. E.g. ``[-1, 0, 1, 0]`` gives rows {0}, {0, 1},
    {0, 1, 2}, {0, 3}; a chain ``[-1, 0, 1, ...]`` gives the causal lower triangle.
    """
    parents = list(parents)
    T = len(parents)
    rows = []
    for i, p in enumerate(parents):
        try:
            p = operator.index(p)
        except TypeError:
            raise ValueError(f"parents[{i}] = {p!r} is not an int; parents holds one parent index per node "
                             f"(-1 for a root)") from None
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p} must be -1 (a root) or an earlier node in [0, {i}); list every "
                             f"node after its parent")
        row = list(rows[p]) if p >= 0 else [False] * T
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device).reshape(T, T)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  tree: torch.Tensor | None = None) -> torch.Tensor:
    """Plain fp32 attention: the oracle for the Triton kernels and the CPU path of the model.

    With a ``tree`` ``[T, m]`` the mask over ``[T, L]`` is ``cat([all True [T, L - m], tree], dim=1)``.
    """
    scale = _validate(q, k, v, scale, tree)
    B, T, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    if T == 0 or B == 0:
        return q.new_empty(q.shape)
    # Fold the G query heads of a group into the query axis: [B, Hk, G*T, D] (row g*T + t).
    qf = q.float().reshape(B, T, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * T, D)
    kf = k.float().transpose(1, 2)  # [B, Hk, L, D]
    vf = v.float().transpose(1, 2)
    mask = None
    if T > 1 or (tree is not None and tree.shape[1] > 1):  # (a valid one-node tree is [[True]]: no mask either)
        mask = causal_mask(T, L, q.device) if tree is None else tree_mask(tree, L)
        mask = mask.repeat(G, 1)  # [G*T, L]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)  # [B, Hk, G*T, D]
    out = out.reshape(B, Hk, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------- public op

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              tree: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last T positions (``q[B, T, Hq, D]``) over ``k, v[B, L, Hk, D]``.

    Returns ``[B, T, Hq, D]`` in q's dtype. ``scale`` defaults to ``D ** -0.5``. ``tree`` (bool ``[T, T]``
    on q's device, see ``ancestor_mask``) makes new query i see new key j iff ``tree[i, j]``, instead of
    iff ``j <= i``; every query still sees all ``L - T`` cached keys. A wider ``tree`` ``[T, m]`` (CPU only)
    masks the last m keys instead: query i sees key ``L - m + j`` iff ``tree[i, j]``, all before them.
    """
    T = q.shape[1]
    if isinstance(tree, torch.Tensor) and tree.ndim == 2 and tree.shape[1] != T:
        if use_triton(q):
            raise ValueError(f"a tree over cached keys (shape {tuple(tree.shape)}, wider than the T={T} new tokens) "
                             f"runs on the CPU torch path only, not on the Triton kernels (device {q.device}); "
                             f"pass a ({T}, {T}) tree there")
        return attention_ref(q, k, v, scale, tree)  # a draft's tree forward (validated there): rows need not be exact
    if use_triton(q):
        return _attention_triton(q, k, v, scale, tree=tree)
    native = q.device.type == "cpu" and q.dtype in _NATIVE_DTYPES and cpu.available()
    # A row-exact chain past a verify's size (a prefix cache's prefill block) where the C++ loop runs it.
    long_chain = native and tree is None and T <= EXACT_CHAIN_ROWS_MAX
    # The amx level's tile path is faster than SDPA's batched block as well: a prefill of any length takes it too.
    tiles = (native and tree is None and q.dtype == torch.bfloat16 and q.shape[3] in _AMX_HEAD_DIMS
             and cpu.level() == "amx")
    if ((T <= _EXACT_MAX_T or long_chain) and rows_exact()) or tiles:
        # A verify's query row must come out bit-identical to the one-token step at that position, or bf16 greedy
        # speculative output drifts from autoregressive.
        if native:
            # Decode steps and verify blocks in C++ (graphspec.kernels.cpu): each row over exactly the keys
            # it sees (the cache, then its path through the new ones) by one loop whatever the other rows, so a
            # verify row is bit-identical to the one-token step at its position, without a call per row.
            scale = _validate(q, k, v, scale, tree)
            if k.stride(-1) != 1 or k.stride() != v.stride():  # the kernel walks k and v with one key stride
                k, v = k.contiguous(), v.contiguous()
            q = q.contiguous()
            if T <= _EXACT_MAX_T:
                p = _attention_cpu.plan(tree, T)
                return cpu.ops().attend(q, k, v, scale, p.lengths, p.nodes)
            # A long chain in pieces of _EXACT_MAX_T rows, each piece's earlier new keys passed as cached ones: every
            # row sees the same keys in the same order (the same bits), and a plan stays O(_EXACT_MAX_T^2).
            base = k.shape[1] - T
            outs = []
            for s in range(0, T, _EXACT_MAX_T):
                e = min(s + _EXACT_MAX_T, T)
                p = _attention_cpu.plan(None, e - s)
                outs.append(cpu.ops().attend(q[:, s:e], k[:, :base + e], v[:, :base + e], scale, p.lengths, p.nodes))
            return torch.cat(outs, dim=1)
        if T > 1:
            # Without it: torch's CPU SDPA rounds a row differently depending on how many rows it is given
            # (for a share of bf16 rows), so each row of a verify runs as its own one-row call over exactly
            # the keys it sees (with a tree: the cache prefix, then its ancestors and itself, in order), all rows
            # in one TorchScript call (graphspec.kernels._attention_cpu).
            return _attention_cpu.attend(q, k, v, _validate(q, k, v, scale, tree), tree)
    return attention_ref(q, k, v, scale, tree)


# Verify-sized blocks (K + 1 rows, a draft tree; up to EXACT_ROWS_MAX) take the row-by-row CPU path above, and so do
# chains up to EXACT_CHAIN_ROWS_MAX where the C++ loop runs; longer blocks, and any inside batched_rows() (prefills),
# keep one batched call.
_EXACT_MAX_T = EXACT_ROWS_MAX
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what kernels/cpu/attention.cpp reads
_AMX_HEAD_DIMS = (32, 64, 96, 128)  # bf16 head dims attention.cpp runs on AMX tiles at the amx level (run_amx)


# ----------------------------------------------------------------------------- Triton kernels

@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # The interpreter multiplies bf16 operands wrongly, so there (DOT_FP32) the operands, already
    # rounded to the storage dtype, are widened to fp32: same products, fp32 accumulation as on a GPU.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_base, v_base, n_idx, n_limit, offs_d, mask_d, q_pos, q_tree, n_new,
                 stride_kl, stride_kd, stride_vl, stride_vd, qk_scale,
                 DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_TREE: tl.constexpr):
    """One key tile of the online softmax, shared by the prefill and split-KV kernels.

    Keys ``n_idx`` below ``n_limit`` that query row i may see update the running max ``m_i``, sum ``l_i``
    and output ``acc`` (base-2 exponentials; ``qk_scale`` folds in log2 e). Row i sees key n iff
    ``n <= q_pos[i]`` (causal), or with HAS_TREE iff ``n < n_new`` (cached) or bit ``n - n_new`` of the
    int64 ``q_tree[i]`` is set (``n_new = L - T``, the first new key).
    """
    mask_n = n_idx < n_limit
    kt = tl.load(k_base + n_idx[None, :] * stride_kl + offs_d[:, None] * stride_kd,
                 mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = _dot(q, kt, DOT_FP32, DOT_PRECISION) * qk_scale
    if HAS_TREE:
        rel = n_idx - n_new
        # Clamped shift: a shift by >= 64 is undefined (poison) even in lanes the mask discards.
        bit = (q_tree[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
        visible = ((rel[None, :] < 0) | (bit != 0)) & mask_n[None, :]
    else:
        visible = (n_idx[None, :] <= q_pos[:, None]) & mask_n[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + n_idx[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attn_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: [B, T, Hq, D]; k, v: [B, L, Hk, D]
    tree_ptr,  # [T] int64: bit j of query i's word is tree[i, j] (read only with HAS_TREE)
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    T, L, Hq, D, GROUP, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_TREE: tl.constexpr,
):
    """Flash attention for one (query tile, batch, query head); ``qk_scale = scale * log2(e)``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < T
    mask_d = offs_d < D

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh

    # Finite start value: a row whose first tile is fully masked gets exp2(-inf - m) = 0, never nan.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_pos = (L - T) + offs_m  # key position of each query
    if HAS_TREE:  # padding rows see every key, so their discarded outputs are not 0/0
        q_tree = tl.load(tree_ptr + offs_m, mask=mask_m, other=-1)
    else:
        q_tree = q_pos  # unused
    # Causal: this tile's last query sees keys up to q_pos[-1]; later key tiles are skipped. A tree
    # only sees ancestors, which precede it, so the same bound holds.
    hi = tl.minimum(L, (L - T) + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, start_n + offs_n, L, offs_d, mask_d, q_pos,
                                     q_tree, L - T, stride_kl, stride_kd, stride_vl, stride_vd, qk_scale,
                                     DOT_FP32, DOT_PRECISION, HAS_TREE)

    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q, o: [B, T, Hq, D]; k, v: [B, L, Hk, D]
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [B*Hk, S, T*GROUP, D], [B*Hk, S, T*GROUP] x2, fp32
    tree_ptr,  # [T] int64: bit j of query i's word is tree[i, j] (read only with HAS_TREE)
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh, stride_od,
    T, L, Hk, D, GROUP, qk_scale, split_len, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr, HAS_TREE: tl.constexpr,
):
    """Flash-decoding: one (batch, kv head, KV split); rows are the T*GROUP queries sharing the kv head.

    Row r is query t = r // GROUP of head hk*GROUP + r % GROUP. With DIRECT (a single split) the
    normalised output is stored at once; otherwise the partial (max, sum, acc) goes to the scratch.
    """
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    rows = tl.arange(0, BLOCK_M)
    t = rows // GROUP
    h = hk * GROUP + rows % GROUP
    n_rows = T * GROUP
    mask_r = rows < n_rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_pos = (L - T) + t
    if HAS_TREE:  # padding rows see every key, so their discarded outputs are not 0/0
        q_tree = tl.load(tree_ptr + t, mask=mask_r, other=-1)
    else:
        q_tree = q_pos  # unused
    n_lo = split * split_len
    n_hi = tl.minimum(L, n_lo + split_len)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, start_n + offs_n, n_hi, offs_d, mask_d, q_pos,
                                     q_tree, L - T, stride_kl, stride_kd, stride_vl, stride_vd, qk_scale,
                                     DOT_FP32, DOT_PRECISION, HAS_TREE)

    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(o_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
    else:
        # A split holding no key a row sees leaves (m, l, acc) = (-1e30, 0, 0): weight 0 in the combine,
        # since some split holds the row's own key, which every row sees (also in a tree).
        part = (pid_bh * num_splits + split) * n_rows + rows
        tl.store(part_m_ptr + part, m_i, mask=mask_r)
        tl.store(part_l_ptr + part, l_i, mask=mask_r)
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=mask_r[:, None] & mask_d[None, :])


@triton.jit
def _attn_combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr,  # [B*Hk, S, T*GROUP, D], [B*Hk, S, T*GROUP] x2, fp32
    o_ptr,  # [B, T, Hq, D]
    stride_ob, stride_ot, stride_oh, stride_od,
    T, Hk, D, GROUP, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the per-split partials of one query row: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    pid_bh = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    t = row // GROUP
    h = hk * GROUP + row % GROUP
    n_rows = T * GROUP
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < D
    part = (pid_bh * num_splits + offs_s) * n_rows + row
    m_s = tl.load(part_m_ptr + part, mask=mask_s, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    acc_s = tl.load(part_acc_ptr + part[:, None] * D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    m = tl.max(m_s, 0)
    w = tl.exp2(m_s - m)
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(acc_s * w[:, None], 0) / denom
    tl.store(o_ptr + b * stride_ob + t * stride_ot + h * stride_oh + offs_d * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=mask_d)


# ----------------------------------------------------------------------------- launcher

_LOG2E = 1.4426950408889634
_SPLIT_MAX_ROWS = 128  # T * GROUP rows held by one flash-decoding program
_SPLIT_MAX_T = 16
_MAX_SPLITS = 64
_TREE_MAX_T = 64  # one int64 bitmask per query


def _launch_config(q):
    """Dot operand handling: widen under the interpreter (bf16 dots are wrong there); fp32 via 3xTF32 on GPU."""
    dot_fp32 = not q.is_cuda
    precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    if dot_fp32:
        precision = "ieee"
    return dot_fp32, precision


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pipeline(q, block_m, block_d):
    """(BLOCK_N, num_stages): fp32 operands (3xTF32 dots) need twice the shared memory of bf16 per stage;
    these keep every configuration under the 227 KiB of an H100/H200 (measured from sm_90 compiles)."""
    if q.dtype != torch.float32:
        return 64, 3
    return 32, (1 if block_m * block_d >= 8192 else 2)


def _default_num_splits(q, B, Hk, L, block_n):
    n_sm = _sm_count(q.device) if q.is_cuda else 4
    want = triton.cdiv(2 * n_sm, max(1, B * Hk))  # about two programs per SM
    return max(1, min(want, triton.cdiv(L, block_n), _MAX_SPLITS))


def _tree_bits(tree: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64, word i = sum_j tree[i, j] * 2^j (T <= 64), built on the tree's device (no host sync).

    Bit 63 has weight 1 << 63 = -2^63 in int64; the weights are distinct bits, so every partial sum
    stays in range and the sum is the two's-complement bit pattern.
    """
    T = tree.shape[0]
    weights = torch.ones(T, dtype=torch.int64, device=tree.device) << torch.arange(T, device=tree.device)
    return (tree.to(torch.int64) * weights).sum(dim=1)


def _attention_triton(q, k, v, scale, mode: str | None = None, num_splits: int | None = None,
                      tree: torch.Tensor | None = None):
    """Validate, pick the kernel, launch. ``mode`` ("prefill" / "split") and ``num_splits`` are test hooks."""
    scale = _validate(q, k, v, scale, tree)
    B, T, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    G = Hq // Hk
    if tree is not None and T > _TREE_MAX_T:
        raise ValueError(f"tree attention on the Triton path supports at most {_TREE_MAX_T} new tokens (one int64 "
                         f"bitmask per query), got T={T}; verify a smaller tree or use backend='torch'")
    out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return out
    has_tree = tree is not None
    tree_bits = _tree_bits(tree) if has_tree else out  # unused without a tree
    block_d = max(16, triton.next_power_of_2(D))
    dot_fp32, precision = _launch_config(q)
    qk_scale = scale * _LOG2E
    if mode is None:
        mode = "split" if (T <= _SPLIT_MAX_T and T * G <= _SPLIT_MAX_ROWS) else "prefill"
    if mode not in ("prefill", "split"):
        raise ValueError(f"mode must be 'prefill', 'split' or None, got {mode!r}")
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride())

    if mode == "prefill":
        block_m = 64
        block_n, stages = _pipeline(q, block_m, block_d)
        grid = (triton.cdiv(T, block_m), B * Hq)
        _attn_prefill_kernel[grid](
            q, k, v, out, tree_bits, *strides, T, L, Hq, D, G, qk_scale,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
            HAS_TREE=has_tree, num_warps=4 if block_d <= 64 else 8, num_stages=stages,
        )
        return out

    block_m = max(16, triton.next_power_of_2(T * G))
    block_n, stages = _pipeline(q, block_m, block_d)
    if block_m > _SPLIT_MAX_ROWS:
        raise ValueError(f"mode='split' holds T*Hq/Hk={T * G} query rows in one program; at most "
                         f"{_SPLIT_MAX_ROWS} are supported (use mode='prefill')")
    if num_splits is None:
        num_splits = _default_num_splits(q, B, Hk, L, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(L, num_splits), block_n) * block_n  # whole KV tiles per split
    num_splits = triton.cdiv(L, split_len)
    direct = num_splits == 1
    n_rows = T * G
    if direct:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = torch.empty((B * Hk, num_splits, n_rows, D), dtype=torch.float32, device=q.device)
        part_m = torch.empty((B * Hk, num_splits, n_rows), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    _attn_split_kernel[(B * Hk, num_splits)](
        q, k, v, out, part_acc, part_m, part_l, tree_bits, *strides, T, L, Hk, D, G, qk_scale, split_len,
        num_splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32, DOT_PRECISION=precision,
        DIRECT=direct, HAS_TREE=has_tree, num_warps=4 if block_m * block_d <= 4096 else 8, num_stages=stages,
    )
    if not direct:
        _attn_combine_kernel[(B * Hk, n_rows)](
            part_acc, part_m, part_l, out, *out.stride(), T, Hk, D, G, num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, num_warps=4,
        )
    return out
