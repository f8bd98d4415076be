"""GGUF targets in their own blocks against llama.cpp on the very same file, one command:

    .venv/bin/python perf/quantized.py --threads 1 2              # Qwen2.5-Coder-1.5B Q4_K_M, 128 tokens
    .venv/bin/python perf/quantized.py --threads 1 --weights gguf-a8 --draft int8 --k 3
    .venv/bin/python perf/quantized.py --threads 1 --weights gguf-a8 --draft gguf --k 5 --no-llamacpp
    .venv/bin/python perf/quantized.py --threads 1 --weights gguf-a8 --prompts 4 --draft-length fixed auto

For each thread count, in one run: llama.cpp's ``llama-bench`` tg<n> on the zoo's GGUF file itself (no
requantization; perf/llamacpp.py builds it), graphspec's plain decoding of the same file with
``weights="gguf"`` (the GGUF's exact model: fp32 activations) and ``weights="gguf-a8"`` (the k-quants on int8
activations, llama.cpp's arithmetic), each through the same code path as speculation with no draft, and
graphspec's speculative decoding on each with the zoo's 0.5B as the draft (``--draft-length fixed auto``: both
``draft_length`` settings, one after the other; the rows then have ``graphspec_spec_auto``, with the k each step
chose), K = 3 by default (``--draft auto``, the
default: its converted checkpoint with 4-bit draft steps where the CPU backend's level has the int4 GEMM, else int8
weights, as docs/quantized.md recommends; ``--draft gguf``: its GGUF in blocks), greedy, ``ignore_eos``; with ``--transformers``,
transformers' plain greedy ``generate`` on the same GGUF file too (transformers cannot run GGUF blocks: it
dequantizes the file at load, here to bf16, its fastest CPU dtype, so it reads 3 GB a step where the blocks are
1). Reported: tokens/s, the ratios measured in this run, and the bandwidth graphspec's plain decoding reached
for the bytes a step reads (its GEMM weights: every layer's and the lm_head). One JSON line per thread count and
weights is appended to perf/quantized.jsonl with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
OUT = ROOT / "perf" / "quantized.jsonl"
_TAG = {"fixed": "", "auto": "_auto"}  # a speculative run's suffix in the row's keys, per draft_length


def _prompts(n: int) -> list:
    data = json.loads((ROOT / "perf" / "prompts.json").read_text())["prompts"][:n]
    return [p.get("messages") or p["prompt"] for p in data]


def _decode(pipe, prompts, tokens: int) -> dict:
    done, seconds, forwards, accepted, proposed = 0, 0.0, 0, 0, 0
    texts, chosen = [], []
    for prompt in prompts:
        out = pipe.run(prompt, max_new_tokens=tokens, ignore_eos=True)
        if getattr(pipe, "_auto_length", None) is not None:  # draft_length="auto": the k of each step
            chosen += pipe._auto_length.chosen
        done += len(out.token_ids)
        seconds += out.stats.decode_seconds
        forwards += out.stats.target_forwards
        accepted += out.stats.accepted
        proposed += out.stats.proposed
        texts.append(out.token_ids)
    out = {"tokens_per_second": done / seconds, "tokens": done, "target_forwards": forwards,
           "acceptance": accepted / proposed if proposed else None, "token_ids": texts}
    if chosen:
        out["chosen_k"] = {str(k): chosen.count(k) for k in sorted(set(chosen))}
    return out


def _transformers_peer(name: str, tok):
    """transformers on zoo model ``name``'s GGUF file (dequantized at load to bf16): ``run(prompts, n) -> dict``
    of plain greedy decoding, n new tokens a prompt, the prompts encoded by graphspec's tokenizer ``tok``."""
    import torch
    import transformers

    from perf._common import transformers_from_gguf

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers_from_gguf(name)

    def generate(x, n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=tok.eos_token_ids[0])
        return time.perf_counter() - t0, out.shape[1] - x.shape[1]

    def run(prompts, n: int) -> dict:
        """Decode speed as graphspec's decode_seconds counts it: the prefill and first token (a 1-token
        generate of the same prompt) taken off."""
        done, seconds = 0, 0.0
        for prompt in prompts:
            text = tok.apply_chat_template(prompt) if isinstance(prompt, list) else prompt
            ids = tok.encode(text, add_special_tokens=not isinstance(prompt, list))
            x = torch.tensor([ids])
            first, _ = generate(x, 1)
            total, new = generate(x, n)
            seconds += total - first
            done += new - 1
        return {"tokens_per_second": done / seconds, "tokens": done, "dtype": "bfloat16",
                "transformers": transformers.__version__}

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=1, help="how many of perf/prompts.json (default 1)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens a step for the speculative run")
    ap.add_argument("--weights", nargs="+", default=["gguf", "gguf-a8"], choices=["gguf", "gguf-a8"],
                    help="the target's weights: gguf (fp32 activations, the GGUF's exact model) and/or gguf-a8 "
                         "(the k-quants on int8 activations, as llama.cpp computes)")
    ap.add_argument("--draft", default="auto", choices=["auto", "gguf", "int8", "int4", "none"],
                    help="the 0.5B draft: its GGUF in blocks (gguf, with the target's --weights), the converted "
                         "checkpoint with int8 weights (int8) or 4-bit draft steps (int4: the amx, avx512 or avx2 "
                         "level), auto (int4 where the level has it, else int8; the default), or no speculative "
                         "run (none)")
    ap.add_argument("--draft-length", nargs="+", default=["fixed"], choices=["fixed", "auto"],
                    help="the speculative run's draft_length: fixed (K a step), auto (1..K a step, chosen from the "
                         "measured forward costs and acceptance), or both, one after the other in this run")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench repetitions")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--transformers", action="store_true",
                    help="also time transformers loading the same GGUF file (dequantized to bf16 at load), plain")
    args = ap.parse_args(argv)

    import torch

    import graphspec
    from graphspec.models import load_model
    from graphspec.models.gguf_weights import gguf_file_for, weight_bytes
    from perf._common import machine_info

    if args.draft == "auto":
        from graphspec.kernels import cpu

        args.draft = "int4" if cpu.have_int4() else "int8"
    targets = {w: load_model(TARGET, weights=w) for w in args.weights}
    drafts = {}
    for w in args.weights:
        if args.draft == "gguf":
            drafts[w] = load_model(DRAFT, weights=w)
        elif args.draft in ("int8", "int4"):
            drafts[w] = drafts.get(args.draft) or load_model(DRAFT, quantize=args.draft)
            drafts[args.draft] = drafts[w]
    step_bytes = weight_bytes(next(iter(targets.values())))
    prompts = _prompts(args.prompts)
    bin_dir = None
    if not args.no_llamacpp:
        from perf import llamacpp

        bin_dir = llamacpp.build()
    hf = _transformers_peer(TARGET, next(iter(targets.values())).tokenizer) if args.transformers else None
    for threads in args.threads:
        torch.set_num_threads(threads)
        hf_run = None
        if hf is not None:
            hf_run = hf(prompts, args.tokens)
            print(f"{threads} thread(s): transformers (the GGUF dequantized to bf16) {hf_run['tokens_per_second']:.2f} "
                  f"tok/s", flush=True)
        lc = None
        if bin_dir is not None:
            lc = llamacpp.bench(bin_dir, gguf_file_for(TARGET), threads, n=args.tokens, reps=args.reps)
            lc = {k: lc[k] for k in ("tokens_per_second", "stddev", "build_commit", "model_type")}
            print(f"{threads} thread(s): llama.cpp tg{args.tokens} {lc['tokens_per_second']:.2f} tok/s", flush=True)
        for w, target in targets.items():
            row = {"target": TARGET, "file": gguf_file_for(TARGET).name, "weights": w, "threads": threads,
                   "tokens": args.tokens, "prompts": len(prompts), "k": args.k, "step_bytes": step_bytes,
                   "machine": machine_info()}
            if lc is not None:
                row["llamacpp_tg"] = lc
            if hf_run is not None:
                row["transformers_bf16"] = hf_run
            t0 = time.time()
            ar = _decode(graphspec.Pipeline(target), prompts, args.tokens)
            row["graphspec_ar"] = {k: v for k, v in ar.items() if k != "token_ids"}
            row["ar_gbps"] = step_bytes * ar["tokens_per_second"] / 1e9
            line = (f"{threads} thread(s), {w}: AR {ar['tokens_per_second']:.2f} tok/s ({row['ar_gbps']:.1f} GB/s of "
                    f"{step_bytes / 1e9:.2f} GB a step)")
            if args.draft != "none":
                row["draft"] = f"{DRAFT} {w if args.draft == 'gguf' else args.draft}"
                for length in args.draft_length:
                    # draft_length="auto" times the two models once per pipeline, before its first run's prefill
                    pipe = graphspec.Pipeline(target, draft=drafts[w], num_speculative_tokens=args.k,
                                              draft_length=length)
                    spec = _decode(pipe, prompts, args.tokens)
                    tag = _TAG[length]
                    row[f"graphspec_spec{tag}"] = {k: v for k, v in spec.items() if k != "token_ids"}
                    row[f"identical_tokens{tag}"] = ar["token_ids"] == spec["token_ids"]
                    row[f"spec{tag}_vs_ar"] = spec["tokens_per_second"] / ar["tokens_per_second"]
                    line += (f" | spec K={args.k}{' auto' if tag else ''} ({row['draft']} draft) "
                             f"{spec['tokens_per_second']:.2f} tok/s (x{row[f'spec{tag}_vs_ar']:.2f} AR, acceptance "
                             f"{spec['acceptance']:.2f}) | identical tokens: {row[f'identical_tokens{tag}']}")
            row["seconds"] = time.time() - t0
            if lc is not None:
                row["ar_vs_llamacpp"] = ar["tokens_per_second"] / lc["tokens_per_second"]
                line += f" | AR/llama.cpp {row['ar_vs_llamacpp']:.2f}"
                for tag in _TAG.values():
                    if f"graphspec_spec{tag}" in row:
                        row[f"spec{tag}_vs_llamacpp"] = (row[f"graphspec_spec{tag}"]["tokens_per_second"]
                                                         / lc["tokens_per_second"])
                        line += f", spec{tag.replace('_', ' ')}/llama.cpp {row[f'spec{tag}_vs_llamacpp']:.2f}"
            if hf_run is not None:
                row["ar_vs_transformers"] = ar["tokens_per_second"] / hf_run["tokens_per_second"]
                line += f" | AR/transformers {row['ar_vs_transformers']:.2f}"
                if "graphspec_spec" in row:
                    row["spec_vs_transformers"] = (row["graphspec_spec"]["tokens_per_second"]
                                                   / hf_run["tokens_per_second"])
                    line += f", spec/transformers {row['spec_vs_transformers']:.2f}"
            with OUT.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(line, flush=True)
    print(f"appended to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
