"""GGUF targets in their own blocks against llama.cpp on the very same file, one command:

    .venv/bin/python perf/quantized.py --threads 1 2              # Qwen2.5-Coder-1.5B Q4_K_M, 128 tokens
    .venv/bin/python perf/quantized.py --threads 1 --tokens 64 --prompts 1

For each thread count, in one run: llama.cpp's ``llama-bench`` tg<n> on the zoo's GGUF file itself (no
requantization; perf/llamacpp.py builds it), graphspec's plain decoding of the same file with
``weights="gguf"`` (the same code path as speculation, no draft), and graphspec's speculative decoding with
the zoo's 0.5B GGUF as the draft (also in its blocks), greedy, ``ignore_eos``. Reported: tokens/s, the ratios
measured in this run, and the bandwidth graphspec's plain decoding reached for the bytes a step reads (its
GEMM weights: every layer's and the lm_head). One JSON line per thread count is appended to
perf/quantized.jsonl with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
OUT = ROOT / "perf" / "quantized.jsonl"


def _prompts(n: int) -> list:
    data = json.loads((ROOT / "perf" / "prompts.json").read_text())["prompts"][:n]
    return [p.get("messages") or p["prompt"] for p in data]


def _decode(pipe, prompts, tokens: int) -> dict:
    done, seconds, forwards, accepted, proposed = 0, 0.0, 0, 0, 0
    texts = []
    for prompt in prompts:
        out = pipe.run(prompt, max_new_tokens=tokens, ignore_eos=True)
        done += len(out.token_ids)
        seconds += out.stats.decode_seconds
        forwards += out.stats.target_forwards
        accepted += out.stats.accepted
        proposed += out.stats.proposed
        texts.append(out.token_ids)
    return {"tokens_per_second": done / seconds, "tokens": done, "target_forwards": forwards,
            "acceptance": accepted / proposed if proposed else None, "token_ids": texts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=1, help="how many of perf/prompts.json (default 1)")
    ap.add_argument("--k", type=int, default=5, help="draft tokens a step for the speculative run")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench repetitions")
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args(argv)

    import torch

    import graphspec
    from graphspec.models import load_model
    from graphspec.models.gguf_weights import gguf_file_for, weight_bytes
    from perf._common import machine_info

    target = load_model(TARGET, weights="gguf")
    draft = load_model(DRAFT, weights="gguf")
    step_bytes = weight_bytes(target)
    prompts = _prompts(args.prompts)
    bin_dir = None
    if not args.no_llamacpp:
        from perf import llamacpp

        bin_dir = llamacpp.build()
    for threads in args.threads:
        torch.set_num_threads(threads)
        row = {"target": TARGET, "file": gguf_file_for(TARGET).name, "threads": threads, "tokens": args.tokens,
               "prompts": len(prompts), "k": args.k, "step_bytes": step_bytes, "machine": machine_info()}
        if bin_dir is not None:
            lc = llamacpp.bench(bin_dir, gguf_file_for(TARGET), threads, n=args.tokens, reps=args.reps)
            row["llamacpp_tg"] = {k: lc[k] for k in ("tokens_per_second", "stddev", "build_commit", "model_type")}
        t0 = time.time()
        ar = _decode(graphspec.Pipeline(target), prompts, args.tokens)
        spec = _decode(graphspec.Pipeline(target, draft=draft, num_speculative_tokens=args.k), prompts, args.tokens)
        row["seconds"] = time.time() - t0
        row["graphspec_ar"] = {k: v for k, v in ar.items() if k != "token_ids"}
        row["graphspec_spec"] = {k: v for k, v in spec.items() if k != "token_ids"}
        row["identical_tokens"] = ar["token_ids"] == spec["token_ids"]
        row["ar_gbps"] = step_bytes * ar["tokens_per_second"] / 1e9
        row["spec_vs_ar"] = spec["tokens_per_second"] / ar["tokens_per_second"]
        if "llamacpp_tg" in row:
            lc_tps = row["llamacpp_tg"]["tokens_per_second"]
            row["ar_vs_llamacpp"] = ar["tokens_per_second"] / lc_tps
            row["spec_vs_llamacpp"] = spec["tokens_per_second"] / lc_tps
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")
        lc_txt = (f"llama.cpp tg{args.tokens} {row['llamacpp_tg']['tokens_per_second']:.2f} tok/s | "
                  if "llamacpp_tg" in row else "")
        print(f"{threads} thread(s): {lc_txt}graphspec gguf AR {ar['tokens_per_second']:.2f} tok/s "
              f"({row['ar_gbps']:.1f} GB/s of {step_bytes / 1e9:.2f} GB a step) | spec K={args.k} "
              f"{spec['tokens_per_second']:.2f} tok/s (x{row['spec_vs_ar']:.2f} AR, acceptance "
              f"{spec['acceptance']:.2f}) | identical tokens: {row['identical_tokens']}"
              + (f" | AR/llama.cpp {row['ar_vs_llamacpp']:.2f}, spec/llama.cpp {row['spec_vs_llamacpp']:.2f}"
                 if "llamacpp_tg" in row else ""), flush=True)
    print(f"appended to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
