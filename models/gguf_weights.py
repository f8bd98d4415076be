"""A GGUF file as a model in its own block formats: no conversion, no dequantized copy.

``load_model("model.gguf")`` (or a zoo name with ``weights="gguf"``) comes here. Main choices:

- The header, config and tokenizer come from ``models/gguf.py`` (the same validation and the same
  config.json / tokenizer.json the converter writes), so a GGUF-weights model and the converted
  checkpoint of the same file have the same config and encode text identically.
- Every matmul weight (q/k/v/o, gate/up/down, the lm_head, and the token embedding) stays a
  ``graphspec.kernels.qlinear.BlockWeight`` holding the file's bytes in its own format; fused
  q/k/v and gate/up are one BlockWeight where the parts share a format and a ``StackedWeight``
  where the file mixes them (Q4_K_M files store some v / down projections in Q6_K). llama.cpp's
  rotary row interleave of the llama architecture's q / k is undone by reordering whole rows of
  blocks (a row of a weight is a run of whole blocks, so no value changes).
- Norm weights and biases (1-d, F32 in every file seen) are dequantized to fp32 as their type says.
- The model computed is the GGUF's: each weight the value ``gguf.quants.dequantize`` gives, fp32
  activations, fp32 accumulation (``Transformer`` with ``weights="gguf"``). ``weights="gguf-a8"`` keeps the
  same blocks and rounds the k-quants' activations to int8 (``activations="int8"``), as llama.cpp does.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from graphspec.kernels.qlinear import FORMATS, BlockWeight, stack

__all__ = ["load_gguf_model", "gguf_file_for"]


def gguf_file_for(name: str) -> Path:
    """The GGUF file of zoo model ``name``, kept in the cache's gguf/ folder (fetched there when missing)."""
    from graphspec.models import zoo

    path = zoo.cache_root() / "gguf" / f"{name}.gguf"
    if not path.is_file():
        path = zoo.fetch(name)
    return path


def _tokenizer(info):
    from graphspec.models import gguf as gg
    from graphspec.models.tokenizer import Tokenizer

    backend, config = gg._build_tokenizer(info)
    eos = gg._end_of_generation_ids(info)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    raw = backend.to_str().encode("utf-8") + b"\0" + json.dumps(config, sort_keys=True).encode("utf-8")
    return Tokenizer(backend, config, config.get("chat_template"), eos, hashlib.sha256(raw).hexdigest(),
                     source=str(info.path))


def _block_weight(t, plan, device, activations="fp32") -> BlockWeight:
    """One 2-d GGUF tensor as a BlockWeight, its q / k rows restored to HF order (whole rows moved)."""
    type_name = t.tensor_type.name
    rows, cols = plan.shape
    raw = np.asarray(t.data)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    if plan.unpermute_heads:
        heads = plan.unpermute_heads
        raw = raw.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
    return BlockWeight(type_name, torch.from_numpy(np.array(raw)).to(device), (rows, cols), activations)


def _dense(t, plan) -> torch.Tensor:
    from gguf.quants import dequantize

    values = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(plan.shape)
    return torch.from_numpy(np.array(values))


def load_gguf_model(path: str | os.PathLike, *, device="cpu", backend: str | None = None,
                    activations: str = "fp32"):
    """A ``Transformer`` whose weights are GGUF ``path``'s tensors in their own formats (see the module docstring).

    Only ``device="cpu"`` runs graphspec's C++ block GEMMs; on CUDA the Triton block GEMMs run where present.
    ``activations="int8"`` (``weights="gguf-a8"``): the k-quant weights' products round their activations to
    int8 per 256 values (``graphspec.kernels.qlinear``); CPU only, and not with the Triton backend.
    """
    if activations not in ("fp32", "int8"):
        raise ValueError(f"activations={activations!r} is not one of 'fp32', 'int8'")
    if activations == "int8" and (torch.device(device).type != "cpu" or backend == "triton"):
        raise ValueError(f"weights='gguf-a8' (int8 activations) runs on the CPU's C++ kernels only, not on "
                         f"device={str(device)!r} with backend={backend!r}; use weights='gguf' there")
    from graphspec.models import gguf as gg
    from graphspec.models.config import ModelConfig
    from graphspec.models.transformer import Layer, Transformer

    info = gg.read_gguf_metadata(path)
    config_dict = gg._hf_config(info, torch.float32)
    config = ModelConfig.from_dict(config_dict, source=str(info.path))
    plans = {p.hf_name: p for p in gg._tensor_plan(info, config_dict)}
    unsupported = sorted({info.tensors[p.gguf_name].type for p in plans.values()} - set(FORMATS))
    if unsupported:
        raise ValueError(f"{info.path} stores tensors as {unsupported}, which graphspec runs only dequantized; "
                         f"load its converted checkpoint instead (weights=None). Block formats run as they are: "
                         f"{list(FORMATS)}")
    reader = {t.name: t for t in info._reader.tensors}
    device = torch.device(device)

    def weight(name: str) -> BlockWeight:
        p = plans.pop(name)
        return _block_weight(reader[p.gguf_name], p, device, activations)

    def dense(name: str) -> torch.Tensor:
        p = plans.pop(name)
        return _dense(reader[p.gguf_name], p).to(device)

    layers = []
    for n in range(config.num_hidden_layers):
        pre = f"model.layers.{n}."
        a = pre + "self_attn."
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([dense(a + "q_proj.bias"), dense(a + "k_proj.bias"), dense(a + "v_proj.bias")])
        layers.append(Layer(
            input_norm=dense(pre + "input_layernorm.weight"),
            wqkv=stack([weight(a + "q_proj.weight"), weight(a + "k_proj.weight"), weight(a + "v_proj.weight")]),
            bqkv=bqkv,
            wo=weight(a + "o_proj.weight"),
            bo=None,
            post_norm=dense(pre + "post_attention_layernorm.weight"),
            w13=stack([weight(pre + "mlp.gate_proj.weight"), weight(pre + "mlp.up_proj.weight")]),
            w2=weight(pre + "mlp.down_proj.weight"),
        ))
    embed = weight("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else weight("lm_head.weight")
    norm = dense("model.norm.weight")
    if plans:  # _tensor_plan rejects unknown tensors, so this is a bug, not a bad file
        raise AssertionError(f"tensors left unused: {sorted(plans)}")
    if activations == "int8":  # into the tiles the int8-activation GEMM reads, once, here rather than mid-request
        for w in [embed, lm_head] + [w for layer in layers for w in (layer.wqkv, layer.wo, layer.w13, layer.w2)]:
            for part in getattr(w, "parts", [w]):
                part.pack()
    model = Transformer(config, embed, layers, norm, lm_head, tokenizer=_tokenizer(info), backend=backend,
                        weights="gguf-a8" if activations == "int8" else "gguf")
    model.gguf_path = info.path
    return model


def weight_bytes(model) -> int:
    """Bytes of the GEMM weights a decode step reads (every layer's and the lm_head's)."""
    total = sum(getattr(w, "nbytes", 0) for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w13, layer.w2))
    return total + getattr(model.lm_head, "nbytes", 0)

