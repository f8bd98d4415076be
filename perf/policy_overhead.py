"""What the speculation policy costs the engine per step when it drafts nothing, measured directly.

Two figures, both with the cost table a serve_bench run measured on the real pair (``--costs``, a serve_bench
JSON), at which the policy drafts nothing from 4 streams on:

- ``plan``: the policy's planning alone, as the engine does it per step for N running greedy sequences (their
  acceptance views, then ``plan``), and N times that: what a step cost when each of the N worker threads made
  its own plan for all N (the engine before 6795377, whose plan also lacked the ``may_draft`` bound).
- ``engine``: seconds per engine step of N streams on a tiny checkpoint pair (forwards of well under a
  millisecond, so the Python work of a step is most of it), plain (no draft) against the draft pipeline under the
  policy, rounds interleaved; the difference is the policy path's Python cost per step. With the real 1.5B
  target a step of 16 streams takes about 0.6 s.

    python perf/policy_overhead.py --costs perf/serve_bench-20261203-qwen0.5b-3.json --streams 16 --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))


def _costs(path: str):
    from graphspec.engine import CostTable

    table = json.loads(Path(path).read_text())["cost_table"]
    return CostTable(**{kind: {int(r): float(v) for r, v in t.items()} for kind, t in table.items()})


def time_plan(costs, n: int, k: int = 5, repeats: int = 300) -> dict:
    """Microseconds a step spends planning for n greedy sequences that have drafted (rates measured, draft
    behind): once for all (the engine now), and n times (each worker thread for itself, the engine before)."""
    from graphspec.engine import SequenceView, SpeculationPolicy

    policy = SpeculationPolicy(costs)
    acc, prop = [30, 26, 22, 18, 14], [40, 36, 30, 25, 20]

    def step():
        views = [SequenceView(policy.position_rates(acc, prop, 3), catch_up=40, remaining=100) for _ in range(n)]
        return policy.plan(k, views)

    ks = step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    once = (time.perf_counter() - t0) / repeats
    return {"streams": n, "ks": ks, "plan_once_us": 1e6 * once, "n_plans_us": 1e6 * once * n}


def tiny_pair(vocab_size: int | None = None):
    """The engine tests' tiny target and draft (tests/graphspec/conftest.py), written to a temporary folder;
    ``vocab_size``: their embedding padded to it (Qwen's 151936 makes the per-step work on logits real-sized)."""
    import contextlib
    import io

    import graphspec
    from tests.checkpoints import make_checkpoint

    root = Path(tempfile.mkdtemp(prefix="policy_overhead-"))
    with contextlib.redirect_stderr(io.StringIO()):
        t = make_checkpoint(root / "t", "qwen2", hidden_size=96, layers=2, heads=6, kv_heads=2, seed=0,
                            chat_template="chatml", vocab_size=vocab_size)
        d = make_checkpoint(root / "d", "qwen2", hidden_size=64, layers=1, heads=4, kv_heads=2, seed=1,
                            chat_template="chatml", vocab_size=vocab_size)
    return graphspec.load_model(t), graphspec.load_model(d)


def time_engine(costs, pair, n: int, tokens: int, rounds: int) -> dict:
    """Seconds per step of n streams, plain and under the policy, on tiny checkpoints; rounds interleaved."""
    import graphspec
    from graphspec.engine import Engine, SpeculationPolicy

    target, draft = pair
    pipes = {"plain": graphspec.Pipeline(target),
             "policy": graphspec.Pipeline(target, draft, num_speculative_tokens=5)}
    prompts = [f"prompt number {i} " * (1 + i % 4) for i in range(n)]
    per_step: dict[str, list[float]] = {name: [] for name in pipes}
    texts: dict[str, list] = {}
    proposed = 0
    for _ in range(rounds):
        for name, pipe in pipes.items():
            engine = Engine(pipe, max_batch=n, policy=SpeculationPolicy(costs) if name == "policy" else "off")
            t0 = time.perf_counter()
            out = engine.run_batch(prompts, max_new_tokens=tokens, ignore_eos=True)
            wall = time.perf_counter() - t0
            per_step[name].append(wall / tokens)  # one token per stream per step: neither drafts
            texts[name] = [r.token_ids for r in out]
            if name == "policy":
                proposed += sum(r.stats.proposed for r in out)
    med = {name: statistics.median(v) for name, v in per_step.items()}
    return {"streams": n, "tokens": tokens, "rounds": rounds, "policy_proposed": proposed,
            "same_tokens": texts["plain"] == texts["policy"],
            "step_ms": {name: [1e3 * x for x in v] for name, v in per_step.items()},
            "step_ms_median": {name: 1e3 * v for name, v in med.items()},
            "policy_minus_plain_ms": 1e3 * (med["policy"] - med["plain"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default=str(Path(__file__).resolve().parent / "serve_bench-20261203-qwen0.5b-3.json"))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=None, help="pad the tiny models' vocabulary to this (151936: Qwen's)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    costs = _costs(args.costs)
    print(f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for n in args.streams:
        p = time_plan(costs, n)
        print(f"N={n:<3} plan once {p['plan_once_us']:8.1f} us/step   N plans of this kind "
              f"{p['n_plans_us']:8.1f} us/step   ks {p['ks']}")
    pair = tiny_pair(args.vocab)
    for n in args.streams:
        e = time_engine(costs, pair, n, args.tokens, args.rounds)
        print(f"N={n:<3} engine step ms, median of {args.rounds}: plain {e['step_ms_median']['plain']:.2f}  "
              f"policy {e['step_ms_median']['policy']:.2f}  (policy - plain {e['policy_minus_plain_ms']:+.2f} ms; "
              f"proposed {e['policy_proposed']}, same tokens {e['same_tokens']})  "
              f"plain {['%.2f' % x for x in e['step_ms']['plain']]} policy {['%.2f' % x for x in e['step_ms']['policy']]}")
    print(f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
