"""The data one generation carries through the graph: sampling parameters, run constants, step fields.

- ``SamplingParams`` is validated on construction (errors name the parameter) and is immutable.
- ``State`` is created per generation, never stored on a Pipeline or a model, so one model can
  serve several generations at once. Graph fields are plain attributes (``state.draft_ids``);
  reading a field nothing has set in this step raises an error that names it. ``state.run`` holds
  the constants of the generation (target model, vocabulary size, device, cache capacity, the
  forward counters) and ``state.scratch(stage)`` a stage's private per-run storage (its KV cache).

Fields of the standard speculative step (see ``graphspec.pipeline``):

==============  ============================================================================
tokens          committed ids, prompt + generated (Python list; the last one is "pending":
                committed but not yet in the target's KV cache)
token_buffer    the committed ids on the device (``[capacity + K + 1]`` int64; entries from
                ``len(tokens)`` on are scratch), so stages feed models without host copies
num_draft       how many draft tokens this step may propose (``min(K, remaining - 1)``)
params          ``SamplingParams``
generator       ``torch.Generator`` on the target's device, seeded from ``params.seed``
draft_ids       ``[1, k]`` int64 proposals, ``0 <= k <= num_draft``
draft_probs     ``[1, k, V_target]`` fp32 warped draft distributions, or None (one-hot drafts)
draft_parents   draft trees only (``draft_siblings``): a tuple of k parent rows, 0 the pending token,
                j + 1 draft j (``TreeVerify``, ``TreeAcceptance``)
target_logits   ``[1, k + 1, V_target]`` fp32 target logits for [pending, draft_ids]
emitted         ``[1, k + 1]`` int64: accepted drafts then one recovered/bonus token, -1 after
==============  ============================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SamplingParams", "State", "RunInfo", "tree_children", "tree_depths"]


def tree_children(parents) -> dict[int, list[int]]:
    """``draft_parents`` as ``{row: [child rows]}``, in row order (row 0 the pending token, j + 1 draft j)."""
    children: dict[int, list[int]] = {}
    for row, parent in enumerate(parents, start=1):
        children.setdefault(parent, []).append(row)
    return children


def tree_depths(parents) -> list[int]:
    """The depth of every row of ``[pending, drafts]`` under ``draft_parents`` (the pending token is 0)."""
    depths = [0]
    for parent in parents:
        depths.append(depths[parent] + 1)
    return depths


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: ``temperature == 0`` is greedy; otherwise softmax(logits / temperature)
    restricted to top-k (0: off) then top-p (1.0: off). ``seed`` (None: a random seed) drives every
    random draw of a generation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 switches top-k off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 switches top-p off), got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RunInfo:
    """Constants of one generation, plus the forward counters stages bump."""

    target: Any                       # the target model
    vocab_size: int                   # the target's logits width: every distribution uses it
    device: torch.device
    capacity: int                     # KV-cache length every stage allocates
    prompt_len: int
    num_speculative_tokens: int
    prefix_cache: Any = None          # graphspec.prefix_cache.PrefixCache, or None
    target_forwards: int = 0
    draft_forwards: int = 0
    extra: dict = field(default_factory=dict)   # room for stages that need more run constants


class State:
    """Fields of one generation. Attributes not starting with ``_`` (other than ``run``) are fields."""

    def __init__(self, run: RunInfo):
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "_fields", {})
        object.__setattr__(self, "_scratch", {})

    def __getattr__(self, name: str):
        fields = object.__getattribute__(self, "_fields")
        try:
            return fields[name]
        except KeyError:
            if name.startswith("_"):
                raise AttributeError(name) from None
            raise AttributeError(f"state field {name!r} has not been set in this step "
                                 f"(set fields: {sorted(fields)}); a stage that writes it must run first") from None

    def __setattr__(self, name: str, value) -> None:
        if name == "run" or name.startswith("_"):
            raise AttributeError(f"{name!r} is not a state field; state.run is fixed for a generation")
        self._fields[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def clear(self, names) -> None:
        """Forget ``names`` (the fields a step writes), so a stale value from the last step is never read."""
        for n in names:
            self._fields.pop(n, None)

    def scratch(self, stage) -> dict:
        """A stage's private storage for this generation (keyed by the stage object)."""
        return self._scratch.setdefault(id(stage), {})

    def __repr__(self) -> str:
        return f"State(fields={sorted(self._fields)})"
