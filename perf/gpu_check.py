"""The one-call GPU check: kernels compiled against their references, kernel speed, end-to-end costs.

On the device machine, in one call (at most 8 minutes; everything is logged under $OUT)::

    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && PYTHONUNBUFFERED=1 python perf/gpu_check.py

Here, on a CPU, the same code paths run on tiny shapes (Triton through its interpreter)::

    .venv/bin/python perf/gpu_check.py --dry-run

Sections, each bounded by what is left of ``--budget-s`` (default 420 s):

1. ``nvidia-smi`` and versions.
2. The kernel tests (tests/kernels) with CUDA tensors and the interpreter off
   (``GRAPHSPEC_TEST_DEVICE=cuda``, read by tests/conftest.py): every Triton kernel compiled
   and compared with its torch reference. JUnit XML in $OUT.
3. Kernel speed (perf/kernel_cases.py): triton vs torch (cuBLAS ``F.linear``, SDPA, the torch
   references), TFLOP/s and GB/s, the GB/s next to the device copy bandwidth measured here; and the
   GGUF block GEMMs (Q4_K, Q6_K, Q8_0, Q5_0) against ``F.linear`` on the same weights in bf16.
4. End to end in bf16 with the real Qwen2.5-Coder-0.5B / 1.5B and SmolLM2-135M configs (random
   weights): one-token step, verify of K+1 tokens for K = 1..8, draft step, autoregressive
   tokens/s, speculative tokens/s with a draft identical to the target (acceptance 1: the
   ceiling). With perf/acceptance.json (acceptance measured on CPU with real weights) it
   projects each bf16 pair's speedup: ``tau * t_step / (n * t_draft + t_verify(K))`` where tau is
   the measured tokens per target forward and n the measured draft forwards a step (K where
   acceptance.json predates that figure); the cross-vocabulary mapping's cost is not in it.
5. A short table. Everything also goes to $OUT/gpu_check.json and $OUT/gpu_check.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def _qwen2_coder(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int) -> dict:
    """config.json of a Qwen2.5-Coder-Instruct size (as the zoo converts it); the sizes differ, nothing else."""
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
            "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": head_dim,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "attention_bias": True, "bos_token_id": 151643,
            "eos_token_id": 151645, "torch_dtype": "bfloat16"}


CONFIGS = {
    "qwen2.5-1.5b": _qwen2_coder(hidden=1536, intermediate=8960, layers=28, heads=12, head_dim=128),
    "qwen2.5-0.5b": _qwen2_coder(hidden=896, intermediate=4864, layers=24, heads=14, head_dim=64),
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                     "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
}
# The CONFIGS entry of each draft model perf/e2e.py runs (its SPECS table names the methods and their drafts).
CONFIG_OF_DRAFT = {"qwen2.5-coder-0.5b-instruct": "qwen2.5-0.5b", "smollm2-135m-instruct": "smollm2-135m"}


def pair_drafts() -> dict:
    """Each speculative method of perf/e2e.py -> the CONFIGS key of its draft (None: prompt lookup, no model).

    Imported here, not at the top: perf.e2e imports graphspec, and with it triton, which must not load before
    a dry run has set TRITON_INTERPRET. A draft missing from CONFIG_OF_DRAFT is a KeyError, not a skipped pair.
    """
    from perf.e2e import SPECS

    return {m: None if spec.draft == "ngram" else CONFIG_OF_DRAFT[spec.draft]
            for m, spec in SPECS.items() if spec.draft is not None}


def tiny(config: dict) -> dict:
    """The same architecture at toy size (dry runs on a CPU)."""
    c = dict(config)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    c.update(hidden_size=16 * heads, head_dim=16, intermediate_size=64, num_hidden_layers=2,
             vocab_size=512, bos_token_id=1, eos_token_id=2, num_key_value_heads=kv)
    return c


class Log:
    def __init__(self, out: Path):
        self.file = open(out / "gpu_check.log", "a", encoding="utf-8")

    def __call__(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.file.write(msg + "\n")
        self.file.flush()


def section(log, title):
    log("")
    log(f"=== {title} " + "=" * max(0, 70 - len(title)))


# --------------------------------------------------------------------------------------------- 1. machine


def machine(log, result):
    section(log, "machine")
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        log(smi.rstrip())
    except (OSError, subprocess.SubprocessError) as e:
        log(f"nvidia-smi: not available ({e.__class__.__name__})")
    import torch
    import triton

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
         "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    try:
        import transformers

        v["transformers"] = transformers.__version__
    except ImportError:
        v["transformers"] = None
    log("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    result["versions"] = v


# --------------------------------------------------------------------------------------------- 2. kernel tests


def kernel_tests(log, result, out: Path, seconds: float, dry: bool):
    section(log, "kernel tests (Triton compiled, CUDA tensors)")
    if dry:
        log("dry run: skipped (the CPU suite runs them under the interpreter: pytest tests/kernels)")
        result["kernel_tests"] = {"skipped": "dry run"}
        return
    env = dict(os.environ, GRAPHSPEC_TEST_DEVICE="cuda", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    xml = out / "kernel_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "-o", "addopts="]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(30, seconds))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    (out / "kernel_tests.txt").write_text(text)
    tail = [ln for ln in text.splitlines() if ln.strip()][-25:]
    for ln in tail:
        log("  " + ln)
    summary = next((ln for ln in reversed(text.splitlines()) if " passed" in ln or " failed" in ln), "")
    result["kernel_tests"] = {"returncode": rc, "summary": summary.strip("= "), "seconds": time.time() - t0}
    log(f"kernel tests: rc={rc} in {time.time() - t0:.0f} s: {summary.strip('= ')}")


# --------------------------------------------------------------------------------------------- 3. kernel speed


def bench(fn, device, reps: int = 50) -> float:
    """Median seconds of ``fn`` (CUDA events via triton.testing.do_bench on GPU; perf_counter on CPU)."""
    import torch

    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=max(20, reps), return_mode="median") / 1e3
    import statistics

    fn()
    ts = []
    for _ in range(min(reps, 5)):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    del torch
    return statistics.median(ts)


def kernel_speed(log, result, device, dry: bool, deadline: float):
    import torch

    from perf.kernel_cases import all_cases, figures

    section(log, "kernel speed: triton vs torch")
    nbytes = (64 << 20) if dry else (1 << 30)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x), device)
    copy_gbps = 2 * nbytes / t / 1e9
    del x, y
    log(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write of {nbytes >> 20} MiB)")
    result["copy_gbps"] = copy_gbps
    rows = []
    for name, factory in all_cases(device, torch.bfloat16, small=dry):
        if time.time() > deadline:
            log(f"(time budget reached: {name} and later cases skipped)")
            break
        try:
            case = factory()
            row = {"case": case.name}
            for prov in ("torch", "triton"):
                row[prov] = figures(case, bench(case.providers[prov], device))
            row["speedup_triton_vs_torch"] = row["torch"]["ms"] / row["triton"]["ms"]
            if "gbps" in row["triton"]:
                row["triton_fraction_of_copy_bw"] = row["triton"]["gbps"] / copy_gbps
            rows.append(row)
            tr, to = row["triton"], row["torch"]
            fig = (f"{tr['tflops']:.1f} TFLOP/s (torch {to['tflops']:.1f})" if case.kind == "compute"
                   else f"{tr.get('gbps', 0):.0f} GB/s = {100 * row.get('triton_fraction_of_copy_bw', 0):.0f}% of copy "
                        f"(torch {to.get('gbps', 0):.0f})")
            log(f"  {case.name:48s} triton {tr['ms']:8.3f} ms  torch {to['ms']:8.3f} ms  "
                f"x{row['speedup_triton_vs_torch']:.2f}  {fig}")
            del case
        except Exception as e:  # one broken kernel must not hide the others' figures
            log(f"  {name}: FAILED {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            rows.append({"case": name, "error": f"{e.__class__.__name__}: {e}"})
    result["kernels"] = rows


def qlinear_speed(log, result, device, dry: bool, deadline: float):
    """GGUF block GEMMs (kernels/qlinear.py, Triton) against cuBLAS on the same weights dequantized to bf16."""
    import torch
    import torch.nn.functional as F

    from graphspec.kernels.qlinear import BlockWeight, qlinear_triton
    from tests.kernels._qblocks import random_blocks

    section(log, "GGUF block GEMMs (triton) vs F.linear on the dequantized weight in bf16")
    n, k = (256, 512) if dry else (8960, 1536)  # the 1.5B's gate/up projection
    rows = []
    for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q5_0"):
        w = BlockWeight(type_name, torch.from_numpy(random_blocks(type_name, n, k)).to(device), (n, k))
        dense = w.dense().bfloat16()
        for m in (1, 8, 32 if dry else 512):
            if time.time() > deadline:
                log("(time budget reached: later block GEMM cases skipped)")
                result["qlinear"] = rows
                return
            x = torch.randn(m, k, device=device)
            xb = x.bfloat16()
            t_q = bench(lambda: qlinear_triton(x, w), device)
            t_b = bench(lambda: F.linear(xb, dense), device)
            row = {"case": f"qlinear {type_name} M={m} N={n} K={k}", "triton_ms": t_q * 1e3,
                   "bf16_linear_ms": t_b * 1e3, "block_gbps": w.nbytes / t_q / 1e9,
                   "tflops": 2.0 * m * n * k / t_q / 1e12}
            rows.append(row)
            log(f"  {row['case']:40s} triton {row['triton_ms']:8.3f} ms ({row['block_gbps']:.0f} GB/s of blocks, "
                f"{row['tflops']:.1f} TFLOP/s)  bf16 F.linear {row['bf16_linear_ms']:8.3f} ms")
    result["qlinear"] = rows


# --------------------------------------------------------------------------------------------- 4. end to end


def random_model(config: dict, device, dtype, seed: int = 0):
    import torch

    from graphspec.models.config import ModelConfig
    from graphspec.models.loader import build, expected_shapes

    cfg = ModelConfig.from_dict(config, source="gpu_check")
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            std = 1.0 if "embed_tokens" in name else 0.02
            tensors[name] = (torch.randn(shape, generator=gen, device=device) * std).to(dtype)
    return build(cfg, tensors)


def e2e(log, result, device, dry: bool, deadline: float):
    import torch

    import graphspec
    from perf._common import step_times

    section(log, "end to end (bf16, random weights, real configs)")
    dtype = torch.bfloat16
    reps = 3 if dry else 20
    configs = {k: (tiny(v) if dry else v) for k, v in CONFIGS.items()}
    costs: dict = {}
    target = random_model(configs["qwen2.5-1.5b"], device, dtype)
    t1 = statistics_median(step_times(target, 1, reps))
    costs["step_ms"] = t1 * 1e3
    costs["verify_ms"] = {}
    for k in range(1, 9):
        costs["verify_ms"][k] = statistics_median(step_times(target, k + 1, reps)) * 1e3
    log(f"target one-token step: {t1 * 1e3:.2f} ms")
    log("target verify of K+1 tokens: " + ", ".join(f"K={k} {v:.2f} ms (x{v / costs['step_ms']:.2f})"
                                                  for k, v in costs["verify_ms"].items()))
    costs["draft_ms"] = {}
    for name in ("qwen2.5-0.5b", "smollm2-135m"):
        draft = random_model(configs[name], device, dtype, seed=1)
        costs["draft_ms"][name] = statistics_median(step_times(draft, 1, reps, logits_for="last")) * 1e3
        log(f"draft step {name}: {costs['draft_ms'][name]:.2f} ms (x{costs['draft_ms'][name] / costs['step_ms']:.2f} "
            f"of the target step)")
        del draft
    result["costs"] = costs

    if time.time() < deadline:
        n_new = 16 if dry else 128
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, configs["qwen2.5-1.5b"]["vocab_size"], (64,), generator=gen).tolist()
        runs = {}
        for label, pipe in (("autoregressive", graphspec.Pipeline(target)),
                            ("draft = target, K=4", graphspec.Pipeline(target, draft=target, num_speculative_tokens=4,
                                                                       draft_confidence_threshold=None,
                                                                       draft_siblings=0)),  # a chain: the ceiling
                            ("draft = target, K=8", graphspec.Pipeline(target, draft=target, num_speculative_tokens=8,
                                                                       draft_confidence_threshold=None,
                                                                       draft_siblings=0))):
            if time.time() > deadline:
                break
            pipe.run(prompt[:8], max_new_tokens=4, ignore_eos=True)  # warm-up
            t0 = time.perf_counter()
            out = pipe.run(prompt, max_new_tokens=n_new, ignore_eos=True)
            sec = time.perf_counter() - t0
            runs[label] = {"tokens_per_second": len(out.token_ids) / sec,
                           "acceptance_rate": out.stats.acceptance_rate,
                           "tokens_per_target_forward": out.stats.mean_accepted_length,
                           "stage_seconds": dict(out.stats.stage_seconds)}
            log(f"{label:22s} {runs[label]['tokens_per_second']:8.1f} tok/s  acceptance "
                f"{out.stats.acceptance_rate:.2f}  {out.stats.mean_accepted_length:.2f} tokens/forward  stages "
                + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in out.stats.stage_seconds.items()))
        result["pipelines"] = runs
    del target

    acc_file = ROOT / "perf" / "acceptance.json"
    projections = {}
    if acc_file.is_file():
        pairs = json.loads(acc_file.read_text()).get("pairs", {})
        drafts = pair_drafts()
        for key, a in sorted(pairs.items()):
            method, _, dname = key.partition("/")
            if dname != "bf16":
                continue  # the costs above are bf16
            if method not in drafts:
                log(f"projected {key}: not a method of perf/e2e.py, skipped")
                continue
            k = int(a["num_speculative_tokens"])
            tau = float(a["tokens_per_target_forward"])
            draft = drafts[method]
            t_draft = costs["draft_ms"][draft] if draft else 0.0
            # draft forwards a step as measured on the CPU (a threshold stops a chain early; a beam's
            # forward is w rows, which on a GPU cost about one); K where acceptance.json predates the figure
            forwards = a.get("draft_forwards_per_step")
            basis = "measured"
            if forwards is None:
                forwards, basis = (float(k) if draft else 0.0), "K"
            t_verify = costs["verify_ms"].get(k) or costs["verify_ms"][max(costs["verify_ms"])]
            speedup = tau * costs["step_ms"] / (forwards * t_draft + t_verify)
            projections[key] = {"K": k, "tokens_per_target_forward": tau, "draft_forwards_per_step": forwards,
                                "draft_forwards_from": basis, "projected_speedup": speedup}
            log(f"projected {key:24s} K={k} tau={tau:.2f} draft forwards {forwards:.2f} ({basis}): "
                f"x{speedup:.2f} over autoregressive")
    else:
        log("perf/acceptance.json missing: no projection (run perf/e2e.py on a CPU first)")
    result["projections"] = projections


def statistics_median(xs):
    import statistics

    return statistics.median(xs)


# --------------------------------------------------------------------------------------------- 5. table


def table(log, result):
    section(log, "summary")
    kt = result.get("kernel_tests", {})
    log(f"kernel tests: {kt.get('summary') or kt.get('skipped') or kt.get('error', '-')}")
    log(f"device copy bandwidth: {result.get('copy_gbps', 0):.0f} GB/s")
    log(f"{'kernel':48s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s} {'figure':>14s}")
    for r in result.get("kernels", []):
        if "error" in r:
            log(f"{r['case']:48s} {'FAILED':>10s}")
            continue
        tr = r["triton"]
        fig = f"{tr['tflops']:.1f} TFLOP/s" if "tflops" in tr and tr.get("tflops", 0) > 1 else f"{tr.get('gbps', 0):.0f} GB/s"
        log(f"{r['case']:48s} {tr['ms']:10.3f} {r['torch']['ms']:10.3f} {r['speedup_triton_vs_torch']:8.2f} {fig:>14s}")
    c = result.get("costs")
    if c:
        log(f"step {c['step_ms']:.2f} ms; verify K=4 x{c['verify_ms'][4] / c['step_ms']:.2f}, K=8 "
            f"x{c['verify_ms'][8] / c['step_ms']:.2f}; draft 0.5B x{c['draft_ms']['qwen2.5-0.5b'] / c['step_ms']:.2f}, "
            f"SmolLM2 x{c['draft_ms']['smollm2-135m'] / c['step_ms']:.2f}")
    for label, r in result.get("pipelines", {}).items():
        log(f"{label:22s} {r['tokens_per_second']:8.1f} tok/s ({r['tokens_per_target_forward']:.2f} tokens/forward)")
    for key, p in result.get("projections", {}).items():
        log(f"projected {key:22s} x{p['projected_speedup']:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton through its interpreter")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all sections")
    ap.add_argument("--tests-s", type=float, default=200.0, help="at most this long for the kernel tests")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args(argv)
    start = time.time()
    deadline = start + args.budget_s
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    out = Path(os.environ.get("OUT") or (ROOT / "perf" / "results" / "gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    sys.path.append(str(ROOT))
    log = Log(out)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        log("no CUDA device: running the dry run instead (tiny shapes, Triton interpreter)")
        args.dry_run = True
        os.environ["TRITON_INTERPRET"] = "1"
    result: dict = {"dry_run": args.dry_run, "device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    steps = [
        ("machine", lambda: machine(log, result)),
        ("kernel_tests", lambda: None if args.skip_tests else kernel_tests(
            log, result, out, min(args.tests_s, deadline - time.time() - 150), args.dry_run)),
        ("kernel_speed", lambda: kernel_speed(log, result, device, args.dry_run, deadline - 120)),
        ("qlinear_speed", lambda: qlinear_speed(log, result, device, args.dry_run, deadline - 100)),
        ("e2e", lambda: e2e(log, result, device, args.dry_run, deadline - 20)),
    ]
    for name, fn in steps:
        try:
            fn()
        except Exception as e:
            log(f"{name}: FAILED {e.__class__.__name__}: {e}")
            log(traceback.format_exc())
            result.setdefault("errors", {})[name] = f"{e.__class__.__name__}: {e}"
    result["seconds"] = time.time() - start
    table(log, result)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"# {result['seconds']:.0f} s; wrote {out / 'gpu_check.json'}")
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
