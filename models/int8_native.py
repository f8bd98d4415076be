"""The int8 draft's cached forward in C++ (``int8_native.cpp``), built on first use and cached.

Why: a small draft's forward is mostly the work around its GEMMs. The TorchScript path
(``graphspec.models.lean_int8``) runs about 25 torch ops a layer, each with dispatch, allocation and
TensorIterator set-up for a few hundred floats; this file's C++ runs the same maths as loops in place
(perf/RESULTS.md section T, AMD EPYC: SmolLM2-135M 15.3 -> 10.4 ms a token with one thread, 12.2 -> 8.7
with two, both on fbgemm's GEMMs).

- The GEMMs: on CPUs with AVX-512 VNNI, graphspec's own int8 GEMM (kernels/_int8_gemm.h: one weight
  stream per 64 outputs, up to 6 rows in registers, each row of x quantized to 8 bits on its own), which
  reads the weights faster than fbgemm's dynamic linear (perf/RESULTS.md section R); elsewhere fbgemm's
  (what the TorchScript path runs). The C++ object keeps a copy of each int8 weight in its own layout
  beside fbgemm's (which the TorchScript path still uses): the int8 weights' bytes once more
  (SmolLM2-135M about 135 MB, the pruned Qwen2.5-0.5B about 420 MB). ``draft_for(model).set_gemm("fbgemm")``
  switches one model back (``using_gemm`` for a block; benchmarks, tests); ``default_gemm()`` says what a
  new int8 one runs.
- ``quantize="int4"`` models start on the "int4" GEMM (kernels/_int4_gemm.h; ``set_gemm("int4")`` on any
  int8 model does the same): the layers' products of up to 3 rows with the int8 weights rounded again to 4
  bits in groups of 64 inputs, packed on the first switch (about 0.56x the int8 bytes more), larger ones and
  the lm_head on the int8 GEMM. The 0.5B's layer products a token 16.9 -> 10.7 ms, at some acceptance
  (perf/RESULTS.md section Q).
- What runs here: cached forwards of an int8 model (``quantize="int8"``, always a draft) with batch 1 and
  no tree mask, any number of new tokens; everything else (batches, draft-beam levels) stays on the
  TorchScript path. ``Transformer._forward_int8`` decides.
- Numerics: not the TorchScript path's bits (fp32 sums in another order, a polynomial exp, and with the
  VNNI GEMM another rounding of the activations); with fbgemm's GEMMs, logits agree within 1e-3 on the
  tests' small models (tests/models/test_int8_native.py), while on a real draft int8
  rounding of the activations amplifies the difference (perf/RESULTS.md section T). A draft may compute
  anything without breaking losslessness; the pipeline's exactness tests run through this path too.
- ``GRAPHSPEC_INT8_NATIVE``: ``auto`` (default) builds it when a C++ compiler is there and otherwise warns
  once, saying why and how to fix it, and runs the TorchScript path; ``1`` requires it (a failed build is an
  error); ``0`` never uses it.
- The build: ``graphspec.kernels._native`` (torch.utils.cpp_extension, about 20 s on 2 cores, once per
  machine, into ``$GRAPHSPEC_CACHE/native/int8-<key>``, keyed by the source, torch, Python and the CPU's flags).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from graphspec.kernels._native import Gate, NativeBuildError, build

__all__ = ["ENV", "mode", "available", "have_vnni", "default_gemm", "draft_for", "using_gemm", "NativeBuildError"]

ENV = "GRAPHSPEC_INT8_NATIVE"
_SOURCE = Path(__file__).with_name("int8_native.cpp")
_NAME = "graphspec_int8_native"
_WHAT = "the C++ int8 draft forward"


def mode() -> str:
    """``GRAPHSPEC_INT8_NATIVE`` as one of "auto", "1", "0" (anything else is an error that says so)."""
    return _gate.mode()


@functools.cache
def _load() -> None:
    """Build (or reuse) and load the extension once per process; NativeBuildError says why not."""
    if not torch.backends.quantized.supported_engines or not hasattr(torch.ops.quantized, "linear_dynamic"):
        raise NativeBuildError("this torch build has no int8 CPU GEMM")
    build(_NAME, [_SOURCE], "int8", _WHAT)
    if not hasattr(torch.classes, _NAME) or not hasattr(getattr(torch.classes, _NAME), "Int8Draft"):
        raise NativeBuildError(f"{_NAME} loaded but registered no Int8Draft class")


_gate = Gate(ENV, _WHAT, "the TorchScript path", "SmolLM2-135M about 1.4x slower a token")


def available() -> bool:
    """Whether int8 forwards may run in C++ here (builds on first call; see the module doc for the modes)."""
    return _gate.available(_load)


def have_vnni() -> bool:
    """Whether the extension was built with AVX-512 VNNI (graphspec's int8 and int4 GEMMs); False where it
    is not available at all."""
    return available() and bool(torch.ops.graphspec_int8_native.have_vnni())


def default_gemm() -> str:
    """The GEMM a new C++ draft of an int8 model runs: "vnni" (graphspec's, where built with AVX-512 VNNI) or
    "fbgemm". (A ``quantize="int4"`` model's runs "int4".)"""
    if not available():
        raise NativeBuildError(f"{_WHAT} is not available here ({ENV}={mode()})")
    return "vnni" if have_vnni() else "fbgemm"


def draft_for(model):
    """The C++ ``Int8Draft`` holding ``model``'s int8 layers (made once per model; rebuilt if they change)."""
    layers = model.layers
    key = tuple(id(x) for layer in layers for x in (layer.wqkv, layer.wo, layer.w13, layer.w2)) + (id(model.norm),)
    held = getattr(model, "_int8_native", None)
    if held is not None and held[0] == key:
        return held[1]
    c = model.config
    obj = getattr(torch.classes, _NAME).Int8Draft(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                                 c.hidden_size, float(c.rms_norm_eps), float(model.scale),
                                                 model.norm.contiguous())
    for layer in layers:
        obj.add_layer(layer.wqkv.packed, layer.bqkv, layer.wo.packed, layer.bo, layer.w13.packed, layer.w2.packed,
                      layer.input_norm.contiguous(), layer.post_norm.contiguous())
    if model.quantize == "int4":
        obj.set_gemm("int4")
    model._int8_native = (key, obj)
    return obj


@contextlib.contextmanager
def using_gemm(model, name: str):
    """Inside the block ``model``'s C++ forward runs ``name``'s GEMM ("vnni", "int4" or "fbgemm"); then what it ran before."""
    draft = draft_for(model)
    before = draft.gemm()
    draft.set_gemm(name)
    try:
        yield draft
    finally:
        draft.set_gemm(before)
