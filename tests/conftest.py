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

# make test runs one pytest-xdist worker a core: one intra-op thread each keeps the cores from being
# oversubscribed (OpenMP threads spin while they wait). Tests about threads set their own counts.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


# The CPU backend's levels (graphspec.kernels.cpu): every C++ level this CPU executes, so that a machine runs its
# best level and every one below it (an AVX-512 machine runs the avx2 and generic builds too). A level the CPU
# executes but that does not build fails its tests rather than skipping them: CI's machines have g++ and ninja.
from graphspec.kernels import cpu as _cpu  # noqa: E402

# amx differs from avx512 in its bf16 linear, its bf16 attention and its GGUF k-quant GEMMs on int8 activations (its
# other kernels are avx512's source): it runs the bf16 tests (bf16_level), the attention's (attention_level), the
# GGUF blocks' (block_level) and the whole-model ones (model_level), and tests/kernels/cpu/test_amx.py checks that
# the rest is avx512's, rather than every per-level test running twice.
ALL_C_LEVELS = [lv for lv in _cpu.supported_levels() if lv != "torch"]
C_LEVELS = [lv for lv in ALL_C_LEVELS if lv != "amx"]
BF16_LEVELS = [lv for lv in ALL_C_LEVELS if _cpu.bf16_linear(lv)]


@pytest.fixture(params=C_LEVELS)
def level(request):
    """Each C++ level this CPU executes (but amx: its kernels other than the bf16 linear are avx512's), in force
    for the test."""
    with _cpu.use_level(request.param):
        yield request.param


@pytest.fixture(params=BF16_LEVELS)
def bf16_level(request):
    """Each level with a bf16 linear (amx, avx512, avx2) this CPU executes, in force for the test."""
    with _cpu.use_level(request.param):
        yield request.param


@pytest.fixture(params=[*C_LEVELS, "torch"])
def any_level(request):
    """Each C++ level this CPU executes (but amx, as ``level``), then the torch level (no C++), in force for the test."""
    with _cpu.use_level(request.param):
        yield request.param


@pytest.fixture(params=ALL_C_LEVELS)
def block_level(request):
    """Every C++ level, amx included (its int8-activation GEMMs on GGUF k-quants run on tiles): for the block
    GEMMs' tests and GGUF models' native forwards."""
    with _cpu.use_level(request.param):
        yield request.param


@pytest.fixture(params=[*ALL_C_LEVELS, "torch"])
def attention_level(request):
    """Every level, amx included (its bf16 attention runs on tiles), then torch: for the attention's own tests."""
    with _cpu.use_level(request.param):
        yield request.param


@pytest.fixture(params=[*ALL_C_LEVELS, "torch"])
def model_level(request):
    """Every level, amx included, then torch: for tests of whole bf16 models, whose products differ at amx."""
    with _cpu.use_level(request.param):
        yield request.param


@pytest.fixture(scope="session", autouse=True)
def _cpu_levels_built():
    """Build every C++ level's extensions before the first test: a first build takes minutes on a loaded 2-core
    machine (a fresh cache, as in CI), and a test that gives a subprocess or a server seconds to answer must not
    pay for it. A level that does not build is left to its own tests, which fail and say why."""
    if _TEST_DEVICE == "cpu":
        for lv in ALL_C_LEVELS:
            try:
                _cpu.ops(lv)
                _cpu.qops(lv)
            except _cpu.NativeBuildError:
                pass
    yield
