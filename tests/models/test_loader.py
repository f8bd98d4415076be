"""load_model on good and on deliberately broken checkpoints: every failure names its file/tensor/field."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphspec.models import KVCache, Tokenizer, Transformer, load_model
from tests.checkpoints import make_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("good"), "llama", tokenizer="bytelevel", chat_template="chatml")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sharded"), "qwen2", tokenizer=None, max_shard_size="60KB")


@pytest.fixture
def ckpt(good, tmp_path):
    """A private copy of the good checkpoint to break."""
    return shutil.copytree(good, tmp_path / "ckpt")


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def test_loads_weights_tokenizer_and_dtypes(good):
    m = load_model(good)
    assert isinstance(m, Transformer) and isinstance(m.tokenizer, Tokenizer)
    assert m.dtype == torch.float32 and m.device == torch.device("cpu") and m.backend is None
    assert m.config.architecture == "LlamaForCausalLM"
    assert m.tokenizer.eos_token_ids[0] == m.config.eos_token_ids[0]
    mb = load_model(str(good), dtype="bfloat16", backend="torch")
    assert mb.dtype == torch.bfloat16 and mb.backend == "torch"
    ids = torch.tensor([[1, 2, 3]])
    out = mb(ids)
    assert out.dtype == torch.float32 and out.shape == (1, 3, m.config.vocab_size)
    # bf16 weights are the fp32 weights rounded: logits agree loosely.
    assert (out - m(ids)).abs().max() < 0.05 * m(ids).abs().max()


def test_config_dtype_is_the_default(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_model(ckpt).dtype == torch.bfloat16
    assert load_model(ckpt, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        load_model(ckpt, dtype="int8")
    with pytest.raises(ValueError, match="backend"):
        load_model(ckpt, backend="cuda")


def test_sharded_checkpoint_loads(sharded):
    assert len(list(sharded.glob("*.safetensors"))) > 2
    m = load_model(sharded)
    assert m.tokenizer is None and m.layers[0].bqkv is not None


def test_missing_directory_and_config(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "no" / "such_dir")
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ckpt)
    with pytest.raises(ValueError, match="is a file"):
        load_model(ckpt / "model.safetensors")


def test_unsupported_config_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_act"] = "gelu_pytorch_tanh"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act"):
        load_model(ckpt)


def test_truncated_file_names_file_and_tensor(ckpt):
    f = ckpt / "model.safetensors"
    n, header = _header(f)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{last}' is truncated"):
        load_model(ckpt)
    f.write_bytes(f.read_bytes()[:n // 2])  # cut inside the header
    with pytest.raises(ValueError, match=r"model.safetensors is truncated or corrupt"):
        load_model(ckpt)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=r"model.safetensors is truncated"):
        load_model(ckpt)


def test_corrupt_header(ckpt):
    f = ckpt / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"#" * 12
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"model.safetensors has a corrupt safetensors header"):
        load_model(ckpt)
    raw[:8] = struct.pack("<Q", 10**12)
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"model.safetensors is truncated or corrupt: its header claims"):
        load_model(ckpt)


def test_offsets_that_disagree_with_the_shape(ckpt):
    f = ckpt / "model.safetensors"
    raw = f.read_bytes()
    n, header = _header(f)
    header["model.norm.weight"]["shape"] = [header["model.norm.weight"]["shape"][0] + 1]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # keep the header length, hence every data offset
    assert len(text) == n
    f.write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' is corrupt"):
        load_model(ckpt)


def test_wrong_missing_and_unexpected_tensors_reported_together(ckpt):
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:-1].clone()
    del t["model.layers.0.self_attn.k_proj.weight"]
    t["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    save_file(t, str(f))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "missing tensors: model.layers.0.self_attn.k_proj.weight" in msg
    assert "unexpected tensors: model.layers.0.self_attn.extra.weight" in msg
    assert "model.layers.1.mlp.up_proj.weight has shape (127, 64), expected (128, 64)" in msg
    assert "3 problem(s)" in msg


def test_missing_lm_head_hints_at_tying(ckpt):
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    del t["lm_head.weight"]
    save_file(t, str(f))
    with pytest.raises(ValueError, match="missing tensors: lm_head.weight; the config has tie_word_embeddings=false"):
        load_model(ckpt)


def test_tied_config_with_a_stored_head_loads_only_if_it_equals_the_embedding(ckpt):
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (ckpt / "config.json").write_text(json.dumps(cfg))
    # some writers store the tied head anyway: an exact copy of the embedding is accepted
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, str(f))
    m = load_model(ckpt)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(m(ids), m(ids))
    # a head that differs contradicts the config: refused, never silently dropped
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
    save_file(t, str(f))
    with pytest.raises(ValueError, match="tie_word_embeddings=true but the stored lm_head.weight"):
        load_model(ckpt)


def test_vocab_mismatch_names_both(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vocab_size"] += 8
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"vocab_size={cfg['vocab_size']}.*embed_tokens.weight.*{cfg['vocab_size'] - 8} rows"):
        load_model(ckpt)


def test_quantized_tensor_refused(ckpt):
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)
    save_file(t, str(f))
    with pytest.raises(ValueError, match="model.norm.weight has dtype I8"):
        load_model(ckpt)


def test_index_naming_a_missing_shard(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "s")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"model.safetensors.index.json names shard\(s\) that do not exist.*{shard.name}"):
        load_model(d)


def test_index_disagreeing_with_shards(sharded, tmp_path):
    d = shutil.copytree(sharded, tmp_path / "s")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(s for s in shards if s != index["weight_map"]["model.norm.weight"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.norm.weight is listed in model.safetensors.index.json under"):
        load_model(d)


def test_pickles_are_never_loaded(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(FileNotFoundError, match="pickled weights are never loaded"):
        load_model(ckpt)


def test_model_holds_no_run_state(good):
    m = load_model(good)
    c1, c2 = m.new_cache(32), m.new_cache(32, batch_size=2)
    assert isinstance(c1, KVCache) and c1.k[0].shape == (1, 32, 2, 16) and c2.batch_size == 2
    m.step(torch.tensor([[1, 2, 3]]), c1)
    assert (c1.length, c2.length) == (3, 0)


def test_zoo_names_go_through_the_zoo(good, monkeypatch):
    from graphspec.models import zoo

    asked = []
    monkeypatch.setitem(zoo.ZOO, "tiny-test-model", object())
    monkeypatch.setattr(zoo, "resolve", lambda name: asked.append(name) or good)
    assert load_model("tiny-test-model").config.vocab_size > 0
    assert asked == ["tiny-test-model"]
    with pytest.raises(FileNotFoundError, match="'no-such-model' is not a zoo model name"):
        load_model("no-such-model")
