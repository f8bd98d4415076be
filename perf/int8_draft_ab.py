"""An int8 draft's C++ forward at each CPU level and GEMM, interleaved.

    .venv/bin/python perf/int8_draft_ab.py [--models NAME ...] [--threads 1 2] [--tokens 1 2 3 6] [--reps 15]
        [--configs avx512:int8 avx2:int8 generic:int8 avx512:int4]

For each draft model (loaded as the pipeline loads a CPU draft: ``quantize="int8"``), the C++ forward
(graphspec.kernels.cpu.int8_draft) alternates between configurations LEVEL:GEMM on the same cache, round by
round, so a shared host's drift hits all alike: the levels of the CPU backend (graphspec.kernels.cpu: avx512's
vpdpbusd int8 GEMM, avx2's vpmaddwd one, generic's plain loops) and the GEMMs ("int8", or "int4": the 4-bit
layer products of ``quantize="int4"``, avx512 and avx2). Default: int8 at every C++ level this CPU executes. It
prints the median milliseconds of ``model.step`` over T new tokens after ``--cached`` ones, logits for the last
row (what a draft asks for), and each configuration's ratio to the first. Writes perf/results/int8_draft_ab.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import machine_info, output_path, save_json  # noqa: E402



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 6])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cached", type=int, default=200)
    ap.add_argument("--configs", nargs="+", default=None, metavar="LEVEL:GEMM",
                    help="the configurations to alternate (default: LEVEL:int8 for every C++ level this CPU runs); "
                         "ratios are against the first")
    ap.add_argument("--out", default="int8_draft_ab.json", help="a .json file name (under perf/results/) or a path")
    args = ap.parse_args(argv)
    out = output_path(args.out)

    from graphspec.kernels import cpu
    from graphspec.kernels.cpu import int8_draft
    from graphspec.models import load_model

    levels = [lv for lv in cpu.runnable_levels() if lv != "torch"]
    if not levels:
        raise SystemExit(f"no C++ level of the CPU backend runs here ({cpu.ENV}; it needs a C++ compiler)")
    configs = args.configs or [f"{lv}:int8" for lv in levels]
    for c in configs:
        lv, _, gemm = c.partition(":")
        if lv not in levels or gemm not in ("int8", "int4") or (gemm == "int4" and not cpu.have_int4(lv)):
            raise SystemExit(f"--configs {c}: expected LEVEL:int8 or LEVEL:int4 (avx512, avx2) with LEVEL one of {levels}")
    result = {"machine": machine_info(), "cached": args.cached, "rows": []}
    print(f"# {result['machine'].get('cpu_model')} x{result['machine']['cpu_count']}, load "
          f"{result['machine'].get('loadavg')}", flush=True)
    g = torch.Generator().manual_seed(0)
    for name in args.models:
        model = load_model(name, dtype=torch.bfloat16, quantize="int8")
        drafts = {}
        for c in configs:
            lv, _, gemm = c.partition(":")
            with cpu.use_level(lv):
                drafts[c] = (lv, gemm)
        prefix = torch.randint(0, model.config.vocab_size, (1, args.cached), generator=g)
        ids = {t: torch.randint(0, model.config.vocab_size, (1, t), generator=g) for t in args.tokens}
        if True:
            for threads in args.threads:
                torch.set_num_threads(threads)
                cache = model.new_cache(args.cached + max(args.tokens))
                model.step(prefix, cache, logits_for="last")
                times = {(s, t): [] for s in configs for t in args.tokens}
                for _ in range(args.reps + 1):  # the first round warms all up and is dropped
                    for s in configs:
                        lv, gemm = drafts[s]
                        with cpu.use_level(lv):
                            int8_draft.draft_for(model).set_gemm(gemm)
                            for t in args.tokens:
                                cache.truncate(args.cached)
                                t0 = time.perf_counter()
                                model.step(ids[t], cache, logits_for="last")
                                times[(s, t)].append(time.perf_counter() - t0)
                cells = []
                for t in args.tokens:
                    med = {s: statistics.median(times[(s, t)][1:]) * 1e3 for s in configs}
                    for s in configs:
                        result["rows"].append({"model": name, "threads": threads, "config": s, "tokens": t,
                                               "median_ms": med[s], "min_ms": min(times[(s, t)][1:]) * 1e3})
                    base = configs[0]
                    cells.append(f"T={t} {base} {med[base]:.2f}" + "".join(
                        f", {s} {med[s]:.2f} (x{med[base] / med[s]:.2f})" for s in configs[1:]) + " ms")
                print(f"{name} threads={threads}: " + "   ".join(cells), flush=True)
    path = save_json(out, result)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
