"""Reading a Hugging Face ``config.json`` into one validated ``ModelConfig``.

- Field names are HF's, verbatim (``num_key_value_heads``, ``rope_scaling``,
  ``tie_word_embeddings``, ``attention_bias``...), so a reader can map them one to one.
- Three architectures: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases, no o_proj
  bias), MistralForCausalLM. Everything else is refused.
- RoPE settings come from ``rope_scaling`` + ``rope_theta`` (transformers 4) or from
  ``rope_parameters`` with ``rope_theta`` inside (transformers 5); ``type`` and
  ``rope_type`` are both accepted. ``rope_scaling`` is stored normalised: None for plain
  RoPE, else a dict whose ``rope_type`` is "llama3" or "linear".
- Anything that would change the maths and that we do not implement (a sliding window
  in use, mixture-of-experts fields, an activation other than SiLU, MLP biases, other
  RoPE types) raises ValueError naming the field: it is never silently ignored.
- Sizes are bounded (``LIMITS``, far above any released Llama-family model) and numbers must be
  finite, so a hostile or mistyped config.json is refused here, before the loader builds a tensor
  list from it or a run sizes a KV cache from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# HF's per-class defaults for fields a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768, "MistralForCausalLM": 131072}
ROPE_TYPES = ("default", "llama3", "linear")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Fields whose mere non-empty presence means a mixture-of-experts model.
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
               "shared_expert_intermediate_size", "n_shared_experts")
# Upper bounds on sizes, each far above any released Llama-family checkpoint (the largest have 126 layers,
# hidden 16384, vocabularies of 256k and contexts of 10M): a value beyond one is a corrupt or hostile config.
LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 19, "num_hidden_layers": 1024,
          "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024,
          "max_position_embeddings": 1 << 24}
_MAX_ROPE_THETA = 1e12
_MAX_CONFIG_BYTES = 16 << 20
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of one Llama-family checkpoint (HF field names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool  # biases on q/k/v (always for Qwen2)
    attention_out_bias: bool  # bias on o_proj (Llama/Mistral attention_bias=True; never Qwen2)
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: torch.dtype | None  # the dtype the weights were saved in, if the config says

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; a checkpoint directory needs a Hugging Face config.json")
        if not path.is_file():  # a directory, named pipe or device: reading it would fail or block
            raise ValueError(f"{path} is not a regular file; a checkpoint directory needs a Hugging Face config.json")
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"{path} has {path.stat().st_size} bytes, more than a config.json ever needs "
                             f"({_MAX_CONFIG_BYTES}); it is not a Hugging Face config")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep, an int too long
            raise ValueError(f"{path} is not valid JSON ({type(e).__name__}: {_short(str(e))}); re-download or "
                             "re-export the checkpoint") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        r = _Reader(d, source)
        arch = _architecture(d, source)

        _refuse_unsupported(d, source, arch)
        vocab_size = r.positive_int("vocab_size")
        hidden_size = r.positive_int("hidden_size")
        intermediate_size = r.positive_int("intermediate_size")
        layers = r.positive_int("num_hidden_layers")
        heads = r.positive_int("num_attention_heads")
        kv_heads = r.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ValueError(f"{source} has num_key_value_heads={kv_heads} but num_attention_heads={heads} "
                             "is not a multiple of it; fix the config")
        head_dim = r.positive_int("head_dim", default=None)
        if head_dim is None:
            if hidden_size % heads:
                raise ValueError(f"{source} has hidden_size={hidden_size} not divisible by num_attention_heads={heads} "
                                 "and no head_dim; add head_dim to the config")
            head_dim = hidden_size // heads
        if head_dim % 2:
            raise ValueError(f"{source} has head_dim={head_dim}; rotary embeddings need an even head_dim")
        eps = r.positive_float("rms_norm_eps", default=1e-6)
        rope_theta, rope_scaling = _rope(d, source, head_dim)
        max_pos = r.positive_int("max_position_embeddings", default=_DEFAULT_MAX_POSITIONS[arch])

        # As in transformers' modeling code: Qwen2 always has q/k/v biases (never on o_proj), Mistral never has
        # any; only Llama reads attention_bias (then q, k, v and o all carry one).
        if arch == "Qwen2ForCausalLM":
            attention_bias, out_bias = True, False
        elif arch == "MistralForCausalLM":
            attention_bias = out_bias = False
        else:
            attention_bias = out_bias = r.bool("attention_bias", default=False)

        tie = r.bool("tie_word_embeddings", default=False)
        bos = d.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or bos < 0):
            raise ValueError(f"{source} has bos_token_id={_short(bos)}; expected a non-negative int or null")
        eos_ids = _eos_ids(d.get("eos_token_id"), source, "eos_token_id")
        return cls(
            architecture=arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=eps, rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=tie,
            max_position_embeddings=max_pos, attention_bias=attention_bias, attention_out_bias=out_bias,
            bos_token_id=bos, eos_token_ids=eos_ids, torch_dtype=_dtype(d, source),
        )


class _Reader:
    """Typed access to config fields; every error names the file and the field."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def _get(self, name, default):
        v = self.d.get(name)
        if v is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.source} has no {name}; every Llama-family config.json needs it")
            return default
        return v

    def positive_int(self, name, default=...):
        v = self._get(name, _REQUIRED if default is ... else default)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{self.source} has {name}={_short(v)}; expected a positive integer")
        if name in LIMITS and v > LIMITS[name]:
            raise ValueError(f"{self.source} has {name}={_short(v)}, above graphspec's limit of {LIMITS[name]}; "
                             "the config is corrupt: fix it or re-download the checkpoint")
        return v

    def positive_float(self, name, default=...):
        v = self._get(name, _REQUIRED if default is ... else default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v) or not v > 0:
            raise ValueError(f"{self.source} has {name}={_short(v)}; expected a finite positive number")
        return float(v)

    def bool(self, name, default):
        v = self._get(name, default)
        if not isinstance(v, bool):
            raise ValueError(f"{self.source} has {name}={_short(v)}; expected true or false")
        return v


_REQUIRED = object()


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _short(v) -> str:
    """repr of a config value, cut short: a hostile file may hold megabytes in one field."""
    text = repr(v)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _architecture(d: dict, source: str) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            raise ValueError(f"{source} has architectures={_short(archs)}; expected exactly one of {', '.join(ARCHITECTURES)}")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{source} has architectures=[{_short(arch)}], which graphspec does not implement; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        return arch
    model_type = d.get("model_type")
    if isinstance(model_type, str) and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"{source} has no architectures field and model_type={_short(model_type)} is not one of "
                     f"{', '.join(_MODEL_TYPES)}; supported: {', '.join(ARCHITECTURES)}")


def _refuse_unsupported(d: dict, source: str, arch: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source} has hidden_act={_short(act)}; only 'silu' (SwiGLU MLP) is implemented")
    if arch == "LlamaForCausalLM" and d.get("mlp_bias"):  # the only one of the three whose MLP reads it
        raise ValueError(f"{source} has mlp_bias=true; MLP biases are not implemented")
    for name in _MOE_FIELDS:
        if d.get(name):
            raise ValueError(f"{source} has {name}={_short(d[name])}: mixture-of-experts models are not supported")
    # A sliding window only matters when it is in use and shorter than the context; refusing a config whose
    # window is in force keeps us from quietly attending to more than the model was trained to see.
    if arch == "Qwen2ForCausalLM" and d.get("use_sliding_window"):
        raise ValueError(f"{source} has use_sliding_window=true: sliding-window attention is not implemented")
    layer_types = d.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        other = sorted({repr(t) for t in layer_types if t != "full_attention"})
        raise ValueError(f"{source} has layer_types containing {other}: only full_attention layers are implemented")
    if arch == "MistralForCausalLM":
        window = d.get("sliding_window")
        max_pos = d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
        if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
            raise ValueError(f"{source} has sliding_window={_short(window)}; expected a positive integer or null")
        if window is not None and isinstance(max_pos, int) and window < max_pos:
            raise ValueError(f"{source} has sliding_window={window} < max_position_embeddings={max_pos}: "
                             "sliding-window attention is not implemented (set sliding_window to null "
                             "only if the model was trained without one)")


def _rope(d: dict, source: str, head_dim: int) -> tuple[float, dict | None]:
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    field = "rope_parameters" if params is not None else "rope_scaling"
    spec = params if params is not None else scaling
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"{source} has {field}={_short(spec)}; expected an object or null")
    spec = dict(spec or {})
    theta = spec.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    if (not isinstance(theta, (int, float)) or isinstance(theta, bool) or not _finite(theta) or not theta > 0
            or theta > _MAX_ROPE_THETA):
        raise ValueError(f"{source} has rope_theta={_short(theta)}; expected a finite positive number "
                         f"(at most {_MAX_ROPE_THETA:g})")
    rope_type = spec.pop("rope_type", None)
    legacy_type = spec.pop("type", None)
    if rope_type is None:
        rope_type = legacy_type
    rope_type = rope_type or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source} has {field} with rope_type={_short(rope_type)}; implemented: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    for key in _LLAMA3_FIELDS if rope_type == "llama3" else ("factor",):
        v = spec.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v) or not v > 0:
            raise ValueError(f"{source} has {field} of rope_type={_short(rope_type)} with {key}={_short(v)}; "
                             "expected a positive number")
    extra = set(spec) - set(_LLAMA3_FIELDS if rope_type == "llama3" else ("factor",)) - {"partial_rotary_factor"}
    if extra:
        raise ValueError(f"{source} has {field} of rope_type={_short(rope_type)} with fields {sorted(extra)} that "
                         "graphspec does not implement")
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source} has {field} with partial_rotary_factor={spec['partial_rotary_factor']}; "
                         "only full rotary embeddings are implemented")
    spec.pop("partial_rotary_factor", None)
    return float(theta), {"rope_type": rope_type, **spec}


def _eos_ids(v, source: str, name: str) -> list[int]:
    if v is None:
        return []
    ids = v if isinstance(v, list) else [v]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"{source} has {name}={_short(v)}; expected a non-negative int or a list of them")
    return list(dict.fromkeys(ids))


def _dtype(d: dict, source: str) -> torch.dtype | None:
    name = d.get("dtype", d.get("torch_dtype"))  # transformers 5 writes "dtype", 4 wrote "torch_dtype"
    if name is None or name == "auto":
        return None
    if not isinstance(name, str) or name.removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"{source} has dtype={_short(name)}; supported: float32, bfloat16, float16")
    return _DTYPES[name.removeprefix("torch.")]
