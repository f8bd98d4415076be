"""Where every op decides whether Triton or torch runs it.

- CUDA tensors run the Triton kernel; CPU tensors run the plain-torch path
  (which is also each op's reference, ``<op>_ref``).
- ``GRAPHSPEC_BACKEND=triton`` (or ``use_backend("triton")``) asks for the Triton
  kernel everywhere. On a CPU that only works under Triton's interpreter, so
  ``TRITON_INTERPRET=1`` must be set *before* triton is imported; asking for it
  without the interpreter is an error, never a silent fallback.
- ``GRAPHSPEC_BACKEND=torch`` (or ``use_backend("torch")``) forces the torch path,
  also on CUDA.

The override is a context variable, so a model loaded with ``backend=...`` can
pin its own choice for the duration of its forward without touching others.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import torch

BACKENDS = ("auto", "torch", "triton")

EXACT_ROWS_MAX = 64
"""On the CPU torch path, blocks of up to this many rows (a speculative verify of K + 1 tokens, a draft tree)
come out with every row bit-identical to a one-row call of the same op (``linear`` on packed weights,
``attention``), so a verify row equals the one-token step at its position and greedy speculative output
equals autoregressive output in bf16 as in fp32. Longer blocks (prefills) run batched: faster, and never
compared with single steps, and so does any block inside ``batched_rows()``. 64 is also the widest draft
tree the Triton attention kernel takes."""

EXACT_CHAIN_ROWS_MAX = 1024
"""Chains (causal blocks, no tree) of up to this many rows are row-exact too where every op of a forward runs in
graphspec's C++ (the bf16 linear and attention at a CPU level that has them): those kernels compute each row
in one order whatever the row count. ``Transformer.exact_block_rows`` says whether a model qualifies; a row-exact
prefill (``graphspec.drafters.prefill(exact=True)``) then runs blocks this long: a prompt's new part is often one
block, which reads the weights once, as a batched prefill does."""

_exact_rows: contextvars.ContextVar[bool] = contextvars.ContextVar("graphspec_exact_rows", default=True)


@contextlib.contextmanager
def batched_rows() -> Iterator[None]:
    """Inside this block, CPU ops run blocks of up to ``EXACT_ROWS_MAX`` rows batched rather than row-exact.

    For forwards whose rows are never compared with one-token steps: a prefill (graphspec prefills the
    target the same way with or without a draft), where batched rows run much faster than row-exact ones.
    """
    token = _exact_rows.set(False)
    try:
        yield
    finally:
        _exact_rows.reset(token)


def rows_exact() -> bool:
    """False inside ``batched_rows()``: whether blocks of up to EXACT_ROWS_MAX rows must be row-exact."""
    return _exact_rows.get()

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("graphspec_backend", default=None)


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS}")
    return name


def requested_backend() -> str:
    """The backend asked for: the innermost ``use_backend``, else GRAPHSPEC_BACKEND, else auto."""
    name = _override.get()
    if name is None:
        name = os.environ.get("GRAPHSPEC_BACKEND", "auto") or "auto"
        if name not in BACKENDS:
            raise ValueError(f"GRAPHSPEC_BACKEND={name!r} is not one of {BACKENDS}")
    return name


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Pin the backend inside a ``with`` block (``None`` leaves the current choice)."""
    if name is None:
        yield
        return
    token = _override.set(_check_name(name))
    try:
        yield
    finally:
        _override.reset(token)


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor ``t`` should run its Triton kernel."""
    name = requested_backend()
    if name == "torch":
        return False
    if name == "auto":
        return t.is_cuda
    # explicit triton
    if not t.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            "the Triton backend was asked for on a CPU tensor, but Triton's interpreter is off; "
            "set TRITON_INTERPRET=1 before importing graphspec (or use backend='torch')"
        )
    return True


def check_tensor(name: str, t, *, ndim: int | tuple[int, ...] | None = None,
                 dtypes: tuple[torch.dtype, ...] | None = None, device: torch.device | None = None) -> None:
    """Validate one op argument; errors name the argument and say what was expected."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.ndim not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}; move them to one device")


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
