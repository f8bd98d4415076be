"""Model-step benchmarks on the real Qwen2.5-Coder-1.5B (skipped unless it is in the zoo cache).

One-token decode step and verify steps over K+1 = 2, 5, 8 tokens after 256 cached positions, bf16
and fp32, CPU fast path (prepared weights). extra_info: GB/s of weights read per step, the fraction
of the read bandwidth measured in this session, and (verify) the cost relative to the one-token
step measured just before it in the same session.
"""

import pytest
import torch

from perf._common import TARGET, read_bandwidth, step_weight_bytes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_one_token: dict = {}


@pytest.fixture(scope="session")
def bandwidth():
    return read_bandwidth()["gbps_median"]


@pytest.fixture(scope="module")
def models():
    from graphspec.models import zoo

    if zoo.cached(TARGET) is None:
        pytest.skip(f"{TARGET} is not in the zoo cache (graphspec fetch {TARGET})")
    cache = {}

    def get(name):
        if name not in cache:
            cache.clear()
            from graphspec.models import load_model

            cache[name] = load_model(TARGET, dtype=DTYPES[name])
        return cache[name]
    return get


@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_step(benchmark, models, bandwidth, dtype_name, tokens):
    model = models(dtype_name)
    context = 256
    cache = model.new_cache(context + tokens + 8)
    gen = torch.Generator().manual_seed(0)
    model.step(torch.randint(0, model.config.vocab_size, (1, context), generator=gen), cache, logits_for="last")
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    benchmark.group = f"step {dtype_name}"
    # Each round appends T tokens after the same 256 cached ones (setup rolls the cache back, untimed).
    benchmark.pedantic(lambda: model.step(ids, cache, logits_for="all"), setup=lambda: cache.truncate(context),
                       rounds=5, warmup_rounds=1, iterations=1)
    med = benchmark.stats.stats.median
    nbytes = step_weight_bytes(model)
    info = {"tokens": tokens, "median_ms": med * 1e3, "gbps": nbytes / med / 1e9,
            "fraction_of_read_bandwidth": nbytes / med / 1e9 / bandwidth, "read_bandwidth_gbps": bandwidth}
    if tokens == 1:
        _one_token[dtype_name] = med
    elif dtype_name in _one_token:
        info["cost_vs_one_token_step"] = med / _one_token[dtype_name]
    benchmark.extra_info.update(info)
