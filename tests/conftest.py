"""Test-wide setup.

Triton's interpreter must be switched on before triton is imported, so that
tests asking for backend="triton" run the very kernels a GPU would compile on
the CPU tensors here. The CPU fast path (torch) is unaffected by this flag.

``GRAPHSPEC_TEST_DEVICE=cuda`` (perf/gpu_check.py sets it on the GPU machine) leaves the
interpreter off and makes CUDA the default device, so the same tests create CUDA tensors and
run the compiled kernels against their references.
"""

import os

_TEST_DEVICE = os.environ.get("GRAPHSPEC_TEST_DEVICE", "cpu")
if _TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"GRAPHSPEC_TEST_DEVICE={_TEST_DEVICE!r}; expected 'cpu' or 'cuda'")
if _TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if _TEST_DEVICE == "cuda":
    torch.set_default_device("cuda")


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield
