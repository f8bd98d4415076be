"""Shared helpers for the benchmarks: machine facts, memory bandwidth, step timing, prompts, JSON.

- Bandwidth is measured in the same process as the figure it is compared with (a 512 MiB fp32
  tensor summed: bytes read / seconds), because a shared machine's bandwidth drifts with its load.
- Times are medians of repeated runs; the minimum is kept too (the least-disturbed run).
- ``step_weight_bytes``: what one decode step must read: every GEMM weight, the lm_head, the
  norms (the KV cache and activations are small next to them at these lengths).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

PERF_DIR = Path(__file__).resolve().parent
PROMPTS_FILE = PERF_DIR / "prompts.json"
RESULTS_DIR = PERF_DIR / "results"
RESULTS_CSV = PERF_DIR / "results.csv"  # the results table: one row per run and method (append_results)

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
CROSS_DRAFT = "smollm2-135m-instruct"


def machine_info() -> dict:
    """What the figures were measured on: CPU model, cores, threads, load, versions, date."""
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key in ("Model name", "CPU family", "Model"):
                info[{"Model name": "cpu_model", "CPU family": "cpu_family", "Model": "cpu_model_number"}[key]] = (
                    value.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
        info["avx512_bf16"] = " avx512_bf16" in flags
        info["amx_bf16"] = " amx_bf16" in flags
        first = next((ln for ln in flags.splitlines() if ln.startswith("flags")), "")
        have = set(first.partition(":")[2].split())
        info["cpu_flags"] = " ".join(f for f in CPU_FLAGS if f in have)
    except OSError:
        pass
    info["commit"] = _commit()

    from graphspec.kernels import cpu

    # the CPU backend's level (graphspec.kernels.cpu): which C++ kernels ran
    info["cpu_level"] = cpu.level()
    info["int8_native"] = cpu.available()  # int8 drafts ran their C++ forward

    # whether bf16 weights ran graphspec's C++ linear (kernels/cpu/linear.cpp) or oneDNN
    info["bf16_native"] = cpu.bf16_linear()
    # transparent huge pages: the kernel's mode, torch's allocator setting, this process's share (MiB) so far
    info["huge_pages"] = cpu.huge_pages()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# The instruction-set flags that decide which kernels run (graphspec.kernels.cpu levels, oneDNN's AMX path).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def machine_fields(machine: dict) -> dict:
    """The machine columns of a JSON-lines result row (perf/workloads.jsonl, perf/prefix_cache.jsonl), from
    ``machine_info()``."""
    return {"cpu": machine.get("cpu_model"), "cpu_flags": machine.get("cpu_flags"),
            "cpu_level": machine.get("cpu_level"), "date": machine.get("date"), "commit": machine.get("commit"),
            "loadavg": machine.get("loadavg"), "huge_pages": machine.get("huge_pages")}


def _commit() -> str:
    """The checkout's commit, with "-dirty" when graphspec's own code differs from it (what the figures ran)."""
    root = PERF_DIR.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "graphspec", "models", "kernels"], cwd=root,
                               capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head}-dirty" if head and dirty else head


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, warmup: int = 2, device="cpu") -> list[float]:
    """Seconds per call of ``fn`` over ``reps`` calls (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def summary(seconds: list[float]) -> dict:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "reps": len(seconds)}


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 7, device="cpu") -> dict:
    """Memory read bandwidth (GB/s, 1e9 bytes): sum over an fp32 tensor of ``nbytes``."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    s = timed(lambda: x.sum(), reps, warmup=1, device=device)
    del x
    return {"gbps_median": nbytes / statistics.median(s) / 1e9, "gbps_best": nbytes / min(s) / 1e9,
            "bytes": nbytes}


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 7, device="cpu") -> dict:
    """Copy bandwidth (GB/s counting read + write) of a ``nbytes`` tensor."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    s = timed(lambda: y.copy_(x), reps, warmup=1, device=device)
    del x, y
    return {"gbps_median": 2 * nbytes / statistics.median(s) / 1e9, "gbps_best": 2 * nbytes / min(s) / 1e9,
            "bytes": nbytes}


def _weight_nbytes(w) -> int:
    if type(w).__name__ == "Int8Weight":  # int8 values (the per-row scales are negligible)
        return w.shape[0] * w.shape[1]
    if type(w).__name__ in ("BlockWeight", "StackedWeight"):  # GGUF blocks (or their tiles), as held
        return w.nbytes
    return w.shape[0] * w.shape[1] * torch.empty(0, dtype=w.dtype).element_size()


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (GEMM weights, biases, norms, lm_head)."""
    total = _weight_nbytes(model.lm_head) + model.norm.numel() * model.norm.element_size()
    for layer in model.layers:
        for w in (layer.wqkv, layer.wo, layer.w13, layer.w2):
            total += _weight_nbytes(w)
        for t in (layer.bqkv, layer.bo, layer.input_norm, layer.post_norm):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def transformers_from_gguf(name: str):
    """transformers' model of zoo model ``name`` loaded from its GGUF file. transformers cannot run GGUF blocks: it
    dequantizes the file at load (showing its own progress bar), here to bf16, its fastest CPU dtype."""
    import transformers

    from graphspec.models.gguf_weights import gguf_file_for

    path = gguf_file_for(name)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.bfloat16).eval()


def step_times(model, tokens: int, reps: int, context: int = 256, logits_for="all") -> list[float]:
    """Seconds of ``model.step`` over ``tokens`` new tokens after ``context`` cached ones (cache rolled back)."""
    cache = model.new_cache(context + tokens + 8)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(model.device)
    model.step(prompt, cache, logits_for="last")
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen).to(model.device)

    def one():
        cache.truncate(context)
        model.step(ids, cache, logits_for=logits_for)

    return timed(one, reps, warmup=2, device=model.device)


def load_prompts(kinds: tuple[str, ...] | None = None, limit: int | None = None) -> list[dict]:
    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"]
    if kinds is not None:
        prompts = [p for p in prompts if p["kind"] in kinds]
    return prompts[:limit] if limit is not None else prompts


def output_path(name: str) -> Path:
    """Where ``--out NAME`` goes: a bare file name under perf/results/, a path with a folder as given.

    Checked before a run starts (the folder is created and must be writable), so a bad path fails
    in the first second rather than after the benchmark has run for minutes.
    """
    path = Path(name) if (os.sep in name or Path(name).is_absolute()) else RESULTS_DIR / name
    if path.suffix != ".json":
        raise SystemExit(f"--out {name!r}: results are written as JSON; give a name ending in .json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {name!r}: cannot make {path.parent} ({e.strerror}); give a writable path") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SystemExit(f"--out {name!r}: {path} is not writable; give a writable path")
    return path


def save_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return path


# ------------------------------------------------------------------------------------ the results table

RESULTS_COLUMNS = (
    "date", "commit", "machine", "cpu_family_model", "cpu_flags", "cpu_level", "threads", "dtype", "target",
    "draft", "method", "draft_settings", "k", "prompts", "max_new_tokens", "tokens_per_second", "x_our_ar", "x_transformers",
    "transformers_peer", "x_llamacpp", "tokens_per_target_forward", "same_tokens_as_ar", "step_ms", "read_gbps",
    "source")


def _fmt(value, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def results_rows(report: dict, drafts: dict, source: str = "perf/e2e.py") -> list[dict]:
    """One results-table row per dtype and method of a perf/e2e.py report (its JSON, as written).

    ``x_our_ar``: tok/s over graphspec's autoregressive run in the same report; ``x_transformers``: over the
    transformers method named in ``transformers_peer`` (assisted generation with the same draft, ``generate``
    otherwise); ``x_llamacpp``: decode tok/s over llama.cpp's (``--llamacpp``); ``same_tokens_as_ar``:
    prompts whose tokens equal the autoregressive ones, of all prompts. ``drafts``: method -> draft name.
    """
    m = report["machine"]
    family = f"{m['cpu_family']}/{m['cpu_model_number']}" if m.get("cpu_family") else ""
    flags = m.get("cpu_flags")
    if flags is None:  # reports older than the flag list kept two booleans
        flags = " ".join(f for f in ("avx512_bf16", "amx_bf16") if m.get(f))
    base = {"date": m.get("date", ""), "commit": m.get("commit", ""), "machine": m.get("cpu_model", ""),
            "cpu_family_model": family, "cpu_flags": flags, "cpu_level": m.get("cpu_level", ""),
            "threads": m.get("torch_threads", ""), "target": report.get("target", ""),
            "prompts": report.get("num_prompts", ""), "max_new_tokens": report.get("max_new_tokens", ""),
            "read_gbps": _fmt(report.get("read_bandwidth", {}).get("gbps_median"), 1), "source": source}
    rows = []
    for dname, d in report["dtypes"].items():
        summary = d["summary"]
        ar = summary.get("ar", {}).get("tokens_per_second")
        lc = d.get("vs_llamacpp", {})
        n = report.get("num_prompts")
        for method, s in summary.items():
            draft = drafts.get(method) or ""
            settings = ""
            if draft and draft != "ngram" and not method.startswith("hf_"):  # graphspec's model drafts
                shape = {"chain": 0, "beam": 0}.get(method.rsplit("_", 1)[-1], d.get("draft_siblings"))
                known = {"quantize": d.get("draft_quantize", "?"), "vocab": d.get("draft_vocab", "?"),
                         "siblings": "?" if shape is None else shape}
                if method.endswith("_beam"):
                    known["beam"] = 2
                elif d.get("draft_length", "fixed") != "fixed":
                    known["length"] = d["draft_length"]
                settings = " ".join(f"{k}={v}" for k, v in known.items())
            differ = s.get("prompts_differing_from_ar", s.get("prompts_differing_from_graphspec_ar"))
            rows.append({**base, "dtype": dname, "draft": draft, "method": method, "draft_settings": settings,
                         "k": s.get("num_speculative_tokens", ""),
                         "tokens_per_second": _fmt(s["tokens_per_second"], 2),
                         "x_our_ar": _fmt(s["tokens_per_second"] / ar if ar else None),
                         "x_transformers": _fmt(s.get("speedup_vs_hf_peer")),
                         "transformers_peer": s.get("hf_peer", ""),
                         "x_llamacpp": _fmt(lc.get(method, {}).get("speedup_vs_llamacpp")),
                         "tokens_per_target_forward": _fmt(s.get("tokens_per_target_forward")),
                         "same_tokens_as_ar": "" if differ is None or method == "ar" else f"{n - differ}/{n}",
                         "step_ms": _fmt(s.get("step_ms"), 1)})
    return rows


def append_results(report: dict, drafts: dict, path: Path = RESULTS_CSV, source: str = "perf/e2e.py") -> Path:
    """Append a report's rows to the results table (perf/results.csv), writing the header for a new file."""
    import csv

    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULTS_COLUMNS, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerows(results_rows(report, drafts, source))
    return path
