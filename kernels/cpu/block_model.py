"""The cached forward of a GGUF block-weight model (``weights="gguf"`` / ``"gguf-a8"``) in C++ (``block_model.cpp``).

Why: a decode step of the 1.5B target on its Q4_K_M file is about 50 ms of GEMMs (1 GB read), and the general
forward added 10-15 ms around them (norms, rope, cache writes, attention, activations, residual adds: some 30
torch ops a layer, plus Python). The C++ runs the same maths as loops in place (``layer_stack.h``, shared with
the int8 draft's forward) around the same block GEMMs (``qgemm.cpp``).

- What runs here: every cached forward (``step``, ``step_many``) of a block-weight model on the CPU at a C++
  level: any batch, chains and trees (a mask). ``Transformer`` calls it; at the torch level, or with
  ``Transformer.native_forward = False``, the general forward runs instead.
- Weights: each GEMM weight's ``native()`` (``BlockLinear``: its own bytes or tiles, no copy). The embedding
  lookup stays in Python (``BlockWeight.rows``).
- Numerics: the GEMMs' bits are the general forward's; the rest sums in another order than torch and uses a
  polynomial exp (relative error < 3e-7), so logits differ from the general forward's by rounding (tested with a
  tolerance, and against transformers). Each row's result is independent of the other rows, so speculative
  decoding is exactly as lossless as with the general forward.
"""

from __future__ import annotations

from graphspec.kernels import cpu
from graphspec.kernels.cpu.layer_stack import held_stack

__all__ = ["model_for"]


def model_for(model, level: str | None = None):
    """The level's C++ ``BlockModel`` holding ``model``'s block weights (made once per model and level; rebuilt
    if the layers change). ``level``: default the level in force; never torch."""
    level = cpu.level() if level is None else level
    return held_stack(model, cpu.qclasses(level).BlockModel, level, "_block_native")
