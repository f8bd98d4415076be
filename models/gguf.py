"""GGUF import: turn a llama.cpp GGUF file into a Hugging Face style checkpoint directory.

The directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) is what
`load_model` and transformers read like any HF checkpoint. Main choices:

- Read with graphspec's own reader (`models/gguf_file.py`: memory-mapped, every length and offset
  checked). Everything that can make the file unusable is checked before anything is written: the
  magic and version, truncation, the architecture (llama, qwen2), every tensor's quantization type
  and name.
- Dequantize with `gguf.quants.dequantize` (numpy), a chunk of rows at a time, streamed straight
  into a safetensors file that this module writes itself; peak memory is about one tensor, not
  the whole model. The default output dtype is float32, so the weights are exactly the GGUF's
  dequantized values (bfloat16 would round them; pass `dtype=` to trade that for half the size).
- llama.cpp stores the Q and K projections of the llama architecture with the rows of each head
  interleaved for its rotary kernel; that permutation is undone here. qwen2 is stored as is.
- tokenizer.json is built with `tokenizers` from the GGUF vocabulary, merges and token types,
  with the pre-tokenizer of the model's family (`tokenizer.ggml.pre`), to encode exactly as
  transformers' own GGUF tokenizer conversion does. Control tokens become special added tokens,
  user-defined ones plain added tokens.
- Output is atomic: everything goes to a temporary sibling directory that is renamed into place
  at the end, and removed on any error.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from graphspec.models.tokenizer import byte_alphabet

__all__ = [
    "GGUFInfo",
    "GGUFTensorInfo",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "convert_gguf",
    "read_gguf_metadata",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Every type here has a numpy dequantizer in gguf.quants (a test checks that).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

# llama.cpp token types (llama_token_type): only these two change how text is split.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

_DTYPE_NAMES = {torch.float32: ("F32", "float32"), torch.bfloat16: ("BF16", "bfloat16"), torch.float16: ("F16", "float16")}

# Rows dequantized per step: bounds the temporary float32 copy (about 64 MB) for huge embeddings.
_CHUNK_ELEMENTS = 16 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# Reading and validating
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: `shape` in PyTorch order (rows first), `type` a ggml type name."""

    name: str
    type: str
    shape: tuple[int, ...]
    n_bytes: int


@dataclass
class GGUFInfo:
    """What `read_gguf_metadata` found: the metadata key/values and the tensor table."""

    path: Path
    version: int
    architecture: str
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    file_size: int
    _reader: Any = field(default=None, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_field(self, suffix: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.architecture}.{suffix}", default)


def read_gguf_metadata(path: str | os.PathLike) -> GGUFInfo:
    """Read and validate a GGUF file's header; raises ValueError on anything we cannot convert.

    Checks: the file exists, starts with b"GGUF", has a version we read (2 or 3), is not
    truncated (every tensor's data lies inside the file), states a supported architecture, and
    stores every tensor in a supported type.
    """
    from graphspec.models.gguf_file import read_gguf

    gf = read_gguf(path)  # ValueError for anything that is not a whole, consistent GGUF file
    tensors = {t.name: GGUFTensorInfo(t.name, t.tensor_type.name, tuple(reversed(t.shape)), t.n_bytes)
               for t in gf.tensors}
    fields = gf.fields
    path, version, file_size = gf.path, gf.version, gf.file_size

    architecture = fields.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path} has general.architecture={architecture!r}, which graphspec cannot convert; "
            f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
        )
    for info in tensors.values():
        if info.type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"{path}: tensor {info.name!r} is stored as {info.type}, which graphspec cannot dequantize; "
                f"supported types: {list(SUPPORTED_TENSOR_TYPES)}"
            )
    return GGUFInfo(path, version, architecture, fields, tensors, file_size, gf)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _required(info: GGUFInfo, suffix: str) -> Any:
    value = info.arch_field(suffix)
    if value is None:
        raise ValueError(f"{info.path} lacks the metadata key {info.architecture}.{suffix}; it cannot be converted")
    return value


def _meta_int(info: GGUFInfo, suffix: str, default: Any = ...) -> int:
    """A positive integer metadata value of the architecture (required unless a default is given)."""
    v = _required(info, suffix) if default is ... else info.arch_field(suffix, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{info.path} has {info.architecture}.{suffix}={_brief(v)}; expected a positive integer")
    return v


def _meta_float(info: GGUFInfo, suffix: str, default: Any = ...) -> float:
    """A finite positive float metadata value of the architecture."""
    v = _required(info, suffix) if default is ... else info.arch_field(suffix, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{info.path} has {info.architecture}.{suffix}={_brief(v)}; expected a finite positive "
                         "number")
    return _f32(v)


def _token_id(info: GGUFInfo, key: str) -> int | None:
    v = info.get(f"tokenizer.ggml.{key}")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ValueError(f"{info.path} has tokenizer.ggml.{key}={_brief(v)}; expected a token id")
    return v


def _brief(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:50] + "..."


def _f32(x: float) -> float:
    # GGUF stores these as float32; the shortest decimal that rounds back (1e-05, not 9.99999974e-06).
    return float(str(np.float32(x)))


def _hf_config(info: GGUFInfo, dtype: torch.dtype) -> dict:
    arch = info.architecture
    hidden = _meta_int(info, "embedding_length")
    heads = _meta_int(info, "attention.head_count")
    kv_heads = _meta_int(info, "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ValueError(
            f"{info.path} has {arch}.attention.head_count_kv={kv_heads} but head_count={heads} is not a multiple"
        )
    head_dim = _meta_int(info, "attention.key_length", max(1, hidden // heads))
    rope_dims = info.arch_field("rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(
            f"{info.path} rotates only {rope_dims} of {head_dim} head dimensions (partial rotary); "
            "graphspec supports full rotary embeddings only"
        )
    if "token_embd.weight" not in info.tensors:
        raise ValueError(f"{info.path} has no token_embd.weight tensor; it cannot be converted")
    vocab_size = info.tensors["token_embd.weight"].shape[0]

    rope_scaling = None
    scaling_type = info.arch_field("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _meta_float(info, "rope.scaling.factor")}
    elif not (scaling_type is None or scaling_type == "none"):
        raise ValueError(
            f"{info.path} uses {arch}.rope.scaling.type={scaling_type!r}; graphspec converts only none and linear"
        )
    if "rope_freqs.weight" in info.tensors:
        raise ValueError(
            f"{info.path} carries rope_freqs.weight (llama3-style rope scaling baked into a tensor), which "
            "graphspec cannot express in config.json; convert the original HF checkpoint instead"
        )

    bos = _token_id(info, "bos_token_id")
    eos = _token_id(info, "eos_token_id")
    config = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": _meta_int(info, "feed_forward_length"),
        "num_hidden_layers": _meta_int(info, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _meta_int(info, "context_length", 2048),
        "rms_norm_eps": _meta_float(info, "attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta_float(info, "rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in info.tensors,
        "attention_bias": "blk.0.attn_q.bias" in info.tensors,
        "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": _DTYPE_NAMES[dtype][1],
        "use_cache": True,
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    # The same bounds as any config.json (sizes, finiteness), before a tensor plan is built from them.
    from graphspec.models.config import ModelConfig

    ModelConfig.from_dict(config, source=f"{info.path} (its metadata as a config)")
    return config


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorPlan:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    unpermute_heads: int  # 0: store as is; n: undo llama.cpp's rotary row interleave over n heads


def _tensor_plan(info: GGUFInfo, config: dict) -> list[_TensorPlan]:
    """Map every GGUF tensor to its HF name; unknown or missing tensors are errors."""
    n_layers = config["num_hidden_layers"]
    plans = []
    for name, t in info.tensors.items():
        if name in _TOP_LEVEL_NAMES:
            hf_name = _TOP_LEVEL_NAMES[name]
            role = None
        else:
            m = _LAYER_TENSOR.match(name)
            if m is None or m.group(2) not in _LAYER_NAMES:
                raise ValueError(
                    f"{info.path}: tensor {name!r} has no counterpart in a {config['architectures'][0]} checkpoint; "
                    "graphspec cannot convert this file"
                )
            layer, role, kind = int(m.group(1)), m.group(2), m.group(3)
            if layer >= n_layers:
                raise ValueError(f"{info.path}: tensor {name!r} is for layer {layer} but block_count={n_layers}")
            hf_name = f"model.layers.{layer}.{_LAYER_NAMES[role]}.{kind}"
        heads = 0
        if info.architecture == "llama" and role in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if role == "attn_q" else config["num_key_value_heads"]
            if t.shape[0] % (2 * heads):
                raise ValueError(f"{info.path}: tensor {name!r} has {t.shape[0]} rows, not a multiple of 2*{heads} heads")
        plans.append(_TensorPlan(name, hf_name, t.shape, heads))

    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    for layer in range(n_layers):
        for hf in _LAYER_NAMES.values():
            expected.add(f"model.layers.{layer}.{hf}.weight")
        if config["attention_bias"]:
            expected.update(f"model.layers.{layer}.self_attn.{p}_proj.bias" for p in "qkv")
    missing = sorted(expected - {p.hf_name for p in plans})
    if missing:
        raise ValueError(f"{info.path} lacks tensors a {config['architectures'][0]} needs, e.g. {missing[:3]}")
    return plans


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores, per head, rows [0, half, 1, half+1, ...] (pairs of the rotate-half layout
    # made adjacent for its interleaved RoPE); reading them back as (head, half, pair) and swapping
    # the last two axes restores HF's (head, pair, half) row order.
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized_chunks(reader_tensor, plan: _TensorPlan) -> Iterator[np.ndarray]:
    """float32 row chunks of one tensor, in row order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(reader_tensor.tensor_type)
    data = reader_tensor.data
    rows = plan.shape[0] if plan.shape else 1
    cols = math.prod(plan.shape[1:]) if len(plan.shape) > 1 else (plan.shape[0] if plan.shape else 1)
    if plan.unpermute_heads or len(plan.shape) < 2:
        full = np.asarray(dequantize(np.asarray(data), qtype), dtype=np.float32).reshape(plan.shape)
        if plan.unpermute_heads:
            full = _unpermute_rows(full, plan.unpermute_heads)
        yield full
        return
    data = data.reshape(rows, -1)
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        chunk = dequantize(np.asarray(data[start : start + step]), qtype)
        yield np.asarray(chunk, dtype=np.float32).reshape(-1, *plan.shape[1:])


def _write_safetensors(
    path: Path,
    plans: list[_TensorPlan],
    chunks_of: Callable[[_TensorPlan], Iterator[np.ndarray]],
    dtype: torch.dtype,
    metadata: dict[str, str],
    on_rows: Callable[[int], None],
) -> None:
    """Stream tensors into one safetensors file: header first (all sizes are known), then data."""
    st_dtype = _DTYPE_NAMES[dtype][0]
    itemsize = torch.empty((), dtype=dtype).element_size()
    plans = sorted(plans, key=lambda p: p.hf_name)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for p in plans:
        nbytes = math.prod(p.shape) * itemsize
        header[p.hf_name] = {"dtype": st_dtype, "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for p in plans:
            written = 0
            for chunk in chunks_of(p):
                if dtype == torch.float32:
                    buf = np.ascontiguousarray(chunk, dtype=np.float32)
                else:
                    buf = torch.from_numpy(np.require(chunk, np.float32, ["C", "W"])).to(dtype).view(torch.int16).numpy()
                f.write(memoryview(buf).cast("B"))
                written += buf.nbytes
                on_rows(chunk.size)
            expected = header[p.hf_name]["data_offsets"]
            if written != expected[1] - expected[0]:
                raise ValueError(f"tensor {p.gguf_name!r} dequantized to {written} bytes, expected {expected[1] - expected[0]}")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`. Each is the family's published
# pre-tokenization rule. `None` means GPT-2's own byte-level split, which is what transformers
# uses for families it has no special pattern for (SmolLM's "smollm" among them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "gpt2": None,
    "smollm": None,
    "starcoder": None,
    "refact": None,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
}


# The tokenizer metadata's value types: anything else is refused by name before a tokenizer is built from it.
_TOKENIZER_LISTS = {"tokens": str, "merges": str, "token_type": int, "scores": float}
_TOKENIZER_FLAGS = ("add_bos_token", "add_eos_token", "add_space_prefix")
_TOKENIZER_IDS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id",
                  "unknown_token_id", "seperator_token_id", "cls_token_id", "mask_token_id")


def _check_tokenizer_metadata(info: GGUFInfo) -> None:
    def bad(key, v, want):
        raise ValueError(f"{info.path} has {key}={_brief(v)}; expected {want}")

    for name, kind in _TOKENIZER_LISTS.items():
        key = f"tokenizer.ggml.{name}"
        v = info.get(key)
        if v is None:
            continue
        if not isinstance(v, list):
            bad(key, v, f"an array of {kind.__name__}")
        if kind is float:
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
        elif kind is int:
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        else:
            ok = all(isinstance(x, str) for x in v)
        if not ok:
            bad(key, v, f"an array of {kind.__name__}")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if (v := info.get(key)) is not None and not isinstance(v, str):
            bad(key, v, "a string")
    for name in _TOKENIZER_FLAGS:
        if (v := info.get(f"tokenizer.ggml.{name}")) is not None and not isinstance(v, bool):
            bad(f"tokenizer.ggml.{name}", v, "true or false")
    for name in _TOKENIZER_IDS:
        _token_id(info, name)


def _build_tokenizer(info: GGUFInfo) -> tuple[Any, dict]:
    """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF tokenizer metadata."""
    _check_tokenizer_metadata(info)
    model = info.get("tokenizer.ggml.model")
    if model == "gpt2":
        return _build_byte_level_bpe(info)
    if model == "llama":
        return _build_sentencepiece_bpe(info)
    raise ValueError(
        f"{info.path} has tokenizer.ggml.model={model!r}; graphspec builds tokenizers for 'gpt2' "
        "(byte-level BPE) and 'llama' (SentencePiece BPE) only"
    )


def _tokens(info: GGUFInfo) -> tuple[list[str], list[int]]:
    tokens = info.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{info.path} has no tokenizer.ggml.tokens; it carries no tokenizer to convert")
    types = info.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{info.path} has {len(tokens)} tokens but {len(types)} token types")
    vocab_rows = info.tensors["token_embd.weight"].shape[0]
    if len(tokens) > vocab_rows:
        raise ValueError(f"{info.path} has {len(tokens)} tokens but only {vocab_rows} embedding rows")
    return list(tokens), [int(t) for t in types]


def _merges(info: GGUFInfo) -> list[tuple[str, str]]:
    merges = []
    for m in info.get("tokenizer.ggml.merges") or []:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{info.path}: merge {m!r} is not two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    return merges


def _special_token(info: GGUFInfo, tokens: list[str], key: str) -> str | None:
    idx = info.get(f"tokenizer.ggml.{key}")
    if idx is None:
        return None
    if not 0 <= int(idx) < len(tokens):
        raise ValueError(f"{info.path} has tokenizer.ggml.{key}={idx}, outside the {len(tokens)} tokens")
    return tokens[int(idx)]


def _added_tokens(tokens, types, vocab, spelled_ok: Callable[[str], bool]):
    from tokenizers import AddedToken

    # A control token whose spelling is outside the vocabulary's alphabet is a mislabel in the
    # file; it is skipped, as transformers does, so that the vocabulary keeps the model's size.
    special = [
        AddedToken(tok, normalized=False, special=True)
        for tok, ty in zip(tokens, types)
        if ty == _TOKEN_TYPE_CONTROL and spelled_ok(tok)
    ]
    plain = [
        AddedToken(tok, normalized=False, special=False)
        for tok, ty in zip(tokens, types)
        if ty == _TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    return special, plain


def _post_processor(bos: str | None, eos: str | None, add_bos: bool, add_eos: bool, vocab: dict[str, int]):
    from tokenizers import processors

    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = []
    if add_bos:
        special.append((bos, vocab[bos]))
    if add_eos:
        special.append((eos, vocab[eos]))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _tokenizer_config(info: GGUFInfo, tokens: list[str], tokenizer, add_bos: bool, add_eos: bool) -> dict:
    added = {}
    for idx, tok in sorted(tokenizer.get_added_tokens_decoder().items()):
        added[str(idx)] = {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": _special_token(info, tokens, "bos_token_id"),
        "eos_token": _special_token(info, tokens, "eos_token_id"),
        "unk_token": _special_token(info, tokens, "unknown_token_id"),
        "pad_token": _special_token(info, tokens, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(info.arch_field("context_length", 2048)),
        "added_tokens_decoder": added,
    }
    template = info.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _build_byte_level_bpe(info: GGUFInfo):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = info.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"{info.path} has tokenizer.ggml.pre={pre!r}, a pre-tokenizer graphspec does not know; "
            f"known: {sorted(_PRE_TOKENIZER_SPLITS)}"
        )
    tokens, types = _tokens(info)
    alphabet = byte_alphabet()
    alphabet_chars = set(alphabet.values())

    def spelled(tok: str) -> bool:
        return set(tok) <= alphabet_chars

    # Tokens are normally already spelled in the byte alphabet; one that is not (raw text with
    # a space, say) is respelled from its UTF-8 bytes so that BPE can reach it. A later duplicate
    # spelling wins, as in transformers' conversion.
    vocab = {}
    for idx, tok in enumerate(tokens):
        vocab[tok if spelled(tok) else "".join(alphabet[b] for b in tok.encode("utf-8"))] = idx
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges(info),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    split = _PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    special, plain = _added_tokens(tokens, types, vocab, spelled)
    _add_named_specials(info, tokens, special)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)

    add_bos = bool(info.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(info.get("tokenizer.ggml.add_eos_token", False))
    bos = _special_token(info, tokens, "bos_token_id")
    eos = _special_token(info, tokens, "eos_token_id")
    tok.post_processor = _post_processor(bos, eos, add_bos, add_eos, tok.get_vocab())
    return tok, _tokenizer_config(info, tokens, tok, add_bos, add_eos)


def _add_named_specials(info: GGUFInfo, tokens: list[str], special: list) -> None:
    """bos/eos/unk/pad are special even where the file does not mark them as control tokens."""
    from tokenizers import AddedToken

    have = {t.content for t in special}
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        name = _special_token(info, tokens, key)
        if name is not None and name not in have:
            special.append(AddedToken(name, normalized=False, special=True))
            have.add(name)


def _build_sentencepiece_bpe(info: GGUFInfo):
    """SentencePiece BPE (`tokenizer.ggml.model == "llama"`): metaspace, byte fallback.

    Merges come from the file when it has them, else they are recovered from the token scores:
    every split of a token into two vocabulary pieces is a merge, ranked by the merged token's score.
    One deliberate difference from transformers: `tokenizer.ggml.add_space_prefix = false` is
    honoured (no "▁" before the first word), as llama.cpp does; transformers always prepends.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, types = _tokens(info)
    vocab = {tok: idx for idx, tok in enumerate(tokens)}
    merges = _merges(info)
    if not merges:
        scores = info.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ValueError(f"{info.path} has neither tokenizer.ggml.merges nor one score per token")
        merges = _merges_from_scores(tokens, [float(s) for s in scores], vocab)
    unk = _special_token(info, tokens, "unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    tok = Tokenizer(bpe)
    tok.normalizer = None
    add_prefix = bool(info.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    special, plain = _added_tokens(tokens, types, vocab, lambda t: True)
    _add_named_specials(info, tokens, special)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(info.get("tokenizer.ggml.add_bos_token", True))
    add_eos = bool(info.get("tokenizer.ggml.add_eos_token", False))
    bos = _special_token(info, tokens, "bos_token_id")
    eos = _special_token(info, tokens, "eos_token_id")
    tok.post_processor = _post_processor(bos, eos, add_bos, add_eos, tok.get_vocab())
    return tok, _tokenizer_config(info, tokens, tok, add_bos, add_eos)


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    ranked = []
    for tok, score in zip(tokens, scores):
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((left, right, score) for left, right in pairs)
    # Higher score merges first; ties by the shorter left piece, then the shorter right piece,
    # so that the order is total and the same on every run.
    ranked.sort(key=lambda r: (r[2], len(r[0]), len(r[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Path:
    """Convert a GGUF file into an HF-style checkpoint directory at `out_dir`; returns `out_dir`.

    Nothing is written unless the file validates; the directory appears only when complete.
    `dtype` (float32, bfloat16 or float16) is the safetensors dtype; float32 keeps the GGUF's
    dequantized values exactly.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"out_dir={str(out_dir)!r} already exists; remove it or choose another directory")
    if progress:  # the reader parses the whole vocabulary first: seconds with nothing else to show
        print(f"reading {Path(gguf_path).name} ...", file=sys.stderr, flush=True)
    info = read_gguf_metadata(gguf_path)
    config = _hf_config(info, dtype)
    plans = _tensor_plan(info, config)
    tokenizer, tokenizer_config = _build_tokenizer(info)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ValueError(
            f"{info.path}: the tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the "
            f"embedding only {config['vocab_size']} rows"
        )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling (same filesystem, so the final rename is atomic); mkdir honours the umask.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": config["bos_token_id"], "eos_token_id": _end_of_generation_ids(info), "do_sample": False,
        })  # fmt: skip
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        reader_tensors = {t.name: t for t in info._reader.tensors}
        total = sum(math.prod(p.shape) for p in plans)
        bar = _progress_bar(total, f"converting {info.path.name}", progress)
        try:
            _write_safetensors(
                tmp / "model.safetensors",
                plans,
                lambda p: _dequantized_chunks(reader_tensors[p.gguf_name], p),
                dtype,
                {"format": "pt", "source": "gguf", "gguf_file": info.path.name},
                bar.update,
            )
        finally:
            bar.close()
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# Control tokens that end a generation whatever the file's eos_token_id says, as llama.cpp treats
# them (a chat model stops at its turn end as well as at the document end).
_END_OF_GENERATION_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")


def _end_of_generation_ids(info: GGUFInfo) -> list[int] | int | None:
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if (i := info.get(f"tokenizer.ggml.{key}")) is not None and int(i) not in ids:
            ids.append(int(i))
    tokens = info.get("tokenizer.ggml.tokens") or []
    types = info.get("tokenizer.ggml.token_type") or []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == _TOKEN_TYPE_CONTROL and tok in _END_OF_GENERATION_TOKENS and i not in ids:
            ids.append(i)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="weights", unit_scale=True, disable=not enabled, leave=False)
