"""The target's step and verify with graphspec's C++ CPU kernels against the torch paths, interleaved.

    .venv/bin/python perf/cpu_kernels_ab.py [--model NAME] [--threads 1 2] [--tokens 1 6 8] [--reps 9]

One bf16 model, its weights held twice (graphspec's blocked layout and oneDNN's), and three settings
timed round-robin on the same cache, so a shared host's drift hits all of them alike:
"native" (the C++ linear and attention: the default where they build), "native-linear" (the C++ linear,
torch's attention path) and "onednn" (oneDNN's bf16 GEMMs and torch's attention path: graphspec before
the kernels). For each row count T it prints the median and minimum milliseconds of ``model.step`` over
T new tokens after 256 cached ones, and the one-token step's achieved bandwidth (weight bytes / time)
against the read bandwidth measured in the same run. Writes perf/results/cpu_kernels_ab.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import TARGET, machine_info, output_path, read_bandwidth, save_json, step_weight_bytes  # noqa: E402

NAMES = ("wqkv", "wo", "w13", "w2")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TARGET)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--cached", type=int, default=256)
    ap.add_argument("--out", default="cpu_kernels_ab.json", help="a .json file name (under perf/results/) or a path")
    args = ap.parse_args(argv)
    out = output_path(args.out)

    from graphspec.kernels import cpu
    from graphspec.kernels.linear import NativeWeight, prepare_weight
    from graphspec.models import load_model

    if not cpu.bf16_linear():
        raise SystemExit(f"graphspec's C++ bf16 linear does not run here (AVX-512 BF16 and a C++ compiler needed; "
                         f"{cpu.ENV}: level {cpu.level()}): nothing to compare")
    model = load_model(args.model, dtype=torch.bfloat16)
    native = {(i, n): getattr(layer, n) for i, layer in enumerate(model.layers) for n in NAMES}
    native["head"] = model.lm_head
    if not all(isinstance(w, NativeWeight) for w in native.values()):
        raise SystemExit("the model's weights are not in graphspec's blocked layout; is GRAPHSPEC_CPU=generic or torch set?")
    onednn = {key: prepare_weight(w.dense(), layout="onednn") for key, w in native.items()}
    nbytes = step_weight_bytes(model)

    def use(weights) -> None:
        for i, layer in enumerate(model.layers):
            for n in NAMES:
                setattr(layer, n, weights[(i, n)])
        model.lm_head = weights["head"]

    real_available = cpu.available
    settings = {"native": (native, True), "native-linear": (native, False), "onednn": (onednn, False)}
    result = {"machine": machine_info(), "model": args.model, "cached": args.cached, "rows": []}
    print(f"# {result['machine'].get('cpu_model')} x{result['machine']['cpu_count']}, load "
          f"{result['machine'].get('loadavg')}", flush=True)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (1, args.cached), generator=g)
    ids = {t: torch.randint(0, model.config.vocab_size, (1, t), generator=g) for t in args.tokens}
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bw = read_bandwidth()["gbps_median"]
            cache = model.new_cache(args.cached + max(args.tokens))
            model.step(prefix, cache, logits_for="last")
            times = {(s, t): [] for s in settings for t in args.tokens}
            for _ in range(args.reps + 1):  # the first round warms every setting up and is dropped
                for s, (weights, attention) in settings.items():
                    use(weights)
                    cpu.available = real_available if attention else (lambda name=None: False)
                    for t in args.tokens:
                        cache.truncate(args.cached)
                        t0 = time.perf_counter()
                        model.step(ids[t], cache, logits_for="all")
                        times[(s, t)].append(time.perf_counter() - t0)
            print(f"threads={threads}, read bandwidth {bw:.1f} GB/s", flush=True)
            for t in args.tokens:
                cells = []
                for s in settings:
                    ts = times[(s, t)][1:]
                    row = {"threads": threads, "setting": s, "tokens": t, "median_ms": statistics.median(ts) * 1e3,
                           "min_ms": min(ts) * 1e3, "read_bandwidth_gbps": bw}
                    if t == 1:
                        row["fraction_of_bandwidth"] = nbytes / statistics.median(ts) / 1e9 / bw
                    result["rows"].append(row)
                    frac = f", {100 * row['fraction_of_bandwidth']:.0f}% of bw" if t == 1 else ""
                    cells.append(f"{s} {row['median_ms']:.1f} (min {row['min_ms']:.1f}{frac})")
                print(f"  T={t}: " + "   ".join(cells), flush=True)
    finally:
        cpu.available = real_available
        use(native)
    path = save_json(out, result)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
