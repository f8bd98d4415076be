"""Graph and Stage: validation at build time, timing, description, DOT, swapping stages."""

import pytest
import torch

import graphspec
from graphspec import Graph, Stage
from graphspec.state import RunInfo, State
from tests.graphspec.toy import ToyLM

pytestmark = pytest.mark.usefixtures("single_thread")


def _stage(name, reads=(), writes=(), fn=None):
    return Stage(name, reads=reads, writes=writes, fn=fn or (lambda s: None))


def test_missing_field_names_stage_and_field():
    a = _stage("a", reads=("x",), writes=("y",))
    b = _stage("b", reads=("y", "z"), writes=("out",))
    with pytest.raises(ValueError, match=r"stage 'b' reads field 'z'.*earlier stages: \['a'\]"):
        Graph([a, b], inputs=("x",))
    # a field written only by a LATER stage does not count
    with pytest.raises(ValueError, match=r"stage 'b' reads field 'y'"):
        Graph([b, a], inputs=("x", "z"))
    Graph([a, b], inputs=("x", "z"), outputs=("out",))  # valid


def test_missing_output_duplicate_names_and_bad_fields():
    a = _stage("a", reads=("x",), writes=("y",))
    with pytest.raises(ValueError, match=r"must produce field 'emitted'"):
        Graph([a], inputs=("x",), outputs=("emitted",))
    with pytest.raises(ValueError, match=r"two stages are named 'a'"):
        Graph([a, _stage("a")], inputs=("x",))
    with pytest.raises(ValueError, match="field names"):
        _stage("c", reads=("not a name",))
    with pytest.raises(ValueError, match="not a graphspec Stage"):
        Graph([lambda s: None])


def test_run_times_every_stage_and_passes_fields():
    order = []

    def double(s):
        order.append("double")
        s.y = s.x * 2

    def inc(s):
        order.append("inc")
        s.out = s.y + 1

    g = Graph([_stage("double", ("x",), ("y",), double), _stage("inc", ("y",), ("out",), inc)],
              inputs=("x",), outputs=("out",))
    state = State(RunInfo(target=None, vocab_size=1, device=torch.device("cpu"), capacity=1, prompt_len=1,
                          num_speculative_tokens=0))
    state.x = 20
    seconds: dict = {}
    for _ in range(3):
        g.run(state, seconds)
    assert state.out == 41 and order == ["double", "inc"] * 3
    assert set(seconds) == {"double", "inc"} and all(v >= 0 for v in seconds.values())
    state.clear(g.written)
    with pytest.raises(AttributeError, match="state field 'y' has not been set"):
        state.y


def test_describe_and_dot_list_stages_and_fields():
    pipe = graphspec.Pipeline(ToyLM(), draft="ngram", num_speculative_tokens=3)
    text = str(pipe.graph)
    assert text.splitlines()[0] == "Graph: draft -> verify -> accept"
    for needle in ("NgramDrafter", "Verify", "RejectionSampling", "reads tokens, token_buffer, num_draft",
                   "writes draft_ids, draft_probs", "writes target_logits", "writes emitted"):
        assert needle in text, needle
    dot = pipe.graph.to_dot()
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert '"draft" -> "verify" [label="draft_ids"]' in dot
    assert '"verify" -> "accept" [label="target_logits"]' in dot
    assert '"in:tokens" -> "draft" [label="tokens"]' in dot

    ar = graphspec.Pipeline(ToyLM())
    assert ar.graph.names == ["verify", "accept"]
    assert "draft_ids" in ar.graph.inputs  # the empty draft is an input: same stages, same code path


def test_graph_edits_are_validated_and_leave_the_original_alone():
    pipe = graphspec.Pipeline(ToyLM(), draft="ngram")
    g = pipe.graph
    logged = _stage("log", reads=("draft_ids",), writes=())
    g2 = g.insert_after("draft", logged)
    assert g2.names == ["draft", "log", "verify", "accept"] and g.names == ["draft", "verify", "accept"]
    with pytest.raises(ValueError, match=r"stage 'log' reads field 'draft_ids'"):
        g.insert_before("draft", logged)
    with pytest.raises(ValueError, match=r"stage 'verify' reads field 'draft_ids'"):
        g.without("draft")
    with pytest.raises(KeyError, match="no stage named 'nope'"):
        g.replace("nope", logged)


class _MapStage(Stage):
    """What the cross-vocabulary map stage will look like: between draft and verify, rewriting draft fields."""

    reads = ("draft_ids", "draft_probs")
    writes = ("draft_ids", "draft_probs")

    def __init__(self):
        super().__init__("map")
        self.calls = 0

    def run(self, state):
        self.calls += 1  # identity map: the vocabularies are the same here


def test_a_stage_inserted_between_draft_and_verify_runs_every_step():
    target = ToyLM(seed=0)
    m = _MapStage()
    pipe = graphspec.Pipeline(target, draft=ToyLM(seed=3), num_speculative_tokens=2)
    ref = pipe.run([1, 2, 3], max_new_tokens=12).token_ids
    pipe.replace_stage("draft", pipe.graph["draft"])  # a no-op swap keeps the graph valid
    pipe.insert_stage(m, before="verify")
    assert pipe.graph.names == ["draft", "map", "verify", "accept"]
    out = pipe.run([1, 2, 3], max_new_tokens=12)
    assert out.token_ids == ref
    assert m.calls == out.stats.steps and "map" in out.stats.stage_seconds


class _CountingGreedy(graphspec.GreedyAcceptance):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def run(self, state):
        self.steps += 1
        super().run(state)


def test_swapping_drafter_and_rule_touches_nothing_else():
    target = ToyLM(seed=0)
    pipe = graphspec.Pipeline(target, draft=ToyLM(seed=1), num_speculative_tokens=3, draft_siblings=0)  # chain stages
    verify_stage = pipe.graph["verify"]
    ref = graphspec.Pipeline(target).run([4, 5, 6], max_new_tokens=16).token_ids
    assert pipe.run([4, 5, 6], max_new_tokens=16).token_ids == ref

    rule = _CountingGreedy()
    pipe.replace_stage("draft", graphspec.NgramDrafter(max_ngram=2)).replace_stage("accept", rule)
    assert pipe.graph["verify"] is verify_stage
    assert [type(s).__name__ for s in pipe.graph] == ["NgramDrafter", "Verify", "_CountingGreedy"]
    out = pipe.run([4, 5, 6], max_new_tokens=16)
    assert out.token_ids == ref and rule.steps == out.stats.steps
    # the swapped-in greedy rule refuses sampling before any work
    with pytest.raises(ValueError, match="temperature=0.5: GreedyAcceptance"):
        pipe.run([4, 5, 6], max_new_tokens=4, temperature=0.5)


def test_a_function_stage_without_fn_or_run_is_an_error():
    s = Stage("empty")
    with pytest.raises(NotImplementedError, match="stage 'empty'"):
        s.run(None)
    with pytest.raises(ValueError, match="non-empty name"):
        Stage("")


def test_sync_timing_synchronises_around_every_stage(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    pipe = graphspec.Pipeline(ToyLM(), draft="ngram", num_speculative_tokens=2, sync_timing=True)
    out = pipe.run([1, 2, 3], max_new_tokens=6)
    # per step: once before the first stage, once after each of the 3 stages, twice around the step's clock
    assert len(calls) >= out.stats.steps * 4
    calls.clear()
    graphspec.Pipeline(ToyLM(), draft="ngram").run([1, 2, 3], max_new_tokens=6)
    assert calls == []  # off by default on a CPU model
