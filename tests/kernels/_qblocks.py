"""Random GGUF blocks for the block-format tests: any bytes, with every fp16 scale finite."""

from __future__ import annotations

import numpy as np

from graphspec.kernels.qlinear import FORMATS

# Byte offsets of each format's fp16 scales inside a block (d, and m / dmin where the format has one).
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}
QUANT_TYPES = tuple(F16_FIELDS)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """uint8 [rows, cols / block * bytes]: random quants and sub-scales, fp16 scales of about ``scale``."""
    size, nbytes = FORMATS[type_name]
    rng = np.random.default_rng(seed)
    if type_name in ("F32", "F16", "BF16"):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        if type_name == "F16":
            x = x.astype(np.float16)
        elif type_name == "BF16":
            x = (x.view(np.uint32) >> 16).astype(np.uint16)
        return np.ascontiguousarray(x).view(np.uint8).reshape(rows, -1)
    b = rng.integers(0, 256, size=(rows * cols // size, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        d = (rng.standard_normal(b.shape[0]) * scale).astype(np.float16)
        b[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)
