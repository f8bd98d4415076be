"""Building the CPU backend's C++ on first use: one place for the cache key and the lock.

``graphspec.kernels.cpu`` builds one extension per instruction-set level from this folder's C++ files with
torch.utils.cpp_extension (about 30-60 s on 2 cores, once per machine and level) into
``$GRAPHSPEC_CACHE/native/<prefix>-<key>`` (default ``~/.cache/graphspec``), keyed by the sources, the
headers beside them, the flags, torch, Python and the machine; a file lock keeps two processes from building
one at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

__all__ = ["CFLAGS", "NativeBuildError", "build"]

CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
"""Every level's flags start with these; the level adds its -m flags. -fopenmp: at::parallel_for is inline in
ATen's headers and runs its loop on one thread unless the extension itself is compiled with OpenMP (_OPENMP);
linked with -fopenmp too, the extension shares torch's libgomp (the same soname, already loaded), so
torch.set_num_threads sets its threads. No -ffast-math: linking it sets
flush-to-zero for the whole process, the target's maths included. No -march=native: a level's binary holds
that level's instructions only, so a lower level built on a newer CPU is the binary an older CPU runs."""


class NativeBuildError(RuntimeError):
    """A C++ extension could not be built or loaded."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


INCLUDE = Path(__file__).parent
"""The C++ files and the headers they share; on every extension's include path."""


def _cache_root() -> Path:
    """$GRAPHSPEC_CACHE, else ~/.cache/graphspec (graphspec.models.zoo keeps its models there too)."""
    env = os.environ.get("GRAPHSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "graphspec"


def build_dir(sources: list[Path], prefix: str, cflags: list[str]) -> Path:
    """Where ``sources`` are built: a directory keyed by everything the binary depends on."""
    key = hashlib.sha256()
    parts = [src.read_bytes() for src in sources] + [h.read_bytes() for h in sorted(INCLUDE.glob("*.h"))]
    for part in (*parts, torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
                 _cpu_flags().encode(), " ".join(cflags).encode()):
        key.update(part)
        key.update(b"\0")
    return _cache_root() / "native" / f"{prefix}-{key.hexdigest()[:16]}"


def build(name: str, sources: list[Path], prefix: str, what: str, cflags: list[str]) -> None:
    """Build (or reuse) and load the extension ``name`` (registering its torch ops / classes) from ``sources``.

    ``what`` names it in messages ("the C++ int8 draft forward"). Raises NativeBuildError saying why not.
    """
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - part of every torch
        raise NativeBuildError(f"torch.utils.cpp_extension is unavailable ({e})") from e
    out = build_dir(sources, prefix, cflags)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # the cache root is a file, read-only, or not a place for files
        raise NativeBuildError(f"cannot build {what} in {out} ({e.strerror or e}): set GRAPHSPEC_CACHE to a writable "
                               f"folder (default ~/.cache/graphspec)") from None
    built = (out / f"{name}.so").exists()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"graphspec: waiting for another process that is building {what} in {out} ...",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            built = (out / f"{name}.so").exists()
        if not built:
            print(f"graphspec: building {what} (once per machine, about a minute) in {out} ...", file=sys.stderr,
                  flush=True)
        # torch's own lock file in the folder: under our lock nobody else builds here, so one that exists was left
        # by a build that was killed, and torch would wait for it forever.
        (out / "lock").unlink(missing_ok=True)
        try:
            cpp_extension.load(name, [str(src) for src in sources], extra_cflags=cflags,
                               extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [],
                               extra_include_paths=[str(INCLUDE)], build_directory=str(out), is_python_module=False,
                               verbose=False)
        except Exception as e:  # compiler missing or failing, ninja missing, headers missing
            tail = "\n".join(str(e).strip().splitlines()[-12:])
            names = ", ".join(src.name for src in sources)
            raise NativeBuildError(f"building {names} in {out} failed: {type(e).__name__}: {tail}") from e
    finally:
        os.close(fd)
