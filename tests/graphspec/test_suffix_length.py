"""Pipeline(draft="suffix", draft_length="auto"): how much of each suffix tree to propose (graphspec.suffix.SuffixLength).

The rule on given verify costs and acceptance counts (long matches proposed whole where rows are cheap, short
matches that keep missing not at all where rows are dear, the chosen nodes a prefix of the best-first tree), then
through Pipeline.run on toy models and a tiny random checkpoint: greedy tokens equal plain decoding's whatever it
proposes, the rule learns from the tokens committed after each of its trees, costs are timed once, and sampled runs
propose as draft_length="fixed" does (a seed gives one sample).
"""

import pytest
import torch

import graphspec
from graphspec.engine import CostTable
from graphspec.suffix import SuffixDrafter, SuffixLength
from tests.checkpoints import make_checkpoint
from tests.graphspec.test_lossless import _target

pytestmark = pytest.mark.usefixtures("single_thread")

FLAT = CostTable(target={1: 1.0, 17: 1.0})    # verify rows free
DEAR = CostTable(target={1: 1.0, 17: 17.0})   # each verify row costs a one-token step
STEPPED = CostTable(target={1: 1.0, 8: 1.05, 9: 2.0, 16: 2.05, 17: 3.0})  # a kernel that passes over 8 rows at once

CHAIN = ([1.0] * 16, list(range(-1, 15)))  # one occurrence: a chain of 16 nodes, each scoring 1


def test_long_matches_are_proposed_whole_where_rows_are_cheap():
    rule = SuffixLength(FLAT)
    assert rule.choose(*CHAIN, match=40) == 16
    assert rule.choose(*CHAIN, match=1) == 16  # free rows: even a weak match is worth proposing
    # Where each row costs a step, a node pays only if it is surely taken: no prior is that sure.
    assert SuffixLength(DEAR).choose(*CHAIN, match=40) == 0
    # A kernel's row block: 7 nodes (8 rows) nearly free, the 9th row doubles the cost.
    assert SuffixLength(STEPPED).choose(*CHAIN, match=2) == 7
    learned = SuffixLength(STEPPED)
    for _ in range(20):
        learned.record(40, 16, 16)  # long matches were always taken whole
    assert learned.choose(*CHAIN, match=40) == 15  # 16 rows at 2.05: 16 tokens, where 8 rows give 8 at 1.05
    assert learned.rate(40) > 0.99 and learned.rate(2) == pytest.approx(2 / 3)


def test_matches_that_keep_missing_are_not_proposed_and_classes_learn_apart():
    costs = CostTable(target={1: 1.0, 2: 1.3, 17: 6.0})
    rule = SuffixLength(costs)
    assert rule.choose(*CHAIN, match=1) > 0  # the prior, 1/2 a token for a one-token match
    for _ in range(10):
        rule.record(1, 4, 0)  # one-token matches: nothing taken
        rule.record(20, 8, 8)  # 16-31-token matches: all taken
    assert rule.choose(*CHAIN, match=1) == 0  # a plain step
    assert rule.choose(*CHAIN, match=20) >= 4
    assert rule.rate(1) < 0.1 < 0.9 < rule.rate(31)
    assert rule.rate(2) == pytest.approx(2 / 3)  # another class: still its prior


def test_the_chosen_nodes_are_a_prefix_of_the_best_first_tree():
    # Two branches after the first token: scores fall best first, children after parents.
    scores = [1.0, 0.6, 0.4, 0.6, 0.4, 0.3]
    parents = [-1, 0, 0, 1, 2, 3]
    rule = SuffixLength(CostTable(target={1: 1.0, 3: 1.0, 7: 2.5}))
    n = rule.choose(scores, parents, match=8)
    assert n == 2  # 3 rows cost a step; the 4th node's row would cost more than its 0.4 x r ** 2
    assert rule.chosen == [n]
    assert SuffixLength(FLAT).choose(scores, parents, match=8) == 6


def test_costs_grow_with_the_context_between_the_two_tables():
    short = CostTable(target={1: 1.0, 9: 1.1, 17: 2.0})
    long = CostTable(target={1: 1.2, 9: 2.0, 17: 2.2})  # after 1040 tokens: 9 rows now dearer; 17 less than short's + 0.2
    rule = SuffixLength(short, long_costs=long, long_context=1040)
    assert rule.seconds(9, 16) == pytest.approx(1.1) and rule.seconds(9, 1040) == pytest.approx(2.0)
    assert rule.seconds(9, 528) == pytest.approx(1.1 + 0.9 / 2)  # halfway
    assert rule.seconds(9, 2064) == pytest.approx(1.1 + 0.9 * 2)  # linear past it
    assert rule.seconds(17, 1040) == pytest.approx(2.2) and rule.seconds(5, 1040) == pytest.approx(1.2 + 0.4)
    assert SuffixLength(short).seconds(9, 5000) == pytest.approx(1.1)  # no long table: the context does not count
    # 16 rows a little dearer than 8 after a short context, far dearer after a long one: a shorter chain there
    rule = SuffixLength(CostTable(target={1: 1.0, 8: 1.05, 9: 2.0, 17: 2.1}),
                        long_costs=CostTable(target={1: 1.2, 8: 1.3, 9: 2.4, 17: 4.5}), long_context=1040)
    for _ in range(20):
        rule.record(40, 16, 16)
    assert rule.choose(*CHAIN, match=40, context=16) == 16
    assert rule.choose(*CHAIN, match=40, context=1040) == 7


def _toy_pipe(costs, k=12):
    pipe = graphspec.Pipeline(_target(), draft="suffix", num_speculative_tokens=k, draft_length="auto")
    pipe.graph["draft"].length = SuffixLength(costs)
    return pipe


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 2], [3, 3, 3, 3, 11, 4], [14, 0, 6, 13, 8, 10]]


@pytest.mark.parametrize("costs", [FLAT, DEAR, STEPPED], ids=["flat", "dear", "stepped"])
def test_greedy_tokens_are_plain_decodings_whatever_it_proposes(costs):
    pipe = _toy_pipe(costs)
    ar = graphspec.Pipeline(pipe.target)
    proposed = 0
    for p in PROMPTS + PROMPTS[:1]:  # the cycle again: the store holds its first output, a long continuation
        want = ar.run(p, max_new_tokens=40, ignore_eos=True).token_ids
        got = pipe.run(p, max_new_tokens=40, ignore_eos=True)
        assert got.token_ids == want, p
        proposed += got.stats.proposed
    rule = pipe.graph["draft"].length
    if costs is DEAR:
        assert proposed == 0 and set(rule.chosen) == {0}
    else:
        assert proposed > 0 and max(rule.chosen) == (12 if costs is FLAT else 7)
        assert sum(rule.accepted) > 0  # learned from the committed tokens


def test_rates_come_from_the_committed_tokens():
    pipe = _toy_pipe(FLAT, k=6)
    accepted = 0
    for p in PROMPTS:
        accepted += pipe.run(p, max_new_tokens=30, ignore_eos=True).stats.accepted
    rule = pipe.graph["draft"].length
    # every proposed tree is settled (the last one at each run's end): it counted what the runs accepted
    assert accepted > 0 and sum(rule.accepted) == accepted
    assert 0 < sum(rule.stopped) < sum(1 for n in rule.chosen if n)


def test_sampled_runs_propose_as_fixed():
    fixed = graphspec.Pipeline(_target(), draft="suffix", num_speculative_tokens=6)
    auto = _toy_pipe(DEAR, k=6)  # would propose nothing if it applied
    for p in PROMPTS[:2]:
        a = fixed.run(p, max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
        b = auto.run(p, max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
        assert a.token_ids == b.token_ids and a.stats.proposed == b.stats.proposed
    assert auto.graph["draft"].length.chosen == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("suffix-length")
    path = make_checkpoint(root / "t", "qwen2", tokenizer=None, vocab_size=96, hidden_size=64, layers=2, heads=4,
                           kv_heads=2, seed=3)
    return graphspec.load_model(path, dtype=torch.bfloat16)


def test_costs_are_timed_once_on_the_first_greedy_run(tiny):
    block = list(range(10, 22))
    prompt = block * 3
    plain = graphspec.Pipeline(tiny).run(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    pipe = graphspec.Pipeline(tiny, draft="suffix", num_speculative_tokens=9, draft_length="auto")
    drafter = pipe.graph["draft"]
    assert drafter.length is None
    pipe.run(prompt, max_new_tokens=8, temperature=1.0, seed=1)  # sampled: nothing timed
    assert drafter.length is None
    assert pipe.run(prompt, max_new_tokens=24, ignore_eos=True).token_ids == plain
    rule = drafter.length
    assert sorted(rule.costs.target) == [1, 2, 4, 6, 8, 9, 10] and rule.max_k == 9
    assert all(v > 0 for v in rule.costs.target.values())
    # and again after a long context (as long as the model's positions allow, up to 1024)
    assert rule.long_context == min(1024, tiny.config.max_position_embeddings - 11) > 16
    assert sorted(rule.long_costs.target) == [1, 8, 9, 10] and all(v > 0 for v in rule.long_costs.target.values())
    assert pipe.run(prompt, max_new_tokens=24, ignore_eos=True).token_ids == plain
    assert drafter.length is rule  # timed once
    other = graphspec.Pipeline(tiny, draft="suffix", num_speculative_tokens=9, draft_length="auto")
    other.run(prompt, max_new_tokens=4, ignore_eos=True)
    # another pipeline on the same target: the same table (timed once a process), counts of its own
    assert other.graph["draft"].length.costs is rule.costs and other.graph["draft"].length is not rule


def test_a_suffix_drafter_stage_takes_the_rule_and_errors_say_what_to_fix(tiny):
    own = SuffixDrafter(spec_factor=2.0)
    pipe = graphspec.Pipeline(tiny, draft=own, num_speculative_tokens=4, draft_length="auto")
    pipe.run([4, 5, 6, 4, 5, 6, 4], max_new_tokens=6, ignore_eos=True)
    assert isinstance(own.length, SuffixLength)
    with pytest.raises(ValueError, match="draft_length='auto' times a model draft's forwards"):
        graphspec.Pipeline(tiny, draft="ngram", draft_length="auto")


def _hybrid(costs, k=12, **kw):
    from graphspec import ModelDrafter
    from graphspec.suffix import HybridDrafter
    from tests.graphspec.test_lossless import _draft

    h = HybridDrafter(ModelDrafter(_draft()), draft_cost=0.2, prefill_cost=0.3, **kw)
    h.suffix.length = SuffixLength(costs)
    return graphspec.Pipeline(_target(), draft=h, num_speculative_tokens=k), h


@pytest.mark.parametrize("costs", [FLAT, STEPPED], ids=["flat", "stepped"])
def test_a_hybrids_suffix_trees_are_sized_too_and_its_tokens_are_plain_decodings(costs):
    pipe, h = _hybrid(costs)
    ar = graphspec.Pipeline(pipe.target)
    for p in PROMPTS + PROMPTS[:1]:
        want = ar.run(p, max_new_tokens=40, ignore_eos=True).token_ids
        assert pipe.run(p, max_new_tokens=40, ignore_eos=True).token_ids == want, p
    assert h.model_k == 5 and max(h.suffix.length.chosen) == (12 if costs is FLAT else 7)  # beyond the model's 5
    assert h.measured["suffix_accepted"] > 0 and sum(h.suffix.length.accepted) > 0


# A model step's 6 rows at three one-row steps: a plain step yields 3 tokens in the model step's unit (a verify of
# its rows), where the model's prior step yields 1.5 (3 tokens for 1 + 0.2 x 5 verifies).
STEEP = CostTable(target={1: 1.0, 6: 3.0, 17: 6.0})


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["rows-alike", "rows-dear"])
def test_a_hybrid_drafts_with_its_model_only_where_that_beats_a_plain_step(costs):
    pipe, h = _hybrid(costs, k=5)
    ar = graphspec.Pipeline(pipe.target)
    forwards = 0
    for p in PROMPTS:
        want = ar.run(p, max_new_tokens=30, ignore_eos=True).token_ids
        out = pipe.run(p, max_new_tokens=30, ignore_eos=True)
        assert out.token_ids == want, p
        forwards += out.stats.draft_forwards
    if costs is FLAT:  # 1.5 tokens a verify beats a plain step's 1: the model drafts where no suffix tree is
        assert forwards > 0 and h.measured["model_steps"] > 0
    else:  # 1.5 against a plain step's 3: never the model (steps without a suffix tree are plain)
        assert forwards == 0 and h.measured["model_steps"] == 0


def test_the_hybrid_weighs_a_long_trees_verify_time():
    from graphspec import ModelDrafter
    from graphspec.suffix import HybridDrafter
    from tests.graphspec.test_lossless import _draft

    h = HybridDrafter(ModelDrafter(_draft()), draft_cost=0.2)  # a model step: 3 tokens for 2 verifies, 1.5
    assert h.prefers_suffix(1.0, 5)  # 2 tokens a verify
    assert not h.prefers_suffix(1.0, 5, verify_ratio=0.5)  # the same tree at twice a model step's verify time
    assert h.prefers_suffix(4.0, 5, verify_ratio=0.5)


def test_a_pipelines_hybrid_takes_the_rule(tiny):
    pipe = graphspec.Pipeline(tiny, draft=[tiny, "suffix"], num_speculative_tokens=8, draft_length="auto",
                              draft_quantize=None)
    want = graphspec.Pipeline(tiny).run([4, 5, 6, 4, 5, 6, 4], max_new_tokens=12, ignore_eos=True).token_ids
    assert pipe.run([4, 5, 6, 4, 5, 6, 4], max_new_tokens=12, ignore_eos=True).token_ids == want
    h = pipe.graph["draft"]
    assert isinstance(h.suffix.length, SuffixLength) and h.suffix.length.max_k == 8
