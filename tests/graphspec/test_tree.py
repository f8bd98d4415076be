"""Draft trees (``draft_siblings``, ``draft_beam``): greedy output equals the target's, sampling keeps its
distribution.

A tree step verifies a chain plus sibling leaves in one forward (``TreeVerify``) and walks the
longest accepted path (``TreeAcceptance``). The toy models make the statistical test cheap (see
test_lossless.py for the method); the tiny transformers check the tree forward and the KV-cache
compaction against plain causal forwards of each path.
"""

import pytest
import torch

import graphspec
from graphspec import SamplingParams
from graphspec.acceptance import TreeAcceptance
from graphspec.kernels.attention import ancestor_mask
from graphspec.kernels.sampling import exponential_noise, sample, warp_logits
from tests.checkpoints import make_checkpoint
from tests.graphspec.oracle import marginal_pvalues
from tests.graphspec.test_lossless import PROMPT, _draft, _target
from tests.graphspec.toy import ToyLM

pytestmark = pytest.mark.usefixtures("single_thread")

N_RUNS = 2000


def _tree_pipe(target=None, draft=None, k=4, siblings=3, threshold=0.7, **kw):
    # a high confidence threshold stops chains early, which leaves rows for siblings
    return graphspec.Pipeline(target or _target(), draft=draft or _draft(), num_speculative_tokens=k,
                              draft_confidence_threshold=threshold, draft_siblings=siblings, **kw)


# --------------------------------------------------------------------------------- greedy

def _greedy_stats(pipe, prompts) -> list:
    """Each prompt's stats, after checking that the pipeline's greedy tokens are its target's alone."""
    ar = graphspec.Pipeline(pipe.target)
    stats = []
    for prompt in prompts:
        want = ar.run(prompt, max_new_tokens=40, ignore_eos=True).token_ids
        got = pipe.run(prompt, max_new_tokens=40, ignore_eos=True)
        assert got.token_ids == want, prompt
        stats.append(got.stats)
    return stats


@pytest.mark.parametrize("k, siblings, threshold", [(4, 3, 0.7), (3, 1, 0.5), (5, 4, None), (2, 2, 0.9)])
def test_greedy_tree_output_equals_the_target_alone(k, siblings, threshold):
    stats = _greedy_stats(_tree_pipe(k=k, siblings=siblings, threshold=threshold),
                          [PROMPT, [5, 9, 2], [7], [3, 3, 3, 3, 11, 4]])
    proposed = sum(s.tree["siblings_proposed"] for s in stats)
    accepted = sum(s.tree["siblings_accepted"] for s in stats)
    if threshold is not None:  # chains stopped early: siblings were proposed and some taken
        assert proposed > 0 and accepted > 0, (proposed, accepted)
    else:  # full chains leave no rows for siblings
        assert proposed == 0


def test_siblings_raise_tokens_per_verify_on_an_uncertain_draft():
    target = _target()
    draft = _draft()
    chain = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4, draft_confidence_threshold=0.7,
                               draft_siblings=0)
    tree = _tree_pipe(target, draft, k=4, siblings=3, threshold=0.7)
    prompts = [PROMPT, [5, 9, 2], [7], [3, 3, 3, 3, 11, 4], [10, 12]]
    steps = {}
    for name, pipe in (("chain", chain), ("tree", tree)):
        steps[name] = sum(pipe.run(p, max_new_tokens=60, ignore_eos=True).stats.steps for p in prompts)
    assert steps["tree"] < steps["chain"], steps


def test_the_draft_cache_follows_the_accepted_branch():
    """After a sibling is taken, the draft must not keep its own (rejected) chain token in its cache."""
    target, draft = _target(), _draft()
    pipe = _tree_pipe(target, draft)
    checked = taken = 0
    for prompt in ([5, 9, 2], [7], [10, 12]):
        log: list = []
        target.log, draft.log = log, log
        target.name, draft.name = "target", "draft"
        out = pipe.run(prompt, max_new_tokens=60, ignore_eos=True)
        taken += out.stats.tree["siblings_accepted"]
        final = prompt + out.token_ids
        for before, entry in zip(log, log[1:]):
            if before[0] == "target" and entry[0] == "draft":  # the first draft call of a step
                cached, fed = entry[1], entry[2]
                assert cached + fed == final[:len(cached) + len(fed)], (cached, fed)
                checked += 1
    assert taken > 0
    assert checked > 10


# --------------------------------------------------------------------------------- sampling

T1 = SamplingParams(temperature=1.0)
T07K = SamplingParams(temperature=0.7, top_k=5)


@pytest.mark.parametrize("params, k, siblings, threshold", [
    (T1, 3, 2, 0.7),
    (T07K, 4, 3, 0.6),
    (SamplingParams(temperature=1.3, top_p=0.8), 2, 1, 0.9),
], ids=["T1-K3-s2", "T0.7-top5-K4-s3", "T1.3-topp0.8-K2-s1"])
def test_tree_sampling_matches_the_target_distribution(params, k, siblings, threshold):
    pipe = _tree_pipe(k=k, siblings=siblings, threshold=threshold)
    pvalues, rate = marginal_pvalues(pipe, PROMPT, params, N_RUNS)
    assert min(pvalues) > 1e-3, pvalues
    assert 0.05 < rate < 0.99
    out = [pipe.run(PROMPT, max_new_tokens=30, temperature=params.temperature, top_k=params.top_k,
                    top_p=params.top_p, seed=s, ignore_eos=True).stats.tree for s in range(20)]
    assert sum(t["siblings_accepted"] for t in out) > 0, out  # the sibling branch of the rule ran


class SiblingsAgainstOriginalP(TreeAcceptance):
    """Pitfall: after rejecting the chain token, test each sibling against the unchanged p and q
    (no residual), then resample from p: the rejected token's probability mass is counted twice."""

    def run(self, state):
        params = state.params
        draft = state.draft_ids[0].tolist()
        parents = tuple(state.draft_parents)
        p_rows = warp_logits(state.target_logits[0], params.temperature, params.top_k, params.top_p)
        q_all = state.draft_probs
        out, cur = [], 0
        while True:
            p = p_rows[cur]
            kids = [j for j, par in enumerate(parents) if par == cur]
            taken = None
            for j in kids:
                x = draft[j]
                u = float(torch.rand((), generator=state.generator))
                if u * float(q_all[0, j, x]) < float(p[x]):
                    taken = j
                    break
            if taken is None:
                out.append(int(sample(p.view(1, -1), exponential_noise((1, p.shape[-1]), state.generator))[0]))
                break
            out.append(draft[taken])
            cur = taken + 1
        state.emitted = torch.tensor([out + [-1] * (len(draft) + 1 - len(out))])


def test_a_tree_rule_without_the_residual_is_detected():
    pipe = _tree_pipe(k=3, siblings=2, threshold=0.7).replace_stage("accept", SiblingsAgainstOriginalP())
    pvalues, _ = marginal_pvalues(pipe, PROMPT, T1, N_RUNS)
    assert min(pvalues) < 1e-6, pvalues


# --------------------------------------------------------------------------------- beams (draft_beam)

def _beam_pipe(target=None, draft=None, k=6, beam=2, threshold=None, **kw):
    return graphspec.Pipeline(target or _target(), draft=draft or _draft(), num_speculative_tokens=k,
                              draft_beam=beam, draft_confidence_threshold=threshold, **kw)


BEAM_PROMPTS = [PROMPT, [5, 9, 2], [7], [3, 3, 3, 3, 11, 4], [10, 12]]


@pytest.mark.parametrize("k, beam, threshold", [(6, 2, None), (4, 3, 0.2), (8, 2, 0.05), (1, 2, None), (3, 1, None)])
def test_greedy_beam_output_equals_the_target_alone(k, beam, threshold):
    stats = _greedy_stats(_beam_pipe(k=k, beam=beam, threshold=threshold), BEAM_PROMPTS)
    if k > 1:  # the beam grows past its first forward
        assert sum(s.draft_forwards for s in stats) > 1.5 * sum(s.steps for s in stats)


def test_a_beam_needs_fewer_verifies_than_a_chain():
    target, draft = _target(), _draft()
    chain = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=6, draft_confidence_threshold=None)
    beam = _beam_pipe(target, draft, k=6, beam=2)
    steps = {name: sum(p.run(pr, max_new_tokens=60, ignore_eos=True).stats.steps for pr in BEAM_PROMPTS)
             for name, p in (("chain", chain), ("beam", beam))}
    assert steps["beam"] < steps["chain"], steps


def test_the_beam_draft_cache_keeps_the_taken_path():
    """Every step's first draft forward sees only committed tokens: the cached prefix plus what it feeds; and
    the nodes of the path the target took stay cached (kept, not fed again)."""
    target, draft = _target(), _draft()
    pipe = _beam_pipe(target, draft, k=6, beam=2)
    checked = kept = 0
    for prompt in BEAM_PROMPTS:
        log: list = []
        target.log, draft.log = log, log
        target.name, draft.name = "target", "draft"
        out = pipe.run(prompt, max_new_tokens=60, ignore_eos=True)
        final = prompt + out.token_ids
        base = None
        for before, entry in zip(log, log[1:]):
            if before[0] == "target" and entry[0] == "draft":  # a step's first draft forward
                cached, fed = entry[1], entry[2]
                assert cached + fed == final[:len(cached) + len(fed)], (cached, fed)
                kept += base is not None and len(cached) > base
                base = len(cached) + len(fed)  # where this step's tree starts
                checked += 1
    assert checked > 10 and kept > 0, (checked, kept)


@pytest.mark.parametrize("params", [T1, T07K], ids=["T1", "T0.7-top5"])
def test_sampled_runs_with_a_beam_keep_the_target_distribution(params):
    """Sampled runs draft a chain with siblings (rejection sampling needs drafted tokens, not ranked ones)."""
    pipe = _beam_pipe(k=3, beam=2, threshold=0.7, draft_siblings=2)
    pvalues, rate = marginal_pvalues(pipe, PROMPT, params, N_RUNS)
    assert min(pvalues) > 1e-3, pvalues
    assert 0.05 < rate < 0.99


def test_beam_settings_and_errors():
    from graphspec.drafters import SAME_VOCAB_BEAM_STOP_PROBABILITY, ModelDrafter

    pipe = graphspec.Pipeline(_target(), draft=_draft(), draft_beam=2)
    drafter = pipe.graph["draft"]
    assert isinstance(drafter, ModelDrafter) and drafter.beam == 2
    assert drafter.beam_threshold == SAME_VOCAB_BEAM_STOP_PROBABILITY
    assert "draft_parents" in drafter.writes and "draft_parents" in pipe.graph["accept"].reads
    assert _beam_pipe(threshold=None).graph["draft"].beam_threshold == 0.0
    assert _beam_pipe(threshold=0.3).graph["draft"].beam_threshold == 0.3
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="draft_beam must be an int >= 0"):
            graphspec.Pipeline(_target(), draft=_draft(), draft_beam=bad)
    with pytest.raises(ValueError, match="beam_threshold must be a probability"):
        ModelDrafter(_draft(), beam=2, beam_threshold=1.0)
    with pytest.raises(ValueError, match="verifies a draft tree"):
        _beam_pipe(acceptance="greedy")
    with pytest.raises(ValueError, match="masks on the CPU only"):
        ModelDrafter(ToyLM(16, seed=1, device="meta"), beam=2)


# --------------------------------------------------------------------------------- stats and errors

def test_stats_count_depths_not_nodes():
    stats = graphspec.GenerationStats(accepted_per_position=[0] * 4, proposed_per_position=[0] * 4)
    stats.record_step(4, 2, parents=(0, 1, 0, 1))  # chain of 2, a sibling at depth 0 and at depth 1
    assert stats.proposed_per_position == [1, 1, 0, 0]
    assert stats.accepted_per_position == [1, 1, 0, 0]
    assert stats.proposed == 4
    assert stats.tested_per_position == [1, 1]  # both depths judged (all kept)
    stats.record_step(4, 1, parents=(0, 1, 2, 3))  # a chain of 4, its second token rejected
    stats.record_step(3, 0, parents=(0, 1, 2))     # a chain of 3, its first token rejected
    assert stats.proposed_per_position == [3, 3, 2, 1]
    assert stats.accepted_per_position == [2, 1, 0, 0]
    assert stats.tested_per_position == [3, 2]  # depth 1 was judged where depth 0 was kept; nothing past it
    assert stats.as_dict()["tested_per_position"] == [3, 2]


@pytest.mark.parametrize("kw, match", [
    (dict(draft="ngram", draft_siblings=2), "needs a model draft"),
    (dict(draft=None, draft_siblings=1), "needs a model draft"),
    (dict(draft_siblings=-1), "draft_siblings must be an int >= 0"),
    (dict(draft_siblings=True), "draft_siblings must be an int >= 0"),
    (dict(draft_siblings=2, acceptance="greedy"), "needs its own acceptance rule"),
])
def test_bad_sibling_arguments_are_refused(kw, match):
    kw.setdefault("draft", ToyLM(16, seed=1))
    with pytest.raises(ValueError, match=match):
        graphspec.Pipeline(_target(), **kw)


def test_auto_siblings_branch_model_drafts_only():
    from graphspec.drafters import AUTO_DRAFT_SIBLINGS

    auto = graphspec.Pipeline(_target(), draft=_draft(), draft_siblings="auto")
    assert auto.graph["draft"].siblings == AUTO_DRAFT_SIBLINGS
    assert "draft_parents" in auto.graph["accept"].reads
    for draft in ("ngram", None):  # nothing to branch: a chain, no error
        pipe = graphspec.Pipeline(_target(), draft=draft, draft_siblings="auto")
        assert "draft_parents" not in pipe.graph["accept"].reads
    with pytest.raises(ValueError, match="draft_siblings must be an int >= 0"):
        graphspec.Pipeline(_target(), draft=_draft(), draft_siblings="many")


def test_the_tree_graph_reads_the_tree():
    pipe = _tree_pipe()
    assert pipe.graph.names == ["draft", "verify", "accept"]
    assert "draft_parents" in pipe.graph["verify"].reads and "draft_parents" in pipe.graph["accept"].reads
    assert "draft_parents" not in graphspec.Pipeline(_target(), draft=_draft(), draft_siblings=0).graph["verify"].reads
    assert "draft_parents" in graphspec.Pipeline(_target(), draft=_draft()).graph["verify"].reads  # "auto": a tree


# --------------------------------------------------------------------------------- real forward

@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    target = make_checkpoint(root / "t", "qwen2", tokenizer=None, vocab_size=96, hidden_size=64, layers=2, heads=4,
                             kv_heads=2, seed=3)
    draft = make_checkpoint(root / "d", "llama", tokenizer=None, vocab_size=96, hidden_size=32, layers=1, heads=2,
                            kv_heads=1, seed=4)
    return target, draft


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_tree_forward_rows_equal_causal_forwards_of_each_path(tiny_dirs, dtype, tol):
    model = graphspec.load_model(tiny_dirs[0], dtype=dtype)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (1, 9), generator=g)
    #          rows: 0 pending, 1..7 drafts; parents in row space
    parents = [-1, 0, 1, 2, 0, 1, 4, 3]
    nodes = torch.randint(0, V, (1, len(parents)), generator=g)
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    cache = model.new_cache(64)
    model.step(prompt, cache)
    L = cache.length
    positions = (L + torch.tensor(depth)).view(1, -1)
    got = model.step(nodes, cache, positions=positions, tree=ancestor_mask(parents))[0]  # [8, V]
    for row in range(len(parents)):
        path = [row]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        ref_cache = model.new_cache(64)
        model.step(prompt, ref_cache)
        want = model.step(nodes[:, path], ref_cache)[0, -1]
        err = (got[row] - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (row, path, err)
    # keep the branch 0 -> 1 -> 5: the cache then equals a causal prefill of that path
    cache.keep(L, [L + 0, L + 1, L + 5])
    ref_cache = model.new_cache(64)
    model.step(torch.cat([prompt, nodes[:, [0, 1, 5]]], dim=1), ref_cache)
    assert cache.length == ref_cache.length == L + 3
    for layer in range(model.config.num_hidden_layers):
        for a, b in ((cache.k[layer], ref_cache.k[layer]), (cache.v[layer], ref_cache.v[layer])):
            torch.testing.assert_close(a[:, :L + 3].float(), b[:, :L + 3].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, quantize, beam", [(torch.float32, None, 0), (torch.bfloat16, None, 0),
                                                   (torch.float32, None, 2), (torch.bfloat16, None, 2),
                                                   (torch.bfloat16, "int8", 2)])
def test_greedy_tree_on_transformers_equals_autoregressive(tiny_dirs, dtype, quantize, beam):
    target = graphspec.load_model(tiny_dirs[0], dtype=dtype)
    draft = graphspec.load_model(tiny_dirs[1], dtype=dtype, quantize=quantize)
    ar = graphspec.Pipeline(target)
    tree = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=7 if beam else 5,
                              draft_confidence_threshold=None if beam else 0.6, draft_siblings=0 if beam else 3,
                              draft_beam=beam)
    g = torch.Generator().manual_seed(5)
    taken = forwards = steps = 0
    for n in (1, 7, 30):
        prompt = torch.randint(0, 96, (n,), generator=g).tolist()
        want = ar.run(prompt, max_new_tokens=48, ignore_eos=True).token_ids
        got = tree.run(prompt, max_new_tokens=48, ignore_eos=True)
        assert got.token_ids == want, n
        taken += got.stats.tree["siblings_accepted"]
        forwards += got.stats.draft_forwards
        steps += got.stats.steps
    assert taken > 0
    if beam:
        assert forwards > 1.5 * steps  # the beam grew past its first forward


def test_greedy_tree_through_the_triton_kernels(tmp_path, monkeypatch):
    """The same tree pipeline with both models pinned to Triton (the interpreter here, CUDA on a GPU):
    the tree reaches the Triton attention kernel, and the output is still the target's."""
    import sys

    attn = sys.modules["graphspec.kernels.attention"]
    trees = []
    real = attn._attention_triton
    monkeypatch.setattr(attn, "_attention_triton",
                        lambda *a, **k: trees.append(k.get("tree") is not None) or real(*a, **k))
    d = make_checkpoint(tmp_path / "t", "llama", tokenizer=None, vocab_size=64, hidden_size=32, layers=1, heads=4,
                        kv_heads=2, seed=6)
    dr = make_checkpoint(tmp_path / "d", "llama", tokenizer=None, vocab_size=64, hidden_size=16, layers=1, heads=2,
                         kv_heads=1, seed=7)
    target = graphspec.load_model(d, backend="triton")
    draft = graphspec.load_model(dr, backend="triton")
    prompt = [3, 17, 42, 5, 9]
    want = graphspec.Pipeline(graphspec.load_model(d)).run(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    got = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4, draft_confidence_threshold=0.9,
                             draft_siblings=2).run(prompt, max_new_tokens=16, ignore_eos=True)
    assert got.token_ids == want
    assert any(trees) and got.stats.tree["siblings_proposed"] > 0
