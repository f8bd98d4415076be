"""Pipeline(draft_length="auto"): one sequence's draft length chosen each step (graphspec.engine.AutoDraftLength).

The rule on given costs and acceptance counts, then through Pipeline.run on tiny random checkpoints: greedy
tokens equal plain decoding's whatever k it picks, a draft that is always right drafts K where verify rows are
cheap, one that is mostly wrong drafts 1 where they are dear, and sampled runs keep K (a seed gives one sample).
"""

import random

import pytest

import graphspec
from graphspec.engine import AutoDraftLength, CostTable

pytestmark = pytest.mark.usefixtures("single_thread")

FLAT = CostTable(target={1: 1.0, 8: 1.0}, draft={1: 0.01})     # verify rows free, drafts nearly so
DEAR = CostTable(target={1: 1.0, 8: 8.0}, draft={1: 0.3})      # each verify row costs a step


def _stats(k):
    return graphspec.GenerationStats(accepted_per_position=[0] * k, proposed_per_position=[0] * k,
                                     tested_per_position=[0] * k)


def _record(stats, accepted, proposed):
    """One step: positions 0..proposed-1 proposed, the first ``accepted`` of them kept."""
    stats.record_step(proposed, accepted)


def test_rule_follows_costs_and_recent_acceptance():
    k = 5
    rule = AutoDraftLength(FLAT)
    stats = _stats(k)
    assert rule(stats, k) == k  # prior acceptance 0.6 and free rows: the longest draft
    rule = AutoDraftLength(DEAR)
    stats = _stats(k)
    for _ in range(10):
        _record(stats, 0, rule(stats, k))
    assert rule.chosen[-1] == 1  # every draft rejected and each row a step: the shortest draft (never 0)
    mid = AutoDraftLength(CostTable(target={1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2, 6: 1.25}, draft={1: 0.05}))
    stats = _stats(k)
    for _ in range(15):
        _record(stats, 0, mid(stats, k))
    low = mid.chosen[-1]
    for _ in range(30):  # the run turns predictable: recent steps outweigh the old misses
        got = mid(stats, k)
        _record(stats, got, got)
    assert low < mid.chosen[-1] == k, mid.chosen
    assert all(1 <= c <= k for c in mid.chosen)


def test_rule_multiplies_the_acceptance_given_the_positions_before():
    # A chain whose every position is kept 4 times in 5 once the ones before it were: 1 + 0.8 + 0.64 + ... tokens.
    # With dear-ish drafts and free rows, k = 4 gives the most per second (1 + .8 + .64 + .51 + .41 = 3.36 tokens
    # for 1.8 s; k = 2: 2.44 for 1.4 s). Multiplying each position's chance that it and all before it were kept
    # (.8, .64, .51, ...) as if it were conditional undercounts the deeper positions and settles on k = 2.
    costs = CostTable(target={1: 1.0, 8: 1.0}, draft={1: 0.2})
    k, rng = 6, random.Random(0)
    rule, stats = AutoDraftLength(costs), _stats(k)
    for _ in range(200):
        cap = rule(stats, k)
        kept = 0
        while kept < cap and rng.random() < 0.8:
            kept += 1
        _record(stats, kept, cap)
    late = rule.chosen[-100:]
    assert 3.2 <= sum(late) / len(late) <= 5.5, late
    # the counts: position i judged when proposed with all before it kept
    assert stats.tested_per_position[0] == stats.proposed_per_position[0]
    assert all(stats.tested_per_position[i] <= stats.accepted_per_position[i - 1] for i in range(1, k))


def _chain_run(rule, k, steps, kept_rate, extra_seconds=0.0, go_on=None, seed=0):
    """Steps of a chain draft through ``rule``: each drafted position kept with ``kept_rate`` once the ones before it
    were, the chain going on past depth i with ``go_on(i, step)`` (always if None), and each step's wall time the
    rule's own table price of its forwards plus ``extra_seconds``."""
    rng, stats = random.Random(seed), _stats(k)
    for step in range(steps):
        cap = rule(stats, k)
        depth = 1
        while depth < cap and (go_on is None or go_on(depth - 1, step)):
            depth += 1
        kept = 0
        while kept < depth and rng.random() < kept_rate:
            kept += 1
        stats.decode_seconds += (depth * rule.costs.draft_cost(1) + rule.costs.target_cost(depth + 1)
                                 + extra_seconds)
        _record(stats, kept, depth)
    return stats


def test_rule_prices_the_steps_time_outside_its_forwards():
    # Half the drafts kept, free verify rows, drafts a third of a step: one draft a step is best (1.5 tokens for
    # 1.3 s; two: 1.75 for 1.6 s). Where each step also spends 4 s between its forwards (a slow host, Python), that
    # time is shared by more tokens with longer drafts: two or three give the most (1.75 / 5.6, 1.88 / 5.9 s).
    costs = CostTable(target={1: 1.0, 8: 1.0}, draft={1: 0.3})
    lean = AutoDraftLength(costs)
    _chain_run(lean, 5, 150, 0.5)
    slow = AutoDraftLength(costs)
    _chain_run(slow, 5, 150, 0.5, extra_seconds=4.0)
    assert sum(lean.chosen[-100:]) / 100 <= 1.2, lean.chosen
    assert sum(slow.chosen[-100:]) / 100 >= 1.8, slow.chosen
    assert slow._over / slow._over_n == pytest.approx(4.0)  # what the steps spent outside the priced forwards


def test_rule_counts_the_chains_that_end_early():
    # A draft unsure past its first token every other step and past its second always: a cap of 4 drafts 1.5 tokens
    # on average, and a chain (no siblings) verifies those rows plus one, not 5.
    rule = AutoDraftLength(FLAT)
    _chain_run(rule, 4, 60, 1.0, go_on=lambda depth, step: depth == 0 and step % 2 == 0)
    assert min(rule.chosen) >= 2  # free rows and cheap drafts: long caps (the chain ends where the draft is unsure)
    tokens, forwards, _ = rule.estimate(4)
    assert 1.3 <= forwards <= 1.9, forwards
    assert tokens == pytest.approx(1 + forwards, rel=0.05)  # every drafted token kept


def test_rule_starts_afresh_for_each_run():
    rule = AutoDraftLength(DEAR)
    stats = _stats(4)
    for _ in range(8):
        _record(stats, 0, rule(stats, 4))
    assert rule.chosen[-1] == 1
    first = AutoDraftLength(DEAR)(_stats(4), 4)
    assert rule(_stats(4), 4) == first and rule.chosen == [first]


def test_greedy_tokens_are_plain_decodings_and_k_follows_the_draft(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    target = graphspec.load_model(target_dir)
    draft = graphspec.load_model(draft_dir)
    plain = graphspec.Pipeline(target).run("the cat sat on the mat", max_new_tokens=40, ignore_eos=True)
    k = 4
    # The target as its own draft is always right; with free verify rows every step drafts K.
    self_draft = graphspec.Pipeline(target, target, num_speculative_tokens=k, draft_length="auto",
                                    draft_confidence_threshold=None, draft_siblings=0, draft_quantize=None)
    self_draft._auto_length = AutoDraftLength(FLAT)
    out = self_draft.run("the cat sat on the mat", max_new_tokens=40, ignore_eos=True)
    assert out.token_ids == plain.token_ids
    assert set(self_draft._auto_length.chosen) == {k}
    # A random draft is mostly wrong; with dear rows the rule settles on one draft token a step.
    other = graphspec.Pipeline(target, draft, num_speculative_tokens=k, draft_length="auto",
                               draft_confidence_threshold=None, draft_siblings=0, draft_quantize=None)
    other._auto_length = AutoDraftLength(DEAR)
    out = other.run("the cat sat on the mat", max_new_tokens=40, ignore_eos=True)
    assert out.token_ids == plain.token_ids
    chosen = other._auto_length.chosen
    assert out.stats.acceptance_rate < 0.5 and chosen[-1] == 1 and len(chosen) == out.stats.steps
    assert out.stats.proposed <= sum(chosen)


def test_costs_are_measured_once_and_trees_keep_their_tokens(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    target = graphspec.load_model(target_dir)
    draft = graphspec.load_model(draft_dir)
    plain = graphspec.Pipeline(target).run("one two three", max_new_tokens=24, ignore_eos=True)
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=3, draft_length="auto", draft_siblings=2,
                              draft_quantize=None)
    for _ in range(2):
        assert pipe.run("one two three", max_new_tokens=24, ignore_eos=True).token_ids == plain.token_ids
    rule = pipe._auto_length
    assert sorted(rule.costs.target) == [1, 2, 3, 4] and sorted(rule.costs.draft) == [1, 2, 3, 4]
    assert all(v > 0 for v in rule.costs.target.values())
    assert pipe._auto_length is rule  # timed on the first run only


def test_runs_in_threads_keep_their_own_counts(tiny_pair_dirs):
    import threading

    target_dir, draft_dir = tiny_pair_dirs
    target = graphspec.load_model(target_dir)
    draft = graphspec.load_model(draft_dir)
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_length="auto",
                              draft_confidence_threshold=None, draft_siblings=0, draft_quantize=None)
    pipe._auto_length = AutoDraftLength(DEAR)
    prompts = ["the cat sat", "one two three four", "hello world"]
    alone = [graphspec.Pipeline(target).run(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    seen = []
    original = AutoDraftLength.for_run

    def spy(self):
        run = original(self)
        seen.append(run)
        return run

    AutoDraftLength.for_run = spy
    try:
        outs = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(
            i, pipe.run(prompts[i], max_new_tokens=20, ignore_eos=True))) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        AutoDraftLength.for_run = original
    assert [o.token_ids for o in outs] == alone
    assert len({id(r) for r in seen}) == len(prompts)  # a rule of its own per run
    for o in outs:  # each run's choices were made from its own counts: one per step
        assert any(len(r.chosen) == o.stats.steps for r in seen)


def test_sampled_runs_draft_k_as_fixed(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    target = graphspec.load_model(target_dir)
    draft = graphspec.load_model(draft_dir)
    kw = dict(num_speculative_tokens=4, draft_confidence_threshold=None, draft_siblings=0, draft_quantize=None)
    fixed = graphspec.Pipeline(target, draft, **kw)
    auto = graphspec.Pipeline(target, draft, draft_length="auto", **kw)
    auto._auto_length = AutoDraftLength(DEAR)  # would pick 1 a step if it applied
    a = fixed.run("hello world", max_new_tokens=30, temperature=0.9, seed=7, ignore_eos=True)
    b = auto.run("hello world", max_new_tokens=30, temperature=0.9, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.stats.proposed == b.stats.proposed
    assert auto._auto_length.chosen == []


@pytest.mark.parametrize("kw, match", [
    (dict(draft_length="sometimes"), "draft_length must be 'fixed'"),
    (dict(draft="ngram", draft_length="auto"), "draft_length='auto' times a model draft"),
    (dict(draft_length="auto", draft_beam=2), "no draft_beam"),
])
def test_draft_length_errors(tiny_pair_dirs, kw, match):
    target_dir, draft_dir = tiny_pair_dirs
    kw = {"draft": draft_dir, **kw}
    with pytest.raises(ValueError, match=match):
        graphspec.Pipeline(target_dir, **kw)
