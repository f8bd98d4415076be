"""The command line, through a subprocess as a user runs it.

Tiny checkpoints written by transformers keep these fast; the real zoo models are
exercised by the slow tests at the bottom (run in CI, cached after the first fetch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphspec.cli import recommend_drafter, recommend_k
from tests.checkpoints import make_checkpoint


def _cli(*args, input_text=None, timeout=300, env_extra=None):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CLI runs the CPU fast path, as a user's would
    if env_extra:
        env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "graphspec", *args], capture_output=True, text=True,
                          input=input_text, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return make_checkpoint(d / "tiny", "llama", tokenizer="bytelevel", chat_template="chatml")


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("graphspec: error:") or last.startswith("graphspec run: error:"), proc.stderr
    for f in fragments:
        assert f in last, (f, last)


def test_run_streams_text_and_prints_stats(tiny):
    p = _cli("run", "--target", str(tiny), "--draft", "ngram", "-k", "3", "--dtype", "fp32", "--draft-confidence", "none",
             "--max-new-tokens", "12", "--ignore-eos", "def fibonacci(n):")
    assert p.returncode == 0, p.stderr
    stats_line = p.stderr.strip().splitlines()[-1]
    assert "tok/s" in stats_line and "acceptance" in stats_line and "tokens per target forward" in stats_line
    assert "12 tokens" in stats_line
    assert p.stdout.strip(), "no generated text on stdout"


def test_run_matches_library_output(tiny):
    import graphspec

    expected = graphspec.Pipeline(graphspec.load_model(tiny, dtype="float32")).run(
        "The quick brown", max_new_tokens=10, ignore_eos=True)
    p = _cli("run", "--target", str(tiny), "--dtype", "fp32", "--max-new-tokens", "10", "--ignore-eos",
             "--json", "The quick brown")
    assert p.returncode == 0, p.stderr
    text, _, stats = p.stdout.partition("\n{")
    assert text == expected.text
    assert json.loads("{" + stats)["generated_tokens"] == 10


def test_run_with_a_cheap_draft_gives_the_target_text(tiny):
    # On a CPU the draft loads with int8 weights by default; --draft-vocab prunes its head.
    import graphspec

    expected = graphspec.Pipeline(graphspec.load_model(tiny, dtype="float32")).run(
        "def fibonacci(n):", max_new_tokens=12, ignore_eos=True)
    for extra in ((), ("--draft-vocab", "200"), ("--draft-quantize", "none", "--draft-vocab", "50"),
                  ("--draft-siblings", "2", "--draft-confidence", "0.9"), ("-k", "6", "--draft-beam", "2"),
                  ("--draft-length", "auto")):
        p = _cli("run", "--target", str(tiny), "--draft", str(tiny), "--dtype", "fp32", "--max-new-tokens", "12",
                 "--ignore-eos", *extra, "def fibonacci(n):")
        assert p.returncode == 0, p.stderr
        assert p.stdout.rstrip("\n") == expected.text, extra
        assert ("(int8 weights)" in p.stderr) == ("none" not in extra), p.stderr


def test_run_chat_and_sampling_flags(tiny):
    p = _cli("run", "--target", str(tiny), "--draft", str(tiny), "--chat", "--temperature", "0.8", "--top-k", "20",
             "--top-p", "0.9", "--seed", "3", "--dtype", "fp32", "--max-new-tokens", "8", "hello there")
    assert p.returncode == 0, p.stderr
    again = _cli("run", "--target", str(tiny), "--draft", str(tiny), "--chat", "--temperature", "0.8", "--top-k", "20",
                 "--top-p", "0.9", "--seed", "3", "--dtype", "fp32", "--max-new-tokens", "8", "hello there")
    assert again.stdout == p.stdout, "the same seed must give the same text"


def test_draft_vocab_flag_reaches_the_pipeline():
    from types import SimpleNamespace

    from graphspec.cli import _draft_kw

    def ns(draft, vocab="auto", siblings="auto", beam=0, length="fixed"):
        return SimpleNamespace(draft=draft, draft_vocab=vocab, draft_siblings=siblings, draft_beam=beam,
                               draft_length=length)

    def kw(draft_arg, vocab):
        return _draft_kw(ns(draft_arg, vocab)).get("draft_vocab")

    assert kw("m", "auto") == "auto"  # the library resolves it: pruned for an int8 draft only
    assert kw("ngram", "auto") is None and kw(None, "auto") is None
    assert kw("m", "none") is None
    assert kw("m", 300) == 300
    siblings = _draft_kw(ns("m", siblings=3))
    assert siblings == {"draft_vocab": "auto", "draft_siblings": 3}
    assert _draft_kw(ns("m", siblings=0))["draft_siblings"] == 0  # a chain, said: Pipeline's own default is a tree
    assert _draft_kw(ns("m", vocab="none")) == {"draft_vocab": None, "draft_siblings": "auto"}
    assert _draft_kw(ns("ngram")) == {}
    assert _draft_kw(ns("m", vocab="none", beam=2)) == {"draft_vocab": None, "draft_siblings": "auto", "draft_beam": 2}
    assert "draft_beam" not in _draft_kw(ns("m"))
    assert _draft_kw(ns("m", length="auto"))["draft_length"] == "auto"
    assert "draft_length" not in _draft_kw(ns("m"))  # fixed: Pipeline's default


@pytest.mark.parametrize("args, fragments", [
    (("run", "--target", "no-such-model-name", "hi"), ["no-such-model-name"]),
    (("run", "--target", "/nonexistent/dir/model", "hi"), ["/nonexistent/dir/model"]),
    (("run", "--target", "TINY", "--top-p", "1.5", "hi"), ["top_p"]),
    (("run", "--target", "TINY", "--top-k", "-3", "hi"), ["top_k"]),
    (("run", "--target", "TINY", "-k", "0", "hi"), ["-k"]),
    (("run", "--target", "TINY", "--temperature", "-1", "hi"), ["--temperature"]),
    (("run", "--target", "TINY", "--draft-confidence", "1.5", "hi"), ["--draft-confidence"]),
    (("run", "--target", "TINY", "--max-new-tokens", "100000", "hi"), ["max_position_embeddings"]),
    (("run", "--target", "TINY", "--draft", "/nope", "hi"), ["--draft", "/nope"]),
    (("run", "--target", "TINY", "--draft-vocab", "100", "hi"), ["--draft-vocab"]),
    (("run", "--target", "TINY", "--draft", "ngram", "--draft-vocab", "100", "hi"), ["--draft-vocab"]),
    (("run", "--target", "TINY", "--draft-vocab", "0", "hi"), ["--draft-vocab"]),
    (("run", "--target", "TINY", "--draft", "TINY", "--draft-vocab", "most", "hi"), ["--draft-vocab", "most"]),
    (("run", "--target", "TINY", "--draft", "TINY", "--draft-quantize", "int2", "hi"), ["--draft-quantize"]),
    (("run", "--target", "TINY", "--draft", "ngram", "--draft-siblings", "2", "hi"), ["--draft-siblings"]),
    (("run", "--target", "TINY", "--draft", "TINY", "--draft-siblings", "-1", "hi"), ["--draft-siblings"]),
    (("bench", "--target", "TINY", "--draft", "TINY", "--draft-siblings", "2"), ["--draft-siblings"]),
    (("run", "--target", "TINY", "--draft", "ngram", "--draft-beam", "2", "hi"), ["--draft-beam"]),
    (("run", "--target", "TINY", "--draft", "TINY", "--draft-beam", "-2", "hi"), ["--draft-beam"]),
    (("bench", "--target", "TINY", "--draft", "TINY", "--draft-beam", "2"), ["--draft-beam"]),
    (("run", "--target", "TINY", "--draft", "ngram", "--draft-length", "auto", "hi"), ["(not ngram)"]),
    (("run", "--target", "TINY", "--draft", "TINY", "--draft-length", "auto", "--draft-beam", "2", "hi"),
     ["--draft-length auto and --draft-beam"]),
    (("run", "--target", "TINY", "--draft", "TINY", "--draft-length", "often", "hi"), ["--draft-length"]),
    (("bench", "--target", "TINY", "--draft", "TINY", "--draft-length", "auto"), ["--draft-length auto"]),
    (("serve", "--target", "TINY", "--draft", "TINY", "--draft-length", "auto"), ["--draft-length is for run"]),
    (("fetch", "not-a-zoo-model"), ["not-a-zoo-model"]),
    (("bench", "--target", "TINY", "--draft", "ngram", "--prompts", "/nope.jsonl"), ["/nope.jsonl"]),
    (("bench", "--target", "TINY", "--draft", "suffix", "--compare", "suffix", "hybrid"),
     ["--compare hybrid needs a draft model", "--draft suffix"]),
    (("bench", "--target", "TINY", "--draft", "ngram", "--compare", "model"), ["--compare model needs a draft model"]),
])
def test_errors_are_one_clear_line(tiny, args, fragments):
    args = tuple(a.replace("TINY", str(tiny)) for a in args)
    _assert_one_line_error(_cli(*args), *fragments)


def test_models_lists_the_zoo(tmp_path):
    p = _cli("models", env_extra={"GRAPHSPEC_CACHE": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        assert name in p.stdout
    assert "not cached" in p.stdout


def test_bench_on_user_prompts(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def fibonacci(n):"}\n"The quick brown fox"\n'
                       '{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / "bench.json"
    p = _cli("bench", "--target", str(tiny), "--draft", str(tiny), "--dtype", "fp32", "--prompts", str(prompts),
             "--draft-confidence", "0.3",
             "--max-new-tokens", "9", "--max-k", "4", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "recommended K:" in p.stdout
    result = json.loads(out.read_text())
    assert len(result["prompts"]) == 3
    # the draft is the target itself: every draft position is accepted whenever proposed
    assert all(r["acceptance_rate"] == 1.0 and r["identical_to_autoregressive"] for r in result["prompts"])
    # beside it, every drafter as `run` builds it, each giving the target's tokens on every prompt
    drafters = result["drafters"]
    assert list(drafters) == ["model", "ngram", "suffix", "suffix-auto", "hybrid"]
    assert {n: d["draft"] for n, d in drafters.items()} == {"model": str(tiny), "ngram": "ngram", "suffix": "suffix",
                                                            "suffix-auto": "suffix -k 16 --draft-length auto",
                                                            "hybrid": f"{tiny}+suffix"}
    assert all(d["prompts_differing"] == 0 and d["tok_s"] > 0 for d in drafters.values())
    assert drafters["ngram"]["draft_forwards"] == drafters["suffix"]["draft_forwards"] == 0
    assert drafters["model"]["draft_forwards"] > 0
    assert all(set(r["drafters"]) == set(drafters) for r in result["prompts"])
    # the recommendation is the rule's, on the figures it printed, and says why
    rec = result["recommended_draft"]
    choice, why = recommend_drafter(result["autoregressive_tok_s"], drafters)
    assert (rec["drafter"], rec["why"]) == (choice, why) and why
    assert rec["draft"] == (drafters[choice]["draft"] if choice else None)
    assert f"recommended draft: {'--draft ' + rec['draft'] if choice else 'none'}" in p.stdout
    assert why in p.stdout


def test_bench_compare_names_what_it_measures(tiny, tmp_path):
    out = tmp_path / "bench.json"
    p = _cli("bench", "--target", str(tiny), "--draft", "ngram", "--dtype", "fp32", "--max-new-tokens", "6",
             "--max-k", "2", "--compare", "suffix", "suffix-auto", "--json", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert list(result["drafters"]) == ["suffix", "suffix-auto"]
    auto = result["drafters"]["suffix-auto"]
    assert auto["k"] == 16 and auto["draft"] == "suffix -k 16 --draft-length auto" and auto["prompts_differing"] == 0
    assert result["recommended_draft"]["drafter"] in ("suffix", "suffix-auto", None)
    p = _cli("bench", "--target", str(tiny), "--draft", "ngram", "--dtype", "fp32", "--max-new-tokens", "6",
             "--max-k", "2", "--compare", "--json", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    assert result["drafters"] == {} and result["recommended_draft"] is None
    assert "recommended draft" not in p.stdout


def test_recommend_drafter_takes_the_fastest_unless_a_weight_free_one_is_as_good():
    ar = 10.0
    # the hybrid is fastest, and suffix more than 5% behind it: the hybrid
    got = {"model": {"tok_s": 20.0}, "ngram": {"tok_s": 15.0}, "suffix": {"tok_s": 18.0}, "hybrid": {"tok_s": 22.0}}
    choice, why = recommend_drafter(ar, got)
    assert choice == "hybrid"
    assert "fastest" in why and "2.20x" in why and "next: model draft (2.00x" in why
    # suffix within 5% of the model-drafted fastest: suffix, which needs no draft model
    got["suffix"]["tok_s"] = 21.0
    choice, why = recommend_drafter(ar, got)
    assert choice == "suffix" and "within 5%" in why and "no draft model" in why
    assert recommend_drafter(ar, got, margin=0.01)[0] == "hybrid"
    # a weight-free drafter that is fastest outright
    assert recommend_drafter(ar, {"model": {"tok_s": 12.0}, "ngram": {"tok_s": 14.0}})[0] == "ngram"
    # nothing beats plain decoding: no drafter
    choice, why = recommend_drafter(ar, {"model": {"tok_s": 9.0}, "suffix": {"tok_s": 8.0}})
    assert choice is None and "plain decoding" in why
    with pytest.raises(ValueError):
        recommend_drafter(ar, {})


def test_recommend_k_prefers_long_drafts_only_when_they_pay():
    # perfect acceptance and a free draft: the longest K wins
    k, rows = recommend_k([10] * 6, steps=10, verify_seconds=1.0, draft_seconds_per_token=0.0, max_k=6)
    assert k == 6 and rows[-1]["tokens_per_step"] == 7
    # acceptance collapses after position 2 and drafting is costly: K=2
    k, _ = recommend_k([9, 8, 0, 0, 0], steps=10, verify_seconds=1.0, draft_seconds_per_token=0.3, max_k=5)
    assert k == 2


@pytest.mark.slow
def test_real_pair_demo_command():
    """The README's demo pair, across tokenizers, through the CLI (models fetched and converted once, then cached)."""
    p = _cli("run", "--target", "qwen2.5-coder-0.5b-instruct", "--draft", "smollm2-135m-instruct", "--chat",
             "--max-new-tokens", "24", "Write a Python function that adds two numbers.", timeout=1800)
    assert p.returncode == 0, p.stderr
    assert "def " in p.stdout
    assert "acceptance" in p.stderr.strip().splitlines()[-1]


def test_cpu_threads_leave_busy_cores_alone(monkeypatch):
    from graphspec import cli

    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cli.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    assert cli.cpu_threads(None) == 1       # one core already busy: one thread (OpenMP barriers stall otherwise)
    monkeypatch.setattr(cli.os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert cli.cpu_threads(None) == 2
    monkeypatch.setattr(cli.os, "getloadavg", lambda: (7.0, 0.0, 0.0))
    assert cli.cpu_threads(None) == 1
    assert cli.cpu_threads(3) == 3          # --threads wins


def test_draft_confidence_takes_auto_none_and_probabilities():
    import argparse

    from graphspec.cli import _confidence

    assert _confidence("auto") == "auto" and _confidence("AUTO") == "auto"
    assert _confidence("none") is None and _confidence("0.25") == 0.25
    for bad in ("1.5", "-0.1", "often"):
        with pytest.raises(argparse.ArgumentTypeError, match="'auto' or 'none'"):
            _confidence(bad)
