"""What a prefix cache costs and saves: the row-exact prefill against the batched one, and a multi-turn loop.

    .venv/bin/python perf/prefix_cache.py --threads 1                       # bf16 1.5B, the agentic workload
    .venv/bin/python perf/prefix_cache.py --threads 1 --weights gguf-a8 --tokens 256
    GRAPHSPEC_CPU=avx2 .venv/bin/python perf/prefix_cache.py --threads 1 --no-loop

1. Prefill: the target's prefill of ``--tokens`` tokens, batched (``graphspec.drafters.prefill``, what a pipeline
   without a prefix cache runs) and row-exact (``exact=True``, blocks of ``EXACT_ROWS_MAX`` rows, what it runs with
   one), interleaved ``--reps`` times; milliseconds per token, median, and their ratio.
2. Loop: the requests of perf/workloads.json's ``--workload`` (default agentic: each request carries the history
   before it) run in order through ``Pipeline(target)`` and ``Pipeline(target, prefix_cache=True)``, alternating
   per request; per request the prefill seconds (time to first token, near enough) and the whole call, and the
   prompt tokens the cache served. Greedy, ``--max-new-tokens``. The two prefill differently (batched, row-exact),
   so on a near tie their tokens may differ (``outputs_differing``); a hit against a cold run of the same
   pipeline is compared bit for bit in tests/graphspec/test_prefix_cache.py, not here.

One JSON line per part is appended to perf/prefix_cache.jsonl, with the machine and the CPU backend's level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import PERF_DIR, TARGET, machine_fields, machine_info  # noqa: E402
from perf.e2e import DTYPES, encode_prompts  # noqa: E402

RESULTS_FILE = PERF_DIR / "prefix_cache.jsonl"


def prefill_cost(model, tokens: int, reps: int) -> dict:
    from graphspec.drafters import prefill

    v = model.config.vocab_size
    ids = [(37 * i + 11) % (v // 2) + v // 8 for i in range(tokens)]  # ordinary ids, away from the specials
    times: dict[str, list[float]] = {"batched": [], "exact": []}
    for _ in range(reps):
        for how in times:
            cache = model.new_cache(tokens + 1)
            t0 = time.perf_counter()
            prefill(model, cache, ids, "cpu", exact=how == "exact")
            times[how].append((time.perf_counter() - t0) * 1e3 / tokens)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": tokens, "reps": reps, "batched_ms_per_token": med["batched"],
            "exact_ms_per_token": med["exact"], "exact_over_batched": med["exact"] / med["batched"]}


def loop(model, prompts: list[list[int]], max_new: int, log) -> dict:
    import graphspec

    pipes = {"cold": graphspec.Pipeline(model), "prefix_cache": graphspec.Pipeline(model, prefix_cache=True)}
    for p in pipes.values():  # warm-up, kept out of the figures
        p.run([1, 2, 3, 4], max_new_tokens=2)
    pipes["prefix_cache"].prefix_cache.clear()
    per = {n: {"prefill_s": [], "call_s": [], "cached": [], "tokens": 0} for n in pipes}
    differ = 0
    for i, ids in enumerate(prompts):
        names = list(pipes) if i % 2 == 0 else list(pipes)[::-1]
        got = {}
        for n in names:
            t0 = time.perf_counter()
            out = pipes[n].run(ids, max_new_tokens=max_new)
            per[n]["call_s"].append(time.perf_counter() - t0)
            per[n]["prefill_s"].append(out.stats.prefill_seconds)
            per[n]["cached"].append(out.stats.cached_prompt_tokens)
            per[n]["tokens"] += len(out.token_ids)
            got[n] = out.token_ids
        differ += got["cold"] != got["prefix_cache"]
        log(f"  request {i + 1}/{len(prompts)}: {len(ids)} prompt tokens, "
            + ", ".join(f"{n} prefill {per[n]['prefill_s'][-1]:.2f} s (cached {per[n]['cached'][-1]}), "
                        f"call {per[n]['call_s'][-1]:.2f} s" for n in pipes))
    cold, warm = per["cold"], per["prefix_cache"]
    return {"requests": len(prompts), "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": max_new,
            "cold_prefill_s": cold["prefill_s"], "cached_prefill_s": warm["prefill_s"],
            "cold_call_s": cold["call_s"], "cached_call_s": warm["call_s"], "cached_tokens": warm["cached"],
            "prefill_speedup": sum(cold["prefill_s"]) / sum(warm["prefill_s"]),
            "call_speedup": sum(cold["call_s"]) / sum(warm["call_s"]), "outputs_differing": differ}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--weights", default=None, choices=["gguf", "gguf-a8"], help="the target's GGUF blocks instead")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=512, help="prompt length of the prefill comparison")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workload", default="agentic", help="a workload of perf/workloads.json")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-loop", action="store_true", help="the prefill comparison only")
    ap.add_argument("--no-results", action="store_true", help="do not append to perf/prefix_cache.jsonl")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from graphspec.models import load_model
    from perf.workloads import load_workloads

    def log(msg: str) -> None:
        print(msg, flush=True)

    machine = machine_info()
    model = (load_model(TARGET, weights=args.weights) if args.weights
             else load_model(TARGET, dtype=DTYPES[args.dtype]))
    base = {"target": TARGET, "dtype": args.weights or args.dtype, "threads": torch.get_num_threads(),
            **machine_fields(machine)}
    rows = [{"part": "prefill", **base, **prefill_cost(model, args.tokens, args.reps)}]
    log(f"prefill of {args.tokens} tokens: batched {rows[0]['batched_ms_per_token']:.2f} ms/token, row-exact "
        f"{rows[0]['exact_ms_per_token']:.2f} ({rows[0]['exact_over_batched']:.2f}x)")
    if not args.no_loop:
        prompts = encode_prompts(model.tokenizer, load_workloads([args.workload])[args.workload])
        r = loop(model, prompts, args.max_new_tokens, log)
        rows.append({"part": "loop", "workload": args.workload, **base, **r})
        log(f"{args.workload}: prefill {r['prefill_speedup']:.2f}x faster with the prefix cache, whole calls "
            f"{r['call_speedup']:.2f}x; outputs differing: {r['outputs_differing']}")
    if not args.no_results:
        with RESULTS_FILE.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
