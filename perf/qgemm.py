"""The CPU block GEMMs (kernels/cpu/qgemm.cpp) one product at a time, at every C++ level this CPU runs:

    .venv/bin/python perf/qgemm.py                                   # Q4_K, Q6_K, Q5_0, Q8_0; 1, 2, 4, 6, 8 rows
    .venv/bin/python perf/qgemm.py --types Q4_K --rows 1 6 --shape 17920 1536 --threads 2
    .venv/bin/python perf/qgemm.py --types Q4_K Q6_K --activations int8      # the a8 GEMMs only
    .venv/bin/python perf/qgemm.py --activations int8 --rows 16 32 512 --levels amx avx512   # two levels

For each format (with fp32 activations, and for the k-quants also with int8 ones: "Q4_K a8"), level and row
count: the median of ``--reps`` calls of ``qlinear`` on one random weight of
``--shape`` (N, K), in milliseconds, as weights a second and as bytes a second, beside graphspec's bf16 linear on
the same shape (the level's, where it has one) and the read bandwidth measured in the same run, all timed
round-robin so a shared host's drift hits every setting alike. A weight that fits the last-level cache runs from
it: the default shape (a 1.5B gate/up projection, 15 MB at Q4_K) is a compute figure; pass a larger N (the lm
head: 151936 1536) for one that streams from memory. Appends one JSON line per run to perf/qgemm.jsonl with the
machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
OUT = ROOT / "perf" / "qgemm.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--shape", type=int, nargs=2, default=[17920, 1536], metavar=("N", "K"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--activations", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"],
                    help="fp32 (the exact GEMMs) and/or int8 (the k-quants' a8 GEMMs, weights='gguf-a8'); a format "
                         "without an int8 path is timed with fp32 activations only")
    ap.add_argument("--levels", nargs="+", default=None, metavar="LEVEL",
                    help="only these C++ levels (default: every level this CPU runs but torch)")
    args = ap.parse_args(argv)

    from graphspec.kernels import cpu
    from graphspec.kernels.linear import linear, prepare_weight
    from graphspec.kernels.qlinear import FORMATS, BlockWeight, qlinear
    from perf._common import machine_info, read_bandwidth
    from tests.kernels._qblocks import random_blocks

    for t in args.types:
        if t not in FORMATS:
            ap.error(f"--types: unknown format {t!r}; expected some of {', '.join(FORMATS)}")
    n, k = args.shape
    if n <= 0 or k <= 0 or k % 256:
        ap.error(f"--shape {n} {k}: N must be positive and K a positive multiple of 256 (the k-quants' block)")
    torch.set_num_threads(args.threads)
    levels = [lv for lv in cpu.runnable_levels() if lv != "torch"]
    if args.levels:
        unknown = [lv for lv in args.levels if lv not in levels]
        if unknown:
            ap.error(f"--levels: {', '.join(unknown)} not among this CPU's C++ levels ({', '.join(levels)})")
        levels = [lv for lv in levels if lv in args.levels]
    from graphspec.kernels.qlinear import A8_TYPES

    weights = {}
    for t in args.types:
        blocks = torch.from_numpy(random_blocks(t, n, k))
        for act in args.activations:
            if act == "fp32" or t in A8_TYPES:
                weights[t if act == "fp32" else f"{t} a8"] = BlockWeight(t, blocks, (n, k), act)
    dense = torch.randn(n, k).to(torch.bfloat16)
    bf16 = {}
    for lv in levels:
        if cpu.bf16_linear(lv):
            with cpu.use_level(lv):
                bf16[lv] = prepare_weight(dense)

    cases = []  # (label, level, rows, bytes, fn)
    for m in args.rows:
        x = torch.randn(m, k)
        xb = x.to(torch.bfloat16)
        for lv in levels:
            for t, w in weights.items():
                cases.append((t, lv, m, w.nbytes, lambda x=x, w=w: qlinear(x, w)))
            if lv in bf16:
                cases.append(("bf16 linear", lv, m, n * k * 2, lambda xb=xb, w=bf16[lv]: linear(xb, w)))
    times = {i: [] for i in range(len(cases))}
    for i, (_, lv, _, _, fn) in enumerate(cases):  # warm-up: builds and first touches
        with cpu.use_level(lv):
            fn()
    bandwidth = read_bandwidth()
    for _ in range(args.reps):
        for i, (_, lv, _, _, fn) in enumerate(cases):
            with cpu.use_level(lv):
                t0 = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - t0)

    rows = []
    print(f"[{n}, {k}], {args.threads} thread(s); read bandwidth {bandwidth['gbps_median']:.1f} GB/s")
    print(f"{'kernel':<13} {'level':<7} {'rows':>4} {'ms':>8} {'Gweights/s':>11} {'GB/s':>6}")
    for i, (label, lv, m, nbytes, _) in enumerate(cases):
        med = statistics.median(times[i])
        rows.append({"kernel": label, "level": lv, "rows": m, "ms": med * 1e3, "gweights_per_s": n * k / med / 1e9,
                     "gbytes_per_s": nbytes / med / 1e9})
        print(f"{label:<13} {lv:<7} {m:>4} {med * 1e3:>8.3f} {n * k / med / 1e9:>11.1f} {nbytes / med / 1e9:>6.1f}")
    record = {"shape": [n, k], "threads": args.threads, "reps": args.reps, "read_bandwidth": bandwidth,
              "machine": machine_info(), "results": rows}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
