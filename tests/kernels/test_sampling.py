"""warp_logits / sample / exponential_noise: Triton (interpreter) == torch reference, the reference ==
a brute-force float64 reading of the definition, and a chi-square check that sampling draws from probs."""

import importlib
import itertools
import sys

import pytest
import torch
from scipy.stats import chisquare

from graphspec.kernels import exponential_noise, sample, sample_ref, use_backend, warp_logits, warp_logits_ref
from graphspec.kernels.sampling import _sample_triton, _warp_logits_triton
from tests.kernels._compare import assert_close
from tests.kernels._sm90 import compile_main, have_ptxas, run_compile_check

ATOL = 1e-6  # fp32 probabilities


def _logits(N, V, dtype=torch.float32, seed=0):
    """Rows of mixed character: plain gaussian, heavy ties (few distinct values), peaked, -inf entries."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(V, generator=g) * 2.0,
            torch.randint(0, 4, (V,), generator=g).float() * 0.75,  # ties everywhere, incl. the boundaries
            torch.randn(V, generator=g) * 6.0]
    masked = torch.randn(V, generator=g)
    masked[torch.randperm(V, generator=g)[: V // 3]] = float("-inf")  # padded vocabulary slots
    rows.append(masked)
    return torch.stack([rows[i % len(rows)] for i in range(N)]).to(dtype)


def _definition(logits, temperature, top_k, top_p):
    """Float64, one row at a time, grouped by distinct values so ties are handled literally."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for r, row in enumerate(logits.double()):
        z = row / temperature
        p = torch.softmax(z, 0)
        kept = torch.ones_like(z, dtype=torch.bool)
        if 0 < top_k < z.numel():
            kth = torch.sort(z, descending=True).values[top_k - 1]
            kept &= z >= kth
        if top_p < 1.0:
            mass_k = p[kept].sum()
            for value in torch.unique(z[kept]).flip(0):  # descending distinct values
                if p[kept & (z >= value)].sum() >= top_p * mass_k:
                    kept &= z >= value
                    break
        out[r, kept] = p[kept] / p[kept].sum()
    return out


GRID = list(itertools.product([1.0, 0.7], [0, 1, 5, 50], [1.0, 0.9, 0.5]))


@pytest.mark.parametrize("temperature,top_k,top_p", GRID)
def test_warp_triton_matches_reference_v1000(temperature, top_k, top_p):
    logits = _logits(4, 1000, seed=top_k)
    expected = warp_logits_ref(logits, temperature, top_k, top_p)
    out = _warp_logits_triton(logits, temperature, top_k, top_p)
    assert_close(out, expected, ATOL, 0.0, name="warp_logits")
    # the kept sets agree exactly, not only within the tolerance
    assert torch.equal(out > 0, expected > 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 50, 0.5)])
def test_warp_triton_matches_reference_v50257(temperature, top_k, top_p):
    logits = _logits(2, 50257, seed=7)  # a gaussian row and a row full of ties
    assert_close(_warp_logits_triton(logits, temperature, top_k, top_p),
                 warp_logits_ref(logits, temperature, top_k, top_p), ATOL, 0.0, name="warp_logits V=50257")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_warp_half_inputs_and_strided_rows(dtype):
    base = _logits(6, 2 * 777, dtype=dtype)
    logits = base[::2, ::2]  # non-contiguous in both axes
    for args in [(0.7, 5, 0.9), (1.0, 0, 0.5), (0.0, 0, 1.0)]:
        out = _warp_logits_triton(logits, *args)
        assert out.dtype == torch.float32 and out.is_contiguous()
        assert_close(out, warp_logits_ref(logits, *args), ATOL, 0.0, name=f"warp_logits{args}")


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.6), (1.3, 4, 0.8),
                                                     (1.0, 1, 0.3), (0.5, 11, 0.95)])
def test_reference_follows_the_definition(temperature, top_k, top_p):
    logits = _logits(8, 11, seed=3)
    expected = _definition(logits, temperature, top_k, top_p)
    assert_close(warp_logits_ref(logits, temperature, top_k, top_p), expected, ATOL, 0.0, name="warp_logits_ref")
    assert_close(_warp_logits_triton(logits, temperature, top_k, top_p), expected, ATOL, 0.0, name="warp triton")


def test_top_k_and_top_p_keep_ties_at_the_boundary():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    for backend in ("torch", "triton"):
        with use_backend(backend):
            # the 1st and 2nd largest tie: top-1 keeps both
            assert torch.equal(warp_logits(logits, 1.0, 1) > 0, torch.tensor([[False, True, True, False, False]]))
            # one of the tied tokens alone reaches top_p, its twin is kept too
            assert torch.equal(warp_logits(logits, 1.0, 0, 0.3) > 0, torch.tensor([[False, True, True, False, False]]))
            # 0.5 alone misses 0.75, 0.5 + 0.3 reaches it: the smallest such set
            probs = warp_logits(torch.log(torch.tensor([[0.2, 0.5, 0.3]])), 1.0, 0, 0.75)
            assert_close(probs, torch.tensor([[0.0, 0.625, 0.375]]), ATOL, 0.0, name=f"top_p=0.75 [{backend}]")


def test_temperature_zero_is_one_hot_argmax_lowest_index():
    logits = _logits(4, 1000)
    logits[0, 10] = logits[0, 700] = logits[0].max() + 1.0  # tie, across tiles of the kernel
    expected = torch.zeros(4, 1000)
    expected[torch.arange(4), logits.argmax(-1)] = 1.0
    assert int(logits[0].argmax()) == 10
    for backend in ("torch", "triton"):
        with use_backend(backend):
            assert torch.equal(warp_logits(logits, 0.0, top_k=5, top_p=0.5), expected), backend


def test_sample_same_noise_same_ids_in_both_backends():
    probs = warp_logits_ref(_logits(16, 3001), 0.8, 0, 0.95)
    probs[3] = 0.0
    probs[3, [5, 2999]] = 0.5  # two-token row: the race decides between tiles
    noise = exponential_noise(probs.shape, torch.Generator().manual_seed(11))
    ids = _sample_triton(probs, noise)
    assert ids.dtype == torch.int64 and ids.shape == (16,)
    assert torch.equal(ids, sample_ref(probs, noise))
    assert bool((probs.gather(1, ids[:, None]) > 0).all()), "a zero-probability token was drawn"
    with use_backend("triton"):
        assert torch.equal(sample(probs[::2], noise[::2]), ids[::2])  # strided rows


def test_sample_draws_from_probs_chi_square():
    probs = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.25, 0.01, 0.04])
    n = 40000
    gen = torch.Generator().manual_seed(1234)
    ids = sample(probs.expand(n, -1), exponential_noise((n, probs.numel()), gen))
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    assert counts[3] == 0
    nz = probs > 0
    expected = probs[nz].double() / probs[nz].double().sum() * counts.sum()
    stat = chisquare(counts[nz].numpy(), expected.numpy())
    assert stat.pvalue > 1e-3, f"draws do not follow probs: {counts.tolist()} (p={stat.pvalue:.2g})"
    # and the Triton race reproduces the same ids on a slice of those draws
    gen = torch.Generator().manual_seed(1234)
    noise = exponential_noise((n, probs.numel()), gen)[:256]
    assert torch.equal(_sample_triton(probs.expand(256, -1), noise), ids[:256])


def test_exponential_noise_is_seeded_and_positive():
    a = exponential_noise((64, 500), torch.Generator().manual_seed(5), "cpu")
    b = exponential_noise((64, 500), torch.Generator().manual_seed(5), "cpu")
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert bool((a > 0).all())
    assert abs(a.mean().item() - 1.0) < 0.02  # Exp(1) has mean 1; 32000 draws: sd of the mean ~0.006


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(logits=torch.randn(10)), "logits must have 2"),
    (dict(logits=torch.randint(0, 5, (2, 10))), "logits has dtype"),
])
def test_warp_errors(kwargs, match, backend):
    args = dict(logits=torch.randn(2, 10), temperature=1.0, top_k=0, top_p=1.0)
    args.update(kwargs)
    with use_backend(backend), pytest.raises(ValueError, match=match):
        warp_logits(**args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_errors(backend):
    probs = torch.full((2, 10), 0.1)
    with use_backend(backend):
        with pytest.raises(ValueError, match="noise has shape"):
            sample(probs, torch.ones(2, 9))
        with pytest.raises(ValueError, match="probs has dtype"):
            sample(probs.double(), torch.ones(2, 10))
        with pytest.raises(ValueError, match="noise is on"):
            sample(probs, torch.ones(2, 10, device="meta"))


def _sm90_specs():
    """The launcher's configurations (V = 50257), fp32 and bf16 logits (fp16 lowers like bf16)."""
    mod = importlib.import_module("graphspec.kernels.sampling")
    specs = []
    for dt in ("fp32", "bf16"):
        for greedy in (False, True):
            specs.append((f"warp {dt} greedy={greedy}", mod._warp_kernel,
                          {"logits_ptr": "*" + dt, "out_ptr": "*fp32", "stride_ln": "i32", "stride_lv": "i32",
                           "stride_on": "i32", "stride_ov": "i32", "V": "i32", "inv_temperature": "fp32",
                           "top_k": "fp32", "top_p": "fp32", "GREEDY": "constexpr", "BLOCK_V": "constexpr",
                           "SEARCH_BLOCK_V": "constexpr", "NPROBE": "constexpr"},
                          {"GREEDY": greedy, "BLOCK_V": 4096, "SEARCH_BLOCK_V": 512, "NPROBE": mod._NPROBE},
                          {"num_warps": 8}))
    specs.append(("race", mod._race_kernel,
                  {"probs_ptr": "*fp32", "noise_ptr": "*fp32", "out_ptr": "*i64", "stride_pn": "i32",
                   "stride_pv": "i32", "stride_nn": "i32", "stride_nv": "i32", "V": "i32", "BLOCK_V": "constexpr"},
                  {"BLOCK_V": 4096}, {"num_warps": 8}))
    return specs


@pytest.mark.skipif(not have_ptxas(), reason="this triton wheel ships no ptxas; cannot compile for sm_90 here")
def test_sampling_kernels_compile_for_sm90():
    run_compile_check("tests.kernels.test_sampling")


if __name__ == "__main__":
    sys.exit(compile_main(_sm90_specs()))
