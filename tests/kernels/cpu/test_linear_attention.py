"""graphspec's C++ CPU backend (graphspec.kernels.cpu): the bf16 linear (kernels/cpu/linear.cpp) at each level
that has one (avx512, avx2) against F.linear and, at avx2, against its exact order of the sums; the decode/verify
attention (kernels/cpu/attention.cpp) at every C++ level (its row exactness and maths against the definition are in
tests/kernels/test_attention.py, for every level); and the switch between levels.

Every level this CPU executes runs (the ``level`` / ``bf16_level`` fixtures in tests/conftest.py), not only its best.
"""

import importlib
import platform
import warnings

import pytest
import torch

from graphspec.kernels import attention, attention_ref, batched_rows, cpu, use_backend
from graphspec.kernels.attention import ancestor_mask
from graphspec.kernels.linear import NativeWeight, PackedWeight, linear, linear_ref, prepare_weight
from tests.kernels._compare import assert_close, attention_inputs

linear_mod = importlib.import_module("graphspec.kernels.linear")

needs_native = pytest.mark.usefixtures("bf16_level")  # each level with a bf16 linear this CPU executes
needs_kernels = pytest.mark.usefixtures("level")  # each C++ level this CPU executes

# Both sides sum exact bf16 products in fp32 in different orders (~1e-6 relative) and round to bf16 to
# nearest even, so outputs may be one bf16 ulp (2^-8 relative) apart; the inputs keep outputs O(1).
ATOL, RTOL = 1e-2, 1.6e-2


def _inputs(m, k, n, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@needs_native
@pytest.mark.parametrize("k,n", [(130, 423), (17, 3), (1, 16), (33, 48), (64, 1), (96, 200)])
@pytest.mark.parametrize("m", [1, 2, 5, 7, 8, 9, 16, 23])
def test_native_matches_reference(m, k, n):
    """Odd K (padded to pairs), N off the 16-output blocks (masked stores), 1..8 rows and several tiles of 8."""
    x, w, b = _inputs(m, k, n, bias=(m % 2 == 1), seed=m * 1000 + k + n)
    nw = prepare_weight(w)
    assert isinstance(nw, NativeWeight) and nw.shape == w.shape and nw.dtype == torch.bfloat16
    y = linear(x, nw, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and y.is_contiguous()
    assert_close(y, linear_ref(x.float(), w.float(), None if b is None else b.float()), ATOL, RTOL,
                 name=f"native linear m={m} k={k} n={n}")
    assert torch.equal(nw.dense(), w)  # the layout changes, the values do not


@needs_native
def test_native_strided_inputs_leading_dims_and_empty():
    x, w, b = _inputs(40, 96, 77)
    nw = prepare_weight(w.t().contiguous().t())  # a column-major weight packs the same
    x4 = torch.randn(2, 9, 3, 96).bfloat16()[:, 1:8:2]  # [2, 4, 3, 96], not viewable as 2-D
    b2 = torch.randn(154).bfloat16()[::2]
    ref = linear_ref(x4.float(), w.float(), b2.float())
    assert_close(linear(x4, nw, b2), ref, ATOL, RTOL, name="native 4-D strided")
    assert_close(linear(x4[0, 0, 0], nw), linear_ref(x4[0, 0, 0].float(), w.float()), ATOL, RTOL, name="1-D")
    xt = torch.randn(96, 5).bfloat16().t()  # [5, 96] with stride (1, 5)
    assert_close(linear(xt, nw), linear_ref(xt.float(), w.float()), ATOL, RTOL, name="column-major x")
    assert linear(torch.randn(0, 96).bfloat16(), nw).shape == (0, 77)


@needs_native
def test_native_closer_to_exact_than_one_ulp_on_a_long_k():
    """A down projection's K = 8960: the fp32 sum stays within bf16 rounding of the float64 product."""
    x, w, _ = _inputs(3, 8960, 50)
    y = linear(x, prepare_weight(w)).double()
    exact = x.double() @ w.double().T
    assert ((y - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_rows_are_bit_identical_whatever_the_row_count_and_threads(threads):
    """Row i of an M-row product equals its one-row product, for M = 1..24, and the thread count changes nothing.

    This is what keeps greedy speculative output (a verify of K+1 rows) equal to autoregressive output (one row a
    step) in bf16, with no padding or splitting (unlike oneDNN's kernels: test_linear.py).
    """
    old = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    weights = [prepare_weight((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16())
               for n, k in ((896, 4864), (4000, 600), (77, 131), (1536, 8960), (300, 64))]
    xs = [torch.randn(24, w.shape[1], generator=g).bfloat16() for w in weights]
    try:
        torch.set_num_threads(1)
        alone = [[linear(x[i:i + 1], w)[0] for i in range(x.shape[0])] for w, x in zip(weights, xs)]
        torch.set_num_threads(threads)
        mismatches = [(tuple(w.shape), m, i) for w, x, a in zip(weights, xs, alone) for m in range(1, 25)
                      for i, row in enumerate(linear(x[:m], w)) if not torch.equal(row, a[i])]
    finally:
        torch.set_num_threads(old)
    assert mismatches == [], mismatches[:10]


@needs_native
def test_native_refuses_triton_and_bad_shapes():
    nw = prepare_weight(torch.randn(8, 4).bfloat16())
    with use_backend("triton"), pytest.raises(ValueError, match="NativeWeight"):
        linear(torch.randn(2, 4).bfloat16(), nw)
    with pytest.raises(ValueError, match="K must match"):
        linear(torch.randn(2, 5).bfloat16(), nw)
    with pytest.raises(ValueError, match="dtype"):
        linear(torch.randn(2, 4), nw)
    with pytest.raises(ValueError, match="bias"):
        linear(torch.randn(2, 4).bfloat16(), nw, torch.randn(7).bfloat16())
    with pytest.raises(RuntimeError, match="does not hold a"):  # the op checks what it is handed
        cpu.ops().linear(torch.randn(2, 6).bfloat16(), nw.packed, 8, None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_native_attention_is_the_same_bits_with_any_thread_count(dtype):
    q, k, v = attention_inputs(2, 6, 47, 12, 2, 128, dtype)
    tree = ancestor_mask([-1, 0, 0, 1, 2, 3], device="cpu")
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append((attention(q, k, v), attention(q, k, v, tree=tree)))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@needs_kernels
def test_native_attention_runs_decode_and_verify_but_not_prefills_or_fp16(monkeypatch):
    """One-token steps and verify blocks take the C++ rows; a prefill (batched_rows) and fp16 keep SDPA."""
    calls = []
    real = cpu.ops

    class Counting:
        def __getattr__(self, name):
            op = getattr(real(), name)
            return (lambda *a: calls.append(a[0].shape[1]) or op(*a)) if name == "attend" else op

    monkeypatch.setattr(cpu, "ops", lambda: Counting())
    q, k, v = attention_inputs(1, 5, 25, 4, 2, 64, torch.float32)
    with use_backend("torch"):
        one = attention(q[:, :1], k[:, :21], v[:, :21])
        block = attention(q, k, v)
        assert calls == [1, 5]
        with batched_rows():
            batched = attention(q, k, v)
        attention(q.half(), k.half(), v.half())
        assert calls == [1, 5]
    assert torch.equal(one, block[:, :1])
    assert torch.equal(batched, attention_ref(q, k, v))
    assert_close(block, batched, 1e-5, 1e-5, name="C++ rows against SDPA")


@needs_kernels
def test_native_attention_checks_its_inputs():
    q, k, v = attention_inputs(1, 3, 8, 4, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="row 2.s path must be non-empty and end at itself"):
        cpu.ops().attend(q, k, v, 0.1, [1, 2, 2], [0, 0, 1, 0, 1])
    with pytest.raises(RuntimeError, match="rise through earlier nodes"):
        cpu.ops().attend(q, k, v, 0.1, [1, 2, 2], [0, 1, 1, 1, 2])
    with pytest.raises(RuntimeError, match="one path length per new token"):
        cpu.ops().attend(q, k, v, 0.1, [1, 2], [0, 0, 1])
    t = k.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, Hk, D] with another key stride than v's
    with pytest.raises(RuntimeError, match="share their layout"):
        cpu.ops().attend(q, t, v, 0.1, [1, 2, 3], [0, 0, 1, 0, 1, 2])
    with use_backend("torch"):  # the Python side makes such k, v contiguous first
        assert_close(attention(q, t, v), attention_ref(q, k, v), 1e-5, 1e-5, name="strided k")


@pytest.mark.parametrize("k,n", [(130, 423), (17, 3), (1536, 40)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 11])
def test_avx2_linear_is_its_order_of_fp32_sums(m, k, n):
    """avx2: each output is one sum, fma(w[k], x[k], acc) for k = 0, 1, 2, ... in turn, then + bias, rounded to
    bf16. A bf16 x bf16 product is exact in fp32, so it is the plain sequential fp32 sum, redone here in torch:
    bit for bit, for every tile shape (1 to 5 rows, 11 rows as 4 + 4 + 3) and each row alone."""
    if "avx2" not in cpu.supported_levels():
        pytest.skip("this CPU has no AVX2")
    x, w, b = _inputs(m, k, n, seed=k + n)
    with cpu.use_level("avx2"):
        packed = prepare_weight(w)
        y = linear(x, packed, b)
        alone = [linear(x[r:r + 1], packed, b) for r in range(m)]
    xf, wf = x.float(), w.float()
    s = torch.zeros(m, n)
    for i in range(k):
        s += xf[:, i:i + 1] * wf[:, i][None, :]  # exact product, one fp32 rounding per add
    assert torch.equal(y, (s + b.float()).bfloat16())
    assert torch.equal(torch.cat(alone), y)


@needs_native
def test_native_linear_with_activation_outliers():
    """Real activations have outliers (a maximum of 486 against a median of 0.3 in SmolLM2): fp32 sums keep them."""
    x, w, b = _inputs(5, 576, 97)
    x[:, 7] = 486.0
    x[2, 100] = -300.0
    y = linear(x, prepare_weight(w), b)
    assert_close(y, linear_ref(x.float(), w.float(), b.float()), 0.5, RTOL, name="outlier activations")


def test_prepare_weight_layouts():
    w = torch.randn(8, 4).bfloat16()
    with pytest.raises(ValueError, match="layout='sideways'; expected one of"):
        prepare_weight(w, layout="sideways")
    with pytest.raises(ValueError, match="needs a bf16 weight"):
        prepare_weight(torch.randn(8, 4), layout="native")
    with use_backend("triton"):
        assert prepare_weight(w) is w
        with pytest.raises(ValueError, match="layout='native'"):
            prepare_weight(w, layout="native")
    if cpu.bf16_linear():
        assert isinstance(prepare_weight(w), NativeWeight)
        assert isinstance(prepare_weight(w, layout="native"), NativeWeight)
    else:
        assert not isinstance(prepare_weight(w), NativeWeight)
        with pytest.raises(ValueError, match="needs a bf16 weight"):
            prepare_weight(w, layout="native")
    onednn = prepare_weight(w, layout="onednn")
    assert isinstance(onednn, (PackedWeight, torch.Tensor)) and not isinstance(onednn, NativeWeight)
    assert isinstance(prepare_weight(torch.randn(8, 4)), (PackedWeight, torch.Tensor))  # fp32: never native


def test_levels_and_the_switch(monkeypatch):
    assert cpu.supported_levels()[-2:] == ("generic", "torch")
    assert cpu.runnable_levels()[-1] == "torch"
    with cpu.use_level("torch"):
        assert cpu.level() == "torch" and not cpu.available()
        assert not isinstance(prepare_weight(torch.randn(8, 4).bfloat16()), NativeWeight)
    with cpu.use_level("generic"):
        assert cpu.level() == "generic" and cpu.available() and not cpu.bf16_linear()
        assert cpu.ops().level() == "generic"
    monkeypatch.setenv(cpu.ENV, "sometimes")
    with pytest.raises(ValueError, match="GRAPHSPEC_CPU=.sometimes. is not a CPU level; use auto or one of amx, avx512"):
        cpu.level()
    monkeypatch.setenv(cpu.ENV, "torch")
    assert cpu.level() == "torch"
    monkeypatch.setenv(cpu.ENV, "auto")
    assert cpu.level() == cpu.runnable_levels()[0]
    monkeypatch.setenv("GRAPHSPEC_CPU_NATIVE", "0")
    with pytest.raises(ValueError, match="GRAPHSPEC_CPU_NATIVE is gone.*GRAPHSPEC_CPU=torch"):
        cpu.level()


def test_a_level_the_cpu_lacks_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(ValueError, match="level=avx512, but this CPU lacks avx512_bf16, avx512_vnni"):
        with cpu.use_level("avx512"):
            pass
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: frozenset())
    assert cpu.supported_levels() == ("generic", "torch") or platform.machine() != "x86_64"


def test_failed_build_warns_once_in_auto_and_raises_when_required(monkeypatch):
    """auto: a level that does not build warns once and the next level down runs; a level asked for by name
    is an error that says why."""
    builds = []

    def fail(name):
        builds.append(name)
        raise cpu.NativeBuildError("no compiler (test)")

    monkeypatch.setattr(cpu, "_load", fail)
    monkeypatch.setattr(cpu, "_failed", {})
    monkeypatch.setattr(cpu, "_warned", set())
    cpu._auto_in.cache_clear()
    cpu._env_level.cache_clear()
    try:
        monkeypatch.setenv(cpu.ENV, "generic")
        with pytest.raises(cpu.NativeBuildError, match="GRAPHSPEC_CPU=generic requires graphspec.s C.. CPU backend.*no compiler"):
            cpu.level()
        monkeypatch.setenv(cpu.ENV, "auto")
        with pytest.warns(RuntimeWarning, match="level of the C.. CPU backend cannot be used .*no compiler .test."):
            assert cpu.level() == "torch"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu.level() == "torch" and not cpu.available()  # once
            assert not isinstance(prepare_weight(torch.randn(8, 4).bfloat16()), NativeWeight)
            q = torch.randn(1, 3, 4, 16)
            for _ in range(3):  # the attention asks at every call: the torch path, and no new build attempt
                assert_close(attention(q, q, q), attention_ref(q, q, q), 1e-6, 1e-6, name="torch rows")
        assert builds and len(builds) == len(set(builds))  # each level tried once per process, not at every call
    finally:
        cpu._auto_in.cache_clear()  # the next test finds the real builds again
        cpu._env_level.cache_clear()


def test_an_unusable_cache_is_a_build_error_naming_graphspec_cache(monkeypatch, tmp_path):
    from graphspec.kernels.cpu import _build

    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file, not a folder")
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(not_a_folder))
    with pytest.raises(cpu.NativeBuildError, match="set GRAPHSPEC_CACHE to a writable folder"):
        _build.build("graphspec_never_built", [_build.INCLUDE / "linear.cpp"], "test", "a test build", [])


def test_a_build_failed_under_an_unusable_cache_is_tried_again_under_a_good_one(monkeypatch, tmp_path):
    """A level that could not build because GRAPHSPEC_CACHE was unusable builds once the cache is usable again
    (the failure is remembered per cache root, not for the whole process)."""
    bad = tmp_path / "file"
    bad.write_text("not a folder")
    monkeypatch.setattr(cpu, "_failed", {})
    monkeypatch.setattr(cpu, "_load", lambda name: (_ for _ in ()).throw(cpu.NativeBuildError("cannot build"))
                        if str(cpu._build._cache_root()) == str(bad) else None)
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(bad))
    assert not cpu._builds("generic")
    monkeypatch.delenv("GRAPHSPEC_CACHE")
    assert cpu._builds("generic")
