"""graphspec's own C++ CPU kernels, built on first use and cached: bf16 linear and decode/verify attention.

Why: on the 2-core AMD EPYC (Zen 4) machines oneDNN's bf16 products do not read the weights at the memory
bandwidth with one thread, and its 7- and 8-row kernels cost much more than its 1-6-row ones; this kernel
reads each weight once per call for up to 8 rows at a time, at the bandwidth, and a row's result does not
depend on the row count or the thread count (see the C++ file). Measured: perf/RESULTS.md section S.

- ``linear`` (``linear_cpu.cpp``): bf16 weights on a CPU with AVX-512 BF16 (``bf16_linear()``), through
  :func:`graphspec.kernels.linear.prepare_weight` (:class:`~graphspec.kernels.linear.NativeWeight`).
  Elsewhere bf16 weights take oneDNN's packed layout (or ``F.linear``) as before.
- ``attend`` (``attention_cpu.cpp``): attention for decode steps and verify blocks (1..EXACT_ROWS_MAX new
  tokens, a chain or a tree), bf16 or fp32, each row over exactly its keys with the same loop whatever the
  other rows, so a verify row is bit-identical to the one-token step at its position; through
  :func:`graphspec.kernels.attention.attention` on CPU tensors. Without the kernels the torch path runs each
  verify row as its own SDPA call (``graphspec.kernels._attention_cpu``).
- ``GRAPHSPEC_CPU_NATIVE``: ``auto`` (default) builds the kernels when a C++ compiler is there, and otherwise
  warns once, saying why and how to fix it, and uses the torch paths; ``1`` requires them (a failed build is
  an error); ``0`` never uses them.
- The build: ``graphspec.kernels._native`` (about 20 s on 2 cores, once per machine, cached).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from graphspec.kernels._native import Gate, NativeBuildError, build

__all__ = ["ENV", "NativeBuildError", "available", "bf16_linear", "mode", "ops"]

ENV = "GRAPHSPEC_CPU_NATIVE"
_HERE = Path(__file__).parent
_SOURCES = [_HERE / "linear_cpu.cpp", _HERE / "attention_cpu.cpp"]
_NAME = "graphspec_cpu"
_WHAT = "graphspec's C++ CPU kernels"


def mode() -> str:
    """``GRAPHSPEC_CPU_NATIVE`` as "auto", "1" or "0" (anything else is an error that says so)."""
    return _gate.mode()


@functools.cache
def _load() -> None:
    """Build (or reuse) and load the extension once per process; NativeBuildError says why not."""
    build(_NAME, _SOURCES, "cpu", _WHAT)
    ops = getattr(torch.ops, _NAME, None)
    if ops is None or not hasattr(ops, "linear") or not hasattr(ops, "attend"):
        raise NativeBuildError(f"{_NAME} loaded but registered no linear / attend op")


_gate = Gate(ENV, _WHAT, "the torch paths (oneDNN, SDPA)",
             "a bf16 step of a 1.5B model about 1.3x slower with one thread on the AMD EPYC")


def available() -> bool:
    """Whether the C++ CPU kernels run here (builds on first call; see the module doc for the modes)."""
    return _gate.available(_load)


def bf16_linear() -> bool:
    """Whether bf16 weights take the C++ linear here: the kernels run and were built with AVX-512 BF16."""
    return available() and bool(ops().supported())


def ops():
    """The extension's torch ops (``supported``, ``pack``, ``unpack``, ``linear``, ``attend``); after ``available()``."""
    return getattr(torch.ops, _NAME)
