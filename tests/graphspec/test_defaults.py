"""Fast by default: ``Pipeline(target, draft)`` and ``graphspec run`` choose the same draft settings.

Both read graphspec.defaults. The CLI side builds its pipeline exactly as ``graphspec run`` does
(its parser, its model loading, its keyword arguments), in this process, so the two choices can be
compared field by field. ``AUTO_DRAFT_VOCAB`` is lowered so that the tiny drafts' vocabularies are
pruned by the "auto" rule as a real draft's would be.
"""

from __future__ import annotations

import pytest
import torch

import graphspec
from graphspec import cli, defaults, drafters
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("defaults")
    return {"target": make_checkpoint(d / "target", "llama", tokenizer="bytelevel", seed=0),
            "draft": make_checkpoint(d / "draft", "llama", tokenizer="bytelevel", seed=1, layers=1),
            "cross": make_checkpoint(d / "cross", "llama", tokenizer="metaspace", seed=2, layers=1)}


@pytest.fixture(autouse=True)
def small_auto_vocab(monkeypatch):
    monkeypatch.setattr(drafters, "AUTO_DRAFT_VOCAB", 256)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _cli_pipeline(*argv):
    args = cli._build_parser().parse_args(["run", *argv, "--threads", "1", "--dtype", "fp32", "hello"])
    target, draft, gs = cli._pipelines(args)
    return gs.Pipeline(target, draft, num_speculative_tokens=args.k, vocab_mapping=args.vocab_mapping,
                       **cli._draft_kw(args))


@pytest.mark.parametrize("which", ["draft", "cross"])
def test_api_and_cli_choose_the_same_fast_defaults(ckpts, which):
    api = graphspec.Pipeline(ckpts["target"], ckpts[which], dtype=torch.float32)
    ours = _cli_pipeline("--target", str(ckpts["target"]), "--draft", str(ckpts[which]))
    assert api.choices.values() == ours.choices.values()
    c = api.choices
    assert c.quantize == "int8"  # a CPU: the draft the pipeline loads gets int8 weights
    assert c.vocab is not None and c.vocab[0] < c.vocab[1]  # and a pruned head
    assert c.siblings == defaults.AUTO_DRAFT_SIBLINGS
    assert c.confidence == (defaults.CROSS_VOCAB_CONFIDENCE if which == "cross" else defaults.SAME_VOCAB_CONFIDENCE)
    assert api.draft.quantize == "int8" and ours.draft.quantize == "int8"
    assert "draft_parents" in api.graph.written  # a tree is verified


def test_plain_arguments_still_give_each_plain_choice(ckpts):
    plain = graphspec.Pipeline(ckpts["target"], ckpts["draft"], dtype=torch.float32, draft_quantize=None,
                               draft_vocab=None, draft_siblings=0, draft_confidence_threshold=None)
    c = plain.choices
    assert (c.quantize, c.vocab, c.siblings, c.confidence) == (None, None, 0, None)
    assert not getattr(plain.draft, "quantize", None)
    assert "draft_parents" not in plain.graph.written  # a chain
    ours = _cli_pipeline("--target", str(ckpts["target"]), "--draft", str(ckpts["draft"]), "--draft-quantize", "none",
                         "--draft-vocab", "none", "--draft-siblings", "0", "--draft-confidence", "none")
    assert ours.choices.values() == c.values()


def test_prompt_lookup_and_plain_decoding_take_no_model_settings(ckpts):
    assert graphspec.Pipeline(ckpts["target"], "ngram").choices.siblings == 0
    assert _cli_pipeline("--target", str(ckpts["target"]), "--draft", "ngram").choices.values() == \
        graphspec.Pipeline(ckpts["target"], "ngram").choices.values()
    assert "plain autoregressive" in graphspec.Pipeline(ckpts["target"]).describe()


def test_describe_says_what_was_chosen_and_why(ckpts):
    pipe = graphspec.Pipeline(ckpts["target"], ckpts["draft"], dtype=torch.float32)
    text = pipe.describe()
    assert str(pipe) == text
    assert "draft weights: int8 (auto" in text
    assert f"vocabulary {pipe.choices.vocab[0]} of {pipe.choices.vocab[1]} (auto" in text
    assert f"{defaults.AUTO_DRAFT_SIBLINGS} siblings (auto" in text
    assert f"confidence threshold: {defaults.SAME_VOCAB_CONFIDENCE:g} (auto" in text
    asked = graphspec.Pipeline(ckpts["target"], ckpts["draft"], dtype=torch.float32, draft_siblings=2,
                               draft_confidence_threshold=0.5).describe()
    assert "2 siblings (as asked)" in asked and "confidence threshold: 0.5 (as asked)" in asked


def test_a_custom_acceptance_rule_gets_a_chain_by_default(ckpts):
    pipe = graphspec.Pipeline(ckpts["target"], ckpts["draft"], dtype=torch.float32, acceptance="greedy")
    assert pipe.choices.siblings == 0
    with pytest.raises(ValueError, match="acceptance"):
        graphspec.Pipeline(ckpts["target"], ckpts["draft"], dtype=torch.float32, acceptance="greedy", draft_siblings=2)


def test_dtype_auto_is_the_clis(ckpts):
    pipe = graphspec.Pipeline(ckpts["target"], dtype="auto")
    assert pipe.target.dtype == cli._dtype("auto", torch.device("cpu")) == defaults.auto_dtype("cpu")
    assert graphspec.Pipeline(ckpts["target"]).target.dtype == torch.float32  # None: as the checkpoint stores it


def test_auto_quantization_is_a_cpu_rule():
    assert defaults.draft_quantize("auto", "cpu") == "int8"
    assert defaults.draft_quantize("auto", "cpu", loads_draft=False) is None
    assert defaults.draft_quantize("auto", "cuda") is None
    assert defaults.draft_quantize("none", "cpu") is None
    with pytest.raises(ValueError, match="CPU only"):
        defaults.draft_quantize("int8", "cuda")
    with pytest.raises(ValueError, match="draft_quantize='fp8' is not one of"):
        defaults.draft_quantize("fp8", "cpu")
