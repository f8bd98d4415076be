"""graphspec: lossless speculative decoding as a graph of stages.

``Pipeline(target, draft=None, num_speculative_tokens=5)`` runs ``draft -> verify -> accept`` once per
step (``verify -> accept`` without a draft); ``load_model`` loads a checkpoint directory or zoo name.
The stages (``ModelDrafter``, ``NgramDrafter``, ``Verify``, ``GreedyAcceptance``, ``RejectionSampling``,
and for draft trees ``TreeVerify`` and ``TreeAcceptance``) and ``Graph`` / ``Stage`` are public so that
a stage can be swapped or added. ``Engine(pipeline)`` runs many generations of a pipeline at once
(continuous batching; ``graphspec serve`` is built on it). ``PrefixCache`` keeps earlier runs' KV rows
for prompts that begin the same (``Pipeline(..., prefix_cache=True)``).
"""

import os as _os

# Before torch allocates: its CPU allocator then asks for transparent huge pages (madvise) under every buffer of
# 2 MiB or more, the packed weights among them. A decode step streams its weights, and on 4 KiB pages it reads
# them measurably slower (perf/RESULTS.md). torch reads the variable once, at its first allocation; set
# THP_MEM_ALLOC_ENABLE=0 before importing graphspec to keep 4 KiB pages. (The name is a literal here: the
# constant, graphspec.kernels.cpu.THP_ENV, lives in a module that imports torch.)
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from graphspec.acceptance import GreedyAcceptance, RejectionSampling, TreeAcceptance
from graphspec.drafters import ModelDrafter, NgramDrafter
from graphspec.engine import Engine
from graphspec.graph import Graph, Stage
from graphspec.pipeline import GenerationResult, Pipeline, build_graph
from graphspec.prefix_cache import PrefixCache
from graphspec.state import SamplingParams, State
from graphspec.stats import GenerationStats
from graphspec.suffix import HybridDrafter, SuffixDrafter, SuffixStore
from graphspec.verify import TreeVerify, Verify

__all__ = ["Pipeline", "GenerationResult", "GenerationStats", "SamplingParams", "State", "Graph", "Stage",
           "build_graph", "ModelDrafter", "NgramDrafter", "Verify", "GreedyAcceptance", "RejectionSampling",
           "TreeVerify", "TreeAcceptance", "load_model", "SuffixDrafter", "HybridDrafter", "SuffixStore",
           "Engine", "PrefixCache"]


def __getattr__(name: str):
    # Imported on first use: the loader pulls in the whole model stack, which ``import graphspec.kernels``
    # alone should not pay for.
    if name == "load_model":
        from graphspec.models.loader import load_model

        return load_model
    raise AttributeError(f"module 'graphspec' has no attribute {name!r}")
