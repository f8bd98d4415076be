"""Building graphspec's C++ extensions on first use: one place for the cache key, the lock and the modes.

Two extensions use it: the CPU kernels (``graphspec.kernels.cpu_native``) and the int8 draft forward
(``graphspec.models.int8_native``). Each is built from its C++ files with torch.utils.cpp_extension
(about 20 s on 2 cores, once per machine) into ``$GRAPHSPEC_CACHE/native/<prefix>-<key>`` (default
``~/.cache/graphspec``), keyed by the sources, the headers they include from this folder, torch, Python,
the machine and the CPU's flags (they are compiled with ``-march=native``); a file lock keeps two
processes from building one at once.

Each has an environment variable with three modes (:func:`mode`): ``auto`` (default: build when a C++
compiler is there, else warn once saying why and how to fix it, and run the torch path), ``1`` (require
it: a failed build is an error) and ``0`` (never use it).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

__all__ = ["CFLAGS", "Gate", "NativeBuildError", "build", "mode"]

CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]
"""No -ffast-math: linking it sets flush-to-zero for the whole process, the target's maths included."""


class NativeBuildError(RuntimeError):
    """A C++ extension could not be built or loaded."""


def mode(env: str, what: str) -> str:
    """``env`` as one of "auto", "1", "0" (anything else is an error that says so); ``what`` names the extension."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    aliases = {"auto": "auto", "1": "1", "on": "1", "true": "1", "0": "0", "off": "0", "false": "0"}
    if value not in aliases:
        raise ValueError(f"{env}={os.environ[env]!r}; use auto (the default: {what} when it builds), 1 (require it) "
                         f"or 0 (the torch path only)")
    return aliases[value]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


INCLUDE = Path(__file__).parent
"""Headers shared by the C++ files (``_native_math.h``); on every extension's include path."""


def build_dir(sources: list[Path], prefix: str, cflags: list[str]) -> Path:
    """Where ``sources`` are built: a directory keyed by everything the binary depends on."""
    from graphspec.models.zoo import cache_root

    key = hashlib.sha256()
    parts = [src.read_bytes() for src in sources] + [h.read_bytes() for h in sorted(INCLUDE.glob("*.h"))]
    for part in (*parts, torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
                 _cpu_flags().encode(), " ".join(cflags).encode()):
        key.update(part)
        key.update(b"\0")
    return cache_root() / "native" / f"{prefix}-{key.hexdigest()[:16]}"


def build(name: str, sources: list[Path], prefix: str, what: str, cflags: list[str] = CFLAGS) -> None:
    """Build (or reuse) and load the extension ``name`` (registering its torch ops / classes) from ``sources``.

    ``what`` names it in messages ("the C++ int8 draft forward"). Raises NativeBuildError saying why not.
    """
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - part of every torch
        raise NativeBuildError(f"torch.utils.cpp_extension is unavailable ({e})") from e
    out = build_dir(sources, prefix, cflags)
    out.mkdir(parents=True, exist_ok=True)
    built = (out / f"{name}.so").exists()
    fd = os.open(out / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"graphspec: waiting for another process that is building {what} in {out} ...",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            built = (out / f"{name}.so").exists()
        if not built:
            print(f"graphspec: building {what} (once per machine, about 20 s) in {out} ...", file=sys.stderr,
                  flush=True)
        try:
            cpp_extension.load(name, [str(src) for src in sources], extra_cflags=cflags,
                               extra_include_paths=[str(INCLUDE)], build_directory=str(out), is_python_module=False,
                               verbose=False)
        except Exception as e:  # compiler missing or failing, ninja missing, headers missing
            tail = "\n".join(str(e).strip().splitlines()[-12:])
            names = ", ".join(src.name for src in sources)
            raise NativeBuildError(f"building {names} in {out} failed: {type(e).__name__}: {tail}") from e
    finally:
        os.close(fd)


class Gate:
    """One extension's switch: its environment variable's mode, and what happens when it does not build.

    ``what`` names the extension ("the C++ int8 draft forward"), ``instead`` the torch path used without it
    ("the TorchScript path"), ``cost`` what that costs, for the warning ("SmolLM2-135M about 1.4x slower a
    token"). ``warned``: whether this process has warned (once); ``failure``: the error of a failed ``load()``,
    kept so that a process tries the build once, not at every call (the attention asks at every layer).
    """

    def __init__(self, env: str, what: str, instead: str, cost: str):
        self.env, self.what, self.instead, self.cost = env, what, instead, cost
        self.warned = False
        self.failure: NativeBuildError | None = None

    def mode(self) -> str:
        return mode(self.env, self.what)

    def available(self, load: Callable[[], object]) -> bool:
        """Whether the extension runs here: ``load()`` (which builds on first call) succeeded, per the mode."""
        m = self.mode()
        if m == "0":
            return False
        if self.failure is None:
            try:
                load()
                return True
            except NativeBuildError as e:
                self.failure = e
        if m == "1":
            raise NativeBuildError(f"{self.env}=1 requires {self.what}, but {self.failure}. Install a C++ compiler "
                                   f"(g++) and ninja, or set {self.env}=auto or 0 to use {self.instead}") from self.failure
        if not self.warned:
            self.warned = True
            warnings.warn(f"graphspec: {self.what} cannot be used ({self.failure}); using {self.instead} ({self.cost}). "
                          f"Install g++ and ninja to build it, or set {self.env}=0 to choose {self.instead} and "
                          "silence this", RuntimeWarning, stacklevel=4)
        return False
