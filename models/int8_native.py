"""The int8 draft's cached forward in C++ (``int8_native.cpp``), built on first use and cached.

Why: a small draft's forward is mostly the work around its GEMMs. The TorchScript path
(``graphspec.models.lean_int8``) runs about 25 torch ops a layer, each with dispatch, allocation and
TensorIterator set-up for a few hundred floats; this file's C++ runs the same maths as loops in place and
calls the same fbgemm GEMMs (perf/RESULTS.md section T, AMD EPYC: SmolLM2-135M 15.3 -> 10.4 ms a token
with one thread, 12.2 -> 8.7 with two; the GEMM-bound 0.5B gains only on several-token forwards).

- What runs here: cached forwards of an int8 model (``quantize="int8"``, always a draft) with batch 1 and
  no tree mask, any number of new tokens; everything else (batches, draft-beam levels) stays on the
  TorchScript path. ``Transformer._forward_int8`` decides.
- Numerics: not the TorchScript path's bits (fp32 sums in another order, a polynomial exp); logits agree
  within 1e-3 on the tests' small models (tests/models/test_int8_native.py), while on a real draft int8
  rounding of the activations amplifies the difference (perf/RESULTS.md section T). A draft may compute
  anything without breaking losslessness; the pipeline's exactness tests run through this path too.
- ``GRAPHSPEC_INT8_NATIVE``: ``auto`` (default) builds it when a C++ compiler is there and otherwise warns
  once, saying why and how to fix it, and runs the TorchScript path; ``1`` requires it (a failed build is an
  error); ``0`` never uses it.
- The build (torch.utils.cpp_extension, about 20 s on 2 cores, once per machine) goes to
  ``$GRAPHSPEC_CACHE/native/<key>`` (default ``~/.cache/graphspec``), keyed by the source, torch, Python and
  the CPU's flags (it is compiled with ``-march=native``); a lock keeps two processes from building at once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["ENV", "mode", "available", "draft_for", "NativeBuildError"]

ENV = "GRAPHSPEC_INT8_NATIVE"
_SOURCE = Path(__file__).with_name("int8_native.cpp")
_NAME = "graphspec_int8_native"
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]


class NativeBuildError(RuntimeError):
    """The C++ int8 forward could not be built or loaded."""


def mode() -> str:
    """``GRAPHSPEC_INT8_NATIVE`` as one of "auto", "1", "0" (anything else is an error that says so)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    aliases = {"auto": "auto", "1": "1", "on": "1", "true": "1", "0": "0", "off": "0", "false": "0"}
    if value not in aliases:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}; use auto (the default: the C++ int8 draft forward when it "
                         f"builds), 1 (require it) or 0 (the TorchScript path only)")
    return aliases[value]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    from graphspec.models.zoo import cache_root

    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
                 _cpu_flags().encode(), " ".join(_CFLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    return cache_root() / "native" / f"int8-{key.hexdigest()[:16]}"


@functools.cache
def _load() -> None:
    """Build (or reuse) and load the extension once per process; NativeBuildError says why not."""
    if not torch.backends.quantized.supported_engines or not hasattr(torch.ops.quantized, "linear_dynamic"):
        raise NativeBuildError("this torch build has no int8 CPU GEMM")
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - part of every torch
        raise NativeBuildError(f"torch.utils.cpp_extension is unavailable ({e})") from e
    out = _build_dir()
    out.mkdir(parents=True, exist_ok=True)
    built = (out / f"{_NAME}.so").exists()
    fd = os.open(out / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"graphspec: waiting for another process that is building the C++ int8 draft forward in {out} ...",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            built = (out / f"{_NAME}.so").exists()
        if not built:
            print(f"graphspec: building the C++ int8 draft forward (once per machine, about 20 s) in {out} ...",
                  file=sys.stderr, flush=True)
        try:
            cpp_extension.load(_NAME, [str(_SOURCE)], extra_cflags=_CFLAGS, build_directory=str(out),
                               is_python_module=False, verbose=False)
        except Exception as e:  # compiler missing or failing, ninja missing, headers missing
            msg = str(e).strip().splitlines()
            tail = "\n".join(msg[-12:])
            raise NativeBuildError(f"building {_SOURCE.name} in {out} failed: {type(e).__name__}: {tail}") from e
    finally:
        os.close(fd)
    if not hasattr(torch.classes, _NAME) or not hasattr(getattr(torch.classes, _NAME), "Int8Draft"):
        raise NativeBuildError(f"{_NAME} loaded but registered no Int8Draft class")


_warned = False


def available() -> bool:
    """Whether int8 forwards may run in C++ here (builds on first call; see the module doc for the modes)."""
    global _warned
    m = mode()
    if m == "0":
        return False
    try:
        _load()
        return True
    except NativeBuildError as e:
        if m == "1":
            raise NativeBuildError(f"{ENV}=1 requires the C++ int8 draft forward, but {e}. Install a C++ compiler "
                                   f"(g++) and ninja, or set {ENV}=auto or 0 to run the TorchScript path") from e
        if not _warned:
            _warned = True
            warnings.warn(f"graphspec: the C++ int8 draft forward is unavailable ({e}); int8 drafts run the "
                          f"TorchScript path (SmolLM2-135M about 1.4x slower a token). Install g++ and ninja to build it, or "
                          f"set {ENV}=0 to choose the TorchScript path and silence this", RuntimeWarning,
                          stacklevel=3)
        return False


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
    model._int8_native = (key, obj)
    return obj
