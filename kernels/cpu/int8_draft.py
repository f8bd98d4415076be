"""The int8 draft's cached forward in C++ (``int8_draft.cpp``), at the CPU backend's level in force.

Why: a small draft's forward is mostly the work around its GEMMs (about 25 torch ops a layer, each with
dispatch and allocation for a few hundred floats); the C++ runs the same maths as loops in place, around
graphspec's int8 GEMM (``int8_gemm.h``).

- What runs here: every cached forward of an int8 model (``quantize="int8"`` or ``"int4"``, always a draft):
  any batch, chains and draft trees (a mask). ``Transformer._forward_native`` calls it at every C++ level; at the
  torch level the general forward runs instead, on :func:`graphspec.kernels.linear.int8_linear_ref`.
- The weights are the model's ``Int8Weight``\\ s packed for the level (``Int8Weight.native``), shared with
  their eager ``linear``: no second copy.
- ``quantize="int4"`` models start on the "int4" GEMM (``int4_gemm.h``; amx, avx512 and avx2): the layers' products
  of up to 3 rows with the int8 weights rounded again to 4 bits in groups of 64 inputs, packed on the first
  switch (about 0.56x the int8 bytes more); larger ones and the lm_head on the int8 GEMM.
  ``draft_for(model).set_gemm("int8" | "int4")`` switches one model; ``using_gemm`` for a block.
- A forward of 8 or more tokens a sequence without a tree (a prompt's prefill, a draft's catch-up; not
  ``forward_many``) runs the layers' products with the activations rounded to bf16 (vdpbf16ps: twice the fp32
  GEMM's products an instruction, so about half its time a prefill token), at the avx512 and amx levels;
  elsewhere, and for every shorter forward, the fp32 GEMM.
- Numerics: not the general forward's bits (fp32 sums in another order, a polynomial exp), with the same
  int8 GEMM; a draft may compute anything without breaking losslessness, and the pipeline's exactness tests
  run through this path too. This module reads the model's fields (``layers``, ``config``, ``norm``, ``scale``,
  ``quantize``) by name; it imports nothing from graphspec.models.
"""

from __future__ import annotations

import contextlib

from graphspec.kernels import cpu
from graphspec.kernels.cpu.layer_stack import held_stack

__all__ = ["draft_for", "using_gemm"]


def draft_for(model, level: str | None = None):
    """The level's C++ ``Int8Draft`` holding ``model``'s int8 layers (made once per model and level; rebuilt
    if the layers change). ``level``: default the level in force; never torch."""
    level = cpu.level() if level is None else level

    def configure(obj):
        if model.quantize == "int4":
            obj.set_gemm("int4")

    return held_stack(model, cpu.classes(level).Int8Draft, level, "_int8_native", configure)


@contextlib.contextmanager
def using_gemm(model, name: str):
    """Inside the block ``model``'s C++ forward runs ``name``'s GEMM ("int8" or "int4"); then what it ran before."""
    draft = draft_for(model)
    before = draft.gemm()
    draft.set_gemm(name)
    try:
        yield draft
    finally:
        draft.set_gemm(before)
