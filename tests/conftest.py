"""Test-wide setup.

Triton's interpreter must be switched on before triton is imported, so that
tests asking for backend="triton" run the very kernels a GPU would compile on
the CPU tensors here. The CPU fast path (torch) is unaffected by this flag.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield
