"""Drafters: n-gram lookup semantics, and the model drafter's cache kept in step with the target."""

import random

import pytest
import torch

import graphspec
from graphspec.drafters import NgramDrafter
from tests.graphspec.toy import ToyLM

pytestmark = pytest.mark.usefixtures("single_thread")


def _propose(tokens, k, max_ngram=3, min_ngram=1):
    d = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    scratch = {"index": {n: {} for n in range(min_ngram, max_ngram + 1)}, "upto": 0}
    return d.propose(list(tokens), k, scratch)


def _brute(tokens, k, max_ngram=3, min_ngram=1):
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_semantics():
    # longest n first: the 3-gram "1 2 3" occurred at 0 -> continue with 9 9; the 1-gram "3" alone would give 7
    assert _propose([1, 2, 3, 9, 9, 5, 3, 7, 1, 2, 3], 2) == [9, 9]
    # the most recent earlier occurrence wins
    assert _propose([5, 1, 5, 2, 5], 1) == [2]
    # fewer than k tokens when the match sits near the end; the match may run into the suffix itself
    assert _propose([4, 4, 4], 5) == [4]
    # nothing to propose: no earlier occurrence, or a single token
    assert _propose([1, 2, 3, 4], 3) == []
    assert _propose([7], 3) == []
    # min_ngram excludes short matches
    assert _propose([1, 2, 9, 3, 2], 2, max_ngram=3, min_ngram=2) == []


def test_ngram_incremental_index_matches_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        V = rng.choice([2, 3, 5, 8])
        seq = [rng.randrange(V) for _ in range(rng.randrange(1, 6))]
        d = NgramDrafter(max_ngram=3)
        scratch = {"index": {n: {} for n in (1, 2, 3)}, "upto": 0}
        for _ in range(25):  # the sequence grows by a few tokens per "step", like committed output
            k = rng.randrange(1, 6)
            assert d.propose(seq, k, scratch) == _brute(seq, k), (trial, seq, k)
            seq = seq + [rng.randrange(V) for _ in range(rng.randrange(1, 4))]


def test_ngram_arguments():
    with pytest.raises(ValueError, match="max_ngram"):
        NgramDrafter(max_ngram=0)
    with pytest.raises(ValueError, match="min_ngram=3 is larger than max_ngram=2"):
        NgramDrafter(max_ngram=2, min_ngram=3)


def test_model_drafter_feeds_exactly_the_uncached_tokens():
    target = ToyLM(seed=0)
    draft = ToyLM(seed=0)  # identical tables: every draft is accepted
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, draft_confidence_threshold=None)
    prompt = [1, 2, 3, 4]
    out = pipe.run(prompt, max_new_tokens=12)
    g = out.token_ids
    # prefill prompt[:-1]; step 1 feeds the pending token then its own 2 drafts (the 3rd is never fed)
    assert draft.calls[0] == prompt[:-1]
    assert draft.calls[1:4] == [[4], g[:1], g[1:2]]
    # after all 3 were accepted (+ bonus g[3]), the next draft catches up with 2 tokens: d3 and the bonus
    assert draft.calls[4] == g[2:4]
    # the target verifies [pending, d1, d2, d3]
    assert target.calls[0] == prompt[:-1] and target.calls[1] == [4] + g[:3] and target.calls[2] == g[3:7]
    assert out.stats.draft_forwards == len(draft.calls) and out.stats.target_forwards == len(target.calls)


def test_model_drafter_rolls_back_after_a_rejection():
    log: list = []
    target = ToyLM(seed=0, log=log, name="target")
    draft = ToyLM(seed=0, log=log, name="draft")
    draft.table[5:9] = torch.randn(4, 16, 16) * 3  # agrees with the target only in some contexts
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4)
    prompt = [3, 1]
    out = pipe.run(prompt, max_new_tokens=40)
    assert out.token_ids == graphspec.Pipeline(ToyLM(seed=0)).run(prompt, max_new_tokens=40).token_ids
    assert 0 < out.stats.acceptance_rate < 1
    full = prompt + out.token_ids
    # The first draft call after each verify is the catch-up: its cache must hold only committed
    # tokens (rejected drafts rolled back) and it must feed the next committed ones (1 or 2 of them).
    catchups = [log[i] for i in range(1, len(log)) if log[i][0] == "draft" and log[i - 1][0] == "target"]
    assert len(catchups) >= out.stats.steps - 2
    for _, prefix, fed in catchups:
        L = len(prefix)
        assert prefix == full[:L] and fed == full[L:L + len(fed)] and len(fed) in (1, 2)
    assert any(len(fed) == 2 for _, _, fed in catchups) and any(len(fed) == 1 for _, _, fed in catchups)
    # every verify starts from a cache holding exactly the committed tokens but the pending one
    for name, prefix, fed in log:
        if name == "target":
            assert prefix == full[:len(prefix)] and fed[0] == full[len(prefix)]


def test_one_token_prompt_has_no_prefill():
    target = ToyLM(seed=0)
    draft = ToyLM(seed=2)
    out = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2).run([5], max_new_tokens=5)
    assert target.calls[0][0] == 5 and len(target.calls[0]) == 3  # the first call is already a verify
    assert draft.calls[0] == [5]
    assert out.stats.target_forwards == out.stats.steps == len(target.calls)


def test_draft_with_a_wider_embedding_never_proposes_ids_outside_the_target():
    V = 12
    target = ToyLM(V, seed=0)
    table = torch.randn(V + 1 + 4, V + 4, V + 4)
    table[..., V:] += 50.0  # the padding ids would win every argmax / most of the mass
    draft = ToyLM(table=table)
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping="none")
    for temperature in (0.0, 1.0):
        out = pipe.run([1, 2], max_new_tokens=10, temperature=temperature, seed=1)
        assert max(out.token_ids) < V
    # a narrower draft: q is zero-padded to the target's width (this target never emits the extra ids)
    padded_target = ToyLM(V, seed=0)
    padded_target.table[..., V - 3:] = float("-inf")
    narrow = ToyLM(V - 3, seed=1)
    pipe = graphspec.Pipeline(padded_target, draft=narrow, num_speculative_tokens=3, vocab_mapping="none")
    out = pipe.run([1, 2], max_new_tokens=10, temperature=1.0, seed=1)
    assert len(out.token_ids) == 10 and out.stats.proposed > 0
