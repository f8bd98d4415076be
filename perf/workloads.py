"""Suffix drafting on repetitive workloads: prompt lookup, suffix, a model draft and the hybrid, interleaved.

    .venv/bin/python perf/workloads.py --threads 1                       # every workload, every method
    .venv/bin/python perf/workloads.py --threads 1 --workloads code_edit --max-new-tokens 64
    .venv/bin/python perf/workloads.py --threads 1 --workloads agentic --prefix-cache --live-history
    .venv/bin/python perf/workloads.py --replay perf/results/workloads-outputs.json   # suffix settings, no model
    .venv/bin/python perf/workloads.py --store-cost                      # store memory and update cost
    .venv/bin/python perf/workloads.py --replay-hybrid perf/results/workloads-outputs.json --threads 1

Workloads (perf/workloads.json): code_edit, agentic, doc_qa, and code_chat_prose (perf/prompts.json).
Each workload's requests run in order through one pipeline per method (so the suffix store learns
across them, as in a server); request i runs every method before request i + 1 (order rotated),
so load drift on a shared machine hits all methods alike. Target Qwen2.5-Coder-1.5B-Instruct
(greedy, each request stops at EOS or --max-new-tokens: 1024 by default, past the end of every code editing,
agent loop and document QA answer, so a code edit restates its whole file; every method must give the
autoregressive tokens); model draft Qwen2.5-Coder-0.5B-Instruct with int8 weights and the library's defaults.
Reported per workload and method: tokens per target forward (generated tokens / verify steps) and
x our autoregressive (its seconds / the method's, prefill included, and after the prompt only). One
JSON line per workload and method is appended to perf/workloads.jsonl, with the machine.

``--prefix-cache`` gives every method's pipeline (the baseline's too) a prefix cache (docs/prefix-cache.md);
``--live-history`` puts the model's own answers into the agent loop's history in place of the workload's fixed
ones, as a live loop would send them (``live_messages``).

``--save-outputs`` keeps the autoregressive outputs; ``--replay`` feeds them to a ``SuffixDrafter`` with
no model at all (greedy acceptance is known from the target's own output: a proposal's accepted length is
how far it agrees with it), which is how the suffix settings were chosen. ``--store-cost`` builds a store
over this repository's own source and docs in the target's tokens: bytes per stored token and
microseconds per appended token.

``--replay-hybrid`` is how the hybrid's rule was studied: on the saved greedy outputs, at every output
position, the suffix tree (its score, the tokens the target would take) and the model draft's tree (the
tokens taken, its draft forwards; the 0.5B int8 draft, no target); then it replays whole requests under
each rule offline and prints tokens per target forward and tokens per unit of time, the unit a verify
and a draft forward ``--draft-cost`` of one, the draft's prefills included (a token of them costs
``--prefill-cost`` draft forwards, by default measured as the hybrid measures it).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from perf._common import DRAFT, PERF_DIR, TARGET, load_prompts, machine_fields, machine_info  # noqa: E402
from perf.e2e import DTYPES, encode_prompts  # noqa: E402

WORKLOADS_FILE = PERF_DIR / "workloads.json"
RESULTS_FILE = PERF_DIR / "workloads.jsonl"
METHODS = ("ar", "ngram", "suffix", "suffix_auto", "model", "hybrid", "hybrid_auto")
# K per method: prompt lookup as perf/e2e.py; the others at the library's default, 6 verify rows, past which a
# verify of the 1.5B costs clearly more than a one-token step on the CPU (perf/cpu_step.py).
# suffix_auto and hybrid_auto (draft_length="auto") propose suffix trees of up to K = 16 where the timed verify costs
# say they pay (the hybrid's model steps keep K = 5).
K = {"ngram": 4, "suffix": 5, "suffix_auto": 16, "model": 5, "hybrid": 5, "hybrid_auto": 16}


def load_workloads(names=None) -> dict[str, list[dict]]:
    data = json.loads(WORKLOADS_FILE.read_text())["workloads"]
    data["code_chat_prose"] = load_prompts()
    if names:
        unknown = [n for n in names if n not in data]
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}; one of {sorted(data)}")
        data = {n: data[n] for n in names}
    return data


def make_pipelines(target, draft, methods, ks, prefix_cache: bool = False) -> dict:
    import graphspec

    out = {}
    pc = dict(prefix_cache=prefix_cache)  # --prefix-cache: every pipeline, the baseline too
    for m in methods:
        if m == "ar":
            out[m] = graphspec.Pipeline(target, **pc)
        elif m == "ngram":
            out[m] = graphspec.Pipeline(target, **pc, draft="ngram", num_speculative_tokens=ks[m])
        elif m == "suffix":
            out[m] = graphspec.Pipeline(target, **pc, draft="suffix", num_speculative_tokens=ks[m])
        elif m == "suffix_auto":
            out[m] = graphspec.Pipeline(target, **pc, draft="suffix", num_speculative_tokens=ks[m], draft_length="auto")
        elif m == "model":
            out[m] = graphspec.Pipeline(target, **pc, draft=draft, num_speculative_tokens=ks[m], draft_siblings="auto",
                                        draft_vocab="auto")
        elif m == "hybrid":
            out[m] = graphspec.Pipeline(target, **pc, draft=[draft, "suffix"], num_speculative_tokens=ks[m],
                                        draft_vocab="auto")
            out[m].graph["draft"].model_k = ks["model"]
        elif m == "hybrid_auto":
            out[m] = graphspec.Pipeline(target, **pc, draft=[draft, "suffix"], num_speculative_tokens=ks[m],
                                        draft_vocab="auto", draft_length="auto")
            out[m].graph["draft"].model_k = ks["model"]
        else:
            raise SystemExit(f"unknown method {m!r}; one of {METHODS}")
    return out


def live_messages(items: list[dict], answers: list[str]) -> list[dict]:
    """Request ``len(answers)``'s messages with the assistant turns of the requests before it replaced by what the
    model answered them (``answers``), as a live agent loop sends its history; fixed turns otherwise. Request i's
    messages must begin with request i - 1's, then that request's assistant turn."""
    i = len(answers)
    if i == 0:
        return items[0]["messages"]
    prev, cur = items[i - 1]["messages"], items[i]["messages"]
    if cur[:len(prev)] != prev or len(cur) <= len(prev) or cur[len(prev)]["role"] != "assistant":
        raise SystemExit(f"--live-history: request {i + 1} does not carry request {i}'s messages and then its "
                         f"assistant turn; use it on a workload whose requests each extend the last (agentic)")
    return live_messages(items, answers[:-1]) + [{"role": "assistant", "content": answers[-1]}] + cur[len(prev) + 1:]


def run_workload(pipes: dict, prompts: list[list[int]], max_new: int, log, live=None) -> dict:
    """``live``: ``(tokenizer, items)``: each request's history holds the answers given to the ones before it
    (``live_messages``), encoded once the previous request has run (every method gives the same answer)."""
    names = list(pipes)
    answers: list[str] = []
    if live is not None:
        tokenizer, items = live
        prompts = [None] * len(items)
    runs = {n: {"tokens": 0, "steps": 0, "seconds": 0.0, "decode_seconds": 0.0, "proposed": 0, "accepted": 0,
                "draft_forwards": 0, "differ": 0, "cached_prompt_tokens": 0, "prompt_tokens": 0} for n in names}
    outputs = []
    for i, ids in enumerate(prompts):
        if live is not None:
            ids = prompts[i] = encode_prompts(tokenizer, [{"messages": live_messages(items, answers)}])[0]
        order = names[i % len(names):] + names[:i % len(names)]
        got = {}
        texts = {}
        for n in order:
            t0 = time.perf_counter()
            out = pipes[n].run(ids, max_new_tokens=max_new)
            dt = time.perf_counter() - t0
            got[n] = out.token_ids
            texts[n] = out.text
            r = runs[n]
            r["tokens"] += len(out.token_ids)
            r["steps"] += out.stats.steps
            r["seconds"] += dt
            r["decode_seconds"] += out.stats.decode_seconds
            r["proposed"] += out.stats.proposed
            r["accepted"] += out.stats.accepted
            r["draft_forwards"] += out.stats.draft_forwards
            r["cached_prompt_tokens"] += out.stats.cached_prompt_tokens
            r["prompt_tokens"] += out.stats.prompt_tokens
        ref = got.get("ar")
        for n in names:
            if ref is not None and got[n] != ref:
                runs[n]["differ"] += 1
        outputs.append({"prompt": ids, "output": ref if ref is not None else got[names[0]]})
        answers.append(texts.get("ar", texts[names[0]]))
        log(f"    request {i + 1}/{len(prompts)}: {len(got[names[0]])} tokens; " + ", ".join(
            f"{n} {runs[n]['tokens'] / runs[n]['seconds']:.2f} tok/s" for n in names) + " so far")
    for name in ("hybrid", "hybrid_auto"):  # the figures its rule ran with (draft_cost and prefill_cost: measured)
        if name not in pipes:
            continue
        from graphspec.suffix import measure_draft_cost

        pipe = pipes[name]
        h = pipe.graph["draft"]
        runs[name]["hybrid"] = {
            "draft_cost": h.draft_cost if h.draft_cost is not None else measure_draft_cost(
                h.model_drafter, pipe.target, h._model_rows(pipe.num_speculative_tokens)),
            "prefill_cost": h.prefill_cost, "model_share": h.model_share(), **h.measured}
    return {"runs": runs, "outputs": outputs}


def report(workload: str, runs: dict, machine: dict, args) -> list[dict]:
    ar = runs.get("ar")
    rows = []
    for n, r in runs.items():
        row = {"workload": workload, "method": n, "k": K.get(n), "tokens": r["tokens"], "steps": r["steps"],
               "tokens_per_target_forward": r["tokens"] / r["steps"] if r["steps"] else 0.0,
               "tok_s": r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
               "x_autoregressive": (ar["seconds"] / r["seconds"]) if ar and r["seconds"] else None,
               # after the prompt: long prompts with short answers (the agent loop) are mostly prefill otherwise
               "x_autoregressive_decode": (ar["decode_seconds"] / r["decode_seconds"])
               if ar and r.get("decode_seconds") else None,
               "acceptance": r["accepted"] / r["proposed"] if r["proposed"] else 0.0,
               "draft_forwards": r["draft_forwards"], "prompts_differing_from_ar": r["differ"],
               "max_new_tokens": args.max_new_tokens, "dtype": args.weights or args.dtype,
               # Pipeline(prefix_cache=True) for every method, the autoregressive baseline included
               "prefix_cache": bool(args.prefix_cache), "live_history": bool(args.live_history),
               "prompt_tokens": r["prompt_tokens"],
               "cached_prompt_tokens": r["cached_prompt_tokens"],
               "threads": torch.get_num_threads(), **machine_fields(machine)}
        if "hybrid" in r:
            row["hybrid"] = r["hybrid"]
        rows.append(row)
    return rows


def replay(path: Path, settings: list[dict], k: int) -> list[dict]:
    """Tokens per target forward of a SuffixDrafter on saved greedy outputs, no model (see the module docstring)."""
    from graphspec.state import RunInfo, SamplingParams, State
    from graphspec.suffix import SuffixDrafter

    data = json.loads(path.read_text())
    results = []
    for s in settings:
        row = {"settings": s, "k": k, "workloads": {}}
        for wl, reqs in data["workloads"].items():
            drafter = SuffixDrafter(**s)
            tokens = steps = rows = 0
            for req in reqs:
                prompt, out = req["prompt"], req["output"]
                run = RunInfo(target=None, vocab_size=1 << 20, device=torch.device("cpu"),
                              capacity=len(prompt) + len(out), prompt_len=len(prompt), num_speculative_tokens=k)
                state = State(run)
                state.tokens = list(prompt)
                state.params = SamplingParams()
                state.generator = torch.Generator()
                drafter.begin(state)
                done = 0
                while done < len(out):
                    toks, parents, _, _, _ = drafter.propose(state, min(k, len(out) - done - 1))
                    rows += len(toks)
                    cur, got = -1, 0
                    for t in out[done:]:
                        nxt = [i for i, (a, p) in enumerate(zip(toks, parents)) if p == cur and a == t]
                        if not nxt:
                            break
                        cur, got = nxt[0], got + 1
                    take = min(got + 1, len(out) - done)
                    state.tokens.extend(out[done:done + take])
                    done += take
                    steps += 1
                tokens += len(out)
                drafter.end(state)
            row["workloads"][wl] = (tokens / steps if steps else 0.0, rows / steps if steps else 0.0)
        results.append(row)
    return results


def _taken(ids: list[int], parents: list[int], out: list[int], root: int) -> int:
    """How many of ``out`` a greedy target takes from a proposal tree (``parents``: ``root`` for the root)."""
    cur, got = root, 0
    for t in out:
        nxt = [i for i, (a, p) in enumerate(zip(ids, parents)) if p == cur and a == t]
        if not nxt:
            break
        cur, got = nxt[0] + (1 if root == 0 else 0), got + 1
    return got


def hybrid_positions(path: Path, draft, k: int) -> dict:
    """Per workload, request and output position: (suffix score, suffix tree size, suffix tokens taken, model
    tree tokens taken, model draft forwards, model chain tokens taken)."""
    from graphspec.defaults import AUTO_DRAFT_SIBLINGS, SAME_VOCAB_CONFIDENCE
    from graphspec.drafters import ModelDrafter
    from graphspec.state import RunInfo, SamplingParams, State
    from graphspec.suffix import SuffixDrafter

    data = json.loads(path.read_text())
    model = ModelDrafter(draft, draft_vocab="auto", siblings=AUTO_DRAFT_SIBLINGS,
                          confidence_threshold=SAME_VOCAB_CONFIDENCE)
    out_all = {}
    for wl, reqs in data["workloads"].items():
        suffix = SuffixDrafter()
        rows = []
        for req in reqs:
            prompt, out = req["prompt"], req["output"]
            run = RunInfo(target=None, vocab_size=draft.config.vocab_size, device=torch.device("cpu"),
                          capacity=len(prompt) + len(out) + k + 2, prompt_len=len(prompt), num_speculative_tokens=k)
            state = State(run)
            state.params = SamplingParams()
            state.generator = torch.Generator()
            state.token_buffer = torch.tensor(prompt + out + [0] * (k + 2), dtype=torch.int64)
            state.tokens = list(prompt) + out[:1]
            suffix.begin(state)
            model.begin(state)
            steps = {}
            for p in range(1, len(out)):  # the first output token comes from the prefill
                state.tokens = list(prompt) + out[:p]
                rest = out[p:]
                state.num_draft = n = min(k, len(rest))
                toks, parents, scores, _, _ = suffix.propose(state, n)
                f0 = run.draft_forwards
                model.run(state)
                ids, tree = state.draft_ids[0].tolist(), list(state.draft_parents)
                chain = sum(1 for i, q in enumerate(tree) if q == i)  # the chain's rows come first
                steps[p] = (sum(scores), len(toks), _taken(toks, parents, rest, -1), _taken(ids, tree, rest, 0),
                            run.draft_forwards - f0, _taken(ids[:chain], tree[:chain], rest, 0))
            state.tokens = list(prompt) + out
            suffix.end(state)
            rows.append({"n": len(out), "prompt_len": len(prompt), "steps": steps})
        out_all[wl] = rows
    return out_all


def _previous_hybrid_rule(score, request) -> bool:
    """The hybrid's rule before 2026-12-03: suffix when c * s >= 0.7 * m, per request (m: 1 before any), with a
    chain for the model draft."""
    c = request["suffix_accepted"] / request["suffix_score"] if request["suffix_score"] > 0 else 1.0
    m = request["model_tokens"] / request["model_steps"] if request["model_steps"] else 1.0
    return c * score >= 0.7 * m


def replay_hybrid(positions: dict, rule: str, draft_cost: float, k: int, prefill_cost: float = 0.0,
                  max_new: int = 96) -> dict:
    """Whole requests replayed under a rule: per workload (tokens per target forward, tokens per unit of time,
    suffix steps, model steps, plain steps); the unit is a verify, a draft forward costs ``draft_cost`` of one and a
    token of the draft's prefill ``prefill_cost`` draft forwards. The model draft's prefills are paid as the
    library pays them: the prompt at the start for ``model``; for the hybrids, the committed tokens its cache
    lacks (two or more) before each model step. ``hybrid`` is the rule without that cost in it (until
    2026-12-03, 12:00 UTC); ``catch-up/all`` the rule with it spread over every token left to the request
    (until 2026-12-03, 14:45 UTC; it may also take plain steps); ``catch-up/share`` the library's rule until
    2026-12-04: spread over the tokens left times the share of the committed tokens that model steps produced so
    far over the drafter's life (``HybridDrafter.model_share()``, prior 1/2 of 6 tokens); ``catch-up/request`` the
    library's rule since: the share counts this request's steps only (``HybridDrafter.model_share(state)``, prior
    1/2 of 6 tokens)."""
    from graphspec.suffix import HybridDrafter

    res = {}
    for wl, reqs in positions.items():
        hybrid = HybridDrafter.__new__(HybridDrafter)  # only its rule and measurements: no model needed
        hybrid.switch, hybrid.draft_cost, hybrid.prior_model = 1.0, draft_cost, 3.0
        hybrid.prefill_cost = prefill_cost
        hybrid.measured = {"suffix_score": 0.0, "suffix_accepted": 0, "model_steps": 0, "model_tokens": 0,
                           "model_forwards": 0, "step_tokens": 0}
        share = 1.0 if rule == "catch-up/all" else None  # None: the library's model_share()
        tokens = steps = forwards = n_suffix = n_model = n_plain = prefilled = 0
        for req in reqs:
            request = dict.fromkeys(hybrid.measured, 0)
            request_tokens = 0
            pos, n = 1, req["n"]
            plen = req.get("prompt_len", 0)
            fed = plen if rule == "model" else 0  # tokens in the draft's cache
            prefilled += fed
            while pos < n:
                score, ntoks, s_got, m_got, fw, chain_got = req["steps"][pos]
                behind = plen + pos - 1 - fed  # the committed tokens but the pending one, less those fed
                behind = behind if behind >= 2 else 0
                remaining = max_new - pos
                if rule == "catch-up/request":
                    share = (request["model_tokens"] + 3) / (request_tokens + 6)
                if rule == "previous":  # its model draft was a chain
                    m_got = chain_got
                if rule == "suffix":
                    kind = "suffix" if ntoks else "plain"
                elif rule == "model":
                    kind = "model"
                elif rule == "previous":
                    kind = "suffix" if ntoks and _previous_hybrid_rule(score, request) else "model"
                elif rule == "hybrid":
                    kind = "suffix" if ntoks and hybrid.prefers_suffix(score, k) else "model"
                else:
                    kind = ("suffix" if ntoks and hybrid.prefers_suffix(score, k, behind, remaining, share=share) else
                            "plain" if not ntoks and hybrid.model_rate(k, behind, remaining, share=share) < 1.0
                            else "model")
                got = {"suffix": s_got, "model": m_got, "plain": 0}[kind]
                if kind == "model" and rule != "model":
                    prefilled += behind
                    fed = plen + pos + got - 1  # all but the newest committed token or two: in step
                for m in (hybrid.measured, request):
                    if kind == "suffix" or ntoks and m is hybrid.measured and rule in (
                            "hybrid", "catch-up/all", "catch-up/share", "catch-up/request"):
                        # the hybrid checks every step's tree against the committed tokens (after a model step,
                        # got + 1 of them); the previous rule counted proposed trees only
                        m["suffix_score"] += score
                        m["suffix_accepted"] += s_got if kind == "suffix" else min(s_got, got + 1)
                    if kind == "model":
                        m["model_steps"] += 1
                        m["model_tokens"] += got + 1
                        m["model_forwards"] += fw
                hybrid.measured["step_tokens"] += got + 1
                request_tokens += got + 1
                n_suffix += kind == "suffix"
                n_model += kind == "model"
                n_plain += kind == "plain"
                forwards += fw if kind == "model" else 0
                pos += got + 1
                steps += 1
            tokens += n - 1
        time_units = steps + draft_cost * (forwards + prefill_cost * prefilled)
        res[wl] = (tokens / steps if steps else 0.0, tokens / time_units if steps else 0.0, n_suffix, n_model,
                   n_plain)
    return res


def store_cost(tokenizer, limit: int) -> dict:
    """Bytes per stored token and microseconds per appended token of a SuffixStore over this repository's text."""
    from graphspec.suffix import SuffixStore

    root = Path(__file__).resolve().parent.parent
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".md", ".cpp", ".h", ".json", ".toml")
                   and ".venv" not in p.parts and ".git" not in p.parts and p.is_file())
    docs, total = [], 0
    for p in files:
        ids = tokenizer.encode(p.read_text(errors="replace"))
        docs.append(ids)
        total += len(ids)
        if total >= limit:
            break
    store = SuffixStore(max_tokens=total + len(docs) + 1)
    gc.collect()
    t0 = time.perf_counter()
    for d in docs:
        store.add(d)
    seconds = time.perf_counter() - t0
    nbytes = store.automaton.nbytes()
    return {"tokens": total, "documents": len(docs), "states": store.automaton.num_states,
            "bytes_per_token": nbytes / total, "mb_per_1m_tokens": nbytes / total * 1e6 / 2 ** 20,
            "update_us_per_token": seconds / total * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="*", default=None, help="code_edit agentic doc_qa code_chat_prose")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--max-new-tokens", type=int, default=1024,
                    help="a request stops at EOS or here (default 1024: past the end of every code editing, agent "
                         "loop and document QA answer; a smaller cap cuts the answers short, and the prompts' "
                         "prefill then weighs more in every whole-call ratio)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--weights", default=None, choices=["gguf", "gguf-a8"],
                    help="the target's zoo GGUF in its own blocks (fp32 / int8 activations) instead of the "
                         "converted checkpoint in --dtype; the model draft stays the int8 checkpoint")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k-suffix", type=int, default=K["suffix"])
    ap.add_argument("--k-suffix-auto", type=int, default=K["suffix_auto"])
    ap.add_argument("--save-outputs", type=Path, default=None, help="write the autoregressive outputs here (JSON)")
    ap.add_argument("--replay", type=Path, default=None, help="replay saved outputs through SuffixDrafter settings")
    ap.add_argument("--store-cost", action="store_true", help="memory and update cost of the suffix store")
    ap.add_argument("--replay-hybrid", type=Path, default=None,
                    help="replay saved outputs through the hybrid's rules (the model draft runs, the target does not)")
    ap.add_argument("--draft-cost", type=float, nargs="*", default=[0.1, 0.2, 0.3],
                    help="--replay-hybrid: a draft forward's cost in verifies (the time unit)")
    ap.add_argument("--prefill-cost", type=float, default=None,
                    help="--replay-hybrid: a draft prefill token's cost in draft forwards (default: measured)")
    ap.add_argument("--positions", type=Path, default=None,
                    help="--replay-hybrid: read the drafted positions from this JSON file if it exists, else write "
                         "them there (the model draft's part takes minutes; the rules' replay takes seconds)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="every method's pipeline (autoregressive too) keeps a prefix cache across its requests")
    ap.add_argument("--live-history", action="store_true",
                    help="each request's history holds the model's own answers to the requests before it, as a live "
                         "agent loop's does, instead of the workload's fixed ones (workloads whose requests extend "
                         "the last: agentic)")
    ap.add_argument("--no-results", action="store_true", help="do not append to perf/workloads.jsonl")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    K["suffix"] = K["hybrid"] = args.k_suffix
    K["suffix_auto"] = args.k_suffix_auto
    machine = machine_info()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"# {machine.get('cpu_model')} ({machine.get('cpu_flags')}), level {machine.get('cpu_level')}, "
        f"threads {torch.get_num_threads()}, load {machine.get('loadavg')}")

    if args.replay is not None:
        settings = [{"spec_factor": f, "min_prob": p} for f in (0.5, 1.0, 2.0, 4.0, 8.0) for p in (0.05, 0.1, 0.3)]
        settings += [{"spec_factor": 4.0, "min_match": m} for m in (2, 3)]
        settings.append({"spec_factor": 4.0, "learn": False})
        for row in replay(args.replay, settings, args.k_suffix):
            log(f"K={row['k']} {json.dumps(row['settings'])}: tokens per forward (draft rows a step) " + ", ".join(
                f"{w} {v:.2f} ({r:.1f})" for w, (v, r) in row["workloads"].items()))
        return 0

    from graphspec.models import load_model

    if args.replay_hybrid is not None:
        from graphspec.defaults import AUTO_DRAFT_SIBLINGS
        from graphspec.drafters import ModelDrafter
        from graphspec.suffix import measure_prefill_cost

        cached = args.positions is not None and args.positions.exists()
        # no model at all with cached positions and a given prefill cost: the replay is then pure arithmetic
        draft = (load_model(DRAFT, dtype=DTYPES[args.dtype], quantize="int8")
                 if not cached or args.prefill_cost is None else None)
        # what the hybrid measures at its first catch-up (the same draft, head and threads)
        prefill_cost = (measure_prefill_cost(ModelDrafter(draft, draft_vocab="auto", siblings=AUTO_DRAFT_SIBLINGS))
                        if args.prefill_cost is None else args.prefill_cost)
        max_new = json.loads(args.replay_hybrid.read_text()).get("max_new_tokens", args.max_new_tokens)
        t0 = time.perf_counter()
        if cached:
            positions = {wl: [{**r, "steps": {int(p): tuple(v) for p, v in r["steps"].items()}} for r in reqs]
                         for wl, reqs in json.loads(args.positions.read_text()).items()}
        else:
            positions = hybrid_positions(args.replay_hybrid, draft, K["hybrid"])
            if args.positions is not None:
                args.positions.write_text(json.dumps(positions))
        log(f"# positions drafted in {time.perf_counter() - t0:.0f} s; a prefill token costs {prefill_cost:.3f} draft "
            f"forwards; per workload: tokens per target forward / tokens per unit of time, draft prefills counted "
            "(suffix steps, model steps, plain steps)")
        for cost in args.draft_cost:
            for rule in ("suffix", "model", "previous", "hybrid", "catch-up/all", "catch-up/share", "catch-up/request"):
                res = replay_hybrid(positions, rule, cost, K["hybrid"], prefill_cost, max_new)
                log(f"draft_cost {cost} {rule:16s} " + "  ".join(
                    f"{wl} {a:.2f} / {b:.2f} ({ns}, {nm}, {npl})" for wl, (a, b, ns, nm, npl) in res.items()))
        return 0

    if args.store_cost:
        from graphspec.models.tokenizer import Tokenizer
        from graphspec.models.zoo import resolve

        tokenizer = Tokenizer.from_dir(resolve(TARGET))
        for limit in (250_000, 1_000_000):
            row = {"kind": "store_cost", **store_cost(tokenizer, limit), "cpu": machine.get("cpu_model"),
                   "date": machine.get("date")}
            log(json.dumps(row))
            if not args.no_results:
                with RESULTS_FILE.open("a") as f:
                    f.write(json.dumps(row) + "\n")
        return 0

    dtype = DTYPES[args.dtype]
    target = load_model(TARGET, weights=args.weights) if args.weights else load_model(TARGET, dtype=dtype)
    needs_draft = {"model", "hybrid", "hybrid_auto"} & set(args.methods)
    draft = load_model(DRAFT, dtype=dtype, quantize="int8") if needs_draft else None
    workloads = load_workloads(args.workloads)
    saved = {"target": TARGET, "max_new_tokens": args.max_new_tokens, "workloads": {}}
    pipes0 = make_pipelines(target, draft, args.methods, K, args.prefix_cache)
    for name, p in pipes0.items():  # warm-up: first-call allocations and oneDNN primitives, kept out of the figures
        t0 = time.perf_counter()
        p.run([1, 2, 3, 4], max_new_tokens=4, ignore_eos=True)
        if name in ("suffix_auto", "hybrid_auto"):  # verify costs: timed once a process per target (SuffixLength)
            d = p.graph["draft"]
            rule = (d.suffix if name == "hybrid_auto" else d).length
            log(f"# {name}: warm-up with the verify costs in {time.perf_counter() - t0:.1f} s; ms by rows after 16 "
                "tokens: " + ", ".join(f"{r} {v * 1e3:.0f}" for r, v in sorted(rule.costs.target.items()))
                + (f"; after {rule.long_context}: " + ", ".join(
                    f"{r} {v * 1e3:.0f}" for r, v in sorted(rule.long_costs.target.items()))
                   if rule.long_costs is not None else ""))
    del pipes0
    all_rows = []
    for name, items in workloads.items():
        prompts = encode_prompts(target.tokenizer, items)
        log(f"## {name}: {len(prompts)} requests, prompts {[len(p) for p in prompts]} tokens"
            + (" (with the fixed answers; live ones replace them)" if args.live_history else ""))
        pipes = make_pipelines(target, draft, args.methods, K, args.prefix_cache)  # fresh stores per workload
        res = run_workload(pipes, prompts, args.max_new_tokens, log,
                           live=(target.tokenizer, items) if args.live_history else None)
        saved["workloads"][name] = res["outputs"]
        rows = report(name, res["runs"], machine, args)
        all_rows.extend(rows)
        for r in rows:
            log(f"  {r['method']:7s} K={r['k']}: {r['tokens_per_target_forward']:.2f} tokens/forward, "
                f"{r['tok_s']:.2f} tok/s, x{r['x_autoregressive'] or 0:.2f} autoregressive, "
                f"differ {r['prompts_differing_from_ar']}" + (f"; rule: {r['hybrid']}" if "hybrid" in r else ""))
        if not args.no_results:
            with RESULTS_FILE.open("a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    if args.save_outputs is not None:
        args.save_outputs.parent.mkdir(parents=True, exist_ok=True)
        args.save_outputs.write_text(json.dumps(saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
