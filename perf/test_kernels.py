"""Kernel benchmarks: provider torch vs triton (CUDA only) vs packed, onednn, native (CPU) vs int8 (CPU draft
weights, decode/verify linears only), decode/verify/prefill shapes (the providers: perf/kernel_cases.py).

    .venv/bin/python -m pytest perf/test_kernels.py --benchmark-only

extra_info of each benchmark holds ms, GB/s (and TFLOP/s for matmul/attention) of the median call,
from the formulas in perf/kernel_cases.py.
"""

import pytest
import torch

from perf.kernel_cases import all_cases, figures

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = dict(all_cases(DEVICE))


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            cache.clear()  # one case's inputs at a time
            cache[name] = CASES[name]()
        return cache[name]
    return get


@pytest.mark.parametrize("provider", ["torch", "triton", "packed", "onednn", "native", "int8"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel(benchmark, built, name, provider):
    if provider == "triton" and DEVICE != "cuda":
        pytest.skip("triton provider: CUDA only (the CPU has only the interpreter)")
    case = built(name)
    if provider not in case.providers:
        pytest.skip(f"{provider} does not apply to {case.name}")
    fn = case.providers[provider]
    if DEVICE == "cuda":
        def run():
            fn()
            torch.cuda.synchronize()
    else:
        run = fn
    benchmark.group = case.name
    benchmark.name = f"{case.name} [{provider}]"
    benchmark.pedantic(run, rounds=7 if DEVICE == "cpu" else 50, warmup_rounds=2, iterations=1)
    benchmark.extra_info.update(case=case.name, provider=provider, device=DEVICE,
                                **figures(case, benchmark.stats.stats.median))
