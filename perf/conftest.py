"""Options for the benchmark suites.

- Kernel benchmarks (test_kernels.py) always run: provider torch (and the CPU ``packed`` path);
  provider triton only on CUDA.
- Model-step benchmarks (test_step.py) need the real Qwen2.5-Coder-1.5B in the zoo cache; they are
  skipped when it is not there (``graphspec fetch qwen2.5-coder-1.5b-instruct``).
- End-to-end benchmarks (test_e2e.py) run only with ``--e2e`` (4 prompts x 128 tokens, about an
  hour on 2 cores) or ``--e2e-short`` (2 prompts x 48 tokens, minutes); ``--e2e-dtypes`` picks
  bf16 / fp32.
- ``--threads N`` sets torch's intra-op threads for the whole session (on a loaded 2-core machine
  1 thread is several times faster than 2: OpenMP barriers wait for descheduled threads).
"""

import pytest
import torch


def pytest_addoption(parser):
    g = parser.getgroup("graphspec perf")
    g.addoption("--e2e", action="store_true", help="run the full end-to-end benchmarks (long)")
    g.addoption("--e2e-short", action="store_true", help="run the short end-to-end benchmarks")
    g.addoption("--e2e-dtypes", default="bf16,fp32", help="comma-separated: bf16,fp32")
    g.addoption("--threads", type=int, default=None, help="torch.set_num_threads for the session")


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: end-to-end benchmark on real checkpoints (--e2e / --e2e-short)")
    threads = config.getoption("--threads")
    if threads:
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--e2e") or config.getoption("--e2e-short"):
        return
    skip = pytest.mark.skip(reason="end-to-end benchmark: pass --e2e or --e2e-short")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)
