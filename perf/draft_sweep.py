"""Cheaper drafts: int8 weights and a pruned vocabulary against the plain draft, one interleaved run.

Target Qwen2.5-Coder-1.5B-Instruct on CPU; drafts Qwen2.5-Coder-0.5B-Instruct (K=5 by default) and
SmolLM2-135M-Instruct (K=4, across tokenizers), each as loaded (the dtype), with int8 weights
(``quantize="int8"``), and with int8 weights plus ``draft_vocab`` (the lowest ids plus special
tokens). Greedy, exactly N tokens per prompt; every prompt runs every method before the next one.
Prints tokens/s, the ratio to autoregressive, tokens per target forward, acceptance, the draft's
milliseconds per forward, and whether the tokens equal the autoregressive ones.

    .venv/bin/python perf/draft_sweep.py [--tokens 48] [--prompts 3] [--dtype bf16] [--threads 1]
        [--draft-k 5] [--cross-k 4] [--kinds plain int8 vocab] [--vocab 32768 16384] [--thresholds 0.4]
        [--siblings 0 2] [--cross-siblings 0 2] [--beams 2] [--cross-beams 2 3] [--no-model] [--no-cross]

``--draft-k`` / ``--cross-k`` take several values to sweep the speculation length of each draft,
``--thresholds`` several draft confidence thresholds (``none``: always draft K), ``--siblings``
several ``draft_siblings`` values for the 0.5B (draft trees) and ``--cross-siblings`` for SmolLM2 (trees
across tokenizers: each sibling's text re-tokenized), ``--beams`` / ``--cross-beams`` ``draft_beam`` widths for
the 0.5B / SmolLM2 as an int8 draft (draft beams; with the ``vocab`` kind also at each ``--vocab``). ``--no-model`` / ``--no-cross``
leave a draft out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from graphspec.cli import _confidence  # noqa: E402  (the CLI's --draft-confidence parser: P, auto or none)
from perf._common import CROSS_DRAFT, DRAFT, TARGET, load_prompts, machine_info  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 16384], help="draft_vocab values to try")
    ap.add_argument("--draft-k", type=int, nargs="+", default=[5], help=f"K values for {DRAFT}")
    ap.add_argument("--cross-k", type=int, nargs="+", default=[4], help=f"K values for {CROSS_DRAFT}")
    ap.add_argument("--thresholds", type=_confidence, nargs="+", default=["auto"],
                    help="draft confidence thresholds to try ('none' drafts K every step); default: 'auto', the "
                         "library's (0.4 with the target's tokenizer, 0.3 with another)")
    ap.add_argument("--siblings", type=int, nargs="+", default=[0],
                    help=f"draft_siblings values to try for {DRAFT} (0: a chain)")
    ap.add_argument("--cross-siblings", type=int, nargs="+", default=[0],
                    help=f"draft_siblings values to try for {CROSS_DRAFT} (0: a chain)")
    ap.add_argument("--beams", type=int, nargs="+", default=[],
                    help=f"draft_beam widths to try for {DRAFT} as an int8 draft (whole, and with each --vocab if "
                         "vocab is in --kinds), at each --draft-k and threshold (a tree grown best first; with "
                         "'auto' thresholds the beam's own 0.25)")
    ap.add_argument("--cross-beams", type=int, nargs="+", default=[],
                    help=f"draft_beam widths to try for {CROSS_DRAFT} as an int8 draft, at each --cross-k and "
                         "threshold (a tree grown best first; with 'auto' thresholds the beam's own 0.15)")
    ap.add_argument("--sibling-min-score", type=float, nargs="+", default=[None],
                    help="ModelDrafter.sibling_min_score values to try with siblings (default: the library's)")
    ap.add_argument("--model", action=argparse.BooleanOptionalAction, default=True,
                    help=f"run {DRAFT} (default on)")
    ap.add_argument("--cross", action=argparse.BooleanOptionalAction, default=True,
                    help=f"also run {CROSS_DRAFT} (default on)")
    ap.add_argument("--kinds", nargs="+", default=["plain", "int8", "vocab"], choices=["plain", "int8", "vocab"],
                    help="plain: the draft as loaded; int8: quantize='int8'; vocab: int8 plus each --vocab")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import graphspec

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    prompts = [p.get("messages") or p["prompt"] for p in load_prompts(limit=args.prompts)]
    target = graphspec.load_model(TARGET, dtype=dtype)
    methods = {"autoregressive": graphspec.Pipeline(target)}
    for name, ks in ((DRAFT, args.draft_k) if args.model else (None, ()),
                     (CROSS_DRAFT, args.cross_k) if args.cross else (None, ())):
        if name is None:
            continue
        short = name.split("-instruct")[0]
        plain = graphspec.load_model(name, dtype=dtype) if "plain" in args.kinds else None
        int8 = graphspec.load_model(name, dtype=dtype, quantize="int8") if {"int8", "vocab"} & set(args.kinds) else None
        for k in ks:
            sibs = [(s, m) for s in (args.siblings if name == DRAFT else args.cross_siblings)
                    for m in (args.sibling_min_score if s else [None])]
            for th, (sib, min_score) in ((th, sm) for th in args.thresholds for sm in sibs):
                tag = f"{short} K={k}" + (f" th={th}" if len(args.thresholds) > 1 else "") + (
                    f" sib={sib}" if sib else "") + (f" min={min_score}" if min_score is not None else "")
                # draft_vocab=None: the "vocab" kind alone prunes (Pipeline's own default would prune an int8 draft)
                kw = {"draft_confidence_threshold": th, "draft_siblings": sib, "draft_vocab": None}
                if plain is not None:
                    methods[f"{tag} {args.dtype}"] = graphspec.Pipeline(target, plain, k, **kw)
                if "int8" in args.kinds:
                    methods[f"{tag} int8"] = graphspec.Pipeline(target, int8, k, **kw)
                for n in args.vocab if "vocab" in args.kinds else ():
                    if n < int8.config.vocab_size:
                        methods[f"{tag} int8 vocab {n}"] = graphspec.Pipeline(target, int8, k, **{**kw, "draft_vocab": n})
                if min_score is not None:
                    for pname, pipe in methods.items():
                        if pname.startswith(tag + " ") or pname == tag:
                            pipe.graph["draft"].sibling_min_score = min_score
            if int8 is not None:  # draft beams (int8 only)
                for th, w in ((th, w) for th in args.thresholds
                              for w in (args.cross_beams if name == CROSS_DRAFT else args.beams) if w):
                    tag = f"{short} K={k}" + (f" th={th}" if len(args.thresholds) > 1 else "") + f" beam={w}"
                    methods[f"{tag} int8"] = graphspec.Pipeline(target, int8, k, draft_beam=w,
                                                                draft_confidence_threshold=th, draft_siblings=0,
                                                                draft_vocab=None)
                    for n in args.vocab if "vocab" in args.kinds else ():
                        if n < int8.config.vocab_size:
                            methods[f"{tag} int8 vocab {n}"] = graphspec.Pipeline(
                                target, int8, k, draft_beam=w, draft_confidence_threshold=th, draft_vocab=n,
                                draft_siblings=0)
    print(f"# {machine_info()}", flush=True)
    for pipe in methods.values():  # warm-up
        pipe.run(prompts[0], max_new_tokens=3)
    totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "proposed": 0, "accepted": 0, "draft_s": 0.0,
                     "draft_forwards": 0, "same": 0, "sib_proposed": 0, "sib_accepted": 0, "verify_s": 0.0}
              for name in methods}
    for i, prompt in enumerate(prompts):
        ref = None
        for name, pipe in methods.items():
            t0 = time.perf_counter()
            out = pipe.run(prompt, max_new_tokens=args.tokens, ignore_eos=True)
            t, s = totals[name], out.stats
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += len(out.token_ids)
            t["steps"] += s.steps
            t["proposed"] += s.proposed
            t["accepted"] += s.accepted
            t["draft_s"] += s.stage_seconds.get("draft", 0.0)
            t["draft_forwards"] += s.draft_forwards
            t["verify_s"] += s.stage_seconds.get("verify", 0.0)
            if s.tree:
                t["sib_proposed"] += s.tree["siblings_proposed"]
                t["sib_accepted"] += s.tree["siblings_accepted"]
            ref = out.token_ids if ref is None else ref
            t["same"] += out.token_ids == ref
        print(f"  prompt {i + 1}/{len(prompts)} done", flush=True)
    base = totals["autoregressive"]["tokens"] / totals["autoregressive"]["seconds"]
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        draft_ms = 1e3 * t["draft_s"] / t["draft_forwards"] if t["draft_forwards"] else 0.0
        acc = t["accepted"] / t["proposed"] if t["proposed"] else 0.0
        print(f"{name:52s} {rate:6.2f} tok/s  x{rate / base:.2f}  tokens/forward {t['tokens'] / t['steps']:.2f}  "
              f"acceptance {acc:.2f}  draft {draft_ms:5.1f} ms/forward, {t['draft_forwards'] / t['steps']:.2f} a step  "
              f"verify {1e3 * t['verify_s'] / t['steps']:5.1f} ms  "
              f"same as AR {t['same']}/{len(prompts)}"
              + (f"  siblings {t['sib_accepted']}/{t['sib_proposed']} taken" if t["sib_proposed"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
