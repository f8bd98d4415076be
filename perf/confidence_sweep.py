"""Draft confidence threshold sweep: speculative vs autoregressive tokens/s, one interleaved run.

Target Qwen2.5-Coder-1.5B-Instruct (bf16, CPU); drafts SmolLM2-135M-Instruct (across tokenizers)
and Qwen2.5-Coder-0.5B-Instruct; thresholds None / 0.3 / 0.5; greedy, exactly N tokens per prompt.
Every prompt runs every method before the next prompt, so load drift hits all methods alike.

    .venv/bin/python perf/confidence_sweep.py [N_TOKENS] [N_PROMPTS]
"""

import json
import sys
import time
from pathlib import Path

import torch

import graphspec


def main() -> None:
    n_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    n_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(1)  # a second thread slows a step down where another process holds a core
    spec = json.loads((Path(__file__).parent / "prompts.json").read_text())["prompts"]
    prompts = [p.get("messages") or p["prompt"] for p in spec][:n_prompts]
    target = graphspec.load_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
    smol = graphspec.load_model("smollm2-135m-instruct", dtype="bfloat16")
    half = graphspec.load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
    methods = {"autoregressive": graphspec.Pipeline(target)}
    chain = {"draft_siblings": 0, "draft_vocab": None}  # chains of whole-vocabulary drafts: the threshold alone varies
    for th in (None, 0.3, 0.5):
        methods[f"smollm2 K=5 threshold={th}"] = graphspec.Pipeline(target, smol, 5, draft_confidence_threshold=th,
                                                                    **chain)
        methods[f"0.5B K=4 threshold={th}"] = graphspec.Pipeline(target, half, 4, draft_confidence_threshold=th,
                                                                 **chain)
    for pipe in methods.values():  # warm-up
        pipe.run(prompts[0], max_new_tokens=3)
    totals = {name: [0, 0.0, 0, 0] for name in methods}
    for prompt in prompts:
        for name, pipe in methods.items():
            t0 = time.perf_counter()
            out = pipe.run(prompt, max_new_tokens=n_tokens, ignore_eos=True)
            t = totals[name]
            t[0] += len(out.token_ids)
            t[1] += time.perf_counter() - t0
            t[2] += out.stats.steps
            t[3] += out.stats.draft_forwards
    base = totals["autoregressive"][0] / totals["autoregressive"][1]
    for name, (n, s, steps, drafts) in totals.items():
        print(f"{name:32s} {n / s:6.2f} tok/s  x{n / s / base:.2f}  tokens/step {n / steps:.2f}  "
              f"draft forwards/step {drafts / steps:.2f}")


if __name__ == "__main__":
    main()
