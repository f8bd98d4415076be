"""What "auto" means for a draft's settings, decided here once: ``Pipeline`` and the CLI both read it.

Every rule changes only how the draft proposes, never the output (the target decides every token), and
each is the setting the end-to-end benchmarks measured fastest (perf/RESULTS.md, perf/results.csv):

- ``draft_quantize="auto"``: int8 GEMM weights for a model draft the pipeline loads on a CPU, where a draft
  step is bound by the bytes it reads; as loaded on other devices (the int8 GEMM is a CPU path) and for a
  draft you loaded yourself (it is used as given).
- ``draft_vocab="auto"``: an int8 draft's lm_head keeps its ``AUTO_DRAFT_VOCAB`` lowest ids plus every special
  token (its head is the largest share of its bytes); any other draft keeps its whole vocabulary.
- ``draft_siblings="auto"``: ``AUTO_DRAFT_SIBLINGS`` next-best tokens beside a model draft's chain (a draft
  tree); a chain for prompt lookup, for a drafter stage of your own, and with an acceptance rule other than
  rejection sampling (a tree needs ``TreeAcceptance``).
- ``draft_confidence_threshold="auto"``: a draft stops proposing once its own probability of a token falls
  below ``SAME_VOCAB_CONFIDENCE`` (the target's tokenizer) or ``CROSS_VOCAB_CONFIDENCE`` (another tokenizer,
  whose shorter tokens carry less text each, so its chains pay to run deeper).
- ``dtype="auto"`` (the CLI's ``--dtype auto``; ``Pipeline(dtype="auto")``): bf16 on CUDA and on CPUs where bf16
  weights run at memory speed, fp32 elsewhere (emulated bf16 would be slower than fp32). ``Pipeline``'s own
  default stays the checkpoint's dtype, so a model loads as stored unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import re

import torch

from graphspec.drafters import AUTO_DRAFT_SIBLINGS, AUTO_DRAFT_VOCAB

__all__ = ["AUTO_DRAFT_SIBLINGS", "AUTO_DRAFT_VOCAB", "SAME_VOCAB_CONFIDENCE", "CROSS_VOCAB_CONFIDENCE",
           "DraftChoices", "draft_quantize", "draft_siblings", "confidence_threshold", "auto_dtype"]

SAME_VOCAB_CONFIDENCE = 0.4
CROSS_VOCAB_CONFIDENCE = 0.3
QUANTIZE_CHOICES = ("auto", "int8", "int4", None, "none")


def cpu_has_bf16() -> bool:
    """True when bf16 weights run at about memory speed here: the CPU backend's level has a bf16 linear (amx,
    avx512, avx2: graphspec.kernels.cpu), or the CPU has native bf16 dot products (AMX) for oneDNN."""
    from graphspec.kernels import cpu

    if cpu.bf16_linear():
        return True
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def auto_dtype(device) -> torch.dtype:
    """dtype "auto": bf16 on CUDA and on CPUs where bf16 weights run at memory speed, fp32 elsewhere."""
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and cpu_has_bf16()):
        return torch.bfloat16
    return torch.float32


def draft_quantize(choice, device, loads_draft: bool = True) -> str | None:
    """The draft's weight quantization: "auto" is int8 on a CPU when the pipeline loads the draft, else None.

    ``choice``: "auto", "int8", "int4", or None / "none" (weights as loaded); ``device``: where the draft runs;
    ``loads_draft``: False for a draft model passed in already loaded, which "auto" leaves as it is.
    """
    if choice not in QUANTIZE_CHOICES:
        raise ValueError(f"draft_quantize={choice!r} is not one of 'auto', 'int8', 'int4', None")
    kind = torch.device(device).type
    if choice == "auto":
        return "int8" if kind == "cpu" and loads_draft else None
    if choice in ("int8", "int4") and kind != "cpu":
        raise ValueError(f"draft_quantize={choice!r} runs on the CPU only (graphspec's int8 GEMM), but the device "
                         f"is {device}; use draft_quantize=None there")
    return None if choice == "none" else choice


def draft_siblings(choice, model_draft: bool, tree_acceptance: bool = True) -> int:
    """Sibling leaves a step: "auto" is ``AUTO_DRAFT_SIBLINGS`` for a model draft whose pipeline may verify a
    tree (``tree_acceptance``: no other acceptance rule was asked for), 0 (a chain) otherwise."""
    if choice == "auto":
        return AUTO_DRAFT_SIBLINGS if model_draft and tree_acceptance else 0
    return choice


def confidence_threshold(choice, cross_vocab: bool) -> float | None:
    """The early-stop threshold of a chain: "auto" by tokenizer (see the module docstring), else as given."""
    if choice == "auto":
        return CROSS_VOCAB_CONFIDENCE if cross_vocab else SAME_VOCAB_CONFIDENCE
    return choice


@dataclass
class DraftChoices:
    """What a pipeline's draft settings came to, with the reason for each ("auto" or as asked)."""

    draft: str = "none"                     # "model", "ngram", "stage" or "none"
    quantize: str | None = None             # the draft's weights: "int8", "int4" or None (as loaded)
    quantize_why: str = ""
    vocab: tuple[int, int] | None = None    # (ids kept, vocabulary size) of a pruned draft head, None: all
    vocab_why: str = ""
    siblings: int = 0
    siblings_why: str = ""
    beam: int = 0
    confidence: float | None = None         # the chain's early-stop threshold (None: always K)
    confidence_why: str = ""

    def values(self) -> tuple:
        """The choices without their reasons: (draft, quantize, vocab, siblings, beam, confidence)."""
        return (self.draft, self.quantize, self.vocab, self.siblings, self.beam, self.confidence)

    def lines(self) -> list[str]:
        if self.draft == "none":
            return ["draft: none (plain autoregressive decoding)"]
        if self.draft != "model":
            return [f"draft: {self.draft} (no model settings)"]
        kept = "whole vocabulary" if self.vocab is None else f"vocabulary {self.vocab[0]} of {self.vocab[1]}"
        shape = (f"beam of width {self.beam}" if self.beam else f"{self.siblings} siblings" if self.siblings
                 else "a chain")
        conf = "none (always K)" if self.confidence is None else f"{self.confidence:g}"
        return [f"draft weights: {self.quantize or 'as loaded'} ({self.quantize_why})",
                f"draft head: {kept} ({self.vocab_why})",
                f"draft shape: {shape} ({self.siblings_why})",
                f"confidence threshold: {conf} ({self.confidence_why})"]
