"""GGUF import: tiny GGUF files written here (fast), and the real zoo checkpoints (slow).

The oracle is transformers loading the very same GGUF (`from_pretrained(..., gguf_file=...)`):
our converted directory must give the same logits and the same token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from graphspec.models import gguf as gg
from graphspec.models.tokenizer import byte_alphabet

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "the hello world",
    "def f():\n    return 12345\n",
    "  leading spaces\t\ttabs\n\n\nend  ",
    "café naïve 日本語 🙂👍🏽",
    "<|im_start|>user\n<think>hi there<|im_end|>\n",
    "",
]


# ----------------------------------------------------------------------------------------------
# Tiny GGUF files
# ----------------------------------------------------------------------------------------------


def _tiny_vocab():
    """A byte-level BPE vocabulary: 256 byte tokens, some merges, control and user-defined tokens."""
    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)]
    types = [1] * 256
    merges = []
    words = ["Ġthe", "the", "hello", "Ġworld", "def", "Ġreturn", "ĠĠ", "ĠĠĠĠ", "in", "Ġin", "12", "Ã©", "ĠhĠ"]
    for word in words:
        piece = word[0]
        for ch in word[1:]:
            merged = piece + ch
            if merged not in tokens:
                merges.append(f"{piece} {ch}")
                tokens.append(merged)
                types.append(1)
            piece = merged
    for tok, ty in [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)]:
        tokens.append(tok)
        types.append(ty)
    return tokens, types, merges


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to the HF q/k rows of the llama architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    pre: str | None = None,
    add_bos: bool = False,
    extra_tensor: tuple[str, np.ndarray, object] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a 2-layer model as llama.cpp would; returns the HF-order float32 weights it encodes.

    Mixed storage: Q8_0, F16 and F32 tensors. Weights are returned as stored (after the type's
    rounding), so a converter must reproduce them exactly.
    """
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, ffn, layers = 64, 4, 2, 96, 2
    head_dim = hidden // heads
    tokens, types, merges = _tiny_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or ("qwen2" if arch == "qwen2" else "smollm"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)

    hf: dict[str, np.ndarray] = {}

    def add(gguf_name, hf_name, shape, qtype, scale=0.2, permute_heads=0):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if hf_name.endswith("layernorm.weight") or hf_name == "model.norm.weight":
            x = 1.0 + x
        stored = _llama_permute(x, permute_heads) if permute_heads else x
        if qtype == Q.F32:
            w.add_tensor(gguf_name, stored)
            back = stored
        elif qtype == Q.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float32)
        else:
            packed = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gguf_name, packed, raw_dtype=qtype)
            back = gguf.quants.dequantize(packed, qtype)
        if permute_heads:  # undo on the stored values: that is what the converter must return
            back = _llama_permute_inverse(back, permute_heads)
        hf[hf_name] = back

    permute = arch == "llama"
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.Q8_0, 1.0)
    for i in range(layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", (hidden,), Q.F32, 0.1)
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", (hidden, hidden), Q.F16, 0.2, heads if permute else 0)
        add(p + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), Q.Q8_0, 0.2,
            kv_heads if permute else 0)  # fmt: skip
        add(p + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), Q.F16)
        if arch == "qwen2":
            add(p + "attn_q.bias", h + "self_attn.q_proj.bias", (hidden,), Q.F32, 0.5)
            add(p + "attn_k.bias", h + "self_attn.k_proj.bias", (kv_heads * head_dim,), Q.F32, 0.5)
            add(p + "attn_v.bias", h + "self_attn.v_proj.bias", (kv_heads * head_dim,), Q.F32, 0.5)
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, hidden), Q.Q8_0)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", (hidden,), Q.F32, 0.1)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", (ffn, hidden), Q.Q8_0)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", (ffn, hidden), Q.F16)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, ffn), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", (hidden,), Q.F32, 0.1)
    if arch == "qwen2":  # untied output, as in Qwen2.5-Coder-0.5B; llama stays tied like SmolLM2
        add("output.weight", "lm_head.weight", (vocab, hidden), Q.F16, 0.5)
    if extra_tensor is not None:
        name, data, raw_dtype = extra_tensor
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _llama_permute_inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{arch: (gguf path, HF weights, converted dir)} for llama and qwen2, built once."""
    out = {}
    root = tmp_path_factory.mktemp("tiny_gguf")
    for arch in ("llama", "qwen2"):
        path = root / f"tiny-{arch}.gguf"
        weights = write_tiny_gguf(path, arch)
        out[arch] = (path, weights, gg.convert_gguf(path, root / f"conv-{arch}", progress=False))
    return out


def _transformers():
    return pytest.importorskip("transformers")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# ----------------------------------------------------------------------------------------------
# Fast tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_converted_dir_layout_and_config(tiny, arch):
    path, weights, out = tiny[arch]
    assert _entries(out) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 4, 2, 16)
    assert (cfg["num_hidden_layers"], cfg["intermediate_size"]) == (2, 96)
    assert cfg["vocab_size"] == weights["model.embed_tokens.weight"].shape[0]
    assert cfg["tie_word_embeddings"] is (arch == "llama")
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0
    assert cfg["torch_dtype"] == "float32"
    tokens, _, _ = _tiny_vocab()
    assert cfg["bos_token_id"] == tokens.index("<|im_start|>") and cfg["eos_token_id"] == tokens.index("<|im_end|>")
    # generation also ends at the document end, as llama.cpp stops at either
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_are_exact_and_llama_qk_unpermuted(tiny, arch):
    """Every tensor equals the HF-order weights the GGUF encodes; for llama this only holds if
    the Q/K row permutation is undone (the test writes it the way llama.cpp does)."""
    from safetensors.numpy import load_file

    _, weights, out = tiny[arch]
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    for name, expected in weights.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    if arch == "llama":  # the permutation is not the identity on these shapes
        q = weights["model.layers.0.self_attn.q_proj.weight"]
        assert not np.array_equal(_llama_permute(q, 4), q)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers_loading_the_gguf(tiny, arch):
    transformers = _transformers()
    path, _, out = tiny[arch]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[5, 260, 7, 99, 261, 3, 291, 17, 42, 0, 255, 270]])
    with torch.no_grad():
        expected, got = ref(ids).logits, ours(ids).logits
    assert _rel_err(got, expected) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_encodes_like_transformers_gguf_tokenizer(tmp_path, arch, add_bos):
    transformers = _transformers()
    from tokenizers import Tokenizer

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, arch, add_bos=add_bos)
    out = gg.convert_gguf(path, tmp_path / "conv", progress=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours_hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        expected = ref(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert ours_hf(text)["input_ids"] == expected, text
    bos = ref.convert_tokens_to_ids("<|im_start|>")
    assert (ours.encode("the").ids[:1] == [bos]) is add_bos
    # whole special and user-defined tokens, not pieces
    assert len(ours.encode("<|im_end|><think>", add_special_tokens=False).ids) == 2


def test_tokenizer_config_has_specials_and_chat_template(tiny):
    _, _, out = tiny["qwen2"]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>" and cfg["unk_token"] is None
    assert cfg["add_bos_token"] is False and cfg["chat_template"] == CHAT_TEMPLATE
    specials = {v["content"] for v in cfg["added_tokens_decoder"].values() if v["special"]}
    plain = {v["content"] for v in cfg["added_tokens_decoder"].values() if not v["special"]}
    assert specials == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} and plain == {"<think>"}


def test_llama3_pre_tokenizer_groups_digits_in_threes(tmp_path):
    """The pre-tokenizer follows tokenizer.ggml.pre: llama-bpe splits numbers into runs of up to three digits."""
    transformers = _transformers()
    from tokenizers import Tokenizer

    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, "llama", pre="llama-bpe")
    out = gg.convert_gguf(path, tmp_path / "conv", progress=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    pieces = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str("x 1234567")]
    assert pieces == ["x", "Ġ", "123", "456", "7"]
    for text in TEXTS + ["1234567 apples"]:
        assert ours.encode(text).ids == ref(text)["input_ids"], text


def test_sentencepiece_vocabulary_encodes_like_transformers(tmp_path):
    """tokenizer.ggml.model == "llama": metaspace BPE with byte fallback, merges recovered from scores."""
    transformers = _transformers()
    from tokenizers import Tokenizer

    pieces = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "▁t", "▁th", "▁the", "he", "ll", "llo", "▁w", "or", "ld"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "sp.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), 32)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    for name, shape in [("attn_norm", (32,)), ("ffn_norm", (32,)), ("attn_q", (32, 32)), ("attn_k", (32, 32)),
                        ("attn_v", (32, 32)), ("attn_output", (32, 32)), ("ffn_gate", (32, 32)),
                        ("ffn_up", (32, 32)), ("ffn_down", (32, 32))]:  # fmt: skip
        w.add_tensor(f"blk.0.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = gg.convert_gguf(path, tmp_path / "conv", progress=False)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ["the hello world", "hello  the\nworld", "é日🙂 the", " the"]:
        assert ours.encode(text).ids == ref(text)["input_ids"], text
    assert ours.encode("the").ids == [1, tokens.index("▁the")]


def test_bfloat16_output_is_the_float32_conversion_rounded(tiny, tmp_path):
    from safetensors.torch import load_file

    path, weights, out32 = tiny["qwen2"]
    out16 = gg.convert_gguf(path, tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    a, b = load_file(str(out32 / "model.safetensors")), load_file(str(out16 / "model.safetensors"))
    for name in weights:
        assert b[name].dtype == torch.bfloat16
        torch.testing.assert_close(b[name], a[name].to(torch.bfloat16), rtol=0, atol=0)
    assert json.loads((out16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_chunked_dequantization_equals_whole_tensor(tiny, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    path, weights, _ = tiny["qwen2"]
    monkeypatch.setattr(gg, "_CHUNK_ELEMENTS", 64 * 7)  # 7 rows a chunk: uneven tails everywhere
    out = gg.convert_gguf(path, tmp_path / "chunked", progress=False)
    got = load_file(str(out / "model.safetensors"))
    for name, expected in weights.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_every_supported_type_has_a_dequantizer():
    for name in gg.SUPPORTED_TENSOR_TYPES:
        qtype = Q[name]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((2, 2 * nbytes), dtype=np.uint8)
        if qtype == Q.F32:
            raw = np.zeros((2, 2), np.float32)
        elif qtype == Q.F16:
            raw = np.zeros((2, 2), np.float16)
        out = gguf.quants.dequantize(raw, qtype)
        assert out.shape[-1] == 2 * block and not np.any(out), name


def test_read_gguf_metadata_reports_the_file(tiny):
    path, _, _ = tiny["llama"]
    info = gg.read_gguf_metadata(path)
    assert info.architecture == "llama" and info.version == 3
    assert info.tensors["blk.0.attn_k.weight"].shape == (32, 64)
    assert info.tensors["blk.0.attn_k.weight"].type == "Q8_0"
    assert info.get("tokenizer.ggml.pre") == "smollm"


# --- errors: a clear message, and nothing left behind ------------------------------------------


def _assert_fails_cleanly(src: Path, out_parent: Path, match: str):
    before = _entries(out_parent)
    with pytest.raises(ValueError, match=match):
        gg.convert_gguf(src, out_parent / "converted", progress=False)
    assert _entries(out_parent) == before, "a failed conversion left files behind"


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 4)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    _assert_fails_cleanly(bad, out_parent, "not a GGUF file")
    _assert_fails_cleanly(tmp_path / "missing.gguf", out_parent, "is not a file")


def test_unsupported_gguf_version(tmp_path):
    bad = tmp_path / "v1.gguf"
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + b"\0" * 64)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    _assert_fails_cleanly(bad, out_parent, "version 1")
    big = tmp_path / "big.gguf"
    big.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + b"\0" * 64)
    _assert_fails_cleanly(big, out_parent, "big-endian")


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_truncated_file(tiny, tmp_path, keep):
    src, _, _ = tiny["qwen2"]
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(12, int(len(data) * keep))])
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    _assert_fails_cleanly(cut, out_parent, "truncated")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    _assert_fails_cleanly(path, out_parent, r"general.architecture='phi2'.*llama.*qwen2")


def test_unsupported_quant_type_names_the_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    block, nbytes = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((8, 64 // block * nbytes), np.uint8)
    write_tiny_gguf(path, "llama", extra_tensor=("blk.0.ffn_extra.weight", raw, Q.IQ4_NL))
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    _assert_fails_cleanly(path, out_parent, r"'blk.0.ffn_extra.weight' is stored as IQ4_NL")


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, "llama", extra_tensor=("blk.0.mystery.weight", np.zeros((4, 4), np.float32), None))
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    _assert_fails_cleanly(path, out_parent, "mystery.*no counterpart")


def test_existing_output_dir_is_not_overwritten(tiny, tmp_path):
    src, _, _ = tiny["llama"]
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists"):
        gg.convert_gguf(src, tmp_path / "converted", progress=False)
    assert (tmp_path / "converted" / "keep.txt").read_text() == "mine"


def test_failure_while_writing_removes_the_temporary_dir(tiny, tmp_path, monkeypatch):
    src, _, _ = tiny["llama"]

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gg, "_write_safetensors", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        gg.convert_gguf(src, tmp_path / "converted", progress=False)
    assert _entries(tmp_path) == set()


# ----------------------------------------------------------------------------------------------
# Slow tests: the real zoo checkpoints (download about 600 MB once, cached under GRAPHSPEC_CACHE)
# ----------------------------------------------------------------------------------------------

REAL_TEXTS = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot, *rest = xs\n"
    "    return quicksort([x for x in rest if x < pivot]) + [pivot] + quicksort([x for x in rest if x >= pivot])\n",
    "The committee's decision, announced on Tuesday, surprised nearly everyone: 1234567 votes were recounted.",
    "    \t\t  \n\n\n   trailing   \r\n  x  ",
    "Café déjà vu, naïve façade; 日本語のテキストです。한국어 Ελληνικά русский 🙂👍🏽🚀",
    "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n",
]
REAL_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


@pytest.fixture(scope="module", params=REAL_MODELS)
def real_model(request):
    """(gguf path, converted dir): the GGUF is kept in the cache for these comparisons."""
    from graphspec.models import zoo

    gguf_path = zoo.fetch(request.param)
    return request.param, gguf_path, zoo.resolve(request.param)


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_model):
    transformers = _transformers()
    from tokenizers import Tokenizer

    _, gguf_path, out = real_model
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in REAL_TEXTS:
        assert ours.encode(text).ids == ref(text)["input_ids"], text
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == ref.chat_template
    assert cfg["eos_token"] == ref.eos_token

    try:
        from graphspec.models.tokenizer import Tokenizer as GraphspecTokenizer
    except ImportError as e:
        pytest.skip(f"graphspec.models.tokenizer is not available yet ({e})")
    ours_gs = GraphspecTokenizer.from_dir(out)
    for text in REAL_TEXTS:
        assert ours_gs.encode(text) == ref(text)["input_ids"], text
    messages = [{"role": "user", "content": "Write a haiku about GGUF."}]
    assert ours_gs.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_real_logits_match_transformers(real_model):
    transformers = _transformers()
    name, gguf_path, out = real_model
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    ours_hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ids = torch.tensor([tok(REAL_TEXTS[0])["input_ids"][:48]])
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours_hf(ids).logits
    del ref, ours_hf
    assert _rel_err(got, expected) < 1e-4, name

    try:
        from graphspec.models.loader import load_model
    except ImportError as e:
        pytest.skip(f"graphspec.models.loader.load_model is not available yet ({e})")
    model = load_model(out, dtype=torch.float32)
    with torch.no_grad():
        ours = model(ids)
    assert ours.shape == expected.shape
    assert _rel_err(ours.float(), expected) < 1e-4, name
