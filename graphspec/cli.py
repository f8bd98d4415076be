"""The ``graphspec`` command line: run, bench, fetch, models.

- ``run`` streams the generated text, then prints one stats line.
- ``bench`` measures acceptance and speedup over autoregressive decoding on the
  user's own prompts (or a built-in mix of code, chat and prose) and recommends
  a speculation length K from the measured per-position acceptance and costs;
  beside the given draft it measures the other drafters (the model draft,
  prompt lookup, suffix, the hybrid) as ``run`` would use them and recommends
  one, saying why.
- ``fetch`` / ``models`` manage the zoo cache.

Every user error (unknown model, missing path, bad flag value) prints one error,
``graphspec: error: ...`` (with the indented lines that list its problems, when it has
several), and exits with status 2; no traceback (docs/errors.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
           "fp16": "float16", "float16": "float16"}

BUILTIN_PROMPTS = [
    {"kind": "code", "messages": [{"role": "user", "content":
        "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, with a docstring."}]},
    {"kind": "code", "prompt": "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"},
    {"kind": "chat", "messages": [{"role": "user", "content":
        "What are three practical tips for keeping a small vegetable garden healthy?"}]},
    {"kind": "prose", "prompt": "The history of the printing press begins in the fifteenth century, when"},
]


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


# The drafters `bench --compare` measures: name -> (what it is, in the output; whether it needs a draft model).
_BENCH_DRAFTERS = {"model": ("model draft", True), "ngram": ("prompt lookup", False), "suffix": ("suffix", False),
                   "suffix-auto": ("suffix sized (K=16, --draft-length auto)", False),
                   "hybrid": ("hybrid model+suffix", True)}
# suffix-auto: suffix trees sized by this machine's verify costs (--draft-length auto) up to this K, whatever -k
SUFFIX_AUTO_K = 16
# bench recommends a drafter with no draft model (prompt lookup, suffix) over a faster one that needs one when it
# is within this share of it: no draft weights to hold and no draft prefill, for a difference the run's noise
# can hide.
WEIGHT_FREE_MARGIN = 0.05


def _draft_vocab(text: str) -> int | str:
    if text in ("auto", "none"):
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'auto' or 'none', got {text!r}") from None


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _nonneg_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _prefix_cache_mib(text: str) -> int | str:
    return text if text == "auto" else _int_at_least(text, 0, "an integer >= 0 (MiB) or 'auto'")


def _draft_siblings(text: str) -> int | str:
    return text if text == "auto" else _int_at_least(text, 0, "an integer >= 0 or 'auto'")


_MAX_THREADS = 1024  # OpenMP allocates per thread up front: a huge count aborts the process


def _threads(text: str) -> int:
    v = _positive_int(text)
    if v > _MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {_MAX_THREADS} threads, got {v}")
    return v


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed with 0 <= seed < 2**64, got {text!r}") from None
    if not 0 <= v < 1 << 64:
        raise argparse.ArgumentTypeError(f"expected an integer seed with 0 <= seed < 2**64, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {v}")
    return v


def _confidence(text: str):
    if text.lower() in ("none", "auto"):
        return None if text.lower() == "none" else "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), 'auto' or 'none', got {text!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), 'auto' or 'none', got {v}")
    return v


def _add_model_flags(p: argparse.ArgumentParser, *, draft_required: bool = False) -> None:
    p.add_argument("--target", required=True, help="checkpoint directory or zoo name (see `graphspec models`)")
    p.add_argument("--draft", required=draft_required, default=None,
                   help="draft checkpoint directory, zoo name, 'ngram' (prompt lookup), 'suffix' (suffix trees over "
                        "this and earlier requests) or MODEL+suffix (per step the suffix tree or the model "
                        "draft); omit for plain decoding")
    p.add_argument("-k", "--num-speculative-tokens", type=_positive_int, default=5, dest="k",
                   help="draft tokens proposed per step (default 5)")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(_DTYPES)],
                   help="weights and activations dtype; auto = bf16 where the device supports it, else fp32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=_threads, default=None,
                   help="CPU threads for torch (default: the cores not already busy, by the load average)")
    p.add_argument("--vocab-mapping", default="auto", choices=["auto", "tli", "slem"],
                   help="how a draft with another tokenizer is mapped to the target (default auto)")
    p.add_argument("--draft-quantize", default="auto", choices=["auto", "int8", "int4", "none"],
                   help="draft model weights: int8 (CPU only; a cheaper draft, output unchanged), int4 (int8 with the "
                        "draft's few-token steps in 4 bits: cheaper still, lower acceptance; AVX2 or AVX-512) or as --dtype; "
                        "auto = int8 on a CPU")
    p.add_argument("--weights", default="checkpoint", choices=["checkpoint", "gguf", "gguf-a8"],
                   help="target weights: checkpoint (safetensors, in --dtype) or gguf (its GGUF file's blocks as stored: "
                        "a zoo name's cached GGUF or a .gguf --target, which implies it; fp32 activations); gguf-a8: "
                        "the same blocks, the k-quants' products on activations rounded to int8 as llama.cpp does "
                        "(faster on a CPU; CPU only)")
    p.add_argument("--draft-weights", default="checkpoint", choices=["checkpoint", "gguf", "gguf-a8"],
                   help="draft weights, as --weights (a gguf draft is not quantized again by --draft-quantize auto)")
    p.add_argument("--draft-vocab", type=_draft_vocab, default="auto", metavar="N",
                   help="prune the draft's vocabulary to its N lowest ids plus special tokens (a cheaper draft "
                        "lm_head; output unchanged); 'none' keeps it whole; auto (the default) = 65536 for an "
                        "int8 draft, else none")
    p.add_argument("--draft-siblings", type=_draft_siblings, default="auto", metavar="N",
                   help="a draft tree: up to N alternative tokens beside the draft's chain, in the verify rows the "
                        "chain left unused (model drafts, with either tokenizer; output unchanged); 0: a chain; "
                        "auto (the default) = 4 for a model draft")
    p.add_argument("--draft-length", choices=("fixed", "auto"), default="fixed",
                   help="auto: each step drafts the k in 1..K that promises the most tokens per second, from this "
                        "machine's forward costs (timed on the first run) and the acceptance so far (greedy runs, "
                        "model and suffix drafts; output unchanged; with suffix give a larger K, e.g. -k 16); "
                        "fixed (the default): K")
    p.add_argument("--draft-beam", type=_nonneg_int, default=0, metavar="W",
                   help="grow a CPU model draft's tree best first, W paths a forward (greedy runs; output "
                        "unchanged); K then bounds the tree: try -k 8 --draft-beam 2 where verify rows are cheap "
                        "(AMX); 0 (the default): no beam")
    p.add_argument("--draft-confidence", type=_confidence, default=argparse.SUPPRESS, metavar="P",
                   help="a model draft stops proposing once it gives its own token less than P; "
                        "auto (the default): 0.4 for a draft with the target's tokenizer, 0.3 for one with another; "
                        "'none' always drafts K")


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="graphspec", description="Lossless speculative decoding for Llama-family models.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{run,bench,fetch,models,serve}")

    run = sub.add_parser("run", help="generate text, streaming it, then print stats")
    _add_model_flags(run)
    run.add_argument("--temperature", type=_nonneg_float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    run.add_argument("--seed", type=_seed, default=None,
                     help="seed for sampling, 0 <= seed < 2**64 (reproducible output)")
    run.add_argument("--max-new-tokens", type=_positive_int, default=128)
    run.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    run.add_argument("--ignore-eos", action="store_true")
    run.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    run.add_argument("--json", action="store_true", help="print the stats as JSON instead of one line")
    run.add_argument("prompt", help="the prompt text ('-' reads standard input)")

    bench = sub.add_parser("bench", help="acceptance and speedup over autoregressive on your prompts")
    _add_model_flags(bench, draft_required=True)
    bench.add_argument("--prompts", type=Path, default=None,
                       help="file of prompts: .jsonl, one a line ({\"prompt\": ...}, {\"messages\": [...]}, "
                            "{\"token_ids\": [...]} or a string), .json (a list of those) or text, one per line")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=64)
    bench.add_argument("--max-k", type=_positive_int, default=8, help="largest K considered for the recommendation")
    bench.add_argument("--compare", nargs="*", default=None, choices=list(_BENCH_DRAFTERS), metavar="DRAFTER",
                       help="drafters measured side by side at -k, each as `run` would use it, to recommend one: "
                            "model (the --draft model), ngram (prompt lookup), suffix, suffix-auto (suffix trees "
                            "sized by this machine's verify costs, K=16), hybrid (MODEL+suffix); "
                            "default: every one that applies (model and hybrid need a model --draft); "
                            "--compare with no names: none")
    bench.add_argument("--json", type=Path, default=None, help="also write the full results to this JSON file")

    fetch = sub.add_parser("fetch", help="download and convert a zoo model into the cache")
    fetch.add_argument("name")

    sub.add_parser("models", help="list the zoo and what is cached")

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with batched speculative decoding")
    _add_model_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    srv.add_argument("--max-batch", type=_positive_int, default=16, help="sequences decoded together (default 16)")
    srv.add_argument("--max-queue", type=_nonneg_int, default=64,
                     help="requests waiting for a slot before new ones get 429 (default 64)")
    srv.add_argument("--policy", choices=["auto", "off"], default="auto",
                     help="auto: each greedy request drafts as many tokens as pay at the current batch size "
                          "(costs measured at start-up); off: always K")
    srv.add_argument("--prefix-cache", type=_prefix_cache_mib, default="auto", metavar="MIB",
                     help="keep up to MIB MiB of earlier requests' KV rows and reuse them for prompts that begin the "
                          "same (multi-turn chats, agent loops); the target's prefills then run row-exact, so "
                          "outputs stay those of a cold run; 0: off; auto (default): 1024 where a row-exact prefill "
                          "costs what a batched one does (bf16 on the C++ linear, gguf-a8), else off")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --target)")
    srv.add_argument("--default-max-tokens", type=_positive_int, default=256,
                     help="new tokens of a chat request that names no max_tokens (default 256)")
    return ap


# ---------------------------------------------------------------------------------------------------------------------


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {name!r} is not a device; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):  # meta, mps, xpu ...: graphspec runs on CPUs and CUDA GPUs only
        raise CLIError(f"--device {name!r}: graphspec runs on cpu or cuda devices only; use --device cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CLIError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA device(s); "
                       "use --device cuda:0")
    return dev


def _dtype(name: str, device):
    import torch

    if name != "auto":
        return getattr(torch, _DTYPES[name])
    return auto_dtype(device)


def auto_dtype(device):
    """--dtype auto, by the rule ``Pipeline(dtype="auto")`` uses (graphspec.defaults): bf16 on CUDA and on CPUs where
    bf16 weights run at memory speed, fp32 elsewhere."""
    from graphspec import defaults

    return defaults.auto_dtype(device)


def _gguf(path_or_name: str, weights: str) -> bool:
    from graphspec.models.loader import GGUF_WEIGHTS

    return weights in GGUF_WEIGHTS or str(path_or_name).endswith(".gguf")


def _load(path_or_name: str, what: str, dtype, device, quantize=None, weights: str = "checkpoint"):
    from graphspec.models.loader import load_model

    gguf = _gguf(path_or_name, weights)
    try:  # GGUF blocks compute in fp32 whatever --dtype says
        return load_model(path_or_name, dtype=None if gguf else dtype, device=device, quantize=quantize,
                          weights=(weights if weights != "checkpoint" else "gguf") if gguf else None)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"--{what} {path_or_name!r}: {_message(e)}") from None


def _message(e: BaseException) -> str:
    """The whole text of an error (every problem it lists, one per line); OSErrors name their file."""
    if isinstance(e, OSError):
        from graphspec.models.zoo import unusable_cache_message

        if (text := unusable_cache_message(e)) is not None:
            return text
    if isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    elif isinstance(e, OSError) and e.strerror and not str(e).startswith(e.strerror):
        text = str(e)
    elif isinstance(e, OSError) and e.strerror:
        text = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    else:
        text = str(e)
    return text.strip() or type(e).__name__


def _text_arg(text: str, what: str) -> str:
    """Refuse text that is not valid UTF-8 (invalid bytes in argv arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CLIError(f"{what} is not valid UTF-8 (byte {ord(text[e.start]) - 0xDC00:#04x} at character "
                       f"{e.start}); pass UTF-8 text") from None
    return text


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"the prompt on standard input is not valid UTF-8 (byte {data[e.start]:#04x} at offset "
                       f"{e.start}); pass UTF-8 text") from None


def _check_writable(path: Path, flag: str) -> None:
    """Find an unusable output path before the work that would be written to it."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CLIError(f"{flag} {str(path)!r} is a directory; give a file path")
    if not parent.is_dir():
        raise CLIError(f"{flag} {str(path)!r}: the folder {str(parent)!r} does not exist; create it first")
    if path.exists() and not (path.is_file() and os.access(path, os.W_OK)):
        raise CLIError(f"{flag} {str(path)!r} cannot be written (not a regular writable file)")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {str(path)!r}: the folder {str(parent)!r} is not writable")


def cpu_threads(requested: int | None) -> int:
    """Threads for the CPU path: as asked, else the cores not already busy.

    On a loaded machine OpenMP's barriers wait for threads the scheduler has parked: with one core
    busy elsewhere, 2 threads ran a step several times slower than 1 (perf/RESULTS.md).
    """
    if requested is not None:
        return requested
    cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, cores - busy)


def draft_quantize(choice: str, device) -> str | None:
    """--draft-quantize, by the rule ``Pipeline`` uses (graphspec.defaults): "auto" is int8 on a CPU, where a
    draft step is bound by the bytes it reads, and none elsewhere (int8 weights are a CPU path)."""
    from graphspec import defaults

    try:
        return defaults.draft_quantize(choice, device)
    except ValueError:
        raise CLIError(f"--draft-quantize {choice} runs on the CPU only, but the device is {device}; "
                       "use --draft-quantize none") from None


def _pipelines(args):
    import torch

    import graphspec

    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    threads = cpu_threads(args.threads)
    torch.set_num_threads(threads)
    where = f"{device}, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else str(device)
    what = (("GGUF blocks, int8 activations" if args.weights == "gguf-a8" else "GGUF blocks, fp32")
            if _gguf(args.target, args.weights) else str(dtype).replace("torch.", ""))
    print(f"loading {args.target} ({what} on {where}) ...", file=sys.stderr, flush=True)
    target = _load(args.target, "target", dtype, device, weights=args.weights)
    draft = None
    if args.draft is not None:
        if args.draft in ("ngram", "suffix"):
            draft = args.draft
        else:
            # MODEL+suffix: the hybrid drafter (graphspec.suffix.HybridDrafter) over that model draft
            name = args.draft[:-len("+suffix")] if args.draft.endswith("+suffix") else args.draft
            if not name:
                raise CLIError("--draft +suffix names no model: give MODEL+suffix (a zoo name or checkpoint directory)")
            quantize = (None if _gguf(name, args.draft_weights) and args.draft_quantize == "auto"
                        else draft_quantize(args.draft_quantize, device))
            print(f"loading draft {name}{f' ({quantize} weights)' if quantize else ''} ...", file=sys.stderr,
                  flush=True)
            draft = _load(name, "draft", dtype, device, quantize, args.draft_weights)
            if name != args.draft:
                draft = [draft, "suffix"]
    return target, draft, graphspec


def _draft_kw(args) -> dict:
    kw = {"draft_confidence_threshold": args.draft_confidence} if hasattr(args, "draft_confidence") else {}
    model_draft = args.draft is not None and args.draft not in ("ngram", "suffix")
    if isinstance(args.draft_vocab, int):
        if not model_draft:
            raise CLIError("--draft-vocab prunes a model draft's vocabulary; give --draft a model")
        kw["draft_vocab"] = args.draft_vocab
    elif model_draft:  # "auto" (graphspec.defaults, as Pipeline's default) or "none" (the whole vocabulary)
        kw["draft_vocab"] = "auto" if args.draft_vocab == "auto" else None
    if args.draft_siblings == "auto":
        if model_draft:
            kw["draft_siblings"] = "auto"  # graphspec.defaults: AUTO_DRAFT_SIBLINGS for a model draft
    else:
        if args.draft_siblings and not model_draft:
            raise CLIError("--draft-siblings branches a model draft's proposals; give --draft a model")
        kw["draft_siblings"] = args.draft_siblings  # 0: a chain
    if args.draft_beam:
        if not model_draft:
            raise CLIError("--draft-beam grows a model draft's tree; give --draft a model")
        kw["draft_beam"] = args.draft_beam
    if args.draft_length == "auto":
        if not (model_draft or args.draft == "suffix"):
            raise CLIError("--draft-length auto times a model draft's steps or sizes suffix trees; give --draft a "
                           "model, suffix or MODEL+suffix (not ngram)")
        if args.draft_beam:
            raise CLIError("--draft-length auto and --draft-beam both size the draft; leave one out")
        kw["draft_length"] = "auto"
    return kw


def _cmd_run(args) -> int:
    prompt = _read_stdin() if args.prompt == "-" else _text_arg(args.prompt, "the prompt")
    for stop in args.stop or ():
        _text_arg(stop, "--stop")
    target, draft, graphspec = _pipelines(args)
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=args.k, vocab_mapping=args.vocab_mapping,
                              **_draft_kw(args))
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    gen = pipe.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop)
    while True:
        try:
            piece = next(gen)
        except StopIteration as done:
            result = done.value
            break
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = result.stats
    if args.json:
        print(json.dumps(s.as_dict(), indent=1))
    else:
        line = (f"[{s.generated_tokens} tokens, {s.tokens_per_second:.2f} tok/s, "
                f"{s.mean_accepted_length:.2f} tokens per target forward")
        if pipe.speculative:
            line += f", acceptance {s.acceptance_rate:.2f}"
        print(line + f", finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def _read_prompts(path: Path | None) -> list[dict]:
    """The bench prompts: the built-in mix, or a file's, each checked (the error names its line).

    A .jsonl line is a string, {"prompt": str}, {"messages": [{"role": str, "content": str}, ...]} or
    {"token_ids": [int, ...]}, optionally with a "kind" string; any other line is an error.
    """
    if path is None:
        return BUILTIN_PROMPTS
    if not path.exists():
        raise CLIError(f"--prompts {str(path)!r}: no such file")
    if not path.is_file():
        raise CLIError(f"--prompts {str(path)!r} is not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompts {path}: not valid UTF-8 (byte offset {e.start})") from None
    prompts: list[dict] = []
    if path.suffix == ".json":  # one JSON list of the items a .jsonl line holds
        try:
            items = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CLIError(f"--prompts {path}: not JSON ({getattr(e, 'msg', type(e).__name__)})") from None
        if not isinstance(items, list):
            raise CLIError(f"--prompts {path}: a .json file holds a list of prompts (each a string or "
                           f"{_PROMPT_FORMS}), got a JSON {type(items).__name__}")
        prompts = [_checked_prompt(item, f"--prompts {path}: item {n}") for n, item in enumerate(items, 1)]
    elif path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise CLIError(f"--prompts {path}: line {n} is not JSON ({getattr(e, 'msg', type(e).__name__)})") from None
            prompts.append(_checked_prompt(item, f"--prompts {path}: line {n}"))
    else:
        prompts = [{"prompt": line} for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CLIError(f"--prompts {path}: no prompts in the file")
    return prompts


def _checked_prompt(item, where: str) -> dict:
    """One bench prompt item (a bare string is a "prompt"), or a CLIError that starts with ``where``."""
    if isinstance(item, str):
        item = {"prompt": item}
    problem = _prompt_problem(item)
    if problem:
        raise CLIError(f"{where} {problem}")
    return item


_PROMPT_FORMS = ('a "prompt" string, a "messages" list of {"role": str, "content": str} or a "token_ids" list of '
                 'ints')


def _prompt_problem(item) -> str | None:
    """What is wrong with one bench prompt item (None if nothing)."""
    if not isinstance(item, dict):
        return f"is a JSON {type(item).__name__}; it needs {_PROMPT_FORMS}"
    forms = [k for k in ("prompt", "messages", "token_ids") if k in item]
    if len(forms) != 1:
        return f"needs exactly one of {_PROMPT_FORMS}" + (f" (it has {', '.join(forms)})" if forms else "")
    if "kind" in item and not isinstance(item["kind"], str):
        return "has a \"kind\" that is not a string"
    v = item[forms[0]]
    if forms[0] == "prompt":
        if not isinstance(v, str) or not v:
            return f"has a \"prompt\" that is not a non-empty string (token ids go in \"token_ids\")"
        return None
    if forms[0] == "token_ids":
        if not isinstance(v, list) or not v or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in v):
            return "has \"token_ids\" that are not a non-empty list of non-negative ints"
        return None
    if not isinstance(v, list) or not v:
        return "has \"messages\" that are not a non-empty list of {\"role\": str, \"content\": str}"
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"has message #{i} that is not {{\"role\": str, \"content\": str}}"
    return None


def recommend_k(accepted_per_position: list[int], steps: int, verify_seconds: float, draft_seconds_per_token: float,
                max_k: int) -> tuple[int, list[dict]]:
    """Pick K maximising modelled tokens/s from measured acceptance and costs.

    With a_i the fraction of steps in which draft position i was accepted (which needs every earlier one accepted),
    a step with K drafts emits 1 + sum_{i<K} a_i tokens and costs verify + K * draft. Positions beyond the measured K
    are not extrapolated.
    """
    rows = []
    best_k, best_rate = 1, -1.0
    emitted = 1.0
    for k in range(1, min(max_k, len(accepted_per_position)) + 1):
        emitted += accepted_per_position[k - 1] / steps if steps else 0.0
        cost = verify_seconds + k * draft_seconds_per_token
        rate = emitted / cost if cost > 0 else 0.0
        rows.append({"k": k, "tokens_per_step": emitted, "modelled_tokens_per_second": rate})
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, rows


def recommend_drafter(autoregressive_tok_s: float, drafters: dict[str, dict],
                      margin: float = WEIGHT_FREE_MARGIN) -> tuple[str | None, str]:
    """The drafter to use, and why, from what ``bench`` measured: ``(name or None, reason)``.

    ``drafters`` maps names of ``_BENCH_DRAFTERS`` to their measured ``{"tok_s": ...}``. The fastest wins,
    unless one that needs no draft model (prompt lookup, suffix) is within ``margin`` of it; None (plain
    decoding) when no drafter beat autoregressive decoding.
    """
    if not drafters:
        raise ValueError("recommend_drafter needs at least one measured drafter")
    ranked = sorted(drafters, key=lambda n: drafters[n]["tok_s"], reverse=True)
    best = ranked[0]

    def said(n: str) -> str:
        return f"{_BENCH_DRAFTERS[n][0]} ({drafters[n]['tok_s'] / autoregressive_tok_s:.2f}x autoregressive)"

    if drafters[best]["tok_s"] <= autoregressive_tok_s:
        return None, f"no drafter was faster than plain decoding on these prompts (the fastest: {said(best)})"
    if _BENCH_DRAFTERS[best][1]:
        for n in ranked:
            if (not _BENCH_DRAFTERS[n][1] and drafters[n]["tok_s"] >= (1 - margin) * drafters[best]["tok_s"]
                    and drafters[n]["tok_s"] > autoregressive_tok_s):
                return n, (f"{said(n)} is within {margin:.0%} of the fastest, {said(best)}, and needs no draft "
                           "model (no draft weights in memory, no draft prefill)")
    why = f"the fastest on these prompts: {said(best)}"
    if len(ranked) > 1:
        why += f"; next: {said(ranked[1])}"
    return best, why


def _bench_compare(args) -> list[str]:
    """The drafters ``bench --compare`` measures (checked before anything loads)."""
    model_draft = args.draft not in ("ngram", "suffix")
    if args.compare is None:
        return [n for n, (_, needs_model) in _BENCH_DRAFTERS.items() if model_draft or not needs_model]
    for n in args.compare:
        if _BENCH_DRAFTERS[n][1] and not model_draft:
            raise CLIError(f"--compare {n} needs a draft model: give --draft MODEL (a zoo name or checkpoint "
                           f"directory), not --draft {args.draft}")
    return list(dict.fromkeys(args.compare))


def _cmd_bench(args) -> int:
    prompts = _read_prompts(args.prompts)
    if args.json is not None:
        _check_writable(args.json, "--json")
    compare = _bench_compare(args)
    target, draft, graphspec = _pipelines(args)
    k = max(args.k, args.max_k)
    base = graphspec.Pipeline(target)
    if args.draft_siblings not in ("auto", 0):
        raise CLIError("bench measures a chain's acceptance at each draft position to recommend K; a draft tree "
                       "(--draft-siblings) would blur it: leave --draft-siblings out")
    if args.draft_beam:
        raise CLIError("bench measures a chain's acceptance at each draft position to recommend K; a beam "
                       "(--draft-beam) would blur it: leave --draft-beam out")
    if args.draft_length == "auto":
        raise CLIError("bench measures a chain's acceptance at each draft position to recommend K; a draft length "
                       "that changes step by step (--draft-length auto) would blur it: leave it out")
    run_kw = _draft_kw(args)
    kw = dict(run_kw, draft_siblings=0)  # a chain, whatever run's default
    spec = graphspec.Pipeline(target, draft, num_speculative_tokens=k, vocab_mapping=args.vocab_mapping, **kw)
    model = draft[0] if isinstance(draft, list) else None if isinstance(draft, str) else draft
    model_name = args.draft[:-len("+suffix")] if args.draft.endswith("+suffix") else args.draft
    flags = {"model": model_name, "ngram": "ngram", "suffix": "suffix", "hybrid": f"{model_name}+suffix",
             "suffix-auto": f"suffix -k {SUFFIX_AUTO_K} --draft-length auto"}

    def compared() -> dict:
        """The drafters to compare at -k, each as `run` builds it (fresh: the suffix stores start empty)."""
        out = {}
        for name in compare:
            if name in ("model", "hybrid"):
                out[name] = graphspec.Pipeline(target, model if name == "model" else [model, "suffix"],
                                               num_speculative_tokens=args.k, vocab_mapping=args.vocab_mapping,
                                               **run_kw)
            elif name == "suffix-auto":  # its verify costs are timed once per target (the warm-up's run)
                out[name] = graphspec.Pipeline(target, "suffix", num_speculative_tokens=SUFFIX_AUTO_K,
                                               draft_length="auto")
            else:
                out[name] = graphspec.Pipeline(target, name, num_speculative_tokens=args.k)
        return out
    has_template = getattr(target.tokenizer, "has_chat_template", False)

    def as_prompt(item):
        if "token_ids" in item:
            return item["token_ids"]
        if "messages" in item:
            if has_template:
                return item["messages"]
            return "\n".join(m["content"] for m in item["messages"])
        return item["prompt"]

    for n, item in enumerate(prompts):  # every prompt encodes (ids in the vocabulary, fits the context) before any run
        try:
            ids = spec.encode_prompt(as_prompt(item))
        except ValueError as e:
            raise CLIError(f"--prompts {args.prompts}: prompt {n + 1}: {_message(e)}") from None
        if len(ids) + args.max_new_tokens > target.config.max_position_embeddings:
            raise CLIError(f"--prompts {args.prompts}: prompt {n + 1} ({len(ids)} tokens) + --max-new-tokens "
                           f"{args.max_new_tokens} exceeds the target's max_position_embeddings="
                           f"{target.config.max_position_embeddings}")

    # Warm-up (allocation, first-call costs) kept out of the numbers; the compared pipelines are built again
    # afterwards, so that no suffix store starts with the warm-up's tokens.
    for pipe in (base, spec, *compared().values()):
        pipe.run(as_prompt(prompts[0]), max_new_tokens=4, ignore_eos=True)
    others = compared()
    cmp = {n: {"tokens": 0, "seconds": 0.0, "steps": 0, "proposed": 0, "accepted": 0, "draft_forwards": 0,
               "differ": 0} for n in others}

    rows = []
    tot = {"base_tokens": 0, "base_seconds": 0.0, "spec_tokens": 0, "spec_seconds": 0.0, "differ": 0}
    acc_pos = [0] * k
    steps = proposed = accepted = 0
    verify_s = draft_s = 0.0
    draft_fw = 0
    for n, item in enumerate(prompts):
        p = as_prompt(item)
        t0 = time.perf_counter()
        a = base.run(p, max_new_tokens=args.max_new_tokens)
        ta = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = spec.run(p, max_new_tokens=args.max_new_tokens)
        tb = time.perf_counter() - t0
        same = a.token_ids == b.token_ids
        tot["base_tokens"] += len(a.token_ids)
        tot["base_seconds"] += ta
        tot["spec_tokens"] += len(b.token_ids)
        tot["spec_seconds"] += tb
        tot["differ"] += 0 if same else 1
        s = b.stats
        for i, c in enumerate(s.accepted_per_position[:k]):
            acc_pos[i] += c
        steps += s.steps
        proposed += s.proposed
        accepted += s.accepted
        draft_fw += s.draft_forwards
        verify_s += s.stage_seconds.get("verify", 0.0)
        draft_s += sum(v for name, v in s.stage_seconds.items() if name not in ("verify", "accept"))
        row = {"prompt": n, "kind": item.get("kind", "user"), "autoregressive_tok_s": len(a.token_ids) / ta,
               "speculative_tok_s": len(b.token_ids) / tb, "speedup": (len(b.token_ids) / tb) / (len(a.token_ids) / ta),
               "acceptance_rate": s.acceptance_rate, "tokens_per_target_forward": s.mean_accepted_length,
               "identical_to_autoregressive": same}
        rows.append(row)
        print(f"prompt {n} ({row['kind']}): {row['autoregressive_tok_s']:.2f} -> {row['speculative_tok_s']:.2f} tok/s "
              f"({row['speedup']:.2f}x), acceptance {s.acceptance_rate:.2f}, "
              f"{s.mean_accepted_length:.2f} tokens/forward{'' if same else ', output differs'}", flush=True)
        if others:
            names = list(others)
            row["drafters"] = {}
            for name in names[n % len(names):] + names[:n % len(names)]:  # rotated: load drift hits each alike
                t0 = time.perf_counter()
                c = others[name].run(p, max_new_tokens=args.max_new_tokens)
                tc = time.perf_counter() - t0
                r = cmp[name]
                r["tokens"] += len(c.token_ids)
                r["seconds"] += tc
                r["steps"] += c.stats.steps
                r["proposed"] += c.stats.proposed
                r["accepted"] += c.stats.accepted
                r["draft_forwards"] += c.stats.draft_forwards
                r["differ"] += c.token_ids != a.token_ids
                row["drafters"][name] = {"tok_s": len(c.token_ids) / tc,
                                         "tokens_per_target_forward": c.stats.mean_accepted_length,
                                         "identical_to_autoregressive": c.token_ids == a.token_ids}
            print(f"  at K={args.k}: " + ", ".join(
                f"{_BENCH_DRAFTERS[name][0]} {d['tok_s']:.2f} tok/s "
                f"({d['tok_s'] / row['autoregressive_tok_s']:.2f}x){'' if d['identical_to_autoregressive'] else ' differs'}"
                for name, d in row["drafters"].items()), flush=True)

    base_rate = tot["base_tokens"] / tot["base_seconds"]
    spec_rate = tot["spec_tokens"] / tot["spec_seconds"]
    draft_per_token = draft_s / draft_fw if draft_fw else 0.0
    best_k, model_rows = recommend_k(acc_pos, steps, verify_s / steps if steps else 0.0, draft_per_token, args.max_k)
    per_pos = [c / steps if steps else 0.0 for c in acc_pos]
    print(f"\nautoregressive {base_rate:.2f} tok/s, speculative (K={k}) {spec_rate:.2f} tok/s: "
          f"{spec_rate / base_rate:.2f}x; acceptance {accepted / proposed if proposed else 0:.2f}")
    print("accepted fraction by draft position: " + " ".join(f"{i + 1}:{a:.2f}" for i, a in enumerate(per_pos)))
    print(f"recommended K: {best_k} (modelled from the acceptance above and the measured verify/draft costs)")
    drafters = {}
    for name, r in cmp.items():
        drafters[name] = {"draft": flags[name], "k": SUFFIX_AUTO_K if name == "suffix-auto" else args.k,
                          "tok_s": r["tokens"] / r["seconds"],
                          "x_autoregressive": (r["tokens"] / r["seconds"]) / base_rate,
                          "tokens_per_target_forward": r["tokens"] / r["steps"] if r["steps"] else 0.0,
                          "acceptance_rate": r["accepted"] / r["proposed"] if r["proposed"] else 0.0,
                          "draft_forwards": r["draft_forwards"], "prompts_differing": r["differ"]}
    recommended = None
    if drafters:
        print(f"\ndrafters at K={args.k}, each as `graphspec run --draft` uses it (suffix and hybrid learn across "
              "the prompts, in order):")
        width = max(len(_BENCH_DRAFTERS[n][0]) for n in drafters)
        for name, d in drafters.items():
            print(f"  {_BENCH_DRAFTERS[name][0]:<{width}}  {d['tok_s']:6.2f} tok/s  {d['x_autoregressive']:.2f}x  "
                  f"{d['tokens_per_target_forward']:.2f} tokens/forward  acceptance {d['acceptance_rate']:.2f}  "
                  f"draft forwards {d['draft_forwards']}"
                  + (f"  ({d['prompts_differing']} outputs differ)" if d["prompts_differing"] else ""))
        choice, why = recommend_drafter(base_rate, drafters)
        recommended = {"drafter": choice, "draft": flags[choice] if choice else None, "why": why}
        print(f"recommended draft: {'--draft ' + flags[choice] if choice else 'none (omit --draft)'}: {why}")
    if tot["differ"] or any(d["prompts_differing"] for d in drafters.values()):
        print(f"note: some outputs differ from autoregressive ({tot['differ']} of {len(prompts)} at K={k}) "
              "(low-precision rounding of batched forwards; run with --dtype fp32 for bitwise-stable greedy output)")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps({"prompts": rows, "autoregressive_tok_s": base_rate,
                                             "speculative_tok_s": spec_rate, "k": k, "accepted_per_position": per_pos,
                                             "recommended_k": best_k, "model": model_rows, "drafters": drafters,
                                             "recommended_draft": recommended}, indent=1))
        except OSError as e:
            raise CLIError(f"--json {str(args.json)!r} could not be written ({e.strerror}); the results are "
                           "printed above") from None
    return 0


def _cmd_fetch(args) -> int:
    from graphspec.models import zoo

    try:
        path = zoo.resolve(args.name, progress=True, repair=True)
    except ValueError as e:
        raise CLIError(_message(e)) from None
    print(path)
    return 0


def _cmd_models(args) -> int:
    from graphspec.models import zoo

    rows = zoo.list_models()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        if r.get("damaged"):
            where = f"DAMAGED: {r['damaged']}"
        else:
            where = r.get("path") or "not cached (graphspec fetch NAME)"
        print(f"{r['name']:<{width}}  {where}")
    return 0


def _port(text: str) -> int:
    v = _int_at_least(text, 0, "a port number in [0, 65535]")
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {v}")
    return v


def _cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CLIError(f"graphspec serve needs the server packages ({e.name} is missing): "
                       f"pip install 'graphspec[serve]'") from None
    from graphspec.server import serve

    if args.draft_length == "auto":
        raise CLIError("graphspec serve sizes each sequence's draft with --policy (auto: from the load and each "
                       "sequence's acceptance); --draft-length is for run: leave it out")
    target, draft, graphspec = _pipelines(args)
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=args.k, vocab_mapping=args.vocab_mapping,
                              prefix_cache=_prefix_cache_setting(args.prefix_cache), **_draft_kw(args))
    store = pipe.prefix_cache
    print(f"serving {args.served_model_name or args.target} on http://{args.host}:{args.port}/v1 "
          f"(max batch {args.max_batch}, policy {args.policy if pipe.speculative else 'no draft'}, "
          + (f"prefix cache {store.max_bytes >> 20} MiB" if store is not None else "no prefix cache")
          + (" (auto)" if args.prefix_cache == "auto" else "") + ")",
          file=sys.stderr, flush=True)
    serve(pipe, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          policy=args.policy, model_name=args.served_model_name or args.target,
          default_max_tokens=args.default_max_tokens)
    return 0


def _prefix_cache_setting(mib: int | str):
    """``--prefix-cache`` as ``Pipeline(prefix_cache=...)``: "auto", a budget in bytes, or False (0)."""
    if mib == "auto":
        return "auto"
    return mib * 2**20 if mib else False


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handler = {"run": _cmd_run, "bench": _cmd_bench, "fetch": _cmd_fetch, "models": _cmd_models, "serve": _cmd_serve}[args.command]
    try:
        return handler(args)
    except CLIError as e:
        print(f"graphspec: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed early (`graphspec run ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as e:  # bad values found by the library (top_p, prompt length, ...), unusable files
        print(f"graphspec: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngraphspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
