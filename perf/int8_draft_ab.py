"""An int8 draft's C++ forward on graphspec's int8 GEMM against fbgemm's, interleaved.

    .venv/bin/python perf/int8_draft_ab.py [--models NAME ...] [--threads 1 2] [--tokens 1 2 3 6] [--reps 15]
        [--gemms fbgemm vnni int4]

For each draft model (loaded as the pipeline loads a CPU draft: ``quantize="int8"``), the C++ forward
(graphspec.models.int8_native) alternates between its two GEMMs on the same cache, round by round, so
a shared host's drift hits both alike: "vnni" (kernels/_int8_gemm.h, the default on CPUs with AVX-512
VNNI) and "fbgemm" (torch's dynamic int8 linear), and with ``--gemms ... int4`` the 4-bit layer products
of ``quantize="int4"`` (kernels/_int4_gemm.h). It prints the median milliseconds of ``model.step``
over T new tokens after ``--cached`` ones, logits for the last row (what a draft asks for), and each
GEMM's ratio to the first. Writes perf/results/int8_draft_ab.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perf._common import machine_info, output_path, save_json  # noqa: E402

GEMMS = ("fbgemm", "vnni", "int4")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 6])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cached", type=int, default=200)
    ap.add_argument("--gemms", nargs="+", default=["fbgemm", "vnni"], choices=GEMMS,
                    help="the GEMMs to alternate; ratios are against the first")
    ap.add_argument("--out", default="int8_draft_ab.json", help="a .json file name (under perf/results/) or a path")
    args = ap.parse_args(argv)
    out = output_path(args.out)

    from graphspec.models import int8_native, load_model

    if not int8_native.available() or int8_native.default_gemm() != "vnni":
        raise SystemExit("graphspec's int8 GEMM does not run here (it needs AVX-512 VNNI and a C++ compiler; "
                         f"{int8_native.ENV}={int8_native.mode()}): nothing to compare")
    result = {"machine": machine_info(), "cached": args.cached, "rows": []}
    print(f"# {result['machine'].get('cpu_model')} x{result['machine']['cpu_count']}, load "
          f"{result['machine'].get('loadavg')}", flush=True)
    g = torch.Generator().manual_seed(0)
    for name in args.models:
        model = load_model(name, dtype=torch.bfloat16, quantize="int8")
        draft = int8_native.draft_for(model)
        prefix = torch.randint(0, model.config.vocab_size, (1, args.cached), generator=g)
        ids = {t: torch.randint(0, model.config.vocab_size, (1, t), generator=g) for t in args.tokens}
        try:
            for threads in args.threads:
                torch.set_num_threads(threads)
                cache = model.new_cache(args.cached + max(args.tokens))
                model.step(prefix, cache, logits_for="last")
                times = {(s, t): [] for s in args.gemms for t in args.tokens}
                for _ in range(args.reps + 1):  # the first round warms both up and is dropped
                    for s in args.gemms:
                        draft.set_gemm(s)
                        for t in args.tokens:
                            cache.truncate(args.cached)
                            t0 = time.perf_counter()
                            model.step(ids[t], cache, logits_for="last")
                            times[(s, t)].append(time.perf_counter() - t0)
                cells = []
                for t in args.tokens:
                    med = {s: statistics.median(times[(s, t)][1:]) * 1e3 for s in args.gemms}
                    for s in args.gemms:
                        result["rows"].append({"model": name, "threads": threads, "gemm": s, "tokens": t,
                                               "median_ms": med[s], "min_ms": min(times[(s, t)][1:]) * 1e3})
                    base = args.gemms[0]
                    cells.append(f"T={t} {base} {med[base]:.2f}" + "".join(
                        f", {s} {med[s]:.2f} (x{med[base] / med[s]:.2f})" for s in args.gemms[1:]) + " ms")
                print(f"{name} threads={threads}: " + "   ".join(cells), flush=True)
        finally:
            draft.set_gemm(int8_native.default_gemm())
    path = save_json(out, result)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
