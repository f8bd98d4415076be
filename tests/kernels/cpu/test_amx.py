"""The amx level of the CPU backend: avx512 plus AMX tiles for the bf16 linear (kernels/cpu/linear.cpp), the
bf16 attention (kernels/cpu/attention.cpp) and the GGUF k-quants on int8 activations (kernels/cpu/qgemm.cpp,
whose tile path gives avx512's bits: tests/kernels/cpu/test_qgemm.py and tests/models/test_gguf_native.py run amx
through ``block_level``).

Its bf16 linear runs every bf16_level test (tests/kernels/cpu/test_linear_attention.py: against the reference on
odd shapes, rows bit-identical whatever the row count and threads) and the model tests of every level
(``model_level``). What is left to check here: that its other kernels are avx512's (the per-level tests do not
run them twice), that the tile path covers the shapes a model has (K a multiple of 32, and not), and that a
kernel which refuses the tile state makes the level unusable with a reason, not a crash.
"""

import warnings

import pytest
import torch

from graphspec.kernels import attention, cpu
from graphspec.kernels.attention import ancestor_mask
from graphspec.kernels.linear import NativeWeight, linear, linear_ref, prepare_weight, quantize_weight
from graphspec.kernels.qlinear import TYPE_IDS
from tests.kernels._compare import assert_close, attention_inputs
from tests.kernels._qblocks import random_blocks

pytestmark = pytest.mark.skipif("amx" not in cpu.supported_levels(), reason="this CPU has no AMX bf16 tiles")


def test_amx_int8_int4_gemms_and_vector_attention_are_avx512s_bits():
    """The amx binary compiles the int8 / int4 GEMMs and the vector attention from avx512's source with the tile
    flags added, which emit no tile instruction there: the same bits. That attention serves fp32 and head dims
    the tiles do not take (80 here). So are the GGUF block GEMMs on fp32 activations (qgemm.cpp's own extension,
    built at amx for its int8-activation tile path)."""
    outs = {}
    g = torch.Generator().manual_seed(1)
    qw = quantize_weight(torch.randn(200, 300, generator=g))
    x = torch.randn(9, 300, generator=g)
    for lv in ("amx", "avx512"):
        with cpu.use_level(lv):
            got = []
            for dtype, d in ((torch.float32, 128), (torch.bfloat16, 80)):
                torch.manual_seed(2)  # attention_inputs draws from the global generator
                q, k, v = attention_inputs(2, 6, 47, 12, 2, d, dtype)
                got += [attention(q, k, v), attention(q, k, v, tree=ancestor_mask([-1, 0, 0, 1, 2, 3], device="cpu"))]
            got.append(qw.native(lv).forward(x))
            got.append(qw.native(lv).forward4(x[:3]))  # the int4 GEMM (products of up to 3 rows)
            for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q5_0"):  # fp32 activations: 1..8 rows and the prefill path
                blocks = torch.from_numpy(random_blocks(type_name, 37, 512, seed=3))
                for m in (1, 5, 13):
                    got.append(cpu.qops(lv).qlinear(x[:m, :256].repeat(1, 2).contiguous(), blocks,
                                                    TYPE_IDS[type_name], 37, 512, None))
            outs[lv] = got
    assert all(torch.equal(a, b) for a, b in zip(outs["amx"], outs["avx512"]))
    assert cpu.qops("amx").level() == "amx" and cpu.qops("avx512").level() == "avx512"
    assert cpu.ops("amx").level() == "amx" and cpu.bf16_linear("amx") and cpu.have_int4("amx")


def _attend_rows(q, k, v, parents=None):
    """The C++ op on a chain (parents None) or a tree of the last T keys, as kernels.attention calls it."""
    t = q.shape[1]
    parents = list(range(-1, t - 1)) if parents is None else parents
    paths = []
    for j in range(t):
        path, i = [], j
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    return cpu.ops().attend(q, k, v, q.shape[3] ** -0.5, [len(p) for p in paths], [i for p in paths for i in p]), paths


def _exact(q, k, v, keys):
    """Float64 attention of q [B, 1, Hq, D] over the keys at positions `keys` of k, v [B, L, Hk, D]."""
    g = q.shape[2] // k.shape[2]
    kd = k[:, keys].double().repeat_interleave(g, 2)
    vd = v[:, keys].double().repeat_interleave(g, 2)
    s = torch.einsum("bhd,blhd->bhl", q[:, 0].double(), kd) * q.shape[3] ** -0.5
    return torch.einsum("bhl,blhd->bhd", s.softmax(-1), vd)[:, None]


# (B, cached, T, Hq, Hk, D): decode and verify rows; the cache's length off 16 and 32 and on them; GQA 6 (the
# 1.5B), 3 (SmolLM2), 20 (more queries a row than a tile's 16), MHA; head dims 32, 64, 96, 128.
AMX_SHAPES = [(1, 47, 6, 12, 2, 128), (2, 64, 17, 9, 3, 64), (1, 300, 40, 12, 2, 128), (1, 5, 3, 20, 1, 96),
              (1, 31, 33, 4, 4, 32), (1, 0, 19, 6, 1, 128)]


@pytest.mark.parametrize("shape", AMX_SHAPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_attention_rows_are_one_token_steps_and_attention(shape, threads):
    """bf16 attention on tiles (kernels/cpu/attention.cpp, run_amx): every row of a chain and of a tree gives the
    bits of the one-token step over exactly its keys, at both thread counts, and is attention within bf16's
    rounding: |error| <= 2^-8 |exact| + 2^-9 max |v| (the output's rounding, plus the softmax weights' own at
    2^-9 relative each)."""
    b, cached, t, hq, hk, d = shape
    g = torch.Generator().manual_seed(cached + t)
    q = torch.randn(b, t, hq, d, generator=g).bfloat16()
    k = (torch.randn(b, cached + t, hk, d, generator=g) * 2).bfloat16()
    v = torch.randn(b, cached + t, hk, d, generator=g).bfloat16()
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, t)]  # a random tree
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with cpu.use_level("amx"):
            for tree in (None, parents):
                out, paths = _attend_rows(q, k, v, tree)
                for j, path in enumerate(paths):
                    keys = list(range(cached)) + [cached + i for i in path]
                    one = cpu.ops().attend(q[:, j:j + 1], k[:, keys], v[:, keys], d ** -0.5, [1], [0])
                    assert torch.equal(one, out[:, j:j + 1]), (shape, tree is None, j)
                    exact = _exact(q[:, j:j + 1], k, v, keys)
                    bound = exact.abs() * 2 ** -8 + v.abs().max().double() * 2 ** -9
                    assert ((out[:, j:j + 1].double() - exact).abs() <= bound).all(), (shape, tree is None, j)
    finally:
        torch.set_num_threads(old)


def test_amx_attention_runs_on_tiles_for_bf16_head_dims_of_32_to_128():
    """The tile path is what the amx level runs for bf16 head dims 32, 64, 96, 128 (its roundings differ from
    avx512's vector path, which keeps fp32, other head dims and longer heads)."""
    torch.manual_seed(4)
    for d, tiles in ((32, True), (64, True), (96, True), (128, True), (80, False), (160, False), (256, False)):
        q, k, v = attention_inputs(1, 5, 70, 6, 2, d, torch.bfloat16)
        with cpu.use_level("amx"):
            amx_out = attention(q, k, v)
        with cpu.use_level("avx512"):
            avx_out = attention(q, k, v)
        assert torch.equal(amx_out, avx_out) != tiles, d


@pytest.mark.parametrize("k", [1536, 8960, 896, 40, 62])
def test_amx_linear_on_model_widths_and_tails(k):
    """K = 1536 / 8960 / 896 (the 1.5B's and 0.5B's widths): whole tile products only; 40 and 62: one tile
    product and a tail of 4 or 15 pairs on vdpbf16ps. 1, 16 and 17 rows: one chunk, a full one, a padded second."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(37, generator=g).bfloat16()
    x = torch.randn(17, k, generator=g).bfloat16()
    with cpu.use_level("amx"):
        nw = prepare_weight(w)
        assert isinstance(nw, NativeWeight)
        y = linear(x, nw, b)
        for rows in (1, 16):
            assert torch.equal(linear(x[:rows], nw, b), y[:rows])
    exact = x.double() @ w.double().T + b.double()
    assert_close(y, linear_ref(x.float(), w.float(), b.float()), 1e-2, 1.6e-2, name=f"amx linear k={k}")
    # fp32 sums, one rounding to bf16 (plus the bias's): within 2 bf16 ulps of the exact value
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-5).all()


def test_a_kernel_that_refuses_the_tile_state_makes_amx_unusable_with_a_reason(monkeypatch):
    """Linux grants AMX's tile state per process on request (5.16+); where it does not, asking for amx by name
    is an error saying so, and auto warns and runs avx512."""

    monkeypatch.setattr(cpu, "_tile_state_granted", lambda: False)
    monkeypatch.setattr(cpu, "_failed", {})
    monkeypatch.setattr(cpu, "_warned", set())
    cpu._load.cache_clear()
    cpu._auto_in.cache_clear()
    cpu._env_level.cache_clear()
    try:
        with pytest.raises(cpu.NativeBuildError, match="did not grant this process the AMX tile state"):
            with cpu.use_level("amx"):
                pass
        monkeypatch.setattr(cpu, "_failed", {})
        with pytest.warns(RuntimeWarning, match="amx level .*cannot be used .*AMX tile state"):
            assert cpu._auto_in("another root") == "avx512"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu._auto_in("yet another root") == "avx512"  # warned once
    finally:
        monkeypatch.undo()
        cpu._load.cache_clear()
        cpu._auto_in.cache_clear()
        cpu._env_level.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_linear_rows_in_pieces_of_k_and_groups_of_rows(threads):
    """17 to 256 rows run k in pieces (sums held in memory between them), more rows in whole-k passes over groups
    of 256: every row of 17, 40, 256, 257 and 300 equals that row's one-row product, K with several pieces and a
    tail (K = 600: 18 tile products and 12 pairs; 1000: 31 and 4) and N off the blocks; both thread counts."""
    g = torch.Generator().manual_seed(3)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with cpu.use_level("amx"):
            for k, n in ((600, 77), (1000, 130)):
                nw = prepare_weight((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16())
                b = torch.randn(n, generator=g).bfloat16()
                x = torch.randn(300, k, generator=g).bfloat16()
                alone = torch.cat([linear(x[i:i + 1], nw, b) for i in range(300)])
                for rows in (17, 40, 256, 257, 300):
                    assert torch.equal(linear(x[:rows], nw, b), alone[:rows]), (k, n, rows)
                assert_close(alone, linear_ref(x.float(), nw.dense().float(), b.float()), 1e-2, 1.6e-2,
                             name=f"amx linear k={k}")
    finally:
        torch.set_num_threads(old)


def test_amx_prefills_take_the_tile_path_too(monkeypatch):
    """At amx a bf16 prefill block (inside batched_rows(), of any length, past EXACT_CHAIN_ROWS_MAX too) runs the C++
    tile path, faster there than SDPA's one batched call: the row-exact rows' bits. fp32, other head dims and other
    levels keep the batched call."""
    from graphspec.kernels import EXACT_CHAIN_ROWS_MAX, attention_ref, batched_rows

    calls = []
    real = cpu.ops

    def counting(*a):
        ops = real(*a)

        class Counted:
            def __getattr__(self, name):
                op = getattr(ops, name)
                return (lambda *b: calls.append(b[0].shape[1]) or op(*b)) if name == "attend" else op
        return Counted()

    monkeypatch.setattr(cpu, "ops", counting)
    torch.manual_seed(6)
    t = EXACT_CHAIN_ROWS_MAX + 37
    q, k, v = attention_inputs(1, t, t + 3, 6, 2, 64, torch.bfloat16)
    with cpu.use_level("amx"):
        with batched_rows():
            batched = attention(q, k, v)
        assert len(calls) > 1 and sum(calls) == t  # in pieces, all rows
        for j in (0, 517, t - 1):  # each row is the one-token step's
            assert torch.equal(attention(q[:, j:j + 1], k[:, :j + 4], v[:, :j + 4]), batched[:, j:j + 1]), j
        n = len(calls)
        for dtype, d in ((torch.float32, 64), (torch.bfloat16, 80)):
            q2, k2, v2 = attention_inputs(1, 40, 50, 6, 2, d, dtype)
            with batched_rows():
                assert torch.equal(attention(q2, k2, v2), attention_ref(q2, k2, v2))
    with cpu.use_level("avx512"), batched_rows():
        assert torch.equal(attention(q, k, v), attention_ref(q, k, v))
    assert len(calls) == n


def test_gguf_a8_model_on_tiles_gives_avx512s_logits(tmp_path):
    """A gguf-a8 model's prefill (40 rows: whole tile chunks and a padded one), a 17-row verify (16 on tiles, one on
    vectors) and a one-token step give the same logits at amx as at avx512, whose GEMMs are all vectors."""
    from graphspec.models import load_model
    from tests.models._chunks import native_steps
    from tests.models.test_gguf_target import write_block_gguf

    model = load_model(write_block_gguf(tmp_path / "m.gguf"), weights="gguf-a8")
    ids = torch.randint(0, model.config.vocab_size, (1, 58), generator=torch.Generator().manual_seed(5))
    got = {}
    for lv in ("amx", "avx512"):
        with cpu.use_level(lv):
            got[lv] = native_steps(model, True, ids, chunks=(40, 17, 1))
    assert torch.equal(got["amx"], got["avx512"])
