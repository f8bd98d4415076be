"""The batched engine: each sequence's output is the one Pipeline.run gives alone, whatever else is batched.

Tiny random checkpoints (a real Transformer, so ``step_many`` batches the forwards) and toy models (the
chi-square oracle). Greedy outputs are token-exact; seeded sampled outputs are the same samples; the
sampling distribution through the engine, with other sequences in the batch, passes the chi-square test.
"""

import contextlib
import gc
import threading
import time

import numpy as np
import pytest
import torch

import graphspec
from graphspec import SamplingParams
from graphspec.engine import CostTable, Engine, QueueFull, SequenceView, SpeculationPolicy
from tests.checkpoints import make_checkpoint
from tests.graphspec.oracle import chi2_pvalue, exact_marginals
from tests.graphspec.test_lossless import PROMPT, _draft, _target

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_dirs(tiny_pair_dirs, tmp_path_factory):
    target, draft = tiny_pair_dirs
    root = tmp_path_factory.mktemp("engine")
    # a draft with another tokenizer (metaspace): the cross-vocabulary stages run in the engine too
    other = make_checkpoint(root / "other", "llama", tokenizer="metaspace", hidden_size=64, layers=1, heads=4,
                            kv_heads=2, seed=2)
    return target, draft, other


PROMPTS = ["hello world", "the cat sat on the mat " * 3, "a", "one two three four five six seven",
           [{"role": "user", "content": "hi there"}], "abc abc abc abc abc", "x y z", "zzz " * 9]


def _requests(n):
    """n requests of mixed prompts, lengths, greedy and seeded sampling."""
    out = []
    for i in range(n):
        kw = dict(max_new_tokens=5 + (7 * i) % 23, ignore_eos=True)
        if i % 3 == 1:
            kw.update(temperature=0.9, seed=1000 + i)
        elif i % 3 == 2:
            kw.update(temperature=0.7, top_k=20, top_p=0.9, seed=2000 + i)
        out.append((PROMPTS[i % len(PROMPTS)], kw))
    return out


def _pipes(tiny_dirs, dtype):
    target_dir, draft_dir, other_dir = tiny_dirs
    target = graphspec.load_model(target_dir, dtype=dtype)
    draft = graphspec.load_model(draft_dir, dtype=dtype)
    return {
        "plain": graphspec.Pipeline(target),
        "model": graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_confidence_threshold=None),
        "tree": graphspec.Pipeline(target, draft, num_speculative_tokens=5, draft_siblings=2),
        "ngram": graphspec.Pipeline(target, "ngram", num_speculative_tokens=3),
        "int8": graphspec.Pipeline(target, graphspec.load_model(draft_dir, dtype=torch.float32, quantize="int8"),
                                   num_speculative_tokens=4, draft_vocab=250),
        "cross": graphspec.Pipeline(target, graphspec.load_model(other_dir, dtype=dtype), num_speculative_tokens=3),
    }


@pytest.mark.parametrize("dtype, concurrency, names", [
    (torch.float32, 1, ["model"]),
    (torch.float32, 4, ["plain", "model", "tree", "ngram", "cross", "int8"]),
    (torch.float32, 16, ["model", "tree", "int8"]),
    (torch.bfloat16, 4, ["plain", "model", "tree"]),
    (torch.bfloat16, 16, ["model", "int8"]),
], ids=["fp32-1", "fp32-4", "fp32-16", "bf16-4", "bf16-16"])
def test_batched_outputs_equal_each_request_alone(tiny_dirs, dtype, concurrency, names):
    requests = _requests(max(concurrency, 6))
    pipes = _pipes(tiny_dirs, dtype)
    for name in names:
        pipe = pipes[name]
        alone = [pipe.run(p, **kw) for p, kw in requests]
        engine = Engine(pipe, max_batch=concurrency, policy="off")
        got = [s.result(timeout=120) for s in [engine.submit(p, **kw) for p, kw in requests]]
        for i, (a, b) in enumerate(zip(alone, got)):
            assert b.token_ids == a.token_ids, (name, i, requests[i])
            assert b.text == a.text and b.finish_reason == a.finish_reason
            assert b.stats.target_forwards == a.stats.target_forwards
        if concurrency > 1:  # forwards really were shared: fewer batched target forwards than requests made
            assert engine.forwards["target"] < sum(a.stats.target_forwards for a in alone), name
        assert engine.running == 0 and engine.waiting == 0
        assert engine.live_caches() == 0


def test_run_batch_is_run_for_each_prompt(tiny_dirs):
    pipe = _pipes(tiny_dirs, torch.float32)["tree"]
    prompts = PROMPTS[:5]
    alone = [pipe.run(p, max_new_tokens=12) for p in prompts]
    batch = pipe.run_batch(prompts, max_new_tokens=12, max_batch=3)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    with pytest.raises(ValueError, match="list of prompts"):
        pipe.run_batch("one string")


def test_step_many_rows_are_the_rows_of_each_step(tiny_dirs, model_level):
    """``Transformer.step_many``: each request's logits are the bits of its own ``step`` (chains, a tree mask,
    logits_for variants), at every CPU level."""
    from graphspec.kernels.attention import ancestor_mask

    for dtype in (torch.float32, torch.bfloat16):
        model = graphspec.load_model(tiny_dirs[0], dtype=dtype)
        g = torch.Generator().manual_seed(0)
        caches = []
        for length in (5, 9, 3, 1):
            c = model.new_cache(64)
            model.step(torch.randint(0, 300, (1, length), generator=g), c)
            caches.append(c)
        parents = [-1, 0, 0, 1]
        tree = ancestor_mask(torch.tensor(parents))
        depth = torch.tensor([[0, 1, 1, 2]]) + caches[3].length
        reqs = [dict(token_ids=torch.randint(0, 300, (1, 1), generator=g)),
                dict(token_ids=torch.randint(0, 300, (1, 6), generator=g), logits_for="all"),
                dict(token_ids=torch.randint(0, 300, (1, 3), generator=g), logits_for="last"),
                dict(token_ids=torch.randint(0, 300, (1, 4), generator=g), positions=depth, tree=tree)]
        lengths = [c.length for c in caches]
        alone = [model.step(cache=c, **r) for c, r in zip(caches, reqs)]
        after = [c.length for c in caches]
        for c, n in zip(caches, lengths):
            c.truncate(n)
        many = model.step_many([dict(cache=c, **r) for c, r in zip(caches, reqs)])
        assert [c.length for c in caches] == after
        for i, (a, b) in enumerate(zip(alone, many)):
            assert a.shape == b.shape and torch.equal(a, b), (dtype, model_level, i)
        with pytest.raises(ValueError, match="share one cache"):
            model.step_many([dict(token_ids=reqs[0]["token_ids"], cache=caches[0])] * 2)


def test_int8_step_many_rows_are_the_rows_of_each_step(tiny_dirs, any_level):
    """An int8 draft's batched forward (the C++ ``forward_many`` at the C++ levels, the general forward at the
    torch level) gives each sequence the bits of its own ``step``: chains, a tree, a pruned head."""
    from graphspec.kernels.attention import ancestor_mask

    model = graphspec.load_model(tiny_dirs[1], dtype=torch.float32, quantize="int8")
    g = torch.Generator().manual_seed(1)
    caches = []
    for length in (4, 11, 2):
        c = model.new_cache(64)
        model.step(torch.randint(0, 300, (1, length), generator=g), c)
        caches.append(c)
    tree = ancestor_mask(torch.tensor([-1, 0, 0]))
    reqs = [dict(token_ids=torch.randint(0, 300, (1, 1), generator=g), logits_for="last"),
            dict(token_ids=torch.randint(0, 300, (1, 5), generator=g)),
            dict(token_ids=torch.randint(0, 300, (1, 3), generator=g), tree=tree,
                 positions=torch.tensor([[0, 1, 1]]) + caches[2].length)]
    for head in (None, model.head_rows(torch.arange(0, 250))):
        lengths = [c.length for c in caches]
        alone = [model.step(cache=c, head=head, **r) for c, r in zip(caches, reqs)]
        for c, n in zip(caches, lengths):
            c.truncate(n)
        many = model.step_many([dict(cache=c, head=head, **r) for c, r in zip(caches, reqs)])
        for i, (a, b) in enumerate(zip(alone, many)):
            assert a.shape == b.shape and torch.equal(a, b), (any_level, head is None, i)
        for c, n in zip(caches, lengths):
            c.truncate(n)


def test_policy_keeps_greedy_tokens_and_follows_the_costs(tiny_dirs):
    pipe = _pipes(tiny_dirs, torch.float32)["model"]
    prompts = [p for p in PROMPTS if isinstance(p, str)][:4]
    alone = [pipe.run(p, max_new_tokens=20, ignore_eos=True) for p in prompts]
    # verify rows free, drafts free: draft every step; verify rows dear: never draft
    cheap = CostTable(target={1: 1.0, 64: 1.0}, draft={1: 0.0, 64: 0.0})
    dear = CostTable(target={1: 1.0, 64: 64.0}, draft={1: 0.5, 64: 0.5})
    for costs, drafts in ((cheap, True), (dear, False)):
        engine = Engine(pipe, max_batch=4, policy=SpeculationPolicy(costs))
        got = [s.result(timeout=60) for s in [engine.submit(p, max_new_tokens=20, ignore_eos=True) for p in prompts]]
        assert [r.token_ids for r in got] == [r.token_ids for r in alone]
        proposed = sum(r.stats.proposed for r in got)
        assert (proposed > 0) == drafts, (costs, proposed)
    # sampled requests keep K whatever the policy says, so a seed gives the same sample as alone
    engine = Engine(pipe, max_batch=2, policy=SpeculationPolicy(dear))
    s = engine.submit(prompts[0], max_new_tokens=15, temperature=0.8, seed=5)
    assert s.result(timeout=60).token_ids == pipe.run(prompts[0], max_new_tokens=15, temperature=0.8, seed=5).token_ids


def test_policy_keeps_a_greedy_sequences_first_step_plain(tiny_dirs):
    """The first token comes at plain's time to first token: a greedy sequence's first step drafts nothing (its
    draft would first prefill the whole prompt), later ones draft as the policy plans; tokens as alone."""
    pipe = _pipes(tiny_dirs, torch.float32)["model"]
    prompts = [p for p in PROMPTS if isinstance(p, str)][:3]
    alone = [pipe.run(p, max_new_tokens=16, ignore_eos=True).token_ids for p in prompts]
    engine = Engine(pipe, max_batch=4, policy=SpeculationPolicy(CostTable(target={1: 1.0, 64: 1.0},
                                                                          draft={1: 0.0, 64: 0.0})))
    budget, calls = engine._pipe._draft_budget, []
    lock = threading.Lock()

    def spy(stats, k):
        got = budget(stats, k)
        with lock:
            calls.append((id(stats), stats.generated_tokens, got))
        return got

    engine._pipe._draft_budget = spy
    assert [r.token_ids for r in engine.run_batch(prompts, max_new_tokens=16, ignore_eos=True)] == alone
    firsts = [got for _, n, got in calls if n == 0]
    later = [got for _, n, got in calls if n > 0]
    assert len(firsts) == len(prompts) and set(firsts) == {0}
    assert later and max(later) == pipe.num_speculative_tokens  # drafting is free here: the policy drafts K after
    # sampled sequences draft K from their first step on (a seed gives the sample it gives alone)
    calls.clear()
    engine.run_batch(prompts[:1], max_new_tokens=6, temperature=0.8, seed=3)
    assert [got for _, n, got in calls if n == 0] == [pipe.num_speculative_tokens]


def test_policy_choice():
    flat = SpeculationPolicy(CostTable(target={1: 1.0, 64: 1.1}, draft={1: 0.05, 64: 0.05}))
    assert flat.choose(5, running=1, accepted=90, proposed=100) == 5  # good drafts, verify rows nearly free
    assert flat.choose(5, running=1, accepted=0, proposed=200) == 0   # a draft that is never accepted
    linear = SpeculationPolicy(CostTable(target={1: 1.0, 64: 64.0}, draft={1: 0.05, 64: 3.2}))
    assert linear.choose(5, running=8, accepted=60, proposed=100) == 0  # rows cost what they return, or more
    mid = SpeculationPolicy(CostTable(target={1: 1.0, 8: 1.2, 64: 8.0}, draft={1: 0.05, 64: 0.4}))
    assert 0 < mid.choose(5, running=1, accepted=70, proposed=100) <= 5
    # as the batch grows the rows cost more, and the policy drafts no more than at a small batch
    assert mid.choose(5, running=16, accepted=70, proposed=100) <= mid.choose(5, running=1, accepted=70,
                                                                               proposed=100)


def test_policy_chooses_one_k_for_the_batch():
    costs = CostTable(target={1: 1.0, 8: 1.1, 16: 1.3, 64: 6.0}, draft={1: 0.05, 16: 0.06, 64: 0.1})
    policy = SpeculationPolicy(costs)
    good = policy.choose_batch(5, [0.9])
    assert good > 0
    # sequences whose drafts are never accepted make the shared verify rows cost more than they return
    assert policy.choose_batch(5, [0.9] + [0.0] * 7) < good
    # sampled sequences' rows and tokens count: with 20 rows of them past the table's knee, one more greedy row
    # costs more than it returns
    steep = SpeculationPolicy(CostTable(target={1: 1.0, 2: 1.0, 64: 32.0}, draft={1: 0.0, 64: 0.0}))
    assert steep.choose_batch(5, [0.6]) > 0
    assert steep.choose_batch(5, [0.6], fixed_rows=20, fixed_tokens=20.0) == 0
    assert policy.choose_batch(5, []) == 0  # no greedy sequence: nothing to gain


def test_cost_table_is_measured(tiny_dirs):
    model = graphspec.load_model(tiny_dirs[0])
    costs = CostTable.measure(model, model, rows=(1, 4), repeats=1)
    assert set(costs.target) == {1, 4} and all(v > 0 for v in costs.target.values())
    assert costs.target_cost(2) > 0 and costs.draft_cost(100) > 0
    assert set(costs.draft_prefill) == {16, 64, 256} and costs.draft_prefill_cost(20) > 0
    for table in (costs.target, costs.draft, costs.draft_prefill):  # never cheaper for more rows
        values = [table[r] for r in sorted(table)]
        assert values == sorted(values), table
    from graphspec.engine import _rising

    assert _rising({8: 0.32, 1: 0.27, 4: 0.37, 2: 0.30}) == {1: 0.27, 2: 0.30, 4: 0.37, 8: 0.37}


def test_cancelled_sequences_free_their_slots_and_caches(tiny_dirs):
    pipe = _pipes(tiny_dirs, torch.float32)["model"]
    engine = Engine(pipe, max_batch=8, max_queue=200, policy="off")
    seqs = []
    for i in range(100):
        s = engine.submit(PROMPTS[i % 4], max_new_tokens=200, ignore_eos=True)
        seqs.append(s)
    for s in seqs:  # cancel each after its first piece (or at once if it is still waiting)
        if s.engine.running and not s.done:
            time.sleep(0.001)
        s.cancel()
    for s in seqs:
        s._done.wait(60)
    assert all(s.done for s in seqs)
    assert all(s._result is None or len(s._result.token_ids) < 200 for s in seqs)
    assert engine.running == 0 and engine.waiting == 0
    gc.collect()
    assert engine.live_caches() == 0
    # and the engine still serves
    r = engine.submit("hello world", max_new_tokens=6).result(timeout=60)
    assert r.token_ids == pipe.run("hello world", max_new_tokens=6).token_ids


def test_queue_limit_and_bad_arguments(tiny_dirs):
    pipe = _pipes(tiny_dirs, torch.float32)["plain"]
    engine = Engine(pipe, max_batch=1, max_queue=1, policy="off")
    first = engine.submit("hello", max_new_tokens=400, ignore_eos=True)
    second = engine.submit("hello", max_new_tokens=5)
    with pytest.raises(QueueFull, match="max_queue=1"):
        engine.submit("hello", max_new_tokens=5)
    first.cancel()
    assert second.result(timeout=60).token_ids == pipe.run("hello", max_new_tokens=5).token_ids
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.submit("hello", max_new_tokens=10**6)
    with pytest.raises(ValueError, match="temperature"):
        engine.submit("hello", temperature=-1)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(pipe, max_batch=0)
    with pytest.raises(ValueError, match="policy"):
        Engine(pipe, policy="sometimes")
    with pytest.raises(ValueError, match="Pipeline"):
        Engine(object())


def test_a_failing_forward_fails_its_requests_only():
    """A forward that raises fails the sequence it ran for, with that error; the others and later ones run."""
    from tests.graphspec.toy import ToyLM

    class Fragile(ToyLM):
        def step(self, token_ids, *args, **kwargs):
            if 13 in token_ids.tolist()[0]:
                raise RuntimeError("token 13 breaks this model")
            return super().step(token_ids, *args, **kwargs)

    target = Fragile(16, seed=0)
    pipe = graphspec.Pipeline(target, ToyLM(16, seed=1), num_speculative_tokens=3)
    want = {}
    for i in range(16):
        try:
            want[i] = pipe.run([1, 2, i], max_new_tokens=6, ignore_eos=True).token_ids
        except RuntimeError:
            pass
    fine = sorted(want)[:4]
    assert len(fine) == 4
    engine = Engine(pipe, max_batch=4, policy="off")
    good = [engine.submit([1, 2, i], max_new_tokens=6, ignore_eos=True) for i in fine[:3]]
    bad = engine.submit([13, 2], max_new_tokens=5)
    with pytest.raises(RuntimeError, match="token 13"):
        bad.result(timeout=30)
    assert [s.result(timeout=30).token_ids for s in good] == [want[i] for i in fine[:3]]
    assert engine.running == 0
    assert engine.submit([1, 2, fine[3]], max_new_tokens=6, ignore_eos=True).result(timeout=30).token_ids == want[fine[3]]


N_RUNS = 2000


def test_sampling_through_the_engine_matches_the_target_distribution():
    """The chi-square oracle of test_lossless, with every sample drawn through the engine while greedy and
    sampled requests of other prompts share the batch."""
    pipe = graphspec.Pipeline(_target(), draft=_draft(), num_speculative_tokens=3, draft_confidence_threshold=None)
    params = SamplingParams(temperature=1.0)
    engine = Engine(pipe, max_batch=16, max_queue=N_RUNS * 2, policy="off")
    seqs, others = [], []
    for seed in range(N_RUNS):
        seqs.append(engine.submit(PROMPT, max_new_tokens=3, temperature=1.0, seed=seed, ignore_eos=True))
        if seed % 4 == 0:  # other traffic in the batch: greedy and sampled, other prompts and lengths
            others.append(engine.submit([5, 6, 7], max_new_tokens=1 + seed % 7, ignore_eos=True,
                                        temperature=0.0 if seed % 8 else 0.6, seed=seed))
    samples = np.array([s.result(timeout=300).token_ids for s in seqs])
    for s in others:
        s.result(timeout=300)
    exact = exact_marginals(pipe.target, PROMPT, params)
    pvalues = [chi2_pvalue(samples[:, i], exact[i]) for i in range(3)]
    assert min(pvalues) > 1e-3, pvalues
    # and the engine's samples are the very samples of Pipeline.run with those seeds
    for seed in (0, 1, 777, 1999):
        assert samples[seed].tolist() == pipe.run(PROMPT, max_new_tokens=3, temperature=1.0, seed=seed,
                                                  ignore_eos=True).token_ids


def test_expected_tokens_per_position():
    p = SpeculationPolicy(CostTable(target={1: 1.0}))
    assert p.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert p.expected_tokens([0.9, 0.5, 0.1], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.045)
    assert p.expected_tokens([0.9, 0.5], 0) == 1.0
    # a sequence sure at the first position and unsure past it drafts short
    costs = CostTable(target={1: 1.0, 64: 1.5}, draft={1: 0.1, 64: 0.1})
    policy = SpeculationPolicy(costs)
    assert policy.choose_batch(5, [[0.95, 0.05, 0.05, 0.05, 0.05]]) == 1
    assert policy.choose_batch(5, [[0.95] * 5]) == 5
    # a position never reached starts from the one before it, so that a short draft that does well is lengthened
    assert policy.position_rates([10, 0], [10, 0]) == [pytest.approx(12.4 / 14)] * 2
    assert policy.position_rates([0, 0], [10, 0]) == [pytest.approx(2.4 / 14)] * 2
    # later positions: the acceptance given the ones before were kept (5 of the 9 steps that kept position 0)
    assert policy.position_rates([9, 5], [10, 10])[1] == pytest.approx((5 + 4 * 11.4 / 14) / 13)
    assert policy.position_rates([9, 5], [10, 10], tested_per_position=[10, 6])[1] == pytest.approx(
        (5 + 4 * 11.4 / 14) / 10)


def test_suffix_drafts_share_their_store_across_batched_sequences(tiny_dirs):
    """Suffix drafting in the engine: the sequences' outputs go into one store from several worker threads (under
    its lock) while others read it, and every greedy output is the target's own."""
    target = graphspec.load_model(tiny_dirs[0])
    plain = graphspec.Pipeline(target)
    pipe = graphspec.Pipeline(target, "suffix", num_speculative_tokens=4)
    prompts = ["abc abc abc abc", "the cat sat on the mat, the cat sat", "x y z x y z x y", "hello hello hello"] * 3
    want = [plain.run(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    engine = Engine(pipe, max_batch=6, policy="off")
    got = [s.result(timeout=120) for s in [engine.submit(p, max_new_tokens=24, ignore_eos=True) for p in prompts]]
    assert [r.token_ids for r in got] == want
    store = pipe.graph["draft"].store
    assert store.num_tokens >= 24 * len(prompts)  # every finished sequence was learned
    assert sum(r.stats.accepted for r in got) > 0


def test_plan_drafts_per_sequence():
    """The plan picks which greedy sequences draft: one whose drafts are never accepted takes a plain step in the
    shared forward while a good one drafts; sampled sequences draft K whatever."""
    costs = CostTable(target={1: 1.0, 8: 1.1, 16: 1.3, 64: 6.0}, draft={1: 0.05, 16: 0.06, 64: 0.1})
    policy = SpeculationPolicy(costs)
    good, bad = SequenceView([0.9] * 5), SequenceView([0.0] * 5)
    ks = policy.plan(5, [good, bad, good])
    assert ks[0] > 0 and ks[2] == ks[0] and ks[1] == 0
    assert policy.plan(5, [bad, bad]) == [0, 0]
    assert policy.plan(5, [SequenceView(0.0, greedy=False), bad]) == [5, 0]
    assert policy.plan(5, []) == []
    # verify rows priced like plain steps: nobody drafts, however good
    dear = SpeculationPolicy(CostTable(target={1: 1.0, 64: 64.0}, draft={1: 0.5, 64: 0.5}))
    assert dear.plan(5, [good] * 4) == [0] * 4


def test_plan_counts_the_drafts_catch_up():
    """A sequence whose draft is behind drafts only if the prefill it needs pays over the tokens it has left."""
    costs = CostTable(target={1: 1.0, 64: 1.1}, draft={1: 0.05, 64: 0.1}, draft_prefill={16: 0.1, 512: 4.0})
    policy = SpeculationPolicy(costs)
    rates = [0.9] * 5
    assert policy.plan(5, [SequenceView(rates, catch_up=500, remaining=2)]) == [0]
    assert policy.plan(5, [SequenceView(rates, catch_up=500, remaining=1000)])[0] > 0
    assert policy.plan(5, [SequenceView(rates, catch_up=0, remaining=2)])[0] > 0
    # of two equally good sequences, the one in step drafts and the one far behind, near its end, does not
    ks = policy.plan(5, [SequenceView(rates), SequenceView(rates, catch_up=500, remaining=3)])
    assert ks[0] > 0 and ks[1] == 0
    assert costs.draft_prefill_cost(0) == 0.0 and costs.draft_prefill_cost(16) == pytest.approx(0.1)


def test_policy_that_never_drafts_never_prefills_the_draft(tiny_dirs):
    """With verify rows priced like plain steps the greedy sequences never draft, so their drafts are never
    prefilled (no draft forward, no draft cache); the outputs are Pipeline.run's."""
    pipes = _pipes(tiny_dirs, torch.float32)
    dear = CostTable(target={1: 1.0, 64: 64.0}, draft={1: 0.5, 64: 0.5}, draft_prefill={16: 1.0})
    prompts = [p for p in PROMPTS if isinstance(p, str)][:4]
    for name in ("model", "tree", "cross", "int8"):
        pipe = pipes[name]
        alone = [pipe.run(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        engine = Engine(pipe, max_batch=4, policy=SpeculationPolicy(dear))
        seqs = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        got = [s.result(timeout=60) for s in seqs]
        assert [r.token_ids for r in got] == [r.token_ids for r in alone], name
        assert engine.forwards.get("draft", 0) == 0, name
        assert sum(r.stats.draft_forwards for r in got) == 0 and len(engine._draft.caches) == 0, name
    # and the target runs plain serving's rows: one per step per sequence, no verify row of an empty draft
    plain = Engine(pipes["plain"], max_batch=4, policy="off")
    assert [r.token_ids for r in plain.run_batch(prompts, max_new_tokens=12, ignore_eos=True)] == [
        r.token_ids for r in got]
    assert engine._batcher.rows == plain._batcher.rows, (engine._batcher.rows, plain._batcher.rows)


class _Alternating(SpeculationPolicy):
    """Greedy sequences draft K for three steps' worth of tokens, then none for three, and so on (by the tokens
    they have left), so that drafts start late and fall behind and catch up again."""

    def plan(self, max_k, sequences):
        return [max_k if not q.greedy or (q.remaining // 3) % 2 else 0 for q in sequences]


def test_drafts_that_start_late_and_catch_up_keep_outputs_and_stay_in_step(tiny_dirs):
    """Greedy sequences whose drafts begin mid-generation and skip steps still give Pipeline.run's tokens (chain,
    tree, int8, cross-tokenizer), sampled ones in the same batch the same samples; and a draft that is the
    target itself, caught up by batched prefills, still proposes what the target takes."""
    target_dir = tiny_dirs[0]
    pipes = _pipes(tiny_dirs, torch.float32)
    target = pipes["model"].target
    pipes["self"] = graphspec.Pipeline(target, graphspec.load_model(target_dir, dtype=torch.float32),
                                       num_speculative_tokens=3, draft_confidence_threshold=None, draft_siblings=0)
    policy = _Alternating(CostTable(target={1: 1.0}))
    requests = [(p, dict(max_new_tokens=30, ignore_eos=True)) for p in PROMPTS[:5]]
    requests.append((PROMPTS[1], dict(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3)))
    for name in ("self", "model", "tree", "int8", "cross"):
        pipe = pipes[name]
        alone = [pipe.run(p, **kw) for p, kw in requests]
        engine = Engine(pipe, max_batch=len(requests), policy=policy)
        got = [s.result(timeout=120) for s in [engine.submit(p, **kw) for p, kw in requests]]
        for i, (a, b) in enumerate(zip(alone, got)):
            assert b.token_ids == a.token_ids, (name, i)
        greedy = got[:-1]
        assert all(r.stats.proposed > 0 for r in greedy), name
        if name == "self":  # a chain without a confidence stop: one draft forward per proposal, the rest prefills
            assert all(r.stats.draft_forwards - r.stats.proposed >= 2 for r in greedy), name  # begun late, caught up
            accepted = sum(r.stats.accepted for r in greedy)
            proposed = sum(r.stats.proposed for r in greedy)
            assert accepted >= 0.9 * proposed, (accepted, proposed)


def test_steps_without_a_draft_take_the_plain_stages(tiny_dirs, monkeypatch):
    """A tree pipeline's step that drafts nothing runs Verify's one-row step and greedy_accept, not the tree stages
    (their bookkeeping runs once per sequence a step, one thread after another under the GIL): never for a greedy
    sequence the policy keeps plain, and only where a tree is to be resolved when drafting comes and goes. Tokens
    (greedy and seeded sampled) are what Pipeline.run gives, and so are the tree stats where both draft alike."""
    from graphspec.acceptance import TreeAcceptance
    from graphspec.verify import TreeVerify

    calls = {"verify": 0, "accept": 0}
    for cls, key in ((TreeVerify, "verify"), (TreeAcceptance, "accept")):
        def counted(self, state, _run=cls.run, _key=key):
            calls[_key] += 1
            return _run(self, state)
        monkeypatch.setattr(cls, "run", counted)
    pipe = _pipes(tiny_dirs, torch.float32)["tree"]
    prompts = [p for p in PROMPTS if isinstance(p, str)][:4]
    alone = [pipe.run(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    never = SpeculationPolicy(CostTable(target={1: 1.0, 64: 64.0}, draft={1: 0.5, 64: 0.5}, draft_prefill={16: 1.0}))
    calls.update(verify=0, accept=0)
    got = Engine(pipe, max_batch=4, policy=never).run_batch(prompts, max_new_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert calls == {"verify": 0, "accept": 0}, calls
    assert all(r.stats.proposed == 0 and r.stats.tree == {"siblings_proposed": 0, "siblings_accepted": 0}
               for r in got)
    # drafting on and off: the tree stages run on the drafting steps and on the step after each (its tree)
    requests = [(p, dict(max_new_tokens=30, ignore_eos=True)) for p in prompts]
    requests.append((PROMPTS[1], dict(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3)))
    alone = [pipe.run(p, **kw) for p, kw in requests]
    calls.update(verify=0, accept=0)
    engine = Engine(pipe, max_batch=len(requests), policy=_Alternating(CostTable(target={1: 1.0})))
    got = [s.result(timeout=120) for s in [engine.submit(p, **kw) for p, kw in requests]]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert got[-1].stats.tree == alone[-1].stats.tree  # the sampled one drafts K every step, alone and here
    steps = sum(r.stats.steps for r in got)
    assert 0 < calls["verify"] < steps and 0 < calls["accept"] < steps, (calls, steps)


def test_plan_drafts_only_past_the_margin():
    """A drafting plan must promise ``margin`` more tokens per second than plain steps."""
    costs = CostTable(target={1: 1.0, 2: 1.5}, draft={1: 0.1})
    # k=1 at acceptance 0.9: 1.9 tokens in 1.6 s, 1.19 tokens/s against plain's 1.0
    assert SpeculationPolicy(costs, margin=0.1).plan(1, [SequenceView([0.9])]) == [1]
    assert SpeculationPolicy(costs, margin=0.25).plan(1, [SequenceView([0.9])]) == [0]
    assert SpeculationPolicy(costs, margin=0.0).plan(1, [SequenceView([0.7])]) == [1]
    assert SpeculationPolicy(costs, margin=0.1).plan(1, [SequenceView([0.7])]) == [0]


class _Recording(SpeculationPolicy):
    def __init__(self, costs):
        super().__init__(costs)
        self.seen: list[int] = []

    def plan(self, max_k, sequences):
        self.seen.append(len(sequences))
        return super().plan(max_k, sequences)


@contextlib.contextmanager
def _started_together(engine):
    """Requests submitted inside start together: until the block ends no forward runs (their first model calls wait
    on the batcher's lock) and no speculation plan is made (the plan lock). Holding back the forwards alone is not
    enough: a one-token prompt ("a") has no prefill forward, so its sequence asks for its first plan at once, and on
    a busy host it would plan before this thread's next submit, for the sequences submitted so far."""
    with engine._batcher._cv, engine._plan_lock:
        yield


def test_policy_counts_sequences_still_in_their_prefill(tiny_dirs):
    """The first sequence to finish its prefill plans for every sequence started with it, not as if alone (else
    it would draft, and prefill its draft, for a batch of one)."""
    pipe = _pipes(tiny_dirs, torch.float32)["model"]
    policy = _Recording(CostTable(target={1: 1.0, 64: 1.0}, draft={1: 0.0}))
    engine = Engine(pipe, max_batch=4, policy=policy)
    with _started_together(engine):
        seqs = [engine.submit(p, max_new_tokens=4, ignore_eos=True) for p in PROMPTS[:4]]
    for s in seqs:
        s.result(timeout=60)
    assert policy.seen[0] == 4, policy.seen


def test_a_sequence_switched_off_is_tried_again_after_plain_steps():
    """Early misses switch a sequence's drafting off; its rates drift back to the prior over the plain steps it
    takes, so the plan tries it again, where drafting at the prior pays."""
    costs = CostTable(target={1: 1.0, 8: 1.1, 64: 6.0}, draft={1: 0.2, 64: 0.4})
    policy = SpeculationPolicy(costs)
    missed = policy.position_rates([0, 0, 0, 0, 0], [8, 0, 0, 0, 0])
    assert policy.plan(5, [SequenceView(missed)]) == [0]
    rested = policy.position_rates([0, 0, 0, 0, 0], [8, 0, 0, 0, 0], rested=40)
    assert rested[0] == pytest.approx(0.6, abs=0.02) and rested[0] > missed[0]
    assert policy.plan(5, [SequenceView(rested)])[0] > 0
    assert policy.position_rates([3], [4], rested=0) == [policy.acceptance(3, 4)]


class _Unbounded(SpeculationPolicy):
    """The policy without its cost-only shortcut: every plan weighs every k and every set of drafting sequences."""

    def may_draft(self, max_k, greedy, sampled=0):
        return True


def test_may_draft_bounds_the_plan():
    """``may_draft`` is False only where the full plan drafts nothing, across cost tables and batches (random,
    seeded), and it is False somewhere (else the shortcut would never be taken and this test would prove
    nothing)."""
    rng = np.random.default_rng(7)
    seen_false = seen_true_drafting = 0
    for trial in range(300):
        rows = [1, 2, 4, 8, 16, 32, 64]
        growth = rng.uniform(0.0, 1.2)  # from verify rows nearly free to rows that cost what they return, or more
        target = {r: 0.2 * (1 + growth * (r - 1) ** rng.uniform(0.7, 1.1)) for r in rows}
        draft = {r: rng.uniform(0.005, 0.1) * (1 + rng.uniform(0, 1) * (r - 1)) for r in rows}
        costs = CostTable(target=target, draft=draft, draft_prefill={16: 0.05, 256: 0.8})
        fast, full = SpeculationPolicy(costs, margin=rng.choice([0.0, 0.1, 0.3])), None
        full = _Unbounded(costs, margin=fast.margin)
        n = int(rng.integers(1, 17))
        views = [SequenceView(list(rng.uniform(0.3, 0.999, 5)), greedy=bool(rng.random() < 0.85),
                              catch_up=int(rng.choice([0, 0, 40])), remaining=int(rng.integers(1, 128)))
                 for _ in range(n)]
        g = sum(v.greedy for v in views)
        want = full.plan(5, views)
        assert fast.plan(5, views) == want, trial
        if not fast.may_draft(5, g, n - g):
            seen_false += 1
            assert all(k == 0 for k, v in zip(want, views) if v.greedy), trial
        elif any(k > 0 for k, v in zip(want, views) if v.greedy):
            seen_true_drafting += 1
    assert seen_false > 20 and seen_true_drafting > 20, (seen_false, seen_true_drafting)


def test_engine_plans_once_a_step_for_all_sequences(tiny_dirs):
    """The sequences of a batch share one plan a step (the first to ask makes it), not one plan each: at 16
    streams each of 16 plans would weigh all 16 sequences, every step."""
    pipe = _pipes(tiny_dirs, torch.float32)["model"]
    prompts = [p for p in PROMPTS if isinstance(p, str)][:4]
    for costs in (CostTable(target={1: 1.0, 64: 1.0}, draft={1: 0.0}),                 # always drafts
                  CostTable(target={1: 1.0, 64: 64.0}, draft={1: 0.5, 64: 0.5})):    # never drafts
        policy = _Recording(costs)
        engine = Engine(pipe, max_batch=4, policy=policy)
        with _started_together(engine):  # so they keep in step
            seqs = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        got = [s.result(timeout=60) for s in seqs]
        assert [r.token_ids for r in got] == [pipe.run(p, max_new_tokens=12, ignore_eos=True).token_ids
                                              for p in prompts]
        steps = [r.stats.steps for r in got]
        # one plan per step of the longest (each sequence asking for its own: the sum of their steps)
        assert engine.plans_made == len(policy.seen) <= max(steps) + 1 < sum(steps), (engine.plans_made, steps)
        assert policy.seen[0] == 4, policy.seen


def test_cross_tokenizer_drafts_catch_up_in_one_prefill(tiny_dirs, monkeypatch):
    """A cross-tokenizer draft that begins late or skipped steps is fed what it missed as one batched prefill (in
    its own tokens), not as the rows of its next draft forward: against the same runs without that catch-up, the
    draft's step forwards carry fewer rows and its prefills more. Outputs are Pipeline.run's either way."""
    import graphspec.engine as engine_module

    pipe = _pipes(tiny_dirs, torch.float32)["cross"]
    requests = [(p, dict(max_new_tokens=30, ignore_eos=True)) for p in PROMPTS[:5]]
    alone = [pipe.run(p, **kw) for p, kw in requests]

    def run():
        engine = Engine(pipe, max_batch=len(requests), policy=_Alternating(CostTable(target={1: 1.0})))
        rows = {True: 0, False: 0}  # rows of the draft's step forwards (row-exact) and of its prefills
        execute = engine._batcher._execute

        def recording(chunk):
            if chunk[0].proxy.name == "draft":
                rows[chunk[0].key()[2]] += sum(c.rows for c in chunk)
            return execute(chunk)

        engine._batcher._execute = recording
        got = [s.result(timeout=120) for s in [engine.submit(p, **kw) for p, kw in requests]]
        assert [r.token_ids for r in got] == [r.token_ids for r in alone]
        assert all(r.stats.proposed > 0 for r in got)
        return rows[True], rows[False]

    steps, prefills = run()
    monkeypatch.setattr(engine_module, "_cross_catch_up", lambda drafter, state: None)
    steps_without, prefills_without = run()
    assert steps < steps_without and prefills > prefills_without, (steps, steps_without, prefills, prefills_without)
