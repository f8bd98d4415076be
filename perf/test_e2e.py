"""End-to-end benchmarks for regression tracking (``--e2e`` or ``--e2e-short``; never in ``make test``).

One benchmark per (dtype, method): the whole prompt set generated greedily, exactly N tokens each,
timed as one round (models load outside the timing). extra_info holds tokens/s, acceptance and
tokens per target forward. Methods run one after another, so cross-method ratios here drift with
the machine's load; the like-for-like comparison (interleaved, one run) is perf/e2e.py.
"""

import gc

import pytest

from perf import e2e
from perf._common import load_prompts

pytestmark = pytest.mark.e2e

CASES = [(d, m) for d in ("bf16", "fp32") for m in (*e2e.METHODS, *e2e.HF_METHODS)]
K = e2e.DEFAULT_K  # as perf/e2e.py
DRAFT_QUANTIZE = "int8"  # as perf/e2e.py and the CLI on a CPU
DRAFT_VOCAB = "auto"  # likewise: graphspec.drafters.AUTO_DRAFT_VOCAB ids for an int8 draft
DRAFT_SIBLINGS = "auto"  # likewise: graphspec.drafters.AUTO_DRAFT_SIBLINGS for model drafts (the *_chain: 0)


class _Pool:
    """Models of one (family, dtype) at a time: fp32 graphspec + transformers do not fit together."""

    def __init__(self):
        self.key, self.models = None, {}

    def get(self, family, dtype_name):
        if self.key != (family, dtype_name):
            self.models.clear()
            gc.collect()
            self.key = (family, dtype_name)
        return self.models


@pytest.fixture(scope="session")
def pool():
    return _Pool()


@pytest.fixture(scope="session")
def workload(request):
    from graphspec.models import zoo
    from graphspec.models.tokenizer import Tokenizer

    short = request.config.getoption("--e2e-short") and not request.config.getoption("--e2e")
    prompts = load_prompts(kinds=("code", "chat"), limit=2) if short else load_prompts()
    tok = Tokenizer.from_dir(zoo.resolve(e2e.TARGET, progress=False))
    return e2e.encode_prompts(tok, prompts), (48 if short else 128)


@pytest.mark.parametrize("dtype_name,method", CASES, ids=[f"{d}-{m}" for d, m in CASES])
def test_generate(benchmark, request, pool, workload, dtype_name, method):
    if dtype_name not in request.config.getoption("--e2e-dtypes").split(","):
        pytest.skip(f"{dtype_name} not in --e2e-dtypes")
    dtype = e2e.DTYPES[dtype_name]
    prompt_ids, n = workload
    if method in e2e.HF_METHODS:
        gen = e2e.hf_runner(method, dtype, pool.get("hf", dtype_name))
    else:
        gen = e2e.graphspec_runner(method, dtype, pool.get("graphspec", dtype_name), K.get(method), DRAFT_QUANTIZE,
                                     DRAFT_VOCAB, DRAFT_SIBLINGS)
    gen(prompt_ids[0][:16], 4)  # warm-up
    runs = []
    benchmark.group = f"e2e {dtype_name}"
    benchmark.pedantic(lambda: runs.extend(gen(ids, n) for ids in prompt_ids), rounds=1, iterations=1)
    agg = e2e._aggregate(runs)
    assert agg["tokens"] == n * len(prompt_ids)  # every run produced exactly n tokens
    benchmark.extra_info.update({k: v for k, v in agg.items() if k not in ("runs",)})
    benchmark.extra_info["token_ids"] = [r["token_ids"] for r in runs]
