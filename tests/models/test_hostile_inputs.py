"""Issue #28, the library side: hostile config.json values, weight files that are not files, KV caches
larger than memory, seeds, and chat messages. Each test reproduces one row of the issue's table and
checks that it is now a ValueError naming the input, raised before anything expensive."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphspec.models.config import LIMITS, ModelConfig
from graphspec.models.loader import load_model
from tests.checkpoints import make_checkpoint

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny", "llama", tokenizer="bytelevel",
                           chat_template="chatml")


def _copy(src: Path, dst: Path, config: dict | None = None) -> Path:
    """A copy of a checkpoint directory (weights hard-linked), with config.json fields replaced."""
    dst.mkdir()
    for f in src.iterdir():
        os.link(f, dst / f.name)
    if config is not None:
        d = json.loads((src / "config.json").read_text())
        d.update(config)
        (dst / "config.json").unlink()
        (dst / "config.json").write_text(json.dumps(d))
    return dst


# --- config.json ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", 10**6), ("num_hidden_layers", 10**7), ("hidden_size", 10**9), ("vocab_size", 10**12),
    ("num_attention_heads", 4096), ("max_position_embeddings", 10**15), ("intermediate_size", 2**40),
    ("head_dim", 2**20),
])
def test_sizes_beyond_any_model_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}, above graphspec's limit of {LIMITS[field]}"):
        ModelConfig.from_dict({**BASE, field: value})


@pytest.mark.parametrize("field, value", [
    ("rope_theta", float("inf")), ("rope_theta", float("nan")), ("rope_theta", 1e300), ("rope_theta", 10**400),
    ("rms_norm_eps", float("inf")), ("rms_norm_eps", float("nan")),
])
def test_numbers_must_be_finite(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict({**BASE, field: value})


def test_infinite_rope_theta_and_huge_context_from_a_file(tmp_path, tiny):
    """The issue's row: rope_theta=Infinity and max_position_embeddings=10**15 used to load and generate."""
    for extra, field in (({"rope_parameters": {"rope_theta": float("inf"), "rope_type": "default"}}, "rope_theta"),
                         ({"max_position_embeddings": 10**15}, "max_position_embeddings")):
        d = _copy(tiny, tmp_path / field, extra)
        assert "Infinity" in (d / "config.json").read_text() or field != "rope_theta"
        with pytest.raises(ValueError, match=field):
            load_model(d)


def test_config_json_that_is_not_a_file_or_too_deep(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        ModelConfig.from_file(tmp_path)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(deep)
    long_int = tmp_path / "long.json"
    long_int.write_text('{"vocab_size": ' + "9" * 10_000 + "}")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(long_int)


def test_values_of_the_wrong_type_are_value_errors():
    for extra in ({"model_type": ["llama"], "architectures": None}, {"layer_types": [{"a": 1}]},
                  {"architectures": ["MistralForCausalLM"], "sliding_window": "4096"},
                  {"num_hidden_layers": "2"}, {"rope_theta": "10000"}, {"hidden_size": True}):
        with pytest.raises(ValueError):
            ModelConfig.from_dict({**BASE, **extra})


def _limited(code: str, limit_gb: float = 4, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run python ``code`` under an address-space limit and a timeout: a refusal must cost neither."""
    limit = int(limit_gb * 2**30)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))


@pytest.mark.parametrize("layers", [10**6, 10**7, 1000])
def test_many_layers_are_refused_cheaply(tmp_path, tiny, layers):
    """num_hidden_layers=10**6 was refused only after 33 s and 3.1 GB; 10**7 under 4 GB died with MemoryError.
    Within the bound (1000 layers) the weights' own layer count names the disagreement."""
    d = _copy(tiny, tmp_path / "m", {"num_hidden_layers": layers})
    p = _limited(f"""
        import time
        from graphspec.models.loader import load_model
        t = time.perf_counter()
        try:
            load_model({str(d)!r})
        except ValueError as e:
            print("REFUSED", time.perf_counter() - t, str(e).splitlines()[0])
    """, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "REFUSED" in p.stdout and "num_hidden_layers" in p.stdout, p.stdout
    assert float(p.stdout.split()[1]) < 10, p.stdout  # not tens of seconds (it was 33 s)
    if layers == 1000:
        assert "the weights hold layers 0..1 (2 layers)" in p.stdout


def test_hidden_size_against_the_weights(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m", {"hidden_size": 128, "head_dim": 16})
    with pytest.raises(ValueError, match="hidden_size=128 but model.embed_tokens.weight .* has 64 columns"):
        load_model(d)


# --- weight files ----------------------------------------------------------------------------------------------

def test_a_directory_named_model_safetensors(tmp_path, tiny):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            os.link(f, d / f.name)
    (d / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model.safetensors is a directory, not a regular file"):
        load_model(d)


def test_a_fifo_named_model_safetensors_does_not_hang(tmp_path, tiny):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            os.link(f, d / f.name)
    os.mkfifo(d / "model.safetensors")
    p = _limited(f"""
        from graphspec.models.loader import load_model
        try:
            load_model({str(d)!r})
        except ValueError as e:
            print("REFUSED", e)
    """, timeout=60)
    assert "REFUSED" in p.stdout and "is a named pipe, not a regular file" in p.stdout, (p.stdout, p.stderr)


def test_a_fifo_among_the_shards(tmp_path, tiny):
    d = _copy(tiny, tmp_path / "m")
    (d / "model.safetensors").unlink()  # no single file: every *.safetensors is read, the pipe among them
    os.link(tiny / "model.safetensors", d / "a.safetensors")
    os.mkfifo(d / "b.safetensors")
    with pytest.raises(ValueError, match="b.safetensors is a named pipe"):
        load_model(d)


def test_a_loader_error_lists_every_problem_by_name(tmp_path, tiny):
    """A transposed and a mistyped tensor: both named in the error (the CLI prints every line, test_hostile_cli)."""
    from safetensors.torch import load_file, save_file

    d = _copy(tiny, tmp_path / "m")
    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].T.contiguous()
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    (d / "model.safetensors").unlink()
    save_file(t, d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_model(d)
    text = str(e.value)
    assert "(2 problem(s))" in text
    assert "model.layers.0.self_attn.k_proj.weight has shape (64, 32), expected (32, 64)" in text
    assert "model.layers.1.mlp.up_proj.weight has dtype I32" in text


@pytest.mark.parametrize("device, fragment", [("meta", "cpu or cuda devices only"), ("tpu", "is not a device"),
                                              (3.5, "is not a device")])
def test_devices_other_than_cpu_and_cuda(tiny, device, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_model(tiny, device=device)


# --- KV cache and max_new_tokens --------------------------------------------------------------------------------

def test_a_kv_cache_beyond_free_memory_is_refused_before_allocating(tiny, monkeypatch):
    import graphspec
    from graphspec.models import kv_cache

    model = load_model(tiny, dtype="float32")
    pipe = graphspec.Pipeline(model)
    assert pipe.run("hi", max_new_tokens=3).token_ids  # fits
    monkeypatch.setattr(kv_cache, "available_bytes", lambda device: 4096)
    allocated = []
    real_zeros = torch.zeros
    monkeypatch.setattr(kv_cache.torch, "zeros", lambda *a, **k: allocated.append(a) or real_zeros(*a, **k))
    with pytest.raises(ValueError, match=r"a KV cache of \d+ positions .* needs .* GiB but only 0.00 GiB .* "
                                         "lower max_new_tokens"):
        pipe.run("hi", max_new_tokens=400)
    assert not allocated


def test_huge_max_new_tokens_with_a_huge_context_claim(tmp_path, tiny):
    """The issue's row (10**8 new tokens, max_position_embeddings=10**15) tried to allocate terabytes: now the
    config is refused; at the largest context allowed the KV cache is checked against free memory instead."""
    import graphspec

    d = _copy(tiny, tmp_path / "big", {"max_position_embeddings": 10**15})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        graphspec.Pipeline(str(d)).run("hi", max_new_tokens=10**8)
    d = _copy(tiny, tmp_path / "limit", {"max_position_embeddings": LIMITS["max_position_embeddings"],
                                         "num_hidden_layers": 2})
    p = _limited(f"""
        import graphspec
        pipe = graphspec.Pipeline({str(d)!r}, dtype="float32")
        try:
            pipe.run("hi", max_new_tokens={LIMITS['max_position_embeddings'] - 8})
        except ValueError as e:
            print("REFUSED", e)
    """, limit_gb=6, timeout=120)
    # 2 layers x 2 KV heads x 16 x 4 bytes x 2 x 16M positions = 8 GiB: more than the address-space limit allows
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REFUSED" in p.stdout and "lower max_new_tokens" in p.stdout, p.stdout


# --- seeds -----------------------------------------------------------------------------------------------------

def test_every_64_bit_seed_has_its_own_stream():
    from graphspec.kernels.sampling import seeded_generator

    def draw(seed):
        return torch.rand(8, generator=seeded_generator(seed, "cpu"))

    seeds = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 1, 2**63, 2**64 - 1]
    draws = {s: draw(s) for s in seeds}
    for a in seeds:
        assert torch.equal(draws[a], draw(a))  # reproducible
        for b in seeds:
            if a < b:
                assert not torch.equal(draws[a], draws[b]), (a, b)
    # seeds below 2**32 keep torch's own stream (existing seeded outputs do not change)
    assert torch.equal(draws[1], torch.rand(8, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("seed", [2**64, -1, 1.5, True, "7", 10**30])
def test_bad_seeds_are_refused_naming_the_seed(tiny, seed):
    import graphspec

    pipe = graphspec.Pipeline(load_model(tiny, dtype="float32"))
    with pytest.raises(ValueError, match=r"seed=.* is not a valid seed; use an integer with 0 <= seed < 2\*\*64"):
        pipe.run("hi", max_new_tokens=2, temperature=1.0, seed=seed)


def test_large_seeds_sample_and_differ(tiny):
    import graphspec

    pipe = graphspec.Pipeline(load_model(tiny, dtype="float32"))

    def sample(seed):
        return pipe.run("The quick", max_new_tokens=24, temperature=2.0, seed=seed, ignore_eos=True).token_ids

    assert sample(2**64 - 1) == sample(2**64 - 1)
    assert sample(1) != sample(2**32 + 1)


# --- chat messages and text ------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "user", "content": 5}], "chat message #0 has content=5 (int); content must be a string"),
    ([{"role": "user", "content": None}], "chat message #0 has content=None (NoneType)"),
    ([{"role": "user", "content": ["a", "b"]}], "chat message #0 has content=['a', 'b'] (list)"),
    ([{"role": None, "content": "hi"}], "chat message #0 has role=None (NoneType); role must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}], "chat message #1 has role=3"),
    ([{"role": "user"}], "chat message #0 has no 'content' key"),
    ([{"role": "user", "content": "\udcff"}], "chat message #0's content is not valid UTF-8"),
])
def test_chat_messages_are_checked_one_by_one(tiny, messages, fragment):
    import graphspec

    pipe = graphspec.Pipeline(load_model(tiny, dtype="float32"))
    with pytest.raises(ValueError, match="^" + __import__("re").escape(fragment)):
        pipe.run(messages, max_new_tokens=2)
    with pytest.raises(ValueError, match=__import__("re").escape(fragment)):
        pipe.tokenizer.apply_chat_template(messages)


def test_text_with_undecodable_bytes_is_refused(tiny):
    import graphspec

    pipe = graphspec.Pipeline(load_model(tiny, dtype="float32"))
    with pytest.raises(ValueError, match=r"prompt is not valid UTF-8 text \(character 0 is '\\udcff'"):
        pipe.run("\udcff\udcfehi", max_new_tokens=2)
    with pytest.raises(ValueError, match="stop string is not valid UTF-8"):
        pipe.run("hi", max_new_tokens=2, stop=["\udcff"])


# --- GGUF metadata ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, fragment", [
    ("llama.block_count", 10**9, "num_hidden_layers=1000000000, above graphspec's limit"),
    ("llama.attention.head_count_kv", 0, "llama.attention.head_count_kv=0; expected a positive integer"),
    ("llama.attention.head_count", "4", "llama.attention.head_count='4'; expected a positive integer"),
    ("llama.rope.freq_base", float("inf"), "llama.rope.freq_base=inf; expected a finite positive number"),
    ("tokenizer.ggml.tokens", 1, "tokenizer.ggml.tokens=1; expected an array of str"),
    ("tokenizer.ggml.eot_token_id", [], "tokenizer.ggml.eot_token_id=[]; expected a token id"),
    ("tokenizer.ggml.add_bos_token", "false", "expected true or false"),
])
def test_gguf_metadata_is_checked_before_conversion(tmp_path, monkeypatch, key, value, fragment):
    """Metadata of the wrong type or size: a ValueError naming the key (a billion blocks was a tensor plan
    of a billion layers), before anything is written."""
    import dataclasses

    from graphspec.models import gguf as gg
    from tests.models.test_gguf import write_tiny_gguf

    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, "llama")
    info = gg.read_gguf_metadata(good)
    fields = {**info.fields, key: value}
    monkeypatch.setattr(gg, "read_gguf_metadata", lambda path: dataclasses.replace(info, fields=fields))
    with pytest.raises(ValueError, match=__import__("re").escape(fragment)):
        gg.convert_gguf(good, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
