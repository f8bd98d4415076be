"""What one generation measured: acceptance, forwards, stage times, throughput.

- ``proposed`` / ``accepted`` count draft tokens; ``acceptance_rate = accepted / proposed`` (0.0
  when nothing was proposed, e.g. autoregressive decoding).
- ``steps`` counts decode steps, i.e. verify forwards of the target; ``mean_accepted_length =
  generated_tokens / steps`` is the number of tokens each of them yielded (1.0 for plain
  autoregressive decoding, K + 1 when every draft is accepted).
- ``target_forwards`` / ``draft_forwards`` count ``model.step`` calls, the prompt prefill included
  (one each when the prompt is longer than one token).
- ``accepted_per_position[i]`` / ``proposed_per_position[i]``: in how many steps draft position i
  was accepted / proposed (i = 0 is the first draft token; with a draft tree, the depth: a step
  counts once per depth however many siblings it had there).
- ``tested_per_position[i]``: in how many steps the target judged draft position i, that is position i was
  proposed and positions 0..i-1 were all accepted; ``accepted_per_position[i] / tested_per_position[i]`` is the
  acceptance at position i given the positions before it were kept (what ``draft_length="auto"`` and the serving
  policy multiply along a draft). With a tree whose accepted path ends in a sibling leaf, a deeper position is
  counted as judged though that path had no child there (a slight undercount of the deeper acceptance).
- ``tree`` (draft trees only): ``{"siblings_proposed", "siblings_accepted"}``; ``proposed`` counts
  every node of the tree, so ``acceptance_rate`` is lower than a chain's for the same path lengths.
- ``cached_prompt_tokens``: how many of the prompt's tokens the target did not prefill, their KV rows copied
  from the pipeline's prefix cache (``graphspec.prefix_cache``); 0 without one.
- Times are wall seconds (``time.perf_counter``): ``prefill_seconds`` covers every stage's
  per-generation setup, ``decode_seconds`` the steps, ``stage_seconds`` each stage's share of them.
  ``tokens_per_second`` is generated tokens over prefill + decode seconds;
  ``decode_tokens_per_second`` over decode seconds only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphspec.state import tree_depths

__all__ = ["GenerationStats"]


@dataclass
class GenerationStats:
    num_speculative_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0     # prompt tokens whose target rows came from the prefix cache
    generated_tokens: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    tested_per_position: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # cross-vocabulary runs only: {"mode", "intersection", "draft_vocab", "target_vocab"}
    vocab: dict | None = None
    # draft trees only: {"siblings_proposed", "siblings_accepted"}
    tree: dict | None = None

    def record_step(self, proposed: int, accepted: int, parents=None) -> None:
        """One verify step: ``proposed`` drafts (a chain, or a tree with ``parents``), ``accepted`` kept."""
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        depths = range(proposed) if parents is None else range(max(tree_depths(parents)))
        for i in depths:
            self.proposed_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        judged = min(len(depths), accepted + 1)  # positions 0..judged-1 were proposed with all before them kept
        if len(self.tested_per_position) < judged:
            self.tested_per_position.extend([0] * (judged - len(self.tested_per_position)))
        for i in range(judged):
            self.tested_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.generated_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """Every field and derived figure, JSON-ready (for the CLI and the benchmarks)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["stage_seconds"] = dict(self.stage_seconds)
        d["accepted_per_position"] = list(self.accepted_per_position)
        d["proposed_per_position"] = list(self.proposed_per_position)
        d["tested_per_position"] = list(self.tested_per_position)
        d["vocab"] = dict(self.vocab) if self.vocab is not None else None
        d["tree"] = dict(self.tree) if self.tree is not None else None
        for k in ("acceptance_rate", "mean_accepted_length", "tokens_per_second", "decode_tokens_per_second"):
            d[k] = getattr(self, k)
        return d

    def __str__(self) -> str:
        stages = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.stage_seconds.items())
        return (f"{self.generated_tokens} tokens in {self.steps} steps; acceptance {self.acceptance_rate:.2f}, "
                f"{self.mean_accepted_length:.2f} tokens/step; {self.tokens_per_second:.1f} tok/s "
                f"({self.decode_tokens_per_second:.1f} decode); prefill {self.prefill_seconds * 1e3:.1f} ms"
                + (f" ({self.cached_prompt_tokens} prompt tokens cached)" if self.cached_prompt_tokens else "") + "; "
                f"forwards target {self.target_forwards} draft {self.draft_forwards}; stages: {stages or '-'}"
                + (f"; vocab map {self.vocab.get('mode')}, {self.vocab.get('intersection')} shared tokens"
                   if self.vocab else ""))
