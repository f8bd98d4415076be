"""The benchmark scripts' own logic where it can be wrong without a benchmark noticing: the bytes a GGUF step
reads, perf/e2e.py on GGUF weights (its methods, its token check), and which files llama.cpp runs beside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))


def test_a_gguf_step_counts_the_bytes_of_its_blocks(tmp_path):
    from graphspec.models import load_model
    from graphspec.models.gguf_weights import weight_bytes
    from perf._common import step_weight_bytes
    from tests.models.test_gguf import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    model = load_model(path, weights="gguf")
    norms_and_biases = model.norm.numel() * 4 + sum(
        t.numel() * t.element_size() for layer in model.layers
        for t in (layer.bqkv, layer.bo, layer.input_norm, layer.post_norm) if t is not None)
    got = step_weight_bytes(model)
    assert got == weight_bytes(model) + norms_and_biases
    # Q8_0 / F16 / F32 blocks: fewer bytes than the same weights in fp32
    dense = sum(w.shape[0] * w.shape[1] * 4 for layer in model.layers
                for w in (layer.wqkv, layer.wo, layer.w13, layer.w2)) + model.lm_head.shape[0] * model.lm_head.shape[1] * 4
    assert got < dense


def test_llamacpp_runs_the_zoo_files_beside_gguf_weights():
    from perf import e2e, llamacpp

    assert {w: e2e._llamacpp_weights(w) for w in e2e.WEIGHTS} == {
        "bf16": "f16", "fp32": "f16", "gguf": "zoo", "gguf-a8": "zoo"}
    with pytest.raises(ValueError, match="'f16' or 'zoo'"):
        llamacpp.prepare(weights="q4")  # refused before anything is built


@pytest.mark.slow
def test_e2e_on_gguf_a8_weights(tmp_path):
    from graphspec.kernels import cpu
    from perf import e2e

    out = tmp_path / "e2e.json"
    # int4 drafts need the avx512 or avx2 level; the generic one runs the int8 draft
    quantize = "int4" if cpu.have_int4() else "int8"
    assert e2e.main(["--short", "--weights", "gguf-a8", "--methods", "ar", "spec_0.5b_chain", "--k-model", "3",
                     "--draft-quantize", quantize, "--no-hf", "--prompts", "1", "--max-new-tokens", "12",
                     "--out", str(out), "--no-acceptance-file", "--no-results-table", "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    run = report["dtypes"]["gguf-a8"]
    spec = run["summary"]["spec_0.5b_chain"]
    assert spec["prompts_differing_from_ar"] == 0  # lossless on the quantized target
    assert spec["num_speculative_tokens"] == 3 and spec["tokens_per_target_forward"] >= 1.0
    assert run["draft_quantize"] == quantize
    # the Q4_K_M 1.5B's blocks (about 1 GB a step), not its fp32 or bf16 size
    assert 0.8e9 < run["weight_bytes"] < 1.3e9


def test_e2e_drops_a_transformers_method_that_raises_and_keeps_ours():
    """A peer's bug (transformers 5.25's universal assisted generation raised on every prompt) leaves that
    method out with its error recorded; graphspec's own methods still raise."""
    from perf import e2e

    def ok(ids, n):
        return {"seconds": 1.0, "tokens": n, "token_ids": list(range(n))}

    def broken(ids, n):
        raise RuntimeError("cannot reshape tensor of 0 elements")

    logged, failures = [], {}
    res = e2e.run_interleaved({"hf_ar": ok, "hf_assist_smollm2": broken}, [[1, 2, 3], [4, 5]], 3, logged.append,
                              failures)
    assert set(res) == {"hf_ar"} and res["hf_ar"]["tokens"] == 6
    assert failures == {"hf_assist_smollm2": "RuntimeError: cannot reshape tensor of 0 elements"}
    assert any("hf_assist_smollm2 raised" in line for line in logged)
    with pytest.raises(RuntimeError):
        e2e.run_interleaved({"ar": broken}, [[1, 2, 3]], 3, logged.append, {})


def _fake_speculative(tmp_path, crash_with_repack: bool) -> Path:
    """A stand-in llama-speculative: its --help names --no-repack; a run prints the lines llamacpp.speculative
    parses, or dies of SIGSEGV where weights would be repacked (as ggml's AMX mul_mat did on an Intel Xeon)."""
    exe = tmp_path / "llama-speculative"
    crash = 'case " $* " in *" --no-repack "*) ;; *) kill -SEGV $$ ;; esac' if crash_with_repack else ""
    exe.write_text(f"""#!/bin/sh
if [ "$1" = "--help" ]; then echo "--repack, -nr, --no-repack   whether to enable weight repacking"; exit 0; fi
{crash}
echo "encoded    7 tokens in    0.100 seconds"
echo "decoded   33 tokens in    2.000 seconds, speed:   16.500 t/s"
echo "n_drafted = 30"
echo "n_accept  = 24"
""")
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("crash", [False, True])
def test_llamacpp_speculative_reruns_without_repacking_after_a_crash(tmp_path, capsys, crash):
    from perf import llamacpp

    _fake_speculative(tmp_path, crash)
    r = llamacpp.speculative(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", "def f():", threads=1, n=32, k=3)
    assert (r["tokens"], r["seconds"], r["drafted"], r["accepted"]) == (33, 2.0, 30, 24)
    assert r["repack"] is (not crash)
    assert ("--no-repack" in r["command_flags"]) is crash
    assert ("crashed (signal 11)" in capsys.readouterr().err) is crash
    if crash:  # told so, a later run goes without repacking at once: no second crash
        r = llamacpp.speculative(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", "x", threads=1, n=32, k=3,
                                 repack=False)
        assert r["repack"] is False and "--no-repack" in r["command_flags"]
        assert capsys.readouterr().err == ""


def test_prefix_cache_bench_compares_like_with_like(tmp_path):
    """perf/prefix_cache.py's two parts on a tiny model: both prefills timed, and a loop whose cached pipeline
    served prompt tokens from its cache and gave the cold pipeline's tokens."""
    import torch

    import graphspec
    from perf import prefix_cache as bench
    from tests.checkpoints import make_checkpoint

    model = graphspec.load_model(make_checkpoint(tmp_path / "m", "qwen2", hidden_size=64, layers=1, heads=4,
                                                 kv_heads=2, seed=0), dtype=torch.float32)
    cost = bench.prefill_cost(model, 100, 1)
    assert cost["batched_ms_per_token"] > 0 and cost["exact_ms_per_token"] > 0
    history = [(7 * i) % 300 + 5 for i in range(60)]
    prompts = [history[:20], history[:40], history]
    r = bench.loop(model, prompts, 6, lambda msg: None)
    assert r["outputs_differing"] == 0
    assert r["cached_tokens"] == [0, 20, 40]
    assert len(r["cold_call_s"]) == len(r["cached_call_s"]) == 3


def test_a_live_agent_loop_carries_the_models_own_answers():
    from perf.workloads import live_messages, load_workloads

    items = load_workloads(["agentic"])["agentic"]
    assert live_messages(items, []) == items[0]["messages"]
    answers = [f"answer {i}" for i in range(len(items) - 1)]
    for i in range(1, len(items)):
        live, fixed = live_messages(items, answers[:i]), items[i]["messages"]
        assert len(live) == len(fixed) and [m["role"] for m in live] == [m["role"] for m in fixed]
        # the turn after each earlier request's messages is the model's answer to it; every other turn is fixed
        theirs = {len(items[j - 1]["messages"]): answers[j - 1] for j in range(1, i + 1)}
        for pos, (a, b) in enumerate(zip(live, fixed)):
            assert a == ({"role": "assistant", "content": theirs[pos]} if pos in theirs else b), (i, pos)
    with pytest.raises(SystemExit, match="live-history"):
        live_messages([{"messages": [{"role": "user", "content": "a"}]},
                       {"messages": [{"role": "user", "content": "b"}]}], ["x"])
