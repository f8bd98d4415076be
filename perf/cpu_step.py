"""What one target forward costs on this machine: decode step, verify over T tokens, GB/s.

    .venv/bin/python perf/cpu_step.py [--model NAME] [--dtypes bf16 fp32] [--threads 2] [--reps 9]
    .venv/bin/python perf/cpu_step.py --model smollm2-135m-instruct --quantize int8 --dtypes bf16 --tokens 1 2
    .venv/bin/python perf/cpu_step.py --weights gguf-a8 --tokens 1 16 32     # the GGUF blocks of the zoo's file

For each dtype and weight layout ("packed": what ``prepare_weight`` gives, the default, which for
bf16 at the CPU backend's amx, avx512 and avx2 levels is graphspec's own kernel (kernels/cpu/linear.cpp); "onednn": oneDNN's
packed layout; "plain": the same weights as plain tensors through ``F.linear``) it times ``model.step`` over
T = 1, 2, 4, 8 new tokens after 256 cached ones (``--context``) and prints the median milliseconds, the ratio
to the one-token step (the cost of a speculative verify) and the one-token step's achieved
bandwidth (weight bytes / time) next to the memory read bandwidth measured in the same run. With
``--quantize int8`` (a draft as the CLI runs it) the layouts are the int8 forward in C++ and in TorchScript;
with ``--weights gguf`` / ``gguf-a8`` the model runs its GGUF file's blocks (layout "blocks") instead of --dtypes.
Writes perf/results/cpu_step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import TARGET, machine_info, output_path, read_bandwidth, save_json, step_times, step_weight_bytes  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def relayout(model, layout: str) -> None:
    """Swap every prepared weight for a plain tensor (``plain``: the F.linear path) or oneDNN's packed one."""
    from graphspec.kernels.linear import prepare_weight

    def convert(w):
        dense = w.dense() if hasattr(w, "dense") else w
        return dense if layout == "plain" else prepare_weight(dense, layout="onednn")

    for layer in model.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            setattr(layer, name, convert(getattr(layer, name)))
    model.lm_head = convert(model.lm_head)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TARGET)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--layouts", nargs="+", default=["packed", "plain"], choices=["packed", "onednn", "plain"])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--context", type=int, nargs="+", default=[256], metavar="TOKENS",
                    help="cached tokens before the T new ones (several: each in turn; attention's share grows with it)")
    ap.add_argument("--quantize", default="none", choices=["none", "int8"],
                    help="int8: the model as a draft runs it (kernels.linear.Int8Weight); layouts then do not apply")
    ap.add_argument("--int8-forwards", nargs="+", default=["native", "general"],
                    choices=["native", "native-int4", "general"],
                    help="with --quantize int8: time the C++ forward (graphspec.kernels.cpu.int8_draft) with the int8 "
                         "GEMM, with the int4 GEMM (native-int4: quantize='int4', avx512), the general forward "
                         "(Python, the same GEMMs), or several, each as its own layout int8-<name>")
    ap.add_argument("--level", default="auto",
                    help="the CPU backend's level to run (graphspec.kernels.cpu: auto, amx, avx512, avx2, generic, torch)")
    ap.add_argument("--min-rows", type=int, nargs="+", default=None, metavar="ROWS",
                    help="also time with products of fewer rows padded to these row counts (kernels.linear.MIN_ROWS; "
                         "1 = unpadded); default: the library's setting only")
    ap.add_argument("--out", default="cpu_step.json",
                    help="a .json file name (under perf/results/) or a path with a folder")
    ap.add_argument("--weights", default=None, choices=["gguf", "gguf-a8"],
                    help="the model's GGUF blocks (fp32 or int8 activations) instead of --dtypes")
    args = ap.parse_args(argv)
    if args.weights and args.quantize != "none":
        ap.error(f"--weights {args.weights} runs the GGUF file's own blocks; leave out --quantize {args.quantize}")
    out = output_path(args.out)

    import importlib

    from graphspec.kernels import cpu
    from graphspec.kernels.cpu import int8_draft
    from graphspec.models import load_model

    cpu.set_level(args.level)

    linear_mod = importlib.import_module("graphspec.kernels.linear")
    pads = args.min_rows or [linear_mod.MIN_ROWS]

    rows = []
    result = {"machine": machine_info(), "model": args.model, "rows": rows}
    result["read_bandwidth"] = read_bandwidth()
    bw = result["read_bandwidth"]["gbps_median"]
    print(f"# {result['machine'].get('cpu_model')} x{result['machine']['cpu_count']}, load "
          f"{result['machine'].get('loadavg')}, read bandwidth {bw:.1f} GB/s (median)", flush=True)
    for dname in [args.weights] if args.weights else args.dtypes:
        quantize = None if args.quantize == "none" else args.quantize
        model = (load_model(args.model, weights=args.weights) if args.weights
                 else load_model(args.model, dtype=DTYPES[dname], quantize=quantize))
        nbytes = step_weight_bytes(model)
        layouts = ["blocks"] if args.weights else [f"int8-{f}" for f in args.int8_forwards] if quantize else args.layouts
        for layout in layouts:
            if layout in ("plain", "onednn"):
                relayout(model, layout)
            if quantize:
                model.native_forward = layout.startswith("int8-native")
                if model.native_forward:
                    if not cpu.available():
                        raise SystemExit(f"the C++ int8 forward is unavailable at level {cpu.level()} ({cpu.ENV}); "
                                         "pass --int8-forwards general")
                    int8_draft.draft_for(model).set_gemm("int4" if layout == "int8-native-int4" else "int8")
            for threads, pad in ((th, p) for th in args.threads for p in pads):
                torch.set_num_threads(threads)
                linear_mod.MIN_ROWS = pad
                bw = read_bandwidth()["gbps_median"]  # at this thread count: 1 thread reads slower when quiet
                bases = {}  # context -> its one-token step
                for ctx, t in ((c, t) for c in args.context for t in args.tokens):
                    s = step_times(model, t, args.reps, context=ctx)
                    med = statistics.median(s)
                    if t == 1:
                        bases[ctx] = med
                    base = bases.get(ctx)
                    row = {"dtype": dname, "layout": layout, "threads": threads, "min_rows": pad, "tokens": t,
                           "context": ctx, "median_ms": med * 1e3, "min_ms": min(s) * 1e3,
                           "ratio_to_1": med / base if base else None,
                           "gbps": nbytes / med / 1e9, "weight_bytes": nbytes, "read_bandwidth_gbps": bw}
                    row["fraction_of_bandwidth"] = row["gbps"] / bw
                    rows.append(row)
                    print(f"{dname:5s} {layout:6s} threads={threads} min_rows={pad} ctx={ctx} T={t}: "
                          f"{med * 1e3:7.1f} ms (min {min(s) * 1e3:6.1f})"
                          f"  x{row['ratio_to_1'] or float('nan'):.2f} of T=1  {row['gbps']:5.1f} GB/s = "
                          f"{100 * row['fraction_of_bandwidth']:.0f}% of read bw", flush=True)
        del model
    result["read_bandwidth_after"] = read_bandwidth()
    path = save_json(out, result)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
