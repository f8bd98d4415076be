"""End to end on real checkpoints: autoregressive vs speculative, graphspec vs transformers, one run.

    .venv/bin/python perf/e2e.py                 # full: 4 prompts x 128 tokens, bf16 and fp32
    .venv/bin/python perf/e2e.py --short         # 2 prompts (code, chat) x 48 tokens: minutes
    .venv/bin/python perf/e2e.py --dtypes bf16 --methods ar spec_0.5b --no-hf
    .venv/bin/python perf/e2e.py --dtypes bf16 --methods ar spec_0.5b --no-hf --llamacpp   # and llama.cpp
    .venv/bin/python perf/e2e.py --weights gguf-a8 --methods ar spec_0.5b --draft-quantize int4 --llamacpp

``--weights`` (also spelled ``--dtypes``) lists the target's weights, one pass each: ``bf16`` / ``fp32`` (the
converted checkpoints in that dtype) or the zoo's GGUF file in its own blocks (``gguf``: fp32 activations, the
GGUF's exact model; ``gguf-a8``: the k-quants on int8 activations, llama.cpp's arithmetic). With a GGUF target the
model drafts are ``--draft-quantize``'s int8 / int4 checkpoints (``none``: their own GGUF in blocks), transformers
loads the same GGUF files (it dequantizes them at load, to bf16), and llama.cpp runs the very same files.

Target Qwen2.5-Coder-1.5B-Instruct; drafts: Qwen2.5-Coder-0.5B-Instruct (same vocabulary),
SmolLM2-135M-Instruct (another tokenizer: graphspec's cross-vocabulary mapping), prompt lookup
("ngram"). Greedy, every run generates exactly ``--max-new-tokens`` (graphspec: ignore_eos;
transformers: min_new_tokens), so tokens/s compare like for like. transformers runs plain
``generate`` and assisted generation (``assistant_model=``; across tokenizers with
``tokenizer=``/``assistant_tokenizer=``) on the same prompt ids, dtype and thread count, in
this same process (its models are freed before graphspec's are loaded, to fit in memory).

Reported per method: tokens/s (wall time of the whole call, prefill included), the speedup
over graphspec's own autoregressive run and over transformers' assisted generation for the
same draft, acceptance rate, tokens per target forward, and whether the tokens equal the
autoregressive ones (required in fp32; bf16 reports how many prompts differ). Results:
perf/results/e2e[-short].json; one row per dtype and method is appended to the results table,
perf/results.csv (``--no-results-table``: not); the acceptance figures also go to perf/acceptance.json (used by
perf/gpu_check.py to project a GPU speedup).

``--llamacpp`` (optional; perf/llamacpp.py builds llama.cpp from the llama-cpp-python sdist on first
use, several minutes): after graphspec's runs, llama.cpp's plain decoding (llama-bench tg<N>) and its
speculative decoding (llama-speculative, the 0.5B draft, K = --k-model) on F16 weights, with the same
thread count, prompts and token count, and graphspec's ratios to them: our autoregressive / llama.cpp's
plain, our 0.5B methods / llama.cpp's speculative. Both sides' figures in those ratios are decode
tokens/s (tokens / seconds after the prompt): llama-bench has no prompt and llama-speculative prints
that figure. It runs minutes after graphspec's (not interleaved), so load drift enters the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import (CROSS_DRAFT, DRAFT, PERF_DIR, RESULTS_CSV, TARGET, append_results, load_prompts,  # noqa: E402
                          machine_info, output_path, read_bandwidth, save_json, step_weight_bytes,
                          transformers_from_gguf)

from graphspec.drafters import AUTO_DRAFT_SIBLINGS, AUTO_DRAFT_VOCAB  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# --weights: a dtype of the converted checkpoints, or a GGUF file's own blocks (load_model(weights=...)).
GGUF_WEIGHTS = ("gguf", "gguf-a8")
WEIGHTS = {**DTYPES, **{w: w for w in GGUF_WEIGHTS}}
@dataclasses.dataclass(frozen=True)
class Method:
    """One graphspec method of the benchmark: everything else about it (the method list, K defaults, the
    transformers peer, which models a run loads, the --k-* flag) is read from here."""

    draft: str | None  # DRAFT, CROSS_DRAFT, "ngram", or None (autoregressive)
    shape: str = "tree"  # model drafts: "tree" (draft_siblings as given), "chain" (none) or "beam"
    k: int | None = None  # default K
    k_flag: str | None = None  # the --k-* option that sets K
    peer: str = "hf_ar"  # the transformers method it is compared with


# spec_0.5b and spec_smollm2 draft trees (draft_siblings "auto", as the CLI); the *_chain methods are the same
# pairs as plain chains, so one run compares the two; spec_0.5b_beam and spec_smollm2_beam grow the draft's tree
# best first (Pipeline(draft_beam=BEAM_WIDTH)). Each K is the one the draft sweeps picked for that shape
# (perf/RESULTS.md): a tree fills up to K + 1 verify rows, so its K stops where a verify still costs about a
# one-token step; beams take a larger K, which pays where extra verify rows are cheap (AMX).
SPECS = {
    "ar": Method(None),
    "spec_0.5b": Method(DRAFT, "tree", 5, "k_model", "hf_assist_0.5b"),
    "spec_0.5b_chain": Method(DRAFT, "chain", 5, "k_model", "hf_assist_0.5b"),
    "spec_0.5b_beam": Method(DRAFT, "beam", 8, "k_model_beam", "hf_assist_0.5b"),
    "spec_smollm2": Method(CROSS_DRAFT, "tree", 5, "k_cross", "hf_assist_smollm2"),
    "spec_smollm2_chain": Method(CROSS_DRAFT, "chain", 4, "k_cross_chain", "hf_assist_smollm2"),
    "spec_smollm2_beam": Method(CROSS_DRAFT, "beam", 8, "k_cross_beam", "hf_assist_smollm2"),
    "ngram": Method("ngram", k=4, k_flag="k_ngram"),
}
METHODS = tuple(SPECS)
BEAM_WIDTH = 2
DEFAULT_K = {m: s.k for m, s in SPECS.items() if s.k is not None}  # perf/test_e2e.py runs these too
HF_DRAFT = {"hf_ar": None, "hf_assist_0.5b": DRAFT, "hf_assist_smollm2": CROSS_DRAFT}  # transformers' methods
HF_METHODS = tuple(HF_DRAFT)
METHOD_DRAFTS = {**{m: s.draft for m, s in SPECS.items()}, **HF_DRAFT}  # each method's draft, for the results table
# Every model draft's early-stop threshold, passed to Pipeline and recorded in the JSON (as the CLI: 0.4 for a
# draft with the target's tokenizer, 0.3 for one with another).
DRAFT_CONFIDENCE = "auto"
# Which transformers run each graphspec method is compared with.
HF_PEER = {m: s.peer for m, s in SPECS.items()}


def encode_prompts(tokenizer, prompts: list[dict]) -> list[list[int]]:
    out = []
    for p in prompts:
        if "messages" in p:
            text = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(p["prompt"]))
    return out


# ----------------------------------------------------------------------------------------------- runners
# Each runner loads what its method needs into ``pool`` (a dict the caller owns and clears to free
# memory: transformers' and graphspec's fp32 models do not fit together next to other work) and
# returns ``gen(ids, n) -> run dict`` with seconds, tokens, token_ids (and graphspec's stats).


def hf_runner(method: str, dtype, pool: dict):
    if method not in HF_DRAFT:
        raise ValueError(f"unknown transformers method {method!r}; one of {HF_METHODS}")
    import transformers
    from graphspec.models import zoo

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    gguf = dtype in GGUF_WEIGHTS

    def model(name):
        if ("hf", name) not in pool:
            if gguf:
                pool[("hf", name)] = transformers_from_gguf(name)
            else:
                d = zoo.resolve(name, progress=False)
                pool[("hf", name)] = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
        return pool[("hf", name)]

    def tokenizer(name):
        if ("hf-tok", name) not in pool:
            pool[("hf-tok", name)] = transformers.AutoTokenizer.from_pretrained(zoo.resolve(name, progress=False))
        return pool[("hf-tok", name)]

    target = model(TARGET)
    tok_t = tokenizer(TARGET)
    extra = {}
    if HF_DRAFT[method] is not None:
        extra = {"assistant_model": model(HF_DRAFT[method])}
        if HF_DRAFT[method] == CROSS_DRAFT:  # another tokenizer: transformers' universal assisted generation
            extra |= {"tokenizer": tok_t, "assistant_tokenizer": tokenizer(CROSS_DRAFT)}
    pad = tok_t.pad_token_id if tok_t.pad_token_id is not None else tok_t.eos_token_id

    def gen(ids, n):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=pad, **extra)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        return {"seconds": seconds, "tokens": len(new), "token_ids": new}

    return gen


def graphspec_runner(method: str, dtype, pool: dict, k: int | None = None, draft_quantize: str | None = None,
                     draft_vocab: int | str | None = None, draft_siblings: int | str = 0,
                     draft_length: str = "fixed"):
    spec = SPECS.get(method)
    if spec is None:
        raise ValueError(f"unknown graphspec method {method!r}; one of {METHODS}")
    import graphspec
    from graphspec.models import load_model

    def model(name, quantize=None):
        if ("gs", name, quantize) not in pool:
            if dtype not in GGUF_WEIGHTS:
                pool[("gs", name, quantize)] = load_model(name, dtype=dtype, quantize=quantize)
            elif quantize is None:  # the GGUF file in its own blocks
                pool[("gs", name, quantize)] = load_model(name, weights=dtype)
            else:  # an int8 / int4 draft beside a GGUF target: the converted checkpoint, quantized
                pool[("gs", name, quantize)] = load_model(name, quantize=quantize)
        return pool[("gs", name, quantize)]

    target = model(TARGET)
    if spec.draft is None:
        pipe = graphspec.Pipeline(target)
    elif spec.draft == "ngram":
        pipe = graphspec.Pipeline(target, draft="ngram", num_speculative_tokens=k)
    else:
        pipe = graphspec.Pipeline(target, draft=model(spec.draft, draft_quantize), num_speculative_tokens=k,
                                  draft_vocab=draft_vocab, draft_siblings=draft_siblings if spec.shape == "tree" else 0,
                                  draft_confidence_threshold=DRAFT_CONFIDENCE,
                                  draft_beam=BEAM_WIDTH if spec.shape == "beam" else 0,
                                  draft_length="fixed" if spec.shape == "beam" else draft_length)

    def gen(ids, n):
        t0 = time.perf_counter()
        out = pipe.run(ids, max_new_tokens=n, ignore_eos=True)
        seconds = time.perf_counter() - t0
        st = out.stats
        return {"seconds": seconds, "tokens": len(out.token_ids), "token_ids": list(out.token_ids),
                "steps": st.steps, "proposed": st.proposed, "accepted": st.accepted,
                "accepted_per_position": list(st.accepted_per_position),
                "proposed_per_position": list(st.proposed_per_position), "draft_forwards": st.draft_forwards,
                "decode_seconds": st.decode_seconds,
                "prefill_seconds": st.prefill_seconds, "stage_seconds": dict(st.stage_seconds),
                "tree": dict(st.tree) if st.tree else None}

    return gen


def run_interleaved(gens: dict, prompt_ids, max_new_tokens, log, failures: dict | None = None) -> dict:
    """Every method on prompt 1, then every method on prompt 2, ... (order rotated per prompt).

    The machine is shared: load drifts over minutes, so methods that ran minutes apart would not
    compare. Interleaving puts each method's prompts in the same stretches of time.

    A transformers method that raises (a peer's bug, not ours) is dropped from the run with its error
    logged and kept in ``failures``; graphspec's own methods raise as they are.
    """
    names = list(gens)

    def call(name, ids, n):
        if failures is None or name not in HF_METHODS:
            return gens[name](ids, n)
        try:
            return gens[name](ids, n)
        except Exception as e:  # noqa: BLE001 - the peer's failure is recorded, not ours to fix
            failures[name] = f"{type(e).__name__}: {e}"
            log(f"  {name} raised {failures[name]}; left out of this run")
            names.remove(name)
            return None

    for name in list(names):
        call(name, prompt_ids[0][:16], 4)  # warm-up: first-call allocations, oneDNN primitive creation
    runs: dict = {name: [] for name in names}
    for i, ids in enumerate(prompt_ids):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            r = call(name, ids, max_new_tokens)
            if r is None:
                runs.pop(name)
            else:
                runs[name].append(r)
        log(f"  prompt {i + 1}/{len(prompt_ids)}: " + ", ".join(
            f"{n} {runs[n][-1]['tokens'] / runs[n][-1]['seconds']:.2f}" for n in names) + " tok/s")
    return {name: _aggregate(r) for name, r in runs.items()}


def _model_bytes(name: str, dtype) -> int:
    from graphspec.models import zoo

    if dtype in GGUF_WEIGHTS:  # the larger side: transformers' bf16 dequantization of the file
        dtype = torch.bfloat16

    d = zoo.resolve(name, progress=False)
    size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    stored = json.loads((d / "config.json").read_text()).get("torch_dtype", "float32")
    per = 4 if stored == "float32" else 2
    return size * torch.empty(0, dtype=dtype).element_size() // per


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_dtype(dtype, methods, hf_methods, prompt_ids, max_new_tokens, ks: dict, log,
              draft_quantize: str | None = None, draft_vocab: int | str | None = None,
              draft_siblings: int | str = 0, draft_length: str = "fixed") -> tuple[dict, dict, dict]:
    """graphspec's and transformers' methods for one dtype; interleaved together when both fit in memory."""
    drafts = {SPECS[m].draft for m in methods} | {HF_DRAFT[m] for m in hf_methods}
    one_family = _model_bytes(TARGET, dtype) + sum(_model_bytes(n, dtype) for n in drafts & {DRAFT, CROSS_DRAFT})
    together = bool(hf_methods) and 2 * one_family < 0.75 * _available_bytes()
    log(f"  models of one family: {one_family / 1e9:.1f} GB; graphspec and transformers "
        f"{'interleaved in one pass' if together else 'in two passes (not enough memory for both)'}")
    pool: dict = {}
    ours_gens = {m: graphspec_runner(m, dtype, pool, ks.get(m), draft_quantize, draft_vocab, draft_siblings,
                                     draft_length) for m in methods}
    info = {"weight_bytes": step_weight_bytes(pool[("gs", TARGET, None)]), "interleaved_with_transformers": together,
            "draft_quantize": draft_quantize, "draft_vocab": draft_vocab, "draft_siblings": draft_siblings,
            "draft_length": draft_length,
            "draft_confidence_threshold": DRAFT_CONFIDENCE}
    hf_gens = {}
    failures: dict = {}
    if together:
        hf_gens = {m: hf_runner(m, dtype, pool) for m in hf_methods}
        res = run_interleaved({**hf_gens, **ours_gens}, prompt_ids, max_new_tokens, log, failures)
    else:
        res = run_interleaved(ours_gens, prompt_ids, max_new_tokens, log)
        ours_gens.clear()
        pool.clear()
        gc.collect()
        if hf_methods:
            hf_gens = {m: hf_runner(m, dtype, pool) for m in hf_methods}
            res.update(run_interleaved(hf_gens, prompt_ids, max_new_tokens, log, failures))
    info["transformers_failures"] = failures
    pool.clear()
    gc.collect()
    ours = {m: res[m] for m in methods}
    for m in methods:
        if m != "ar":
            ours[m]["num_speculative_tokens"] = ks[m]
    return ours, {m: res[m] for m in hf_methods if m in res}, info


def _aggregate(runs: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    out = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
           "per_prompt_tokens_per_second": [r["tokens"] / r["seconds"] for r in runs], "runs": runs}
    if "steps" in runs[0]:
        steps = sum(r["steps"] for r in runs)
        proposed = sum(r["proposed"] for r in runs)
        accepted = sum(r["accepted"] for r in runs)
        out["steps"] = steps
        out["acceptance_rate"] = accepted / proposed if proposed else 0.0
        out["tokens_per_target_forward"] = tokens / steps if steps else 0.0
        k = max(len(r["accepted_per_position"]) for r in runs)
        out["accepted_per_position"] = [sum(r["accepted_per_position"][i] for r in runs if i < len(r["accepted_per_position"])) for i in range(k)]
        out["proposed_per_position"] = [sum(r["proposed_per_position"][i] for r in runs if i < len(r["proposed_per_position"])) for i in range(k)]
        # the draft's forwards a verify step, its prefill forward included (it also drafts the first step)
        out["draft_forwards_per_step"] = sum(r["draft_forwards"] for r in runs) / steps if steps else 0.0
        out["decode_seconds"] = sum(r["decode_seconds"] for r in runs)
        stages: dict[str, float] = {}
        for r in runs:
            for name, s in r["stage_seconds"].items():
                stages[name] = stages.get(name, 0.0) + s
        out["stage_seconds"] = stages
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(results: dict, weight_bytes: int, bandwidth: float) -> dict:
    """Ratios, token identity with our autoregressive run, achieved GB/s of the plain step."""
    summary = {}
    ar = results.get("ar")
    hf = {m: results[m] for m in HF_METHODS if m in results}
    for method in METHODS:
        if method not in results:
            continue
        r = results[method]
        row = {"tokens_per_second": r["tokens_per_second"]}
        if ar is not None:
            row["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
            diffs = [_first_difference(a["token_ids"], b["token_ids"]) for a, b in zip(ar["runs"], r["runs"])]
            row["prompts_differing_from_ar"] = sum(d is not None for d in diffs)
            row["first_difference"] = diffs
        peer = HF_PEER[method]
        if peer in hf:
            row["hf_peer"] = peer
            row["speedup_vs_hf_peer"] = r["tokens_per_second"] / hf[peer]["tokens_per_second"]
        if "hf_ar" in hf:
            row["speedup_vs_hf_ar"] = r["tokens_per_second"] / hf["hf_ar"]["tokens_per_second"]
        for key in ("acceptance_rate", "tokens_per_target_forward", "num_speculative_tokens"):
            if key in r:
                row[key] = r[key]
        summary[method] = row
    for method, r in hf.items():
        row = {"tokens_per_second": r["tokens_per_second"]}
        if "hf_ar" in hf:
            row["speedup_vs_hf_ar"] = r["tokens_per_second"] / hf["hf_ar"]["tokens_per_second"]
        if ar is not None:
            diffs = [_first_difference(a["token_ids"], b["token_ids"]) for a, b in zip(ar["runs"], r["runs"])]
            row["prompts_differing_from_graphspec_ar"] = sum(d is not None for d in diffs)
        summary[method] = row
    if ar is not None:
        per_step = ar["decode_seconds"] / ar["steps"]
        summary["ar"]["step_ms"] = per_step * 1e3
        summary["ar"]["step_gbps"] = weight_bytes / per_step / 1e9
        summary["ar"]["step_fraction_of_bandwidth"] = weight_bytes / per_step / 1e9 / bandwidth
    return summary


def write_acceptance(report: dict) -> Path:
    """perf/acceptance.json: measured acceptance per draft pair and dtype (what gpu_check projects from)."""
    path = PERF_DIR / "acceptance.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["note"] = ("Greedy acceptance measured on CPU with real weights by perf/e2e.py (target "
                    f"{TARGET}); tokens_per_target_forward = generated tokens / target verify forwards; "
                    "draft_forwards_per_step = the draft's forwards (its prefill included) / target verify forwards.")
    pairs = data.setdefault("pairs", {})
    for dname, res in report["dtypes"].items():
        for method in (m for m in METHODS if m != "ar"):  # every speculative method
            r = res["graphspec"].get(method)
            old = pairs.get(f"{method}/{dname}", {})
            if r is None or old.get("prompts", 0) * old.get("max_new_tokens", 0) > (
                    report["num_prompts"] * report["max_new_tokens"]):
                continue  # keep the figure measured on more tokens
            pairs[f"{method}/{dname}"] = {
                "num_speculative_tokens": r["num_speculative_tokens"], "acceptance_rate": r["acceptance_rate"],
                "tokens_per_target_forward": r["tokens_per_target_forward"],
                "accepted_per_position": r["accepted_per_position"], "proposed_per_position": r["proposed_per_position"],
                "draft_forwards_per_step": r["draft_forwards_per_step"],
                "prompts": report["num_prompts"], "max_new_tokens": report["max_new_tokens"], "date": report["machine"]["date"]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


# our method -> the llama.cpp run it is compared with (every method with the 0.5B draft -> llama-speculative)
LLAMACPP_PEER = {"ar": "ar", **{m: "speculative" for m, s in SPECS.items() if s.draft == DRAFT}}


def _llamacpp_weights(dname: str) -> str:
    """Which files llama.cpp runs beside our ``dname`` weights: the zoo's GGUFs themselves beside a GGUF target,
    else their F16 requantization (2 bytes a weight, as bf16)."""
    return "zoo" if dname in GGUF_WEIGHTS else "f16"


def run_llamacpp(report: dict, prompts, tokenizer, max_new: int, k: int, log) -> None:
    """llama.cpp at this run's thread count, prompts and tokens (perf/llamacpp.py), on the files that match each of
    our weights (:func:`_llamacpp_weights`); our ratios to it, per weights."""
    from perf import llamacpp

    threads = torch.get_num_threads()
    report["llamacpp"] = {}
    for kind in dict.fromkeys(_llamacpp_weights(d) for d in report["dtypes"]):
        lc = llamacpp.run([threads], prompts, max_new, k=k, tokenizer=tokenizer, log=log, weights=kind)
        report["llamacpp"][kind] = lc
        theirs = lc["threads"][str(threads)]
        files = "F16" if kind == "f16" else "the zoo's GGUF files"
        log(f"  = llamacpp_ar          {theirs['ar']['tokens_per_second']:6.2f} tok/s  (llama-bench tg{max_new}, {files})")
        log(f"  = llamacpp_speculative {theirs['speculative']['tokens_per_second']:6.2f} tok/s  (llama-speculative "
            f"K={k}, {files})  acceptance_rate {theirs['speculative']['acceptance_rate']:.2f}")
    for dname, d in report["dtypes"].items():
        theirs = report["llamacpp"][_llamacpp_weights(dname)]["threads"][str(threads)]
        rows = {}
        for method, peer in LLAMACPP_PEER.items():
            r = d["graphspec"].get(method)
            if r is None or not r.get("decode_seconds"):
                continue
            ours = r["tokens"] / r["decode_seconds"]
            rows[method] = {"llamacpp_peer": peer, "decode_tokens_per_second": ours,
                            "llamacpp_tokens_per_second": theirs[peer]["tokens_per_second"],
                            "speedup_vs_llamacpp": ours / theirs[peer]["tokens_per_second"]}
            log(f"  = {dname} {method:15s} {ours:6.2f} decode tok/s  vs llamacpp_{peer}: "
                f"{rows[method]['speedup_vs_llamacpp']:.2f}x")
        d["vs_llamacpp"] = rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="2 prompts (code, chat) x 48 tokens")
    ap.add_argument("--dtypes", "--weights", dest="dtypes", nargs="+", default=["bf16", "fp32"], choices=list(WEIGHTS),
                    help="the target's weights, a pass each: bf16 / fp32 (the converted checkpoint in that dtype), "
                         "gguf / gguf-a8 (the zoo's GGUF in its own blocks: fp32 or int8 activations)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--hf-methods", nargs="+", default=list(HF_METHODS), choices=HF_METHODS)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None, help="use only the first N prompts")
    k = DEFAULT_K
    ap.add_argument("--k-model", type=int, default=k["spec_0.5b"], help="K for the 0.5B draft (tree and chain)")
    ap.add_argument("--k-model-beam", type=int, default=k["spec_0.5b_beam"], help="K for the 0.5B beam (spec_0.5b_beam)")
    ap.add_argument("--k-cross", type=int, default=k["spec_smollm2"], help="K for the SmolLM2 draft tree (spec_smollm2)")
    ap.add_argument("--k-cross-chain", type=int, default=k["spec_smollm2_chain"],
                    help="K for the SmolLM2 chain (spec_smollm2_chain)")
    ap.add_argument("--k-cross-beam", type=int, default=k["spec_smollm2_beam"],
                    help="K for the SmolLM2 beam (spec_smollm2_beam)")
    ap.add_argument("--draft-quantize", default="int8", choices=["int8", "int4", "none"],
                    help="graphspec's draft weights (default int8, as the CLI on a CPU; none: the dtype, or with a "
                         "GGUF target the draft's own GGUF in blocks); transformers' stay in the dtype")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="prune graphspec's model drafts to N ids (Pipeline(draft_vocab=N)); 0 keeps them whole; "
                         f"default: Pipeline(draft_vocab='auto') as the CLI ({AUTO_DRAFT_VOCAB} ids for int8 drafts)")
    ap.add_argument("--draft-siblings", type=int, default=None, metavar="N",
                    help="draft trees for spec_0.5b and spec_smollm2 (Pipeline(draft_siblings=N)); 0: chains; "
                         f"default: Pipeline(draft_siblings='auto') as the CLI ({AUTO_DRAFT_SIBLINGS}); the *_chain "
                         "methods always run chains")
    ap.add_argument("--draft-length", choices=("fixed", "auto"), default="fixed",
                    help="Pipeline(draft_length=...) for the model drafts' chains and trees (beams keep K): auto "
                         "drafts 1..K a step from the forward costs and the acceptance so far")
    ap.add_argument("--k-ngram", type=int, default=k["ngram"], help="K for prompt lookup")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="a .json file name (under perf/results/) or a path with a folder; "
                                                 "default e2e.json (e2e-short.json with --short)")
    ap.add_argument("--no-acceptance-file", action="store_true")
    ap.add_argument("--no-results-table", action="store_true",
                    help="do not append this run's rows to perf/results.csv (the results table)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="also run llama.cpp (F16; plain llama-bench and llama-speculative with the 0.5B draft) at the "
                         "same threads / prompts / tokens, and report our ratios to it (perf/llamacpp.py; the first "
                         "use builds llama.cpp: minutes)")
    args = ap.parse_args(argv)
    out = output_path(args.out or ("e2e-short.json" if args.short else "e2e.json"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.llamacpp:  # built, and its F16 weights made, before graphspec's runs: a failure shows in minutes, not after
        from perf import llamacpp

        for kind in dict.fromkeys(_llamacpp_weights(d) for d in args.dtypes):
            llamacpp.prepare(weights=kind)

    from graphspec.models import zoo
    from graphspec.models.tokenizer import Tokenizer

    if args.short:
        prompts = load_prompts(kinds=("code", "chat"), limit=args.prompts or 2)
        max_new = args.max_new_tokens or 48
    else:
        prompts = load_prompts(limit=args.prompts)
        max_new = args.max_new_tokens or 128
    tokenizer = Tokenizer.from_dir(zoo.resolve(TARGET, progress=False))
    prompt_ids = encode_prompts(tokenizer, prompts)

    def log(msg):
        print(msg, flush=True)

    report = {"machine": machine_info(), "target": TARGET, "num_prompts": len(prompts), "max_new_tokens": max_new,
              "prompt_kinds": [p["kind"] for p in prompts], "prompt_tokens": [len(p) for p in prompt_ids],
              "dtypes": {}}
    report["read_bandwidth"] = read_bandwidth()
    bw = report["read_bandwidth"]["gbps_median"]
    log(f"# {report['machine'].get('cpu_model')} x{report['machine']['cpu_count']}, threads "
        f"{torch.get_num_threads()}, load {report['machine'].get('loadavg')}, read bandwidth {bw:.1f} GB/s; "
        f"{len(prompts)} prompts x {max_new} tokens")
    for dname in args.dtypes:
        dtype = WEIGHTS[dname]
        log(f"[{dname}]")
        ks = {m: getattr(args, s.k_flag) for m, s in SPECS.items() if s.k_flag}
        ours, hf, info = run_dtype(dtype, args.methods, [] if args.no_hf else args.hf_methods, prompt_ids, max_new,
                                   ks, log, None if args.draft_quantize == "none" else args.draft_quantize,
                                   "auto" if args.draft_vocab is None else args.draft_vocab or None,
                                   "auto" if args.draft_siblings is None else args.draft_siblings, args.draft_length)
        summary = compare({**ours, **hf}, info["weight_bytes"], bw)
        report["dtypes"][dname] = {"graphspec": ours, "transformers": hf, "summary": summary, **info}
        for method, row in summary.items():
            extras = "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                               if k not in ("tokens_per_second", "first_difference", "hf_peer"))
            log(f"  = {method:18s} {row['tokens_per_second']:6.2f} tok/s  {extras}")
    if args.llamacpp:
        # graphspec's figures are written first, so a llama.cpp failure (it is one line and stops the run) loses
        # only llama.cpp's; the file is written again with them below.
        log(f"# wrote {save_json(out, report)} (graphspec's runs; llama.cpp next)")
        run_llamacpp(report, prompts, tokenizer, max_new, args.k_model, log)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    path = save_json(out, report)
    log(f"# wrote {path}")
    if not args.no_acceptance_file:
        log(f"# wrote {write_acceptance(report)}")
    if not args.no_results_table:
        log(f"# appended to {append_results(report, METHOD_DRAFTS, RESULTS_CSV)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
