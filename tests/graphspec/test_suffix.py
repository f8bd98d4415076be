"""Suffix drafting and the hybrid drafter (graphspec.suffix).

- The automaton against brute force on random strings (hypothesis): the longest earlier match of
  every prefix, the occurrences of a state, matching statistics of a query against a store's text;
  the continuation tree's counts and best-first order against counting by hand.
- Greedy: the output equals the target alone (toy models, tiny random checkpoints, across
  tokenizers for the hybrid), on repetitive and non-repetitive prompts.
- Sampling: a tree of deterministic proposals keeps the target's distribution (chi-square on the
  first three tokens, 2000 seeded runs), and dropping the drawn sibling order is detected.
- The store: learning across requests, the memory bound and its FIFO eviction, JSON persistence
  (validated on load), one tokenizer per store.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphspec
from graphspec import SamplingParams
from graphspec.suffix import SEP, HybridDrafter, SuffixAutomaton, SuffixDrafter, SuffixStore, continuation_tree
from tests.checkpoints import make_checkpoint
from tests.graphspec.oracle import marginal_pvalues
from tests.graphspec.test_lossless import V, _draft, _target

pytestmark = pytest.mark.usefixtures("single_thread")

N_RUNS = 2000

# ----------------------------------------------------------------------------- the structure


def _occurs_before(t: list[int], L: int) -> bool:
    suf = t[len(t) - L:]
    return any(t[e - L + 1:e + 1] == suf for e in range(L - 1, len(t) - 1))


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=70)


@settings(max_examples=150, deadline=None)
@given(tokens)
def test_longest_earlier_match_and_occurrences_equal_brute_force(t):
    sam = SuffixAutomaton()
    for i, c in enumerate(t):
        sam.extend(c)
        seen = t[:i + 1]
        want = max((L for L in range(1, len(seen)) if _occurs_before(seen, L)), default=0)
        s = sam.link[sam.last]
        assert (sam.len[s] if s > 0 else 0) == want
        if want:
            suf = seen[len(seen) - want:]
            ends = [e for e in range(want - 1, len(seen)) if seen[e - want + 1:e + 1] == suf]
            assert sorted(sam.occurrences(s, 10 ** 6)) == ends
            assert len(sam.occurrences(s, 2)) == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_matching_statistics_against_a_store_equal_brute_force(docs, query):
    store = SuffixStore()
    for d in docs:
        store.add(d)
    text = list(store.automaton.text)
    assert text.count(SEP) == len(docs)
    m = (0, 0)
    for i, c in enumerate(query):
        m = store.automaton.walk(*m, c)
        q = query[:i + 1]
        # the longest suffix of the query that is a substring of some document (never spanning SEP)
        want = max((L for L in range(1, len(q) + 1) if any(
            d[j:j + L] == q[len(q) - L:] for d in docs for j in range(len(d) - L + 1))), default=0)
        assert m[1] == want
        if want:
            ends = sorted(store.automaton.occurrences(m[0], 10 ** 6))
            suf = q[len(q) - want:]
            assert ends == [e for e in range(want - 1, len(text)) if text[e - want + 1:e + 1] == suf]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=2, max_size=60), st.integers(1, 8), st.sampled_from([0.0, 0.1, 0.3]),
       st.data())
def test_continuation_tree_counts_and_order_equal_brute_force(text, budget, min_prob, data):
    ends = sorted(set(data.draw(st.lists(st.integers(0, len(text) - 1), min_size=1, max_size=12))))
    toks, parents, scores, counts = continuation_tree(text, ends, len(text), budget, min_prob)
    conts = [text[e + 1:e + 1 + budget] for e in ends if e + 1 < len(text)]
    assert len(toks) <= budget
    paths = []
    for i, (t, p) in enumerate(zip(toks, parents)):
        assert -1 <= p < i
        path = (paths[p] if p >= 0 else []) + [t]
        paths.append(path)
        want = sum(1 for c in conts if c[:len(path)] == path)
        assert counts[i] == want and scores[i] == pytest.approx(want / len(conts))
        assert scores[i] >= min_prob
    assert len(set(map(tuple, paths))) == len(paths)  # no two nodes spell the same path
    assert scores == sorted(scores, reverse=True)
    # best first: no path left out scores above the worst one proposed (while there was room)
    if len(toks) < budget:
        frontier = {tuple(c[:len(p) + 1]) for c in conts for p in [[]] + paths if c[:len(p)] == p and len(c) > len(p)}
        left = [sum(1 for c in conts if tuple(c[:len(f)]) == f) / len(conts) for f in frontier
                if list(f) not in paths]
        assert all(s < min_prob for s in left), (left, min_prob)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=2, max_size=40), st.lists(st.integers(0, 2), min_size=2, max_size=40),
       st.integers(1, 6), st.data())
def test_continuation_tree_pools_a_second_source_as_more_occurrences(text, other, budget, data):
    """``more``: the second text's occurrences count in the same trie, each stopping at its own text's end; on a tie
    the first source's occurrence ranks as the most recent."""
    ends = sorted(set(data.draw(st.lists(st.integers(0, len(text) - 1), min_size=1, max_size=8))))
    other_ends = sorted(set(data.draw(st.lists(st.integers(0, len(other) - 1), min_size=1, max_size=8))))
    toks, parents, scores, counts = continuation_tree(text, ends, len(text), budget, 0.0,
                                                      more=[(other, other_ends, len(other))])
    conts = [t[e + 1:e + 1 + budget] for t, es in ((text, ends), (other, other_ends)) for e in es if e + 1 < len(t)]
    paths = []
    for i, (t, p) in enumerate(zip(toks, parents)):
        path = (paths[p] if p >= 0 else []) + [t]
        paths.append(path)
        want = sum(1 for c in conts if c[:len(path)] == path)
        assert counts[i] == want and scores[i] == pytest.approx(want / len(conts))
    assert scores == sorted(scores, reverse=True)
    assert len(toks) == min(budget, len({tuple(c[:j]) for c in conts for j in range(1, len(c) + 1)}))


def _state_of(drafter, tokens):
    """A run whose committed tokens are ``tokens`` (no model), begun by ``drafter``."""
    from graphspec.state import RunInfo, State

    run = RunInfo(target=None, vocab_size=64, device=torch.device("cpu"), capacity=len(tokens) + 8,
                  prompt_len=len(tokens), num_speculative_tokens=4)
    state = State(run)
    state.tokens = list(tokens)
    state.params = SamplingParams()
    drafter.begin(state)
    return state


def _proposal(drafter, tokens):
    """``drafter``'s first proposed token and its count for a run of ``tokens``, the match length and the source."""
    state = _state_of(drafter, tokens)
    toks, parents, scores, counts, length = drafter.propose(state, 4)
    return toks[:1], counts[:1], length, state.scratch(drafter)["proposed_from"]


def test_the_longer_match_of_request_and_store_drafts_and_equal_ones_pool():
    store = SuffixStore()
    store.add([7, 1, 2, 5])
    store.add([8, 0, 1, 2, 4])
    drafter = SuffixDrafter(store, learn=False)
    # this request's [3, 1, 2] (then 6) against the store's [1, 2]
    assert _proposal(drafter, [3, 1, 2, 6, 0, 3, 1, 2]) == ([6], [1], 3, "local")
    # the store's [0, 1, 2] (then 4) against this request's [1, 2]
    assert _proposal(drafter, [9, 1, 2, 6, 0, 1, 2]) == ([4], [1], 3, "global")
    # [1, 2] in both: one tree over three occurrences; on the tie this request's first, then the latest (6, 4, 5)
    toks, parents, scores, counts, length = drafter.propose(_state_of(drafter, [9, 1, 2, 6, 3, 1, 2]), 4)
    assert length == 2 and toks[:3] == [6, 4, 5] and counts[:3] == [1, 1, 1] and scores[0] == pytest.approx(1 / 3)
    assert drafter.propose(_state_of(drafter, [9, 1, 2, 6, 3, 1, 2]), 4)[:4] == (toks, parents, scores, counts)


# ----------------------------------------------------------------------------- greedy, token-exact

REPETITIVE = [1, 2, 3, 1, 2, 3, 1, 2]
# The toy draft costs about as much as the toy target (measure_draft_cost: 1.1 on a Zen 4 core), so a hybrid that
# measured it would rightly never draft with it; tests of the model steps' mechanics price it as a small draft.
TOY_DRAFT_COST = 0.2
FRESH = [[5, 9, 2], [7], [3, 3, 3, 3, 11, 4], [14, 0, 6, 13, 8, 10]]


def _check_greedy(pipe, prompts, n: int = 40):
    ar = graphspec.Pipeline(pipe.target)
    stats = []
    for p in prompts:
        want = ar.run(p, max_new_tokens=n, ignore_eos=True).token_ids
        got = pipe.run(p, max_new_tokens=n, ignore_eos=True)
        assert got.token_ids == want, p
        stats.append(got.stats)
    return stats


@pytest.mark.parametrize("k", [1, 4, 9])
def test_greedy_suffix_equals_the_target_alone_on_toy_models(k):
    pipe = graphspec.Pipeline(_target(), draft="suffix", num_speculative_tokens=k)
    assert pipe.graph.names == ["draft", "verify", "accept"]
    assert type(pipe.graph["verify"]).__name__ == "TreeVerify"
    stats = _check_greedy(pipe, [REPETITIVE] + FRESH)
    assert stats[0].accepted > 0  # the repetitive prompt's cycle is proposed and taken
    assert sum(s.accepted for s in stats) / sum(s.steps for s in stats) > (0.5 if k > 1 else 0.3)


def test_greedy_hybrid_equals_the_target_alone_on_toy_models(monkeypatch):
    import graphspec.suffix as suffix

    used = []
    real = suffix.write_tree
    monkeypatch.setattr(suffix, "write_tree", lambda *a: (used.append(1), real(*a))[1])
    pipe = graphspec.Pipeline(_target(), draft=[_draft(), "suffix"], num_speculative_tokens=6)
    pipe.graph["draft"].draft_cost = TOY_DRAFT_COST
    stats = _check_greedy(pipe, [REPETITIVE] + FRESH + [REPETITIVE])
    assert used  # some steps proposed the suffix tree
    assert sum(s.draft_forwards for s in stats) > len(stats)  # the model drafted some steps
    assert sum(s.accepted for s in stats) > 0
    assert pipe.graph["draft"].store.num_tokens > 0


class CheckedHybrid(HybridDrafter):
    """After every step, the model draft's cache must hold committed tokens only (drafts may follow them)."""

    def run(self, state):
        super().run(state)
        cache = state.scratch(self.model_drafter)["cache"]
        held = cache.tokens[0, :min(cache.length, len(state.tokens))].tolist()
        assert held == state.tokens[:len(held)], "the model draft's cache holds a token that was not committed"


@pytest.mark.parametrize("siblings", [0, 2])
def test_the_hybrid_keeps_the_model_cache_on_the_committed_tokens(siblings):
    from graphspec import ModelDrafter

    # switch=0: the suffix tree whenever there is one, so model and suffix steps alternate often
    hybrid = CheckedHybrid(ModelDrafter(_draft(), siblings=siblings, confidence_threshold=0.6 if siblings else None),
                           switch=0.0, draft_cost=TOY_DRAFT_COST)
    pipe = graphspec.Pipeline(_target(), draft=hybrid, num_speculative_tokens=5)
    stats = _check_greedy(pipe, [REPETITIVE] + FRESH + [REPETITIVE], n=60)
    assert sum(s.draft_forwards for s in stats) > len(stats)


def test_the_hybrid_rule_weighs_tokens_against_draft_forwards():
    from graphspec import ModelDrafter

    h = HybridDrafter(ModelDrafter(_draft()), draft_cost=0.2, prior_model=3.0)
    # nothing measured: the prior model step, 3 tokens for 5 forwards, is worth 3 / (1 + 0.2 * 5) = 1.5 a verify
    assert h.prefers_suffix(0.5, 5) and not h.prefers_suffix(0.4, 5)
    # 10 model steps of 5 tokens and 5 forwards (with the prior: 53 / 11 tokens, 5 forwards a step): 2.41 a verify;
    # a suffix tree expecting 1.5 tokens yields 2.5 a verify and is taken, though the model yields 3x more a step
    h.measured.update(model_steps=10, model_tokens=50, model_forwards=50)
    assert h.prefers_suffix(1.5, 5) and not h.prefers_suffix(1.3, 5)
    # suffix trees were accepted at half their scores so far (with the prior, 14 / 24): 1.5 is now worth 1.875
    h.measured.update(suffix_score=20.0, suffix_accepted=10)
    assert not h.prefers_suffix(1.5, 5) and h.prefers_suffix(2.9, 5)
    # free draft forwards: only tokens per step count
    h.draft_cost = 0.0
    assert not h.prefers_suffix(6.0, 5) and h.prefers_suffix(7.0, 5)
    # one early tree that missed entirely does not rule suffix trees out (c = 4 / 9)
    h.draft_cost = 0.2
    h.measured.update(suffix_score=5.0, suffix_accepted=0)
    assert h.prefers_suffix(3.5, 5) and not h.prefers_suffix(3.0, 5)
    with pytest.raises(ValueError, match="draft_cost"):
        HybridDrafter(ModelDrafter(_draft()), draft_cost=-1)


def test_the_hybrid_prefills_its_model_draft_only_when_it_drafts():
    # switch=0: the suffix tree whenever there is one. The repetitive prompt has one at every step, so its request
    # runs no draft forward at all, not even the prompt's prefill; a fresh prompt makes the model draft and catch up.
    pipe = graphspec.Pipeline(_target(), draft=[_draft(), "suffix"], num_speculative_tokens=4)
    hybrid = pipe.graph["draft"]
    hybrid.switch, hybrid.draft_cost = 0.0, TOY_DRAFT_COST
    hybrid.suffix.learn = False
    want = graphspec.Pipeline(pipe.target).run(REPETITIVE * 4, max_new_tokens=24, ignore_eos=True).token_ids
    out = pipe.run(REPETITIVE * 4, max_new_tokens=24, ignore_eos=True)
    assert out.token_ids == want
    assert out.stats.draft_forwards == 0 and hybrid.measured["model_steps"] == 0
    stats = _check_greedy(pipe, FRESH, n=24)
    assert sum(s.draft_forwards for s in stats) > 0 and hybrid.measured["model_steps"] > 0
    # what the steps earned is kept across requests
    before = dict(hybrid.measured)
    _check_greedy(pipe, FRESH[:1], n=24)
    assert hybrid.measured["model_steps"] + hybrid.measured["suffix_score"] > before["model_steps"] + before[
        "suffix_score"]


def test_the_hybrid_calibrates_suffix_trees_it_did_not_propose():
    # switch huge: the model drafts every step; the suffix trees built meanwhile are still checked against the
    # committed tokens, so their calibration keeps learning (the repetitive prompt's trees are followed)
    pipe = graphspec.Pipeline(_target(), draft=[_draft(), "suffix"], num_speculative_tokens=4)
    hybrid = pipe.graph["draft"]
    hybrid.switch, hybrid.draft_cost = 1e9, TOY_DRAFT_COST
    out = _check_greedy(pipe, [REPETITIVE * 3], n=24)[0]
    m = hybrid.measured
    assert pipe.run(REPETITIVE, max_new_tokens=2).stats.steps >= 1
    assert m["model_steps"] > 0 and out.draft_forwards > 0
    assert m["suffix_score"] > 0 and m["suffix_accepted"] > 0


def test_the_hybrid_rule_counts_the_draft_catch_up_prefill():
    from graphspec import ModelDrafter

    # nothing measured: a model step yields 3 tokens for 1 + 0.2 * 5 = 2 verifies (1.5 a verify); a prefill token
    # costs 0.3 draft forwards, 0.06 verify
    h = HybridDrafter(ModelDrafter(_draft()), draft_cost=0.2, prior_model=3.0, prefill_cost=0.3)
    assert h.model_rate(5) == pytest.approx(1.5)
    # an 800-token prompt to prefill (48 verifies) with 96 tokens left, of which model steps are expected to produce
    # half (the prior: nothing measured yet): a step's share is 3/48 of it, 3 verifies
    assert h.model_share() == pytest.approx(0.5)
    assert h.model_rate(5, catch_up=800, remaining=96) == pytest.approx(3 / (2 + 3))
    # spread over every token left (share 1, the rule before), 3/96 of it
    assert h.model_rate(5, catch_up=800, remaining=96, share=1.0) == pytest.approx(3 / (2 + 1.5))
    # so a decent suffix tree (expecting 0.3 tokens) is taken while the catch-up is owed ...
    assert h.prefers_suffix(0.3, 5, catch_up=800, remaining=96)
    # ... and the model once the catch-up is paid (the same tree, nothing left to prefill)
    assert not h.prefers_suffix(0.3, 5, catch_up=0, remaining=96)
    # the share grows as the request runs out: near its end the same prompt is worth even less
    assert h.model_rate(5, 800, remaining=10) < h.model_rate(5, 800, remaining=96)
    # with many tokens left the catch-up spreads thin, and the model is taken over the same tree
    assert not h.prefers_suffix(0.3, 5, catch_up=800, remaining=100_000)
    # a step's share never exceeds the whole catch-up: a step cannot cost more than all of it
    assert h.model_rate(5, 800, remaining=1) == pytest.approx(3 / (2 + 48))
    # below one token a verify: a step with no suffix tree is better plain (what run() does with it)
    assert h.model_rate(5, 800, remaining=20) < 1.0 < h.model_rate(5, 0, remaining=20)
    with pytest.raises(ValueError, match="prefill_cost"):
        HybridDrafter(ModelDrafter(_draft()), prefill_cost=-0.1)
    with pytest.raises(ValueError, match="not measured"):
        HybridDrafter(ModelDrafter(_draft())).model_rate(5, catch_up=10, remaining=10)


def test_the_catch_up_is_spread_over_the_tokens_model_steps_produce():
    from graphspec import ModelDrafter

    h = HybridDrafter(ModelDrafter(_draft()), draft_cost=0.2, prior_model=3.0, prefill_cost=0.3)
    # suffix trees produced 90% of the 294 tokens committed so far; 9 model steps of 3 tokens and 5 forwards each
    # (with the prior step: m = 3, f = 5), trees accepted as scored (c = 1)
    h.measured.update(step_tokens=294, model_steps=9, model_tokens=27, model_forwards=45, suffix_score=100.0,
                      suffix_accepted=100)
    assert h.model_share() == pytest.approx(30 / 300)
    # an 800-token catch-up (48 verifies) with 1000 tokens left, of which model steps are expected to produce 100: a
    # step's share is 3/100 of it, 1.44 verifies (the rule before spread it over all 1000: 0.144)
    assert h.model_rate(5, 800, 1000) == pytest.approx(3 / (2 + 1.44))
    assert h.model_rate(5, 800, 1000, share=1.0) == pytest.approx(3 / (2 + 0.144))
    # so a weak suffix tree (expecting 0.2 tokens: 1.2 a verify) is taken over the model, which the rule before
    # would have prefilled 800 tokens for
    assert h.prefers_suffix(0.2, 5, 800, 1000)
    assert not h.prefers_suffix(0.2, 5, 800, 1000, share=1.0)
    # the other way: model steps produced 90% of the tokens (89 steps, m = 3, f = 5): the catch-up buys them 900 of
    # the 1000 tokens left, a step's share is 0.16 verifies, and the model is taken over the same tree
    h.measured.update(model_steps=89, model_tokens=267, model_forwards=445)
    assert h.model_share() == pytest.approx(0.9)
    assert h.model_rate(5, 800, 1000) == pytest.approx(3 / (2 + 0.16))
    assert not h.prefers_suffix(0.2, 5, 800, 1000)
    # nothing to prefill: the share does not enter
    assert h.model_rate(5, 0, 1000) == h.model_rate(5, 0, 1000, share=0.01) == pytest.approx(1.5)
    # a step never pays more than the whole catch-up, however few tokens model steps are expected to produce
    assert h.model_rate(5, 800, 5, share=0.01) == pytest.approx(3 / (2 + 48))
    # plain steps count in the share: their token is one that model steps did not produce
    h.measured.update(step_tokens=0, model_steps=0, model_tokens=0, model_forwards=0)
    assert h.model_share() == pytest.approx(0.5)


def test_the_rule_counts_the_share_over_the_request():
    from graphspec import ModelDrafter
    from graphspec.state import RunInfo, State

    h = HybridDrafter(ModelDrafter(_draft()), draft_cost=0.2, prior_model=3.0, prefill_cost=0.3)
    h.measured.update(step_tokens=294, model_steps=9, model_tokens=27, model_forwards=45)
    assert h.model_share() == pytest.approx(0.1)  # over the drafter's life
    state = State(RunInfo(target=None, vocab_size=V, device=torch.device("cpu"), capacity=64, prompt_len=8,
                          num_speculative_tokens=5))
    state.scratch(h).update(request_tokens=0, request_model_tokens=0)
    assert h.model_share(state) == pytest.approx(0.5)  # a request starts from the prior
    state.scratch(h).update(request_tokens=24, request_model_tokens=24)
    assert h.model_share(state) == pytest.approx(27 / 30)
    assert h.model_share() == pytest.approx(0.1)
    # an 800-token catch-up with 1000 tokens left: paid over the 900 tokens this request's share expects
    assert h.model_rate(5, 800, 1000, share=h.model_share(state)) == pytest.approx(3 / (2 + 0.2 * 0.3 * 800 * 3 / 900))


def test_plain_and_suffix_steps_lower_the_model_share_and_model_steps_raise_it():
    # a costly catch-up: plain and suffix steps only, whose tokens all count against the model's share
    costly = _recording(1e4)
    _check_greedy(graphspec.Pipeline(_target(), draft=costly, num_speculative_tokens=4), [FRESH[2], FRESH[3]], n=24)
    kinds = [kind for _, kind in costly.log]
    assert "plain" in kinds and "model" not in kinds
    m = costly.measured
    # 23 tokens a request from steps (the first comes from the prefill); a request's last step is not counted
    assert m["model_tokens"] == 0 and 30 <= m["step_tokens"] <= 2 * 23
    assert costly.model_share() < 0.1
    # the model whenever it is worth anything: its share grows toward 1
    eager = _recording(0.0, switch=1e9)
    _check_greedy(graphspec.Pipeline(_target(), draft=eager, num_speculative_tokens=4), [FRESH[2], FRESH[3]], n=24)
    assert eager.measured["model_tokens"] > 0.8 * eager.measured["step_tokens"] and eager.model_share() > 0.8


class RecordingHybrid(HybridDrafter):
    """Records, per step, the catch-up the rule saw and what it chose (suffix, model or plain)."""

    def run(self, state):
        behind = self.catch_up_tokens(state)
        before = dict(state.run.extra.get("hybrid", {}))
        super().run(state)
        after = state.run.extra["hybrid"]
        kind = next((k[:-len("_steps")] for k in after if after[k] != before.get(k, 0)), "none")
        self.log.append((behind, kind))


def _recording(prefill_cost, **kw):
    from graphspec import ModelDrafter

    kw.setdefault("draft_cost", TOY_DRAFT_COST)
    h = RecordingHybrid(ModelDrafter(_draft()), prefill_cost=prefill_cost, **kw)
    h.log = []
    return h


def test_a_costly_catch_up_keeps_the_model_draft_out_and_output_exact():
    # A long prompt (60 tokens, whose repeats give suffix trees) and few tokens left: with prefill free the
    # model drafts at some steps; priced high, the draft is never prefilled (suffix or plain steps only, no
    # draft forward), and the tokens are the target's alone either way.
    prompt = [(7 * i) % 13 for i in range(60)]
    free = _recording(0.0)
    out = _check_greedy(graphspec.Pipeline(_target(), draft=free, num_speculative_tokens=5), [prompt], n=16)[0]
    assert any(kind == "model" for _, kind in free.log) and out.draft_forwards > 0
    assert free.log[0][0] == len(prompt) - 1  # the first step owes the whole prompt (the pending token aside)
    costly = _recording(1e4)
    out = _check_greedy(graphspec.Pipeline(_target(), draft=costly, num_speculative_tokens=5), [prompt], n=16)[0]
    kinds = {kind for _, kind in costly.log}
    assert "model" not in kinds and kinds and out.draft_forwards == 0
    assert costly.measured["model_steps"] == 0


def test_a_request_whose_tokens_suffix_trees_produce_does_not_prefill_its_prompt_for_one_model_step():
    # A 120-token prompt (repeats: suffix trees at most steps) with 40 tokens to go and a prefill token at 0.3 draft
    # forwards (the 0.5B's figure). The share of the tokens left that model steps are expected to produce is the
    # request's own: half at first, less with each suffix step. Spread over those, the prompt's catch-up costs more
    # than a model step yields, and steps without a good tree are plain. After earlier requests that model steps
    # served (the agent loop: a short first request drafted by the model, then long prompts that suffix trees
    # serve), the share counted over the drafter's life (the rule until 2026-12-04) is near 1: spread over nearly
    # all 40 tokens the catch-up looks cheap, and the draft is prefilled for a few model steps. Tokens exact.
    prompt = [(7 * i) % 13 for i in range(120)]
    runs = {}
    for rule in ("request", "request after model-heavy ones", "drafter's life after model-heavy ones"):
        h = _recording(0.3)
        if rule != "request":
            h.measured.update(step_tokens=300, model_tokens=300, model_steps=100, model_forwards=500)
        if rule.startswith("drafter's life"):
            life = HybridDrafter.model_share
            h.model_share = lambda state=None, h=h: life(h)
        out = _check_greedy(graphspec.Pipeline(_target(), draft=h, num_speculative_tokens=5), [prompt], n=40)[0]
        runs[rule] = ([kind for _, kind in h.log], out.draft_forwards)
    for rule in ("request", "request after model-heavy ones"):
        kinds, forwards = runs[rule]
        assert "model" not in kinds and "plain" in kinds and forwards == 0, (rule, kinds)
    kinds, forwards = runs["drafter's life after model-heavy ones"]
    assert "model" in kinds and forwards > 0, kinds


def test_fresh_text_with_no_suffix_tree_takes_plain_steps_while_the_catch_up_costs_more():
    # FRESH prompts give few suffix trees: with the catch-up priced out of reach the steps without one are plain.
    # (A one-token prompt owes no catch-up at its first step, so the model drafts there: left out.)
    costly = _recording(1e4)
    prompts = [p for p in FRESH if len(p) > 2]
    stats = _check_greedy(graphspec.Pipeline(_target(), draft=costly, num_speculative_tokens=4), prompts, n=24)
    assert any(kind == "plain" for _, kind in costly.log)
    assert sum(s.draft_forwards for s in stats) == 0


def test_after_a_model_step_the_catch_up_is_paid_and_the_model_keeps_drafting():
    # switch huge: the model whenever it is worth anything; prefill priced (0.3) but affordable over 40 tokens
    h = _recording(0.3, switch=1e9)
    prompt = FRESH[2]
    _check_greedy(graphspec.Pipeline(_target(), draft=h, num_speculative_tokens=4), [prompt], n=40)
    model_at = [i for i, (_, kind) in enumerate(h.log) if kind == "model"]
    assert len(model_at) > 3 and h.log[0] == (len(prompt) - 1, "model")  # the prompt, the pending token aside
    # every model step right after another found the draft in step (nothing to prefill); after plain or suffix
    # steps it owes their tokens
    followers = [i for i in model_at if i - 1 in model_at]
    assert len(followers) > 3 and all(h.log[i][0] == 0 for i in followers)
    assert all(h.log[i][0] > 0 for i in model_at if i - 1 not in model_at)


def test_sampled_runs_leave_the_timed_catch_up_out_of_the_rule():
    # A seeded sample must not depend on the host's load: catch_up_tokens is 0 in sampled runs, so the (timed)
    # prefill cost never enters their choice. Priced free or out of reach, the same seed gives the same steps
    # and tokens (in a greedy run the two prices give different steps: see the tests above).
    runs = []
    for cost in (0.0, 1e4):
        h = _recording(cost)
        pipe = graphspec.Pipeline(_target(), draft=h, num_speculative_tokens=4)
        out = pipe.run([5, 9, 2, 7, 7, 1, 12], max_new_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
        assert h.log and all(behind == 0 for behind, _ in h.log)
        runs.append((out.token_ids, [kind for _, kind in h.log]))
    assert runs[0] == runs[1] and "model" in runs[0][1]


def test_measure_prefill_cost_times_once_per_model(monkeypatch, tiny):
    import graphspec.suffix as suffix
    from graphspec import ModelDrafter

    _, draft = tiny
    calls = []
    real = suffix.prefill
    monkeypatch.setattr(suffix, "prefill", lambda *a: (calls.append(len(a[2])), real(*a))[1])
    monkeypatch.setattr(suffix, "_PREFILL_COSTS", __import__("weakref").WeakKeyDictionary())
    d = ModelDrafter(draft)
    ratio = suffix.measure_prefill_cost(d, tokens=16, repeats=2)
    assert 0 < ratio < float("inf") and calls == [16, 16]
    assert suffix.measure_prefill_cost(ModelDrafter(draft), tokens=16) == ratio and calls == [16, 16]  # kept
    # the hybrid measures it at its first catch-up, and only then
    pipe = graphspec.Pipeline(tiny[0], draft=[draft, "suffix"], num_speculative_tokens=4)
    h = pipe.graph["draft"]
    assert h.prefill_cost is None
    pipe.run(_prompts()[2], max_new_tokens=8)
    assert h.prefill_cost is not None and h.prefill_cost > 0


@pytest.mark.parametrize("prefill_cost", [0.0, 0.3, 1e4])
def test_greedy_hybrid_with_any_catch_up_price_equals_autoregressive(tiny, prefill_cost):
    target, draft = tiny
    pipe = graphspec.Pipeline(target, draft=[draft, "suffix"], num_speculative_tokens=6)
    pipe.graph["draft"].prefill_cost = prefill_cost
    pipe.graph["draft"].draft_cost = TOY_DRAFT_COST
    stats = _check_greedy(pipe, [p for p in _prompts() if len(p) > 2], n=40)  # a 1-token prompt owes no catch-up
    if prefill_cost == 1e4:  # priced out: the draft never runs
        assert sum(s.draft_forwards for s in stats) == 0
    else:
        assert sum(s.draft_forwards for s in stats) > 0


class _Slowed:
    """A model whose ``step`` takes ``seconds`` longer (what measure_draft_cost sees of a bigger model)."""

    def __init__(self, model, seconds: float):
        self.model, self.seconds = model, seconds

    def new_cache(self, *a, **kw):
        return self.model.new_cache(*a, **kw)

    def step(self, *a, **kw):
        import time

        time.sleep(self.seconds)
        return self.model.step(*a, **kw)


def test_measure_draft_cost_times_a_draft_forward_against_a_verify(monkeypatch, tiny):
    import types

    import graphspec.suffix as suffix

    target, draft = tiny
    monkeypatch.setattr(suffix, "_DRAFT_COSTS", __import__("weakref").WeakKeyDictionary())
    # a draft forward 4 ms longer, a verify 40 ms longer: about a tenth (the tiny forwards add well under 1 ms)
    slow_draft, slow_target = _Slowed(draft, 0.004), _Slowed(target, 0.04)
    drafter = types.SimpleNamespace(model=slow_draft, head=None)
    ratio = suffix.measure_draft_cost(drafter, slow_target, rows=6)
    assert 0.05 < ratio < 0.2, ratio
    # kept per pair, thread count and rows: measured once
    calls = []
    monkeypatch.setattr(slow_target, "step", lambda *a, **kw: (calls.append(1), target.step(*a, **kw))[1])
    assert suffix.measure_draft_cost(drafter, slow_target, rows=6) == ratio and not calls
    suffix.measure_draft_cost(drafter, slow_target, rows=3)  # another verify size: measured
    assert calls
    with pytest.raises(ValueError, match="rows"):
        suffix.measure_draft_cost(drafter, slow_target, rows=0)


def test_the_hybrid_measures_its_draft_cost_in_greedy_runs_only(monkeypatch, tiny):
    import graphspec.suffix as suffix

    target, draft = tiny
    calls = []
    real = suffix.measure_draft_cost
    monkeypatch.setattr(suffix, "measure_draft_cost", lambda d, t, rows: (calls.append(rows), real(d, t, rows))[1])
    pipe = graphspec.Pipeline(target, draft=[draft, "suffix"], num_speculative_tokens=4)
    h = pipe.graph["draft"]
    assert h.draft_cost is None  # the default: measured
    # sampled: a timed figure must not move a seeded sample, so the fixed figure, and nothing timed
    pipe.run(_prompts()[2], max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    assert not calls
    # greedy: measured at the verify's K + 1 rows, token-exact
    _check_greedy(pipe, _prompts()[1:3], n=16)
    assert calls and set(calls) == {5}
    assert real(h.model_drafter, target, 5) > 0
    # set: never measured
    calls.clear()
    h.draft_cost = 0.1
    _check_greedy(pipe, _prompts()[1:2], n=8)
    assert not calls
    with pytest.raises(ValueError, match="draft_cost"):
        HybridDrafter(pipe.graph["draft"].model_drafter, draft_cost="fast")


def test_followed_walks_a_tree_from_its_root():
    from graphspec.suffix import _followed

    toks, parents = [5, 6, 7, 8], [-1, 0, 0, 2]  # 5 -> {6, 7 -> 8}
    assert _followed(toks, parents, [5, 7, 8, 9]) == 3
    assert _followed(toks, parents, [5, 6, 8]) == 2
    assert _followed(toks, parents, [6]) == 0 and _followed(toks, parents, []) == 0


def test_the_hybrid_model_draft_is_a_tree_by_default():
    from graphspec.defaults import AUTO_DRAFT_SIBLINGS

    pipe = graphspec.Pipeline(_target(), draft=[_draft(), "suffix"], num_speculative_tokens=5)
    assert pipe.choices.siblings == AUTO_DRAFT_SIBLINGS > 0
    assert pipe.graph["draft"].model_drafter.siblings == AUTO_DRAFT_SIBLINGS
    assert graphspec.Pipeline(_target(), draft=[_draft(), "suffix"], draft_siblings=0).graph[
        "draft"].model_drafter.siblings == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("suffix")
    target = make_checkpoint(root / "t", "qwen2", tokenizer=None, vocab_size=96, hidden_size=64, layers=2, heads=4,
                             kv_heads=2, seed=3)
    draft = make_checkpoint(root / "d", "llama", tokenizer=None, vocab_size=96, hidden_size=32, layers=1, heads=2,
                            kv_heads=1, seed=4)
    return graphspec.load_model(target, dtype=torch.bfloat16), graphspec.load_model(draft, dtype=torch.bfloat16)


def _prompts(vocab: int = 96):
    g = torch.Generator().manual_seed(5)
    fresh = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 9, 30)]
    block = torch.randint(0, vocab, (12,), generator=g).tolist()
    return fresh + [block * 3, block + [1, 2] + block[:6]]


@pytest.mark.parametrize("kind", ["suffix", "hybrid", "hybrid-siblings"])
def test_greedy_on_transformers_equals_autoregressive(tiny, kind):
    target, draft = tiny
    kw = {"draft_siblings": 2, "draft_confidence_threshold": 0.6} if kind == "hybrid-siblings" else {}
    pipe = graphspec.Pipeline(target, draft="suffix" if kind == "suffix" else [draft, "suffix"],
                              num_speculative_tokens=8, **kw)
    stats = _check_greedy(pipe, _prompts(), n=48)
    assert sum(s.accepted for s in stats) > 0


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    root = tmp_path_factory.mktemp("suffix-x")
    target = make_checkpoint(root / "t", "llama", tokenizer="bytelevel", seed=1)
    draft = make_checkpoint(root / "d", "llama", tokenizer="metaspace", seed=2, vocab_size=416)
    return graphspec.load_model(target), graphspec.load_model(draft)


@pytest.mark.parametrize("mode", ["slem", "tli"])
def test_greedy_hybrid_across_tokenizers_equals_autoregressive(cross, mode, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(tmp_path / "gs-cache"))
    target, draft = cross
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny vocabularies: a small intersection is expected
        pipe = graphspec.Pipeline(target, draft=[draft, "suffix"], num_speculative_tokens=6, vocab_mapping=mode)
        hybrid = pipe.graph["draft"]
        assert isinstance(hybrid, HybridDrafter) and [type(s).__name__ for s in hybrid.model_stages] == [
            "CrossVocabDrafter", "VocabMap"]
        prompts = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "abc abc abc abc", "x = 1\ny = 2\nx = 1\n"]
        ar = graphspec.Pipeline(target)
        for p in prompts + prompts:
            want = ar.run(p, max_new_tokens=40, ignore_eos=True)
            got = pipe.run(p, max_new_tokens=40, ignore_eos=True)
            assert got.token_ids == want.token_ids and got.text == want.text, p
    assert hybrid.store.num_tokens > 0
    assert hybrid.store.fingerprint == target.tokenizer.fingerprint


# ----------------------------------------------------------------------------- sampling, in distribution

# the longest earlier match, "9 1 2", continues with 3 7, 4 6 and 5 8: three children of the root, q = 1/3 each
BRANCHY = [9, 1, 2, 3, 7, 9, 1, 2, 4, 6, 9, 1, 2, 5, 8, 9, 1, 2]
# here with 3 7, 4 6 and 3 8: the tree is 3 (2/3) -> 8 (1/3), and 4 (1/3)
LOPSIDED = [9, 1, 2, 3, 7, 9, 1, 2, 4, 6, 9, 1, 2, 3, 8, 9, 1, 2]


@pytest.mark.parametrize("params, k", [(SamplingParams(temperature=1.0), 4),
                                       (SamplingParams(temperature=0.7, top_k=5), 6),
                                       (SamplingParams(temperature=1.3, top_p=0.8), 3)],
                         ids=["T1-K4", "T0.7-top5-K6", "T1.3-topp0.8-K3"])
def test_suffix_tree_sampling_matches_the_target_distribution(params, k):
    pipe = graphspec.Pipeline(_target(), draft=SuffixDrafter(learn=False, min_prob=0.05),
                              num_speculative_tokens=k)
    pvalues, rate = marginal_pvalues(pipe, BRANCHY, params, N_RUNS)
    assert min(pvalues) > 1e-3, pvalues
    assert 0 < rate < 0.99
    out = [pipe.run(BRANCHY, max_new_tokens=20, temperature=params.temperature, top_k=params.top_k,
                    top_p=params.top_p, seed=s, ignore_eos=True).stats.tree for s in range(40)]
    assert sum(t["siblings_proposed"] for t in out) > 0
    assert sum(t["siblings_accepted"] for t in out) > 0, out  # a sibling was taken: the recursive branch ran


def test_hybrid_sampling_matches_the_target_distribution():
    pipe = graphspec.Pipeline(_target(), draft=[_draft(), "suffix"], num_speculative_tokens=4)
    pipe.graph["draft"].suffix.learn = False
    pipe.graph["draft"].suffix.min_prob = 0.05
    pvalues, rate = marginal_pvalues(pipe, BRANCHY, SamplingParams(temperature=1.0), N_RUNS)
    assert min(pvalues) > 1e-3, pvalues


def test_a_sibling_order_that_is_no_draw_from_q_is_detected(monkeypatch):
    import graphspec.suffix as suffix

    # every race variable equal: children in count order, the heaviest first, whatever q says
    monkeypatch.setattr(suffix, "exponential_noise", lambda shape, gen, device: torch.ones(shape))
    pipe = graphspec.Pipeline(_target(), draft=SuffixDrafter(learn=False, min_prob=0.0), num_speculative_tokens=4)
    # LOPSIDED's root: q = (2/3, 1/3) for 3 and 4, but 3 is offered first every time
    pvalues, _ = marginal_pvalues(pipe, LOPSIDED, SamplingParams(temperature=1.0), N_RUNS)
    assert min(pvalues) < 1e-6, pvalues


# ----------------------------------------------------------------------------- the store


def test_the_store_learns_across_requests():
    target = _target()
    prompt = [7]
    learning = graphspec.Pipeline(target, draft="suffix", num_speculative_tokens=8)
    forgetful = graphspec.Pipeline(target, draft=SuffixDrafter(learn=False), num_speculative_tokens=8)
    first = learning.run(prompt, max_new_tokens=40, ignore_eos=True)
    assert learning.graph["draft"].store.docs == [first.token_ids]
    again = learning.run(prompt, max_new_tokens=40, ignore_eos=True)
    alone = forgetful.run(prompt, max_new_tokens=40, ignore_eos=True)
    assert again.token_ids == first.token_ids == alone.token_ids
    assert again.stats.steps < alone.stats.steps  # the earlier output was proposed from the store
    assert again.stats.mean_accepted_length > 3


def test_a_store_is_shared_by_pipelines_of_one_tokenizer_and_refuses_another(cross, tmp_path, monkeypatch):
    target, draft = cross
    store = SuffixStore()
    a = graphspec.Pipeline(target, draft=SuffixDrafter(store), num_speculative_tokens=6)
    b = graphspec.Pipeline(target, draft=SuffixDrafter(store), num_speculative_tokens=6)
    out = a.run("x = 1\n", max_new_tokens=20, ignore_eos=True)
    assert store.docs == [out.token_ids]
    b.run("y = 2\n", max_new_tokens=20, ignore_eos=True)
    assert len(store.docs) == 2
    other = graphspec.Pipeline(draft, draft=SuffixDrafter(store), num_speculative_tokens=6)
    with pytest.raises(ValueError, match="another tokenizer"):
        other.run("x = 1\n", max_new_tokens=4)


def test_memory_bound_and_fifo_eviction():
    store = SuffixStore(max_tokens=100)
    docs = [[i] * 10 + list(range(20, 30)) for i in range(12)]  # 20 tokens + SEP each
    for d in docs:
        store.add(d)
        assert store.num_tokens + len(store.docs) <= 100
    # the newest documents are kept, the oldest dropped first
    assert store.docs == docs[-len(store.docs):] and len(store.docs) < len(docs)
    assert store.evictions == len(docs) - len(store.docs)
    # the automaton is the one of the kept documents
    rebuilt = SuffixAutomaton()
    for d in store.docs:
        rebuilt.extend_all(d)
        rebuilt.extend(SEP)
    assert list(store.automaton.text) == list(rebuilt.text)
    assert store.automaton.num_states == rebuilt.num_states
    m = (0, 0)
    for t in docs[0][:10]:  # an evicted document's run no longer matches
        m = store.automaton.walk(*m, t)
    assert m[1] <= 1
    long = list(range(200, 400))
    store.add(long)
    assert store.docs == [long[-74:]]  # longer than the bound: its last tokens


def test_persistence_round_trip_and_validation(tmp_path):
    path = tmp_path / "suffix" / "store.json"
    store = SuffixStore(max_tokens=1000, tokenizer_fingerprint="abc")
    store.add([1, 2, 3])
    store.add([4, 5])
    store.save(path)
    back = SuffixStore.load(path)
    assert back.docs == store.docs and back.fingerprint == "abc" and back.max_tokens == 1000
    assert list(back.automaton.text) == list(store.automaton.text)
    data = json.loads(path.read_text())
    for bad, match in [({**data, "docs": [[1, -3]]}, "token ids >= 0"), ({**data, "format": "x"}, "not a graphspec"),
                       ({**data, "version": 99}, "version 99"), ({**data, "docs": [[1.5]]}, "token ids"),
                       ({**data, "max_tokens": 0}, "max_tokens")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            SuffixStore.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        SuffixStore.load(path)


def test_a_drafter_with_a_file_saves_after_each_request_and_loads_it(tmp_path):
    path = tmp_path / "store.json"
    target = _target()
    a = graphspec.Pipeline(target, draft=SuffixDrafter(save_path=path), num_speculative_tokens=4)
    out = a.run([7], max_new_tokens=12, ignore_eos=True)
    assert json.loads(path.read_text())["docs"] == [out.token_ids]
    b = SuffixDrafter(save_path=path)
    assert b.store.docs == [out.token_ids]


def test_no_match_proposes_nothing_and_errors_say_what_to_fix():
    pipe = graphspec.Pipeline(_target(), draft=SuffixDrafter(learn=False), num_speculative_tokens=4)
    out = pipe.run([0, 1, 2, 3, 4, 5], max_new_tokens=1, ignore_eos=True)
    assert out.stats.proposed == 0  # all tokens distinct: nothing occurred before
    with pytest.raises(ValueError, match="spec_factor"):
        SuffixDrafter(spec_factor=0)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixDrafter(min_prob=2)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixStore(max_tokens=0)
    with pytest.raises(ValueError, match="hybrid draft"):
        graphspec.Pipeline(_target(), draft=["ngram", "suffix"])
    with pytest.raises(ValueError, match="hybrid draft"):
        graphspec.Pipeline(_target(), draft=[_draft(), "ngram"])
    with pytest.raises(ValueError, match="negative"):
        SuffixStore().add([1, -1])


def test_cli_runs_suffix_and_hybrid_drafts(tmp_path):
    from tests.graphspec.test_cli import _assert_one_line_error, _cli

    tiny = make_checkpoint(tmp_path / "tiny", "llama", tokenizer="bytelevel")
    prompt = "x = 1\ny = 2\nx = 1\n"
    expected = graphspec.Pipeline(graphspec.load_model(tiny, dtype="float32")).run(
        prompt, max_new_tokens=16, ignore_eos=True)
    for draft, extra in (("suffix", ()), (f"{tiny}+suffix", ()), ("suffix", ("--draft-length", "auto"))):
        p = _cli("run", "--target", str(tiny), "--draft", draft, "--dtype", "fp32", "--max-new-tokens", "16",
                 "--ignore-eos", "-k", "8", *extra, prompt)
        assert p.returncode == 0, p.stderr
        assert p.stdout.rstrip("\n") == expected.text, (draft, extra)
    _assert_one_line_error(_cli("run", "--target", str(tiny), "--draft", "+suffix", prompt), "MODEL+suffix")
    _assert_one_line_error(_cli("run", "--target", str(tiny), "--draft", "suffix", "--draft-siblings", "2", prompt),
                           "draft-siblings")
