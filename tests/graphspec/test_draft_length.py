"""Pipeline(draft_length="auto"): one sequence's draft length chosen each step (graphspec.engine.AutoDraftLength).

The rule on given costs and acceptance counts, then through Pipeline.run on tiny random checkpoints: greedy
tokens equal plain decoding's whatever k it picks, a draft that is always right drafts K where verify rows are
cheap, one that is mostly wrong drafts 1 where they are dear, and sampled runs keep K (a seed gives one sample).
"""

from types import SimpleNamespace

import pytest

import graphspec
from graphspec.engine import AutoDraftLength, CostTable

pytestmark = pytest.mark.usefixtures("single_thread")

FLAT = CostTable(target={1: 1.0, 8: 1.0}, draft={1: 0.01})     # verify rows free, drafts nearly so
DEAR = CostTable(target={1: 1.0, 8: 8.0}, draft={1: 0.3})      # each verify row costs a step


def _stats(k):
    return SimpleNamespace(accepted_per_position=[0] * k, proposed_per_position=[0] * k)


def _record(stats, accepted, proposed):
    """One step: positions 0..proposed-1 proposed, the first ``accepted`` of them kept."""
    for i in range(proposed):
        stats.proposed_per_position[i] += 1
        stats.accepted_per_position[i] += int(i < accepted)


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
