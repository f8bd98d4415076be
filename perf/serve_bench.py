"""Serving under load: N concurrent streams against graphspec's server, with and without speculation.

For each configuration (``plain``: no draft; ``spec``: the draft, K every step; ``policy``: the draft with
the speculation policy, which picks each greedy request's draft length from its acceptance and the measured
cost of verify rows at the current batch size) a server runs in this process on 127.0.0.1, and an asyncio
load generator (the openai client) keeps N streams in flight for N in ``--concurrency``, each request 128 new
tokens of a held-out-style prompt (perf/prompts.json, cycled), greedy. Per N it reports output tokens per
second over the level's wall time, time to first token and time per output token (p50, p95), acceptance and
tokens per target forward, then whether every output equals the plain configuration's (it must: greedy). Each
configuration first runs its concurrency-1 requests through ``Pipeline.run`` alone, the figure serving at
concurrency 1 is compared with (``x_pipeline_run``). The configurations' servers run side by side and the levels
are interleaved (every configuration at N before any at the next N), so host drift falls on all alike; with
``--repeats R`` every level runs R rounds, each configuration once a round, and ``summary`` gives each cell's
median, min, max and spread over its rounds (the run-to-run noise) and its ratio to plain of the same round. Each
level records the 1-minute load average at its end and, over its own wall time, the CPU seconds this process used
(``own_cpu_s``) and those the rest of the host used (``others_cpu_s``, from /proc/stat; ``others_cores`` per second
of the cell): on a shared 2-core host the target's step time follows the others' load (perf/RESULTS.md), so a ratio
between two cells is read against the difference of their ``others_cores``. The report also has the policy's
measured cost table.

    python perf/serve_bench.py --threads 2                     # 1.5B target, 0.5B draft, N = 1 2 4 8 16
    python perf/serve_bench.py --draft smollm2-135m-instruct --concurrency 1 4 --max-tokens 64
    python perf/serve_bench.py --configs plain policy --repeats 3    # noise: three rounds of every cell
    python perf/serve_bench.py --concurrency 16 --alone 0           # no Pipeline.run baseline (16 requests alone)

Writes perf/results/serve_bench-<date>.json (``--out``) and a plot (``--plot``, default docs/img/serve.png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from perf._common import DRAFT, TARGET, load_prompts, machine_info, output_path, save_json  # noqa: E402

CONFIGS = ("plain", "spec", "policy")


def _cpu() -> tuple[float, float, float] | None:
    """(CPU seconds this process has used, busy CPU seconds of the whole host, wall clock), or None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            own = f.read()
        with open("/proc/stat") as f:
            host = [int(x) for x in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    fields = own[own.rindex(")") + 2:].split()
    busy = sum(host) - host[3] - host[4]
    return (int(fields[11]) + int(fields[12])) / hz, busy / hz, time.perf_counter()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _one(client, model: str, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    pieces, stats, usage = [], None, None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0.0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        extra = chunk.model_extra or {}
        if extra.get("graphspec"):
            stats = extra["graphspec"]
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter()
                pieces.append(choice.delta.content)
    end = time.perf_counter()
    n = usage.completion_tokens if usage is not None else 0
    return {"text": "".join(pieces), "tokens": n, "ttft": (first or end) - t0,
            "tpot": (end - first) / (n - 1) if first is not None and n > 1 else None, "stats": stats or {}}


async def _level(url: str, model: str, prompts: list, concurrency: int, requests: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    queue = list(range(requests))
    results: dict[int, dict] = {}

    async def worker():
        while queue:
            i = queue.pop(0)
            results[i] = await _one(client, model, prompts[i % len(prompts)], max_tokens)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    out = [results[i] for i in range(requests)]
    tokens = sum(r["tokens"] for r in out)
    proposed = sum(r["stats"].get("proposed_draft_tokens", 0) for r in out)
    accepted = sum(r["stats"].get("accepted_draft_tokens", 0) for r in out)
    forwards = sum(max(r["stats"].get("target_forwards", 1) - 1, 0) for r in out)
    ttft = [r["ttft"] for r in out]
    tpot = [r["tpot"] for r in out if r["tpot"] is not None]
    return {"concurrency": concurrency, "requests": requests, "seconds": wall, "output_tokens": tokens,
            "tokens_per_second": tokens / wall, "ttft_p50": _pct(ttft, 0.5), "ttft_p95": _pct(ttft, 0.95),
            "tpot_p50": _pct(tpot, 0.5), "tpot_p95": _pct(tpot, 0.95),
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_target_forward": tokens / forwards if forwards else None,
            "texts": [r["text"] for r in out]}


def _pipeline(config: str, target, draft, k: int):
    import graphspec

    if config == "plain":
        return graphspec.Pipeline(target)
    return graphspec.Pipeline(target, draft, num_speculative_tokens=k)


def summarize(report: dict) -> dict:
    """Per configuration and N: tokens/s of the repeated cells (median, min, max), their spread ((max - min) /
    median: the run-to-run noise), and the ratio to plain in the same round (median, min, max)."""
    out: dict = {}
    for config, levels in report["results"].items():
        for n in sorted({lv["concurrency"] for lv in levels}):
            cells = [lv for lv in levels if lv["concurrency"] == n]
            tps = [lv["tokens_per_second"] for lv in cells]
            med = statistics.median(tps)
            row = {"tokens_per_second_median": med, "min": min(tps), "max": max(tps), "cells": len(tps),
                   "spread": (max(tps) - min(tps)) / med if med else None,
                   "tpot_p50_median": statistics.median([lv["tpot_p50"] for lv in cells if lv["tpot_p50"]] or [0.0]),
                   "proposed_any": any(lv["acceptance"] is not None for lv in cells)}
            others = [lv["others_cores"] for lv in cells if "others_cores" in lv]
            if others:  # the rest of the host's load during the cells, in cores busy
                row["others_cores_median"] = statistics.median(others)
            xs = [lv["x_plain"] for lv in cells if "x_plain" in lv]
            if xs:
                row.update(x_plain_median=statistics.median(xs), x_plain_min=min(xs), x_plain_max=max(xs),
                           same_text_as_plain=all(lv["same_text_as_plain"] for lv in cells))
            out.setdefault(config, {})[str(n)] = row
    return out


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for config, cells in summarize(report).items():  # the median of repeated cells
        xs = sorted(cells, key=int)
        a.plot([int(n) for n in xs], [cells[n]["tokens_per_second_median"] for n in xs], marker="o", label=config)
        b.plot([int(n) for n in xs], [1000 * cells[n]["tpot_p50_median"] for n in xs], marker="o", label=config)
    for ax, title in ((a, "throughput (output tok/s)"), (b, "time per output token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    m = report["machine"]
    fig.suptitle(f"graphspec serve: {report['target']} + {report['draft']}, {m.get('cpu_model', '?')}, "
                 f"{report['threads']} thread(s), {report['dtype']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every level (their spread is the noise)")
    ap.add_argument("--alone", type=int, default=None,
                    help="requests run through Pipeline.run alone per configuration, the figure serving at "
                         "concurrency 1 is compared with (default: --requests or the lowest concurrency; 0: none)")
    ap.add_argument("--out", default=f"serve_bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parents[1] / "docs" / "img" / "serve.png"))
    args = ap.parse_args(argv)
    out = output_path(args.out)

    import torch

    import graphspec
    from graphspec.engine import Engine
    from graphspec.server import background

    torch.set_num_threads(args.threads)
    dtype = (torch.bfloat16 if args.dtype == "auto" and graphspec.kernels.cpu.bf16_linear() else
             torch.float32 if args.dtype in ("auto", "float32") else torch.bfloat16)
    print(f"loading {args.target} and {args.draft} ({dtype}, {args.threads} thread(s)) ...", file=sys.stderr)
    target = graphspec.load_model(args.target, dtype=dtype)
    draft = graphspec.load_model(args.draft, dtype=dtype, quantize="int8")
    prompts = [p["messages"] if "messages" in p else [{"role": "user", "content": p["prompt"]}]
               for p in load_prompts()]
    report = {"machine": machine_info(), "target": args.target, "draft": f"{args.draft} (int8)", "k": args.k,
              "dtype": str(dtype).replace("torch.", ""), "threads": args.threads, "max_tokens": args.max_tokens,
              "cpu_level": graphspec.kernels.cpu.level(), "results": {}}
    engines = {}
    for config in args.configs:
        pipe = _pipeline(config, target, draft, args.k)
        engine = Engine(pipe, max_batch=max(args.concurrency), max_queue=1024,
                        policy="auto" if config == "policy" else "off")
        if config == "policy":
            report["cost_table"] = dataclasses.asdict(engine.policy().costs)  # measured before the clock starts
        engines[config] = engine
        # the same requests through Pipeline.run, one after another: what serving at concurrency 1 is held to
        n_alone = args.alone if args.alone is not None else (args.requests or min(args.concurrency))
        report["results"][config] = []
        if n_alone <= 0:
            continue
        t0 = time.perf_counter()
        alone_tokens = sum(len(pipe.run(prompts[i % len(prompts)], max_new_tokens=args.max_tokens).token_ids)
                           for i in range(n_alone))
        alone = alone_tokens / (time.perf_counter() - t0)
        report.setdefault("pipeline_run", {})[config] = alone
        print(f"{config:>7} Pipeline.run {alone:7.2f} tok/s", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as servers:
        urls = {c: servers.enter_context(background(e, "bench")) for c, e in engines.items()}
        # Levels interleaved: every configuration at N before any at the next N (the order rotating with N), so
        # that a shared host's drift between levels falls on all configurations alike.
        # With --repeats R each level runs R times, every configuration once per round (the order rotating), so
        # that the spread of a configuration's repeated cells is the run-to-run noise its ratios are read against.
        turn = 0
        for n in args.concurrency:
            for rep in range(args.repeats):
                order = args.configs[turn % len(args.configs):] + args.configs[:turn % len(args.configs)]
                turn += 1
                for config in order:
                    cpu0 = _cpu()
                    lv = asyncio.run(_level(urls[config], "bench", prompts, n, args.requests or n, args.max_tokens))
                    cpu1 = _cpu()
                    lv["loadavg_1min"] = os.getloadavg()[0]
                    if cpu0 is not None and cpu1 is not None:
                        lv["own_cpu_s"] = cpu1[0] - cpu0[0]
                        lv["others_cpu_s"] = (cpu1[1] - cpu0[1]) - lv["own_cpu_s"]
                        lv["others_cores"] = lv["others_cpu_s"] / (cpu1[2] - cpu0[2])
                    lv["repeat"] = rep
                    report["results"][config].append(lv)
                    print(f"{config:>7} N={n:<3} #{rep} {lv['tokens_per_second']:7.2f} tok/s  ttft p50 "
                          f"{lv['ttft_p50']:.2f} s  tpot p50 {1000 * (lv['tpot_p50'] or 0):.0f} ms  acceptance "
                          f"{lv['acceptance']}  tokens/forward {lv['tokens_per_target_forward']}  "
                          f"load {lv['loadavg_1min']:.2f}  others' CPU {lv.get('others_cores', 0):.2f} cores",
                          file=sys.stderr, flush=True)
    for config, levels in report["results"].items():
        for lv in levels:
            if lv["concurrency"] == 1 and config in report.get("pipeline_run", {}):
                lv["x_pipeline_run"] = lv["tokens_per_second"] / report["pipeline_run"][config]
    base = {(lv["concurrency"], lv.get("repeat", 0)): lv for lv in report["results"].get("plain", [])}
    for config, levels in report["results"].items():
        for lv in levels:
            ref = base.get((lv["concurrency"], lv.get("repeat", 0)))
            if ref is not None:  # against plain in the same round
                lv["x_plain"] = lv["tokens_per_second"] / ref["tokens_per_second"]
                lv["same_text_as_plain"] = lv["texts"] == ref["texts"]
    report["summary"] = summarize(report)
    save_json(out, report)
    if args.plot:
        plot(report, Path(args.plot))
    print(f"wrote {out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    for config, cells in report["summary"].items():
        print(config, " ".join(
            f"N={n}:{c['tokens_per_second_median']:.2f}[{c['min']:.2f}-{c['max']:.2f}, spread {100 * c['spread']:.0f}%]"
            + (f"({c['x_plain_median']:.2f}x, {c['x_plain_min']:.2f}-{c['x_plain_max']:.2f})" if "x_plain_median" in c
               else "") for n, c in cells.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
