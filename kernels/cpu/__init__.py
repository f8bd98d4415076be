"""graphspec's CPU backend: C++ kernels per instruction-set level, behind one entry point and one switch.

- Levels, best first (``LEVELS``): ``amx`` (avx512 + AMX tiles for bf16 and int8), ``avx512`` (AVX-512
  F/BW/VL/DQ + BF16 + VNNI), ``avx2`` (AVX2 + FMA + F16C), ``generic`` (plain C++ for any CPU) and ``torch`` (no C++: every op's
  torch path). Each C++ level is one extension, built on first use from this folder's files with that level's
  -m flags (``_build``; about a minute on 2 cores, once per machine and level, cached) and registering its ops under
  ``torch.ops.graphspec_cpu_<level>``, so several levels can run side by side in one process: the tests
  run every level the machine can execute, not only its best.
- What runs where (``KERNELS``): the bf16 linear (``linear.cpp``) and the bf16 MLP activation
  (``silu_mul.cpp``) at amx (tile products), avx512 and avx2; decode/verify attention (``attention.cpp``) and
  the int8 GEMM and int8 draft forward (``int8_gemm.h``, ``int8_draft.cpp``) at every C++ level; the int4 GEMM
  (``int4_gemm.h``) at amx, avx512 and avx2; the GGUF block GEMMs (``qgemm.cpp``, an extension of its own per
  level: ``qops``; at amx the k-quants on int8 activations of 12 rows or more run on tiles) at every C++ level.
  At the torch level the ops run their torch paths (oneDNN, SDPA, the int8 reference), which are correct on every
  CPU.
- The switch: ``GRAPHSPEC_CPU`` = ``auto`` (default: the best level this CPU executes and this machine
  builds; a failed build warns once, saying why, and the next level down is used) or a level's name (that
  level, required: an error where the CPU lacks it or it does not build). ``use_level(name)`` pins one for
  a ``with`` block (tests, benchmarks), ``set_level(name)`` for the process; :func:`level` says which is in
  force.
- Weights on huge pages: importing graphspec sets ``THP_MEM_ALLOC_ENABLE=1`` (unless set) before torch allocates,
  so torch's CPU allocator advises the kernel to back every buffer of 2 MiB or more, packed weights included, with
  2 MiB pages; a decode step streams its weights and reads them faster so. :func:`huge_pages` says what is in force.
- ``README.md`` beside this file says how to add a level.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
import warnings
from pathlib import Path
from typing import Iterator

import torch

from graphspec.kernels.cpu import _build
from graphspec.kernels.cpu._build import CFLAGS, NativeBuildError, build

__all__ = ["ENV", "KERNELS", "LEVELS", "NativeBuildError", "available", "bf16_linear", "have_int4", "huge_pages",
           "level", "ops", "qops", "runnable_levels", "set_level", "supported_levels", "use_level"]

ENV = "GRAPHSPEC_CPU"
LEVELS = ("amx", "avx512", "avx2", "generic", "torch")

_REQUIRES = {
    "amx": ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
            "avx512_vnni", "avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
    "torch": (),
}
"""The /proc/cpuinfo flags a level's binary needs."""

_FLAGS = {
    "amx": ["-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
            "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mavx2",
               "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}

KERNELS = {
    "amx": ("bf16 linear (AMX tiles, tdpbf16ps)", "bf16 silu_mul", "attention", "int8 GEMM (FMA)",
            "int4 GEMM (vpdpbusd)", "int8 draft forward", "GGUF block GEMMs (avx512's)",
            "GGUF k-quants on int8 activations (AMX tiles, tdpbsud, from 12 rows)"),
    "avx512": ("bf16 linear (vdpbf16ps)", "bf16 silu_mul", "attention", "int8 GEMM (FMA)", "int4 GEMM (vpdpbusd)",
               "int8 draft forward", "GGUF block GEMMs (FMA)",
               "GGUF k-quants on int8 activations (16-row tiles, vpdpbusd)"),
    "avx2": ("bf16 linear (FMA)", "bf16 silu_mul", "attention", "int8 GEMM (FMA)", "int8 draft forward",
             "GGUF block GEMMs (FMA)", "GGUF k-quants on int8 activations (16-row tiles, vpmaddubsw + vpmaddwd)"),
    "generic": ("attention (scalar)", "int8 GEMM (scalar)", "int8 draft forward", "GGUF block GEMMs (scalar)",
                "GGUF k-quants on int8 activations (scalar)"),
    "torch": (),
}
"""Which C++ kernels each level runs; everything else takes the op's torch path."""

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "linear.cpp", _HERE / "attention.cpp", _HERE / "int8_draft.cpp", _HERE / "silu_mul.cpp"]
_OLD_ENVS = {"GRAPHSPEC_CPU_NATIVE", "GRAPHSPEC_INT8_NATIVE"}


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def supported_levels() -> tuple[str, ...]:
    """The levels this CPU can execute (not yet built), best first; always ends with generic and torch."""
    flags = _cpu_flags()
    return tuple(lv for lv in LEVELS if not _REQUIRES[lv] or (_x86() and set(_REQUIRES[lv]) <= flags))


def _missing(name: str) -> str:
    if not _x86():
        return f"it is an x86 level and this machine is {platform.machine()}"
    lacking = sorted(set(_REQUIRES[name]) - _cpu_flags())
    return "this CPU lacks " + ", ".join(lacking)


def _load_extension(name: str, ns: str, sources: list[Path], prefix: str, what: str, flags: list[str]) -> None:
    """Build (or reuse) and load one extension of level ``name`` in op namespace ``ns``, and check that it was
    compiled as that level; NativeBuildError says why not."""
    if hasattr(getattr(torch.ops, ns), "level"):  # loaded already (a library registers its ops once a process)
        return
    build(ns, sources, prefix, what, CFLAGS + _FLAGS[name] + flags + [f"-DGS_NS={ns}"])
    got = getattr(torch.ops, ns).level()
    if got != name:
        raise NativeBuildError(f"{what} compiled as level {got!r}: the compiler ignored {_FLAGS[name]}")


@functools.cache
def _load(name: str) -> None:
    """Build (or reuse) and load level ``name``'s extension once per process; NativeBuildError says why not."""
    _load_extension(name, f"graphspec_cpu_{name}", _SOURCES, f"cpu-{name}",
                    f"graphspec's C++ CPU backend at the {name} level", [])
    if name == "amx" and not _tile_state_granted():
        raise NativeBuildError("Linux did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM "
                               "needs Linux 5.16 or newer)")


def _tile_state_granted() -> bool:
    """Whether Linux gave this process AMX's tile state (the amx extension asks it, once per process)."""
    return bool(torch.ops.graphspec_cpu_amx.amx_permitted())


_failed: dict[tuple[str, str], NativeBuildError] = {}  # (level, cache root) -> why it did not build
_warned: set[str] = set()


def _failure(name: str) -> NativeBuildError | None:
    """Why level ``name`` did not build under the cache root in force, if it was tried there and failed."""
    return _failed.get((name, str(_build._cache_root())))


def _builds(name: str) -> bool:
    """Whether level ``name`` (a C++ level this CPU supports) is built and loaded; tried once per process and
    cache root (a build that failed in an unusable GRAPHSPEC_CACHE is tried again under another)."""
    if _failure(name) is not None:
        return False
    try:
        _load(name)
        return True
    except NativeBuildError as e:
        _failed[(name, str(_build._cache_root()))] = e
        return False


def runnable_levels() -> tuple[str, ...]:
    """The levels that run here, best first: those the CPU executes whose C++ builds (building each on first
    call), then torch."""
    return tuple(lv for lv in supported_levels() if lv == "torch" or _builds(lv))


_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("graphspec_cpu_level", default=None)
_process_level: str | None = None


def _check_name(name: str, source: str) -> str:
    if name not in LEVELS:
        raise ValueError(f"{source}={name!r} is not a CPU level; use auto or one of {', '.join(LEVELS)}")
    return name


def _auto() -> str:
    return _auto_in(_root(os.environ.get("GRAPHSPEC_CACHE"), os.environ.get("HOME")))


@functools.cache
def _root(cache_env: str | None, home: str | None) -> str:
    """The build cache root for these values of the variables it depends on (level() runs on every kernel call,
    so the path is not rebuilt each time)."""
    return str(_build._cache_root())


@functools.cache
def _auto_in(root: str) -> str:
    """auto's level, found once per process and cache root (where the builds live)."""
    for lv in supported_levels():
        if lv == "torch" or _builds(lv):
            return lv
        if lv not in _warned:
            _warned.add(lv)
            warnings.warn(f"graphspec: the {lv} level of the C++ CPU backend cannot be used ({_failure(lv)}); "
                          f"trying the next level down. Install g++ and ninja to build it, or set {ENV} to a "
                          "lower level (or torch) to choose one and silence this", RuntimeWarning, stacklevel=3)
    return "torch"


def _required(name: str, source: str) -> str:
    if name != "torch" and name not in supported_levels():
        raise ValueError(f"{source}={name}, but {_missing(name)}; use auto or one of "
                         f"{', '.join(supported_levels())}")
    if name != "torch" and not _builds(name):
        raise NativeBuildError(f"{source}={name} requires graphspec's C++ CPU backend at that level, but "
                               f"{_failure(name)}. Install a C++ compiler (g++) and ninja, or use {ENV}=auto")
    return name


def level() -> str:
    """The level in force: the innermost ``use_level``, else ``set_level``'s, else ``GRAPHSPEC_CPU``, else auto."""
    name = _override.get() or _process_level
    if name is not None:
        return name
    for old in [e for e in _OLD_ENVS if e in os.environ]:  # not environ.keys() & ...: that copies the environment
        raise ValueError(f"{old} is gone: graphspec's CPU backend has one switch, {ENV} (auto, {', '.join(LEVELS)}); "
                         f"{old}=0 is {ENV}=torch. Unset {old}")
    env = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if env == "auto":
        return _auto()
    return _env_level(env)


@functools.cache
def _env_level(env: str) -> str:
    return _required(_check_name(env, ENV), ENV)


def _resolve(name: str) -> str:
    """``name`` ("auto" or a level) as the level it means here; an error where it cannot run."""
    return _auto() if name == "auto" else _required(_check_name(name, "level"), "level")


@contextlib.contextmanager
def use_level(name: str) -> Iterator[str]:
    """Run the CPU ops inside the ``with`` block at level ``name`` ("auto" for the default); an error where it
    cannot run here."""
    name = _resolve(name)
    token = _override.set(name)
    try:
        yield name
    finally:
        _override.reset(token)


def set_level(name: str | None) -> None:
    """Pin the level for the whole process (None: back to ``GRAPHSPEC_CPU`` / auto)."""
    global _process_level
    _process_level = None if name is None else _resolve(name)


def available(name: str | None = None) -> bool:
    """Whether C++ kernels run at ``name`` (default: the level in force): any level but torch."""
    return (level() if name is None else name) != "torch"


def bf16_linear(name: str | None = None) -> bool:
    """Whether bf16 weights take the C++ linear at ``name`` (default: the level in force): amx, avx512 and avx2."""
    return (level() if name is None else name) in ("amx", "avx512", "avx2")


def have_int4(name: str | None = None) -> bool:
    """Whether ``name`` (default: the level in force) has the int4 GEMM of ``quantize="int4"`` drafts: amx and
    avx512 (``vpdpbusd``) and avx2 (``vpmaddubsw``), the same bits."""
    return (level() if name is None else name) in ("amx", "avx512", "avx2")


def ops(name: str | None = None):
    """The torch ops of level ``name`` (default: the level in force): ``level``, ``linear``, ``attend``."""
    name = level() if name is None else name
    if name == "torch":
        raise ValueError("the torch level has no C++ ops; check available() first")
    return _namespace(name, "graphspec_cpu_", _load)


_namespaces: dict[str, object] = {}


def _namespace(name: str, prefix: str, load) -> object:
    """torch.ops.<prefix><name>, loaded by ``load(name)`` the first time (kept: torch.ops lookups cost
    microseconds, and the ops run once per kernel call)."""
    got = _namespaces.get(prefix + name)
    if got is None:
        load(name)
        got = _namespaces[prefix + name] = getattr(torch.ops, prefix + name)
    return got


_QSOURCES = [_HERE / "qgemm.cpp", _HERE / "block_model.cpp"]


@functools.cache
def _load_q(name: str) -> None:
    """Build (or reuse) and load level ``name``'s block-format extension (``qgemm.cpp``: the GEMMs;
    ``block_model.cpp``: the cached forward around them) once per process.

    Its own extension (``graphspec_cpuq_<level>``), so that editing it rebuilds only itself; -ffp-contract=off
    keeps its dequantization op for op the gguf package's (no fused multiply-adds the source does not ask for).
    """
    _load_extension(name, f"graphspec_cpuq_{name}", _QSOURCES, f"cpuq-{name}",
                    f"graphspec's C++ block-format GEMMs at the {name} level", ["-ffp-contract=off"])


def qops(name: str | None = None):
    """The block-format GEMM ops of level ``name`` (default: the level in force): ``level``, ``qlinear``."""
    name = level() if name is None else name
    if name == "torch":
        raise ValueError("the torch level has no C++ ops; check available() first")
    return _namespace(name, "graphspec_cpuq_", _load_q)


def qclasses(name: str | None = None):
    """The block-format custom classes of level ``name`` (default: the level in force): ``BlockLinear``,
    ``BlockModel``."""
    name = level() if name is None else name
    qops(name)
    return getattr(torch.classes, f"graphspec_cpuq_{name}")


def classes(name: str | None = None):
    """The custom classes of level ``name`` (default: the level in force): ``Int8Linear``, ``Int8Draft``."""
    ops(name)
    return getattr(torch.classes, f"graphspec_cpu_{level() if name is None else name}")


THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's switch; graphspec/__init__.py sets it before torch is imported


def huge_pages() -> dict:
    """Whether this process's large buffers can sit on transparent huge pages, and how much of it does.

    ``kernel``: the kernel's THP mode (``always``, ``madvise`` or ``never``; None where there is no THP, as off
    Linux); ``torch``: the environment's ``THP_MEM_ALLOC_ENABLE``, which torch's allocator reads at its first
    allocation (graphspec sets "1" on import unless it was set: torch then advises huge pages for buffers of 2 MiB
    or more, which the kernel's ``madvise`` and ``always`` modes honour); ``anon_huge_mib``: this process's
    anonymous memory on huge pages now (None where /proc does not say)."""
    kernel = None
    try:
        text = THP_SYSFS.read_text()
        kernel = next((w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")), None)
    except OSError:
        pass
    anon = None
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                anon = int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"kernel": kernel, "torch": os.environ.get(THP_ENV), "anon_huge_mib": anon}
