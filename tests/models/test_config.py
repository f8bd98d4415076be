"""ModelConfig: HF config.json fields read verbatim, unsupported features refused by name."""

import json

import pytest
import torch

from graphspec.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _hf(arch: str, **kw) -> dict:
    """A config.json as transformers writes it (the architectures field added like save_pretrained does)."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    d = json.loads(cls(**{**BASE, **kw}).to_json_string())
    d["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[arch]]
    return d


def test_llama_fields():
    c = ModelConfig.from_dict(_hf("llama", eos_token_id=[5, 7], bos_token_id=1, rope_theta=500000.0,
                                  tie_word_embeddings=True, max_position_embeddings=1024))
    assert c.architecture == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (300, 64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    assert c.eos_token_ids == [5, 7] and c.bos_token_id == 1
    assert c.tie_word_embeddings and c.max_position_embeddings == 1024
    assert not c.attention_bias and not c.attention_out_bias


def test_qwen2_has_qkv_bias_and_no_o_bias():
    c = ModelConfig.from_dict(_hf("qwen2"))
    assert c.architecture == "Qwen2ForCausalLM" and c.attention_bias and not c.attention_out_bias


def test_mistral_without_window_and_explicit_head_dim():
    c = ModelConfig.from_dict(_hf("mistral", sliding_window=None, head_dim=32))
    assert c.architecture == "MistralForCausalLM" and c.head_dim == 32
    # transformers' Mistral has no biases whatever the config says; Llama's attention_bias covers q, k, v and o
    assert not ModelConfig.from_dict({**_hf("mistral", sliding_window=None), "attention_bias": True}).attention_bias
    c = ModelConfig.from_dict(_hf("llama", attention_bias=True))
    assert c.attention_bias and c.attention_out_bias


def test_llama3_rope_both_spellings_and_both_places():
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    want = {"rope_type": "llama3", **llama3}
    # transformers 5: rope_parameters with rope_theta inside
    c5 = ModelConfig.from_dict(_hf("llama", rope_scaling={"rope_type": "llama3", **llama3}, rope_theta=123.0))
    assert c5.rope_scaling == want and c5.rope_theta == 123.0
    # transformers 4: rope_scaling + top-level rope_theta, legacy "type" key
    d4 = {**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 77.0, "rope_scaling": {"type": "llama3", **llama3}}
    c4 = ModelConfig.from_dict(d4)
    assert c4.rope_scaling == want and c4.rope_theta == 77.0
    assert ModelConfig.from_dict({**d4, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None


def test_dtype_and_defaults():
    d = {**BASE, "model_type": "llama", "torch_dtype": "bfloat16"}
    c = ModelConfig.from_dict(d)
    assert c.torch_dtype == torch.bfloat16 and c.eos_token_ids == [] and c.head_dim == 16
    assert ModelConfig.from_dict({**d, "dtype": "float16"}).torch_dtype == torch.float16
    assert ModelConfig.from_dict({**BASE, "model_type": "llama", "num_key_value_heads": None}).num_key_value_heads == 4


def test_from_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf("llama")))
    assert ModelConfig.from_file(tmp_path).vocab_size == 300
    assert ModelConfig.from_file(tmp_path / "config.json").hidden_size == 64
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_file(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": None, "model_type": "gemma"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"num_experts": 4}, "num_experts"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"hidden_size": 66, "head_dim": None}, "head_dim"),
])
def test_refusals_name_the_field(change, field):
    d = {**_hf("llama"), **change}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(d, source="x/config.json")


def test_sliding_window_refused_when_in_use():
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_dict(_hf("qwen2", use_sliding_window=True, sliding_window=256))
    with pytest.raises(ValueError, match="sliding_window=4096"):
        ModelConfig.from_dict(_hf("mistral", sliding_window=4096, max_position_embeddings=32768))
    # A window at least as long as the context never drops anything: accepted.
    assert ModelConfig.from_dict(_hf("mistral", sliding_window=4096, max_position_embeddings=4096)).head_dim == 16
    # Qwen2 configs always carry sliding_window; it is harmless while use_sliding_window is false.
    assert ModelConfig.from_dict(_hf("qwen2", sliding_window=4096, use_sliding_window=False)).attention_bias
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**_hf("qwen2"), "layer_types": ["full_attention", "sliding_attention"]})
