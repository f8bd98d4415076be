"""``Pipeline``: speculative (or plain autoregressive) generation as a graph run once per step.

- The step graph is ``draft -> verify -> accept`` (``build_graph``); a stage that maps draft
  tokens into the target's vocabulary goes between draft and verify (``_vocab_stage``). With no
  draft the graph is ``verify -> accept`` and the empty draft is a graph input, so baselines and
  speculative runs execute the same code.
- Committed tokens live in a Python list; the target's cache holds all of them but the last
  ("pending"). Each step drafts ``min(K, remaining - 1)`` tokens (so the lookahead never runs
  past ``max_new_tokens``), verifies ``[pending, drafts]`` in one forward, and commits the
  ``m + 1`` emitted tokens. The only host sync of a step is reading ``emitted``.
- Everything a generation owns (caches, generator, counters) lives in its ``State``; a Pipeline
  holds models and the graph only, so one model can serve several pipelines and generations.
- Stop rules: any end-of-sequence id of the target (``config.eos_token_ids`` plus the tokenizer's,
  which include generation_config.json's) unless ``ignore_eos``; the EOS id is kept in
  ``token_ids`` but not in ``text``. Stop strings cut the text before the string; ``token_ids``
  end with the token that completed it. ``max_new_tokens`` is never exceeded.
- Text goes through ``StreamDecoder``, so ``stream`` never yields half a UTF-8 character and
  holds back the tail that could still become a stop string; ``run`` uses the same path, so
  ``"".join(stream(...)) == run(...).text``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from graphspec import defaults as _defaults
from graphspec.acceptance import GreedyAcceptance, RejectionSampling, TreeAcceptance
from graphspec.drafters import (ModelDrafter, NgramDrafter, check_beam, check_confidence_threshold, check_siblings,
                                draft_vocab_ids)
from graphspec.graph import Graph, Stage
from graphspec.kernels import EXACT_ROWS_MAX, use_backend
from graphspec.kernels.sampling import check_seed, seeded_generator
from graphspec.models.tokenizer import check_message, check_text
from graphspec.prefix_cache import check_prefix_cache, free_exact_prefill
from graphspec.state import RunInfo, SamplingParams, State
from graphspec.stats import GenerationStats
from graphspec.verify import TreeVerify, Verify

__all__ = ["Pipeline", "GenerationResult", "build_graph", "STEP_INPUTS", "STEP_OUTPUTS"]

STEP_INPUTS = ("tokens", "token_buffer", "num_draft", "params", "generator")
STEP_OUTPUTS = ("emitted",)
_NO_DRAFT_INPUTS = ("draft_ids", "draft_probs")
VOCAB_MAPPING_MODES = ("auto", "tli", "slem", "none")
# A verify block (the pending token and K drafts) stays within the rows the CPU kernels compute exactly as
# one-token steps (graphspec.kernels.EXACT_ROWS_MAX), which is also the widest tree mask.
MAX_SPECULATIVE_TOKENS = EXACT_ROWS_MAX - 1
# draft_confidence_threshold="auto": the first for a draft that shares the target's tokenizer, the second for
# one that does not (graphspec.defaults, where every "auto" is decided).
DEFAULT_DRAFT_CONFIDENCE_THRESHOLD: float | None = _defaults.SAME_VOCAB_CONFIDENCE
CROSS_VOCAB_DRAFT_CONFIDENCE_THRESHOLD: float | None = _defaults.CROSS_VOCAB_CONFIDENCE


@dataclass
class GenerationResult:
    text: str                   # generated text (no EOS, no stop string); "" when the target has no tokenizer
    token_ids: list[int]        # generated ids, EOS included when generation ended on one
    stats: GenerationStats
    finish_reason: str = "length"  # "eos" | "stop" | "length"
    prompt_token_ids: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text


def build_graph(verify: Stage, drafter: Stage | None = None, acceptance: Stage | None = None,
                between: Sequence[Stage] = ()) -> Graph:
    """``draft -> [between...] -> verify -> accept``, or ``verify -> accept`` without a drafter."""
    acceptance = acceptance if acceptance is not None else RejectionSampling()
    if drafter is None:
        if between:
            raise ValueError("stages between draft and verify need a drafter")
        return Graph([verify, acceptance], inputs=STEP_INPUTS + _NO_DRAFT_INPUTS, outputs=STEP_OUTPUTS)
    return Graph([drafter, *between, verify, acceptance], inputs=STEP_INPUTS, outputs=STEP_OUTPUTS)


# ------------------------------------------------------------------------------------------ helpers

def _gguf_weights(model_or_path, weights) -> bool:
    """Whether a model the pipeline loads keeps GGUF block weights (asked for, or a .gguf file)."""
    from graphspec.models.loader import GGUF_WEIGHTS

    return weights in GGUF_WEIGHTS or (isinstance(model_or_path, (str, Path)) and str(model_or_path).endswith(".gguf"))


def _load(model_or_path, what: str, dtype, device, backend, quantize=None, weights=None):
    if isinstance(model_or_path, (str, Path)):
        from graphspec.models.loader import load_model

        if _gguf_weights(model_or_path, weights):  # block weights compute in fp32 whatever the pipeline's dtype
            dtype = None
        return load_model(model_or_path, dtype=dtype, device=device or "cpu", backend=backend, quantize=quantize,
                          weights=weights)
    if weights is not None:
        raise ValueError(f"{what}_weights={weights!r} applies when the pipeline loads the {what} (a path or zoo "
                         f"name); this one is already loaded: load it with load_model(..., weights={weights!r})")
    if quantize is not None:
        raise ValueError(f"draft_quantize={quantize!r} applies when the pipeline loads the draft (a path or zoo "
                         f"name); this draft is already loaded: load it with load_model(..., quantize={quantize!r})")
    for attr in ("step", "new_cache", "config", "device"):
        if not hasattr(model_or_path, attr):
            raise ValueError(f"{what} must be a checkpoint directory, a zoo name or a loaded graphspec model; "
                             f"got a {type(model_or_path).__name__} without .{attr}")
    return model_or_path


def _tokenizer(model):
    return getattr(model, "tokenizer", None)


def _same_vocabulary(target, draft) -> bool:
    tt, dt = _tokenizer(target), _tokenizer(draft)
    if tt is None and dt is None:
        return target.config.vocab_size == draft.config.vocab_size
    if tt is None or dt is None:
        return False
    if tt.fingerprint and tt.fingerprint == dt.fingerprint:
        return True
    return tt.get_vocab() == dt.get_vocab()


def _vocab_stage(target, draft, mode: str, confidence_threshold: float | None = None,
                 draft_vocab=None, siblings: int = 0, beam: int = 0,
                 beam_threshold: float | str | None = "auto") -> tuple[Stage, Stage] | None:
    """``(drafter, map stage)`` for a draft with another tokenizer, or None when they share one.

    The single hook for cross-vocabulary drafting (``graphspec.vocab_stages``): the drafter keeps
    its own token list in step with the committed text and the map stage runs between draft and
    verify. ``mode``: "auto", "tli" or "slem" (see vocab_stages); ``"none"`` trusts that the ids are
    shared (tiny test models without tokenizers).
    """
    if mode not in VOCAB_MAPPING_MODES:
        raise ValueError(f"vocab_mapping={mode!r} is not one of {VOCAB_MAPPING_MODES}")
    if mode == "none" or _same_vocabulary(target, draft):
        return None
    tt, dt = _tokenizer(target), _tokenizer(draft)
    if tt is None or dt is None:
        which = "the target" if tt is None else "the draft"
        raise ValueError(f"different vocabularies: {which} has no tokenizer, so graphspec cannot tell whether "
                         f"draft and target ids mean the same tokens; give both a tokenizer, or pass "
                         f"vocab_mapping='none' if they share one vocabulary")
    from graphspec.vocab_stages import vocab_stages

    return vocab_stages(target, draft, mode, confidence_threshold=confidence_threshold, draft_vocab=draft_vocab,
                        siblings=siblings, beam=beam, beam_threshold=beam_threshold)


def _check_positive_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")  # any of the 2**64 seeds


# ------------------------------------------------------------------------------------------ text

class _TextSink:
    """Incremental text with stop strings: push ids, get safe text out, learn where a stop string ended."""

    def __init__(self, tokenizer, stop: list[str]):
        from graphspec.models.tokenizer import StreamDecoder

        self.decoder = StreamDecoder(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.given = 0        # characters already handed out by take()
        self.stopped = False

    def _check(self, before: int) -> bool:
        start = max(0, before - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def push(self, ids: list[int]) -> int:
        """Feed ids; returns how many were consumed (fewer than given when a stop string completed)."""
        if not self.stop:
            self.text += self.decoder.push(ids)
            return len(ids)
        for n, i in enumerate(ids, 1):
            before = len(self.text)
            self.text += self.decoder.push(i)
            if self._check(before):
                return n
        return len(ids)

    def finish(self) -> None:
        if not self.stopped:
            before = len(self.text)
            self.text += self.decoder.flush()
            if self.stop:
                self._check(before)

    def take(self, final: bool = False) -> str:
        """The text not handed out yet, minus a tail that could still start a stop string."""
        end = len(self.text) if (final or self.stopped) else max(self.given, len(self.text) - self.hold)
        out = self.text[self.given:end]
        self.given = end
        return out


# ------------------------------------------------------------------------------------------ pipeline

class Pipeline:
    """Speculative decoding with a draft (a model, ``"ngram"``, or a drafter stage), or plain decoding.

    ``target`` / ``draft``: a checkpoint directory, a zoo name, or a loaded graphspec model
    (strings load with ``dtype``, ``device``, ``backend``; ``dtype="auto"`` is the CLI's rule, bf16 where bf16
    weights run at memory speed; a string draft goes to the target's
    device). ``draft="ngram"`` is prompt lookup with ``max_ngram``; a ``Stage`` is used as the
    drafter as is. ``acceptance``: None (``RejectionSampling``, exact match at temperature 0),
    ``"greedy"``, ``"rejection"`` or a ``Stage``. ``vocab_mapping``: for a draft with another tokenizer,
    "tli", "slem" (greedy only) or "auto" (see ``graphspec.vocab_stages``); "none" trusts shared ids.
    ``sync_timing``: synchronise the device around stage timers (default: on CUDA).
    ``draft_confidence_threshold``: a model draft stops early in a step once its own probability of the
    token it proposed falls below this (lossless: the count depends only on the draft); None: always K.
    "auto" (the default): ``DEFAULT_DRAFT_CONFIDENCE_THRESHOLD`` (0.4) for a draft with the target's
    tokenizer, ``CROSS_VOCAB_DRAFT_CONFIDENCE_THRESHOLD`` (0.3) for a draft with another one.

    The draft settings default to "auto", the CLI's defaults, decided in ``graphspec.defaults``; pass a
    plain value for each plain choice (``draft_quantize=None, draft_vocab=None, draft_siblings=0,
    draft_confidence_threshold=None``). ``describe()`` (and ``print(pipe)``) says what was chosen and why.
    ``target_weights="gguf"`` / ``draft_weights="gguf"``: load that model (a .gguf file or a zoo name) in its
    GGUF block formats as the file stores them, fp32 activations (``load_model(..., weights="gguf")``; a .gguf
    path implies it); a GGUF draft is not quantized again. ``"gguf-a8"``: the same blocks, the k-quants'
    products on activations rounded to int8 (llama.cpp's arithmetic; faster on a CPU; CPU only).
    ``draft_quantize="int8"``: load a model draft (path or zoo name) with int8 GEMM weights, CPU only:
    a draft step then reads half the bytes of bf16 (lossless too: only the target decides the output).
    ``"int4"``: the same, with the draft's one- to three-token steps in 4 bits (``load_model``'s
    ``quantize="int4"``; the amx, avx512 or avx2 level): cheaper draft steps, lower acceptance. "auto" (the default):
    int8 for a draft the pipeline loads on a CPU; None (as loaded) elsewhere and for a loaded draft.
    ``draft_vocab``: prune a model draft's vocabulary to its ``n`` lowest ids (plus special tokens) or to
    given ids (``graphspec.drafters.DraftHead``): a smaller lm_head per draft token; lossless. "auto"
    (the default): ``AUTO_DRAFT_VOCAB`` ids for an int8 draft, the whole vocabulary for any other.
    ``draft_siblings=n``: a draft tree. Besides its chain, a model draft proposes up to n alternative
    tokens as leaves beside chain tokens, where it is least sure, in the verify rows the chain left
    unused (a step still verifies at most K + 1 rows); ``TreeVerify`` checks all branches in one forward
    and ``TreeAcceptance`` keeps the longest accepted path (greedy, or recursive rejection sampling:
    lossless at every temperature). Across tokenizers, TLI maps each sibling to its one target id and
    SLEM re-tokenizes each sibling's text into a branch of target ids (``graphspec.vocab_stages``).
    "auto" (the default): ``AUTO_DRAFT_SIBLINGS`` for a model draft, a chain for prompt lookup, a drafter
    stage, a hybrid draft and an acceptance rule other than rejection sampling.
    ``draft_beam=w`` (a CPU model draft, greedy runs): the draft grows its tree best first instead, each
    forward after the first expanding its w likeliest paths as w rows, and proposes its K likeliest nodes
    (``graphspec.drafters.grow_beam``; across tokenizers each leaf's text is re-tokenized for the target);
    K then bounds the tree's draft tokens, its depth and its target rows, and ``draft_confidence_threshold``
    is the path probability below which it stops growing ("auto": the drafter's own,
    ``graphspec.drafters.SAME_VOCAB_BEAM_STOP_PROBABILITY``, 0.25, for a draft with the target's tokenizer,
    ``BEAM_STOP_PROBABILITY``, 0.15, across tokenizers; None: never). Pays where extra verify rows are
    cheap (AMX CPUs, with a larger K); sampled runs draft as without it. 0 (the default): no beam.
    ``draft_length="auto"`` (a model draft, chain or tree; greedy runs): each step drafts the k in 1..K that
    promises the most tokens per second, from this machine's forward costs (the target's verify of 1..K + 1
    rows and one draft step, timed on the first greedy run: a few forwards of each) and the acceptance per
    draft position over the run's recent steps (``graphspec.engine.AutoDraftLength``). It drafts less where the
    draft is often wrong (chat, prose) and where one more verify row costs more than it returns. With
    ``draft="suffix"`` it sizes each step's suffix tree instead: the first n of its best-first nodes, n in 0..K,
    from the same verify costs and the acceptance so far per class of match length
    (``graphspec.suffix.SuffixLength``); give it a larger K (16) to propose long copies where rows are cheap. A
    hybrid's suffix trees are sized so too (its model steps keep drafting at most ``HYBRID_MODEL_K``, and its rule
    weighs each tree's verify time against a model step's).
    Same tokens, other stats; sampled runs draft K as before (a seed keeps giving one sample). "fixed" (the
    default): K.
    ``prefix_cache``: True (a ``graphspec.PrefixCache`` of 1 GiB), a budget in bytes, or a ``PrefixCache`` to share
    between pipelines: each finished run's KV rows are kept, and a later run whose prompt begins with the same
    tokens copies them and prefills only the rest (chats, agent loops; CPU targets). The target's prefills then run
    row-exact, so a hit gives the cold run's output bit for bit (``graphspec.prefix_cache``). "auto" (what
    ``graphspec serve`` uses): 1 GiB where that row-exact prefill costs what a batched one does (a bf16 target on
    the C++ linear, a ``gguf-a8`` target; ``graphspec.prefix_cache.free_exact_prefill``), else none. False (the
    default): none, prefills batched.
    """

    def __init__(self, target, draft=None, num_speculative_tokens: int = 5, *, acceptance=None,
                 max_ngram: int = 3, vocab_mapping: str = "auto", dtype=None, device=None, backend=None,
                 sync_timing: bool | None = None,
                 draft_confidence_threshold: float | str | None = "auto",
                 draft_quantize: str | None = "auto", draft_vocab="auto", draft_siblings: int | str = "auto",
                 draft_beam: int = 0, target_weights: str | None = None, draft_weights: str | None = None,
                 draft_length: str = "fixed", prefix_cache=False):
        self.num_speculative_tokens = _check_positive_int("num_speculative_tokens", num_speculative_tokens)
        if not (isinstance(draft_length, str) and draft_length in ("fixed", "auto")):
            raise ValueError(f"draft_length must be 'fixed' (K drafts a step) or 'auto' (1..K a step, from this "
                             f"machine's forward costs and the acceptance so far), got {draft_length!r}")
        if num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} makes a verify block of "
                             f"{num_speculative_tokens + 1} rows, beyond the {EXACT_ROWS_MAX} up to which each row "
                             f"is computed exactly as a one-token step (and the widest tree attention takes); "
                             f"use at most {MAX_SPECULATIVE_TOKENS}")
        siblings = check_siblings(draft_siblings, allow_auto=True)
        beam = check_beam(draft_beam)
        threshold = check_confidence_threshold(draft_confidence_threshold, allow_auto=True)
        if vocab_mapping not in VOCAB_MAPPING_MODES:
            raise ValueError(f"vocab_mapping={vocab_mapping!r} is not one of {VOCAB_MAPPING_MODES}")
        if isinstance(dtype, str) and dtype == "auto":  # the CLI's --dtype auto (graphspec.defaults)
            dtype = _defaults.auto_dtype(device or "cpu")
        self.target = _load(target, "target", dtype, device, backend, weights=target_weights)
        self.prefix_cache = check_prefix_cache(prefix_cache, self.target)
        self._prefix_cache_auto = isinstance(prefix_cache, str) and prefix_cache == "auto"
        self.vocab_mapping = vocab_mapping
        self.draft = None  # the draft model, when there is one

        drafter: Stage | None
        between: list[Stage] = []
        # draft=[model, "suffix"]: a hybrid (graphspec.suffix.HybridDrafter) over that model draft
        hybrid = isinstance(draft, (list, tuple))
        if hybrid:
            if len(draft) != 2 or not (isinstance(draft[1], str) and draft[1] == "suffix") or (
                    isinstance(draft[0], str) and draft[0] in ("ngram", "suffix")) or isinstance(draft[0], Stage):
                raise ValueError(f"a hybrid draft is [model, 'suffix'] (a model path, zoo name or loaded model, then "
                                 f"'suffix'), got {draft!r}")
            draft = draft[0]
        model_draft = not (draft is None or isinstance(draft, Stage) or (isinstance(draft, str)
                                                                         and draft in ("ngram", "suffix")))
        if draft_quantize not in (None, "auto") and not model_draft:
            raise ValueError(f"draft_quantize={draft_quantize!r} needs a model draft (a path or zoo name), "
                             f"got draft={draft!r}")
        if draft_vocab not in (None, "auto") and not model_draft:
            raise ValueError(f"draft_vocab needs a model draft, got draft={draft!r}")
        choices = _defaults.DraftChoices(draft="model" if model_draft else "none" if draft is None else
                                         "stage" if isinstance(draft, Stage) else str(draft), beam=beam)
        if model_draft:
            quantize = _defaults.draft_quantize(draft_quantize, device or self.target.device,
                                                loads_draft=isinstance(draft, (str, Path)))
            choices.quantize = quantize
            choices.quantize_why = (("auto: int8 for a draft loaded on a CPU" if quantize else
                                     "auto: int8 only for a draft the pipeline loads on a CPU")
                                    if draft_quantize == "auto" else "as asked")
        else:
            draft_vocab = None
        choices.siblings_why = "as asked"
        if siblings == "auto":
            tree_rule = acceptance in (None, "rejection")  # a hybrid's model steps take a tree too
            siblings = _defaults.draft_siblings("auto", model_draft, tree_rule)
            choices.siblings_why = ("auto: a tree for a model draft" if siblings else
                                    "auto: a chain, the acceptance rule asked for takes no tree"
                                    if model_draft else "auto: a chain")
        choices.siblings = siblings
        if siblings and not model_draft:
            raise ValueError(f"draft_siblings={siblings} needs a model draft (a path, zoo name or loaded model) that "
                             f"ranks alternatives, got draft={draft!r}")
        if beam and not model_draft:
            raise ValueError(f"draft_beam={beam} grows a model draft's tree, got draft={draft!r}")
        from graphspec.suffix import SuffixDrafter

        suffix_draft = not hybrid and (isinstance(draft, SuffixDrafter) or isinstance(draft, str) and draft == "suffix")
        if draft_length == "auto" and not suffix_draft and (not model_draft or beam):
            raise ValueError("draft_length='auto' times a model draft's forwards against the target's, or sizes a "
                             "suffix draft's trees: give draft a model (a path, zoo name or loaded model), "
                             "'suffix' or [model, 'suffix'], and no draft_beam; got "
                             f"draft={draft!r}" + (f", draft_beam={beam}" if beam else ""))
        self.draft_length = draft_length
        if draft is None:
            drafter = None
        elif isinstance(draft, Stage):
            drafter = draft
        elif isinstance(draft, str) and draft == "ngram":
            drafter = NgramDrafter(max_ngram=max_ngram)
        elif isinstance(draft, str) and draft == "suffix":
            drafter = SuffixDrafter()
        else:
            self.draft = _load(draft, "draft", dtype, device or self.target.device, backend,
                               None if _gguf_weights(draft, draft_weights) and draft_quantize == "auto" else quantize,
                               draft_weights)
            choices.quantize = getattr(self.draft, "quantize", None)  # what its weights are, as loaded
            if not isinstance(draft, (str, Path)):
                choices.quantize_why = "as loaded"  # by the caller
            elif draft_quantize == "auto" and _gguf_weights(draft, draft_weights):
                choices.quantize_why = "auto: a GGUF draft stays in its own block formats"
            if torch.device(self.draft.device) != torch.device(self.target.device):
                raise ValueError(f"draft is on {self.draft.device} but target is on {self.target.device}; "
                                 f"load both on one device (device=...)")
            cross = _vocab_stage(self.target, self.draft, vocab_mapping,
                                 _defaults.confidence_threshold(threshold, cross_vocab=True),
                                 draft_vocab, siblings, beam,
                                 threshold)
            choices.confidence = _defaults.confidence_threshold(threshold, cross_vocab=cross is not None)
            choices.confidence_why = ("as asked" if threshold != "auto" else
                                      "auto: a draft with another tokenizer" if cross is not None else
                                      "auto: a draft with the target's tokenizer")
            kept = draft_vocab_ids(self.draft, draft_vocab)
            choices.vocab = None if kept is None else (int(kept.numel()), self.draft.config.vocab_size)
            choices.vocab_why = (("auto: an int8 draft's head is pruned" if kept is not None else
                                  "auto: pruned only for an int8 draft") if draft_vocab == "auto" else "as asked")
            if cross is None:
                drafter = ModelDrafter(self.draft, draft_vocab=draft_vocab, siblings=siblings, beam=beam,
                                       confidence_threshold=_defaults.confidence_threshold(threshold, False),
                                       beam_threshold=threshold)
            else:
                drafter, mapper = cross
                between.append(mapper)
        self.choices = choices  # what the draft settings came to, and why (describe())

        verify: Stage = Verify(self.target)
        if hybrid:
            from graphspec.suffix import HybridDrafter

            drafter = HybridDrafter([drafter, *between])
            between = []
        # draft_length="auto" with suffix trees (alone or in a hybrid): a SuffixLength sizes them
        self._suffix_auto = None
        if draft_length == "auto" and (suffix_draft or hybrid):
            self._suffix_auto = drafter.suffix if hybrid else drafter
        if siblings or beam or (drafter is not None and "draft_parents" in drafter.writes):
            if acceptance not in (None, "rejection"):
                what = (f"draft_siblings={siblings}" if siblings else f"draft_beam={beam}" if beam
                        else f"the {type(drafter).__name__} draft")
                raise ValueError(f"{what} verifies a draft tree, which needs its own acceptance "
                                 f"rule (TreeAcceptance, greedy and sampling); leave acceptance=None, got "
                                 f"{acceptance!r}")
            acceptance = TreeAcceptance()
            verify = TreeVerify(self.target)
        if acceptance is None or acceptance == "rejection":
            rule: Stage = RejectionSampling()
        elif acceptance == "greedy":
            rule = GreedyAcceptance()
        elif isinstance(acceptance, Stage):
            rule = acceptance
        else:
            raise ValueError(f"acceptance must be None, 'greedy', 'rejection' or a Stage; got {acceptance!r}")
        self._graph = build_graph(verify, drafter, rule, between)
        dev = torch.device(self.target.device)
        self.sync_timing = (dev.type == "cuda") if sync_timing is None else bool(sync_timing)

    # A callable (stats, K) -> the draft length of the next step (the batched engine's speculation policy);
    # None: K every step.
    _draft_budget = None
    _auto_length = None  # draft_length="auto": its AutoDraftLength, made on the first greedy run

    def _auto_draft_length(self, k: int):
        """draft_length="auto"'s rule, its forward costs timed on the first call (a few forwards of each model)."""
        from graphspec.engine import AutoDraftLength

        if self._suffix_auto is not None:  # a suffix draft sizes its own trees (graphspec.suffix.SuffixLength)
            from graphspec.suffix import SuffixLength

            if self._suffix_auto.length is None or self._suffix_auto.length.max_k < k:
                with use_backend(getattr(self.target, "backend", None)):
                    self._suffix_auto.length = SuffixLength.measure(self.target, k)
            return None
        if self._auto_length is None:
            # a draft tree's siblings fill the rows its chain leaves, up to K
            with use_backend(getattr(self.target, "backend", None)):
                self._auto_length = AutoDraftLength.measure(self.target, self.draft, k,
                                                            siblings=self.choices.siblings)
        return self._auto_length

    def _rebound(self, models: list[tuple[object, object]]) -> "Pipeline":
        """A shallow copy whose stages call ``new`` wherever they called model ``old``, for each
        ``(old, new)`` in ``models`` (the batched engine's proxies); options and stages otherwise shared."""
        import copy

        swap = {id(old): new for old, new in models}

        def rebind(stage: Stage) -> Stage:
            """The stage's twin; stages it refers to (a hybrid's model drafter, the map stage's drafter) become
            their twins too, one twin per stage, so the copies refer to each other as the originals do."""
            if id(stage) in swap:
                return swap[id(stage)]
            twin = copy.copy(stage)
            swap[id(stage)] = twin
            for name, value in list(vars(twin).items()):
                if id(value) in swap:
                    setattr(twin, name, swap[id(value)])
                elif isinstance(value, Stage):
                    setattr(twin, name, rebind(value))
            return twin

        pipe = copy.copy(self)
        graph = self._graph
        for stage in self._graph:
            graph = graph.replace(stage.name, rebind(stage))
        pipe._graph = graph
        pipe.target = swap.get(id(self.target), self.target)
        pipe.draft = swap.get(id(self.draft), self.draft) if self.draft is not None else None
        return pipe

    def run_batch(self, prompts: Sequence, max_batch: int = 16, policy="off", **kwargs) -> list[GenerationResult]:
        """``run`` for each of ``prompts`` (same keyword arguments), the sequences batched together by
        ``graphspec.engine.Engine``: each result is the one ``run`` gives alone. ``policy="auto"`` lets greedy
        sequences draft fewer tokens where verify rows cost more than they return (same tokens, other stats)."""
        from graphspec.engine import Engine

        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            raise ValueError("run_batch takes a list of prompts (each a string, token ids or chat messages)")
        engine = Engine(self, max_batch=max_batch, max_queue=len(prompts), policy=policy)
        return engine.run_batch(list(prompts), **kwargs)

    # ----------------------------------------------------------------------------- graph

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def speculative(self) -> bool:
        return "draft_ids" in self._graph.written

    def replace_stage(self, name: str, stage: Stage) -> "Pipeline":
        """Swap one stage (validated against the rest of the graph); returns self."""
        self._graph = self._graph.replace(name, stage)
        return self

    def insert_stage(self, stage: Stage, *, before: str | None = None, after: str | None = None) -> "Pipeline":
        """Add a stage before or after a named one (validated); returns self."""
        if (before is None) == (after is None):
            raise ValueError("insert_stage needs exactly one of before= or after=")
        self._graph = (self._graph.insert_before(before, stage) if before is not None
                       else self._graph.insert_after(after, stage))
        return self

    @property
    def tokenizer(self):
        return _tokenizer(self.target)

    def __repr__(self) -> str:
        return f"Pipeline({self._graph!r}, K={self.num_speculative_tokens})"

    def describe(self) -> str:
        """What this pipeline runs: its stages, K, and each draft setting with why it was chosen."""
        stages = " -> ".join(stage.name for stage in self._graph)
        lines = [f"Pipeline: {stages}, K={self.num_speculative_tokens}"]
        if self.prefix_cache is not None:
            why = f"; auto: {free_exact_prefill(self.target)}" if self._prefix_cache_auto else ""
            lines.append(f"  prefix cache: {self.prefix_cache!r} (the target's prefills row-exact{why})")
        elif self._prefix_cache_auto:
            lines.append("  prefix cache: none (auto: only where a miss costs nothing, a CPU target in bf16 on the C++ "
                         "linear or gguf-a8 at a C++ level)")
        return "\n".join(lines + ["  " + line for line in self.choices.lines()])

    __str__ = describe

    # ----------------------------------------------------------------------------- inputs

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or chat messages."""
        tok = self.tokenizer
        vocab = self.target.config.vocab_size
        if isinstance(prompt, str):
            if tok is None:
                raise ValueError("prompt is a string but the target has no tokenizer; pass token ids")
            check_text(prompt, "prompt")
            ids = tok.encode(prompt)
        elif isinstance(prompt, torch.Tensor):
            if prompt.ndim != 1 or prompt.dtype.is_floating_point:
                raise ValueError(f"prompt as a tensor must be 1-D integer ids, got shape {tuple(prompt.shape)} "
                                 f"dtype {prompt.dtype}")
            ids = [int(i) for i in prompt.tolist()]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if tok is None or not tok.has_chat_template:
                raise ValueError("prompt is a list of chat messages but the target's tokenizer has no chat template; "
                                 "pass a string or token ids")
            for i, m in enumerate(prompt):
                check_message(m, i)
            ids = tok.encode(tok.apply_chat_template(list(prompt), add_generation_prompt=True),
                             add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
                raise ValueError("prompt must be a string, a list of int token ids, or a list of "
                                 "{'role', 'content'} messages")
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or chat messages, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (it encodes to no tokens); give at least one token")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt holds token ids outside [0, {vocab}) of the target vocabulary: {bad[:5]}")
        return ids

    def _prepare(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop):
        if seed is not None:
            check_seed(seed)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        _check_positive_int("max_new_tokens", max_new_tokens)
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        for s in stops:
            check_text(s, "a stop string")
        if any(s == "" for s in stops):
            raise ValueError("stop holds an empty string, which would stop before the first token")
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need text, but the target has no tokenizer")
        for stage in self._graph:
            stage.check(params)
        ids = self.encode_prompt(prompt)
        # The last verify of a run reaches position len(ids) + max_new_tokens - 2 (drafts never run
        # past max_new_tokens), so this is the exact requirement on both models.
        need = len(ids) + max_new_tokens
        for what, model in (("target", self.target), ("draft", self.draft)):
            if model is None:
                continue
            limit = model.config.max_position_embeddings
            if need > limit:
                raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                                 f"the {what}'s max_position_embeddings={limit}; shorten the prompt or lower "
                                 f"max_new_tokens")
        return ids, params, stops

    # ----------------------------------------------------------------------------- generation

    def _steps(self, ids: list[int], max_new_tokens: int, params: SamplingParams, ignore_eos: bool,
               stats: GenerationStats, outcome: dict) -> Iterator[list[int]]:
        """Run the graph until done; yields the ids each step commits."""
        target = self.target
        graph = self._graph
        device = torch.device(target.device)
        K = self.num_speculative_tokens if self.speculative else 0
        capacity = len(ids) + max_new_tokens
        run = RunInfo(target=target, vocab_size=target.config.vocab_size, device=device,
                      capacity=capacity, prompt_len=len(ids), num_speculative_tokens=K,
                      prefix_cache=self.prefix_cache)
        state = State(run)
        gen = seeded_generator(params.seed if params.seed is not None else _random_seed(), device)
        state.tokens = list(ids)
        # The committed ids on the device too, so stages slice their inputs without host->device
        # copies; each step writes its whole emitted row at len(tokens) (the -1 tail is scratch).
        buffer = torch.empty(capacity + K + 1, dtype=torch.int64, device=device)
        buffer[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
        state.token_buffer = buffer
        state.params = params
        state.generator = gen
        if not self.speculative:
            state.draft_ids = torch.empty(1, 0, dtype=torch.int64, device=device)
            state.draft_probs = None
        eos = set() if ignore_eos else set(target.config.eos_token_ids) | set(
            getattr(self.tokenizer, "eos_token_ids", None) or ())
        backend = getattr(target, "backend", None)
        sync = self.sync_timing
        stats.num_speculative_tokens = K
        stats.prompt_tokens = len(ids)
        stats.accepted_per_position = [0] * K
        stats.proposed_per_position = [0] * K
        stats.tested_per_position = [0] * K

        def clock() -> float:
            if sync:
                torch.cuda.synchronize(device)
            return time.perf_counter()

        budget = self._draft_budget
        if budget is None and K and params.temperature == 0 and self.draft_length == "auto":
            rule = self._auto_draft_length(K)
            budget = None if rule is None else rule.for_run()
        try:
            t0 = clock()
            with use_backend(backend):
                graph.begin(state)
            stats.prefill_seconds = clock() - t0
            stats.cached_prompt_tokens = run.extra.get("prefix_reused", 0)
            produced = 0
            while produced < max_new_tokens:
                run.extra["settled"] = False  # a step under way: its caches may hold half of it
                t0 = clock()
                remaining = max_new_tokens - produced
                state.clear(graph.written)
                k = K if budget is None or not K else budget(stats, K)
                state.num_draft = min(k, remaining - 1)
                with use_backend(backend):
                    graph.run(state, stats.stage_seconds, sync=sync, device=device)
                emitted = state.emitted[0]
                n = len(state.tokens)
                buffer[n:n + emitted.shape[0]] = emitted
                row = emitted.tolist()  # the step's one host sync
                valid = row.index(-1) if -1 in row else len(row)
                if valid < 1:
                    raise RuntimeError(f"the accept stage emitted no token (emitted={row}); it must emit at least one")
                stats.record_step(int(state.draft_ids.shape[1]), valid - 1,
                                  state.draft_parents if "draft_parents" in state else None)
                new = row[:min(valid, remaining)]
                if eos:
                    for i, t in enumerate(new):
                        if t in eos:
                            new = new[:i + 1]
                            outcome["reason"] = "eos"
                            break
                state.tokens.extend(new)
                produced += len(new)
                stats.generated_tokens = produced
                stats.decode_seconds += time.perf_counter() - t0
                run.extra["settled"] = True  # between steps: the caches hold committed tokens (and rejected rows)
                yield new
                if outcome.get("reason") == "eos":
                    return
        finally:
            stats.target_forwards = run.target_forwards
            stats.draft_forwards = run.draft_forwards
            stats.vocab = run.extra.get("vocab")
            stats.tree = run.extra.get("tree")
            for stage in graph:  # stages that learn from a finished generation (graphspec.suffix)
                end = getattr(stage, "end", None)
                if end is not None:
                    end(state)

    def _generate(self, ids, max_new_tokens, params, ignore_eos, stops) -> Iterator[str]:
        """Yields text pieces as tokens are committed; returns the GenerationResult."""
        stats = GenerationStats()
        outcome: dict = {}
        tok = self.tokenizer
        sink = _TextSink(tok, stops) if tok is not None else None
        out: list[int] = []
        steps = self._steps(ids, max_new_tokens, params, ignore_eos, stats, outcome)
        try:
            for new in steps:
                if sink is not None:
                    text_ids = new[:-1] if outcome.get("reason") == "eos" else new
                    used = sink.push(text_ids)
                    if sink.stopped:
                        new = new[:used]
                        outcome["reason"] = "stop"
                    piece = sink.take()
                    if piece:
                        yield piece
                out.extend(new)
                if sink is not None and sink.stopped:
                    break
        finally:
            steps.close()
        if sink is not None:
            sink.finish()
            if sink.stopped:
                outcome["reason"] = "stop"
            piece = sink.take(final=True)
            if piece:
                yield piece
        stats.generated_tokens = len(out)
        return GenerationResult(text=sink.text if sink is not None else "", token_ids=out, stats=stats,
                                finish_reason=outcome.get("reason", "length"), prompt_token_ids=list(ids))

    def run(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            seed: int | None = None, ignore_eos: bool = False, stop: str | Sequence[str] | None = None
            ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (a string, token ids, or chat messages)."""
        ids, params, stops = self._prepare(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop)
        gen = self._generate(ids, max_new_tokens, params, bool(ignore_eos), stops)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False,
               stop: str | Sequence[str] | None = None) -> Iterator[str]:
        """Like ``run`` but yields text as it is accepted; the generator's return value is the result.

        Arguments are checked here, before the first ``next``.
        """
        if self.tokenizer is None:
            raise ValueError("stream() yields text, but the target has no tokenizer; use run() with token ids")
        ids, params, stops = self._prepare(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop)
        return self._generate(ids, max_new_tokens, params, bool(ignore_eos), stops)
