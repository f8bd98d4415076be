"""Pipeline(target, draft)'s defaults ("auto", graphspec.defaults) against the plain settings, one interleaved run.

    .venv/bin/python perf/api_defaults.py [--threads 1] [--prompts 2] [--tokens 48]

Target Qwen2.5-Coder-1.5B-Instruct in bf16, draft Qwen2.5-Coder-0.5B-Instruct: autoregressive; the draft loaded
in bf16 with the plain settings (``draft_quantize=None, draft_vocab=None, draft_siblings=0,
draft_confidence_threshold=None``); and ``Pipeline(target, draft_name)`` as a user writes it. Greedy, exactly N
tokens a prompt (prefill included), every prompt running every method before the next. Prints what the default
pipeline chose (``print(pipe)``), tok/s, the ratio to autoregressive and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import DRAFT, TARGET, load_prompts, machine_info  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2, help="the first N code and chat prompts of perf/prompts.json")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import graphspec

    target = graphspec.load_model(TARGET, dtype="bfloat16")
    plain = graphspec.load_model(DRAFT, dtype="bfloat16")
    pipes = {"autoregressive": graphspec.Pipeline(target),
             "plain settings": graphspec.Pipeline(target, plain, draft_quantize=None, draft_vocab=None,
                                                  draft_siblings=0, draft_confidence_threshold=None),
             "defaults": graphspec.Pipeline(target, DRAFT, dtype="bfloat16")}
    print(pipes["defaults"])
    prompts = [p.get("messages") or p["prompt"] for p in load_prompts(kinds=("code", "chat"), limit=args.prompts)]
    for pipe in pipes.values():  # warm-up
        pipe.run(prompts[0], max_new_tokens=4, ignore_eos=True)
    names = list(pipes)
    tokens = {n: 0 for n in names}
    seconds = {n: 0.0 for n in names}
    ids: dict[str, list] = {n: [] for n in names}
    for i, prompt in enumerate(prompts):
        for n in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            out = pipes[n].run(prompt, max_new_tokens=args.tokens, ignore_eos=True)
            seconds[n] += time.perf_counter() - t0
            tokens[n] += len(out.token_ids)
            ids[n].append(out.token_ids)
    m = machine_info()
    print(f"# {m.get('date')} {m.get('cpu_model')} (family {m.get('cpu_family')} model {m.get('cpu_model_number')}; "
          f"{m.get('cpu_flags')}), level {m.get('cpu_level')}, {args.threads} thread(s), load {m.get('loadavg')}, "
          f"commit {m.get('commit')}; {len(prompts)} prompts x {args.tokens} tokens")
    ar = tokens["autoregressive"] / seconds["autoregressive"]
    for n in names:
        rate = tokens[n] / seconds[n]
        print(f"{n:16s} {rate:6.2f} tok/s  {rate / ar:.2f}x autoregressive  same tokens: {ids[n] == ids['autoregressive']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
