"""``load_model``: a Hugging Face checkpoint directory (or a zoo name) -> ``Transformer``.

- Reads ``config.json`` (``ModelConfig``), every ``*.safetensors`` (one file, or the shards
  that ``model.safetensors.index.json`` names) and, when present, the tokenizer files.
- Never unpickles: weights come only from safetensors, opened memory-mapped with
  ``safetensors.safe_open``. Each file's header is checked here first (length prefix within
  the file, JSON object, float dtypes, data offsets inside the file and matching the shape),
  so a truncated or corrupt download fails with the file's (and tensor's) name instead of a
  crash deep inside a parser.
- Tensor names are HF's (``model.layers.N.self_attn.q_proj.weight``...). Every expected
  tensor must be there with its shape; missing, unexpected and mis-shaped tensors are all
  reported in one error, each by name.
- dtype: the argument, else the config's ``torch_dtype``/``dtype``, else fp32; tensors are
  converted while loading.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path

import torch

from graphspec.kernels._dispatch import FLOAT_DTYPES
from graphspec.models.config import ModelConfig
from graphspec.models.tokenizer import Tokenizer
from graphspec.models.transformer import Layer, Transformer, check_quantize

INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_ALL_ST_DTYPES = {**_ST_DTYPES, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
WEIGHTS = (None, "gguf", "gguf-a8")
"""``load_model``'s weights: safetensors, a GGUF's blocks (exact), its blocks with int8 activations."""
GGUF_WEIGHTS = ("gguf", "gguf-a8")

# At most this many names are listed per kind of problem (a hostile config can make thousands go missing).
_MAX_LISTED = 12
# Buffers some older checkpoints saved; we recompute them from the config, so they are not "unexpected".
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_model(path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               backend: str | None = None, quantize: str | None = None, weights: str | None = None) -> Transformer:
    """Load a Llama/Qwen2/Mistral checkpoint directory (or zoo name) onto ``device``.

    dtype: torch.float32 / bfloat16 / float16 or their names; None uses the checkpoint's.
    backend: None (dispatch by device), "torch" or "triton": pinned for this model's forward.
    quantize: None, or "int8" for a draft model on the CPU (int8 GEMM weights, activations in
    ``dtype``; approximate: see ``Transformer``), or "int4" (the same, with the C++ forward's
    few-row layer products in 4 bits; needs the CPU backend's avx512 or avx2 level).
    weights: None (safetensors; a ``.gguf`` file means "gguf"), or "gguf": the GGUF file's tensors in their own
    block formats (a ``.gguf`` path, or a zoo name: its GGUF in the cache), fp32 activations, exactly the GGUF's
    model (``graphspec.models.gguf_weights``); or "gguf-a8": the same blocks with the k-quants' products taking
    activations rounded to int8 per 256 (llama.cpp's arithmetic: faster on a CPU, not exactly the GGUF's model;
    ``graphspec.kernels.qlinear``).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not one of None, 'gguf', 'gguf-a8'")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device; use 'cpu' or 'cuda'") from None
    if device.type not in ("cpu", "cuda"):  # meta tensors hold no weights; other device types have no kernels here
        raise ValueError(f"device={str(device)!r}: graphspec runs on cpu or cuda devices only")
    if weights in GGUF_WEIGHTS or str(path).endswith(".gguf"):
        return _load_gguf_weights(path, dtype, device, backend, quantize, weights or "gguf")
    directory = _resolve(path)
    config = ModelConfig.from_file(directory / "config.json")
    dtype = _pick_dtype(dtype, config)
    if backend not in (None, "auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r} is not one of None, 'auto', 'torch', 'triton'")
    check_quantize(quantize, backend, device)

    tensors = read_safetensors(directory, expected_shapes(config), dtype, device)
    tokenizer = Tokenizer.from_dir(directory) if (directory / "tokenizer.json").is_file() else None
    return build(config, tensors, tokenizer=tokenizer, backend=backend, quantize=quantize)


def _load_gguf_weights(path, dtype, device, backend, quantize, weights="gguf") -> Transformer:
    from graphspec.models.gguf_weights import gguf_file_for, load_gguf_model

    if dtype is not None and _pick_dtype(dtype, None) != torch.float32:
        raise ValueError(f"dtype={dtype!r}: a model in GGUF block weights computes in float32 (the blocks are "
                         "dequantized to fp32 in the GEMMs); pass dtype=None or float32")
    if quantize is not None:
        raise ValueError(f"quantize={quantize!r} rounds dense weights; GGUF block weights are quantized already: "
                         "pass quantize=None with weights='gguf'")
    activations = "int8" if weights == "gguf-a8" else "fp32"
    p = Path(path).expanduser()
    if p.is_file():
        return load_gguf_model(p, device=device, backend=backend, activations=activations)
    from graphspec.models import zoo

    if str(path) in zoo.ZOO:
        return load_gguf_model(gguf_file_for(str(path)), device=device, backend=backend, activations=activations)
    if p.is_dir():
        raise ValueError(f"weights='gguf' needs a .gguf file or a zoo name, but {p} is a directory; pass the "
                         "GGUF file it was converted from, or weights=None for its safetensors")
    raise FileNotFoundError(f"{p} does not exist, and {str(path)!r} is not a zoo model name either "
                            f"(zoo: {', '.join(sorted(zoo.ZOO))})")


def _resolve(path) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise ValueError(f"{p} is a file; pass the checkpoint directory that holds config.json and *.safetensors")
    try:
        from graphspec.models import zoo
    except ImportError:
        raise FileNotFoundError(f"checkpoint directory {p} does not exist") from None
    name = str(path)
    if name not in zoo.ZOO:
        raise FileNotFoundError(f"checkpoint directory {p} does not exist, and {name!r} is not a zoo model "
                                f"name either (zoo: {', '.join(sorted(zoo.ZOO))})")
    return Path(zoo.resolve(name))


def _pick_dtype(dtype, config: ModelConfig) -> torch.dtype:
    if dtype is None:
        return config.torch_dtype or torch.float32
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPE_NAMES:
            raise ValueError(f"dtype={dtype!r}; supported: float32, bfloat16, float16")
        return _DTYPE_NAMES[dtype.removeprefix("torch.")]
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r}; supported: torch.float32, torch.bfloat16, torch.float16")
    return dtype


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, by HF name, with its shape."""
    c = config
    h, v, i = c.hidden_size, c.vocab_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def build(config: ModelConfig, t: dict[str, torch.Tensor], tokenizer=None, backend=None,
          quantize=None) -> Transformer:
    """Assemble a Transformer from HF-named tensors (already checked, converted and on their device)."""
    layers = []
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([t.pop(a + "q_proj.bias"), t.pop(a + "k_proj.bias"), t.pop(a + "v_proj.bias")])
        layers.append(Layer(
            input_norm=t.pop(p + "input_layernorm.weight"),
            wqkv=torch.cat([t.pop(a + "q_proj.weight"), t.pop(a + "k_proj.weight"), t.pop(a + "v_proj.weight")]),
            bqkv=bqkv,
            wo=t.pop(a + "o_proj.weight"),
            bo=t.pop(a + "o_proj.bias") if config.attention_out_bias else None,
            post_norm=t.pop(p + "post_attention_layernorm.weight"),
            w13=torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")]),
            w2=t.pop(p + "mlp.down_proj.weight"),
        ))
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else t.pop("lm_head.weight")
    return Transformer(config, embed, layers, t.pop("model.norm.weight"), lm_head, tokenizer=tokenizer,
                       backend=backend, quantize=quantize)


# --- safetensors -----------------------------------------------------------------------------------------------

def check_regular_file(file: Path, what: str = "weights file") -> int:
    """Raise ValueError unless ``file`` (after symlinks) is a regular file; return its size.

    Opening a directory fails and opening a named pipe blocks forever, so weights are only ever
    opened after this check.
    """
    try:
        st = os.stat(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {file} does not exist; the download is incomplete") from None
    except OSError as e:
        raise ValueError(f"{what} {file} cannot be read ({e.strerror}); check its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a named pipe" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ValueError(f"{what} {file} is {kind}, not a regular file; replace it with the real file "
                         "(re-download the checkpoint)")
    return st.st_size


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: the index's shards, else model.safetensors, else every *.safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, RecursionError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (JSON with a 'weight_map'): "
                             f"{type(e).__name__}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise ValueError(f"{index} has a weight_map that is not a {{tensor name: shard file}} object")
        shards = sorted(set(weight_map.values()))
        for s in shards:
            if Path(s).name != s:
                raise ValueError(f"{index} names shard {s!r}, which is not a plain file name in the checkpoint directory")
        missing = [s for s in shards if not (directory / s).exists()]
        for s in shards:
            if s not in missing:
                check_regular_file(directory / s, "shard")
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist in {directory}: {', '.join(missing)}; "
                                    "the download is incomplete")
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    if single.exists():
        check_regular_file(single)
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    for file in files:
        check_regular_file(file)
    if not files:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
        hint = (f" (found {', '.join(pickles)}: pickled weights are never loaded; convert them to safetensors)"
                if pickles else "")
        raise FileNotFoundError(f"{directory} has no *.safetensors weights{hint}")
    return files


def read_header(file: Path) -> dict[str, dict]:
    """Check one safetensors file's framing and return its tensor entries {name: {dtype, shape, data_offsets}}."""
    size = check_regular_file(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file} is truncated or not a safetensors file: {size} bytes, shorter than the "
                             "8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{file} is truncated or corrupt: its header claims {n} bytes but the file has "
                             f"{size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep, an int too long
        raise ValueError(f"{file} has a corrupt safetensors header (not JSON: {type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} has a corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, e in header.items():
        where = f"{file}: tensor {name!r}"
        if (not isinstance(e, dict) or not isinstance(e.get("shape"), list) or not isinstance(e.get("data_offsets"), list)
                or len(e["data_offsets"]) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                           for x in e["shape"] + e["data_offsets"])):
            raise ValueError(f"{where} has a corrupt header entry {_cut(repr(e))}")
        if not isinstance(e.get("dtype"), str) or e["dtype"] not in _ALL_ST_DTYPES:
            raise ValueError(f"{where} has unknown dtype {_cut(repr(e.get('dtype')))}")
        start, end = e["data_offsets"]
        numel = 1
        for s in e["shape"]:
            numel *= s
        if end > data_size:
            raise ValueError(f"{where} is truncated: its bytes end at {end} but the file holds only {data_size} "
                             "bytes of data; re-download the file")
        if end - start != numel * _ALL_ST_DTYPES[e["dtype"]]:
            raise ValueError(f"{where} is corrupt: {end - start} bytes for shape {e['shape']} of {e['dtype']}")
    return header


def _cut(text: str) -> str:
    return text if len(text) <= 200 else text[:160] + f"... ({len(text)} characters)"


def _check_against_config(directory: Path, expected: dict[str, tuple[int, ...]], entries: dict[str, dict],
                          where: dict[str, Path]) -> None:
    """The config's sizes against the weights' own, in one line each, before any per-tensor check: a config
    claiming a million layers or another width is named for what it is, not as thousands of missing tensors."""
    embed = entries.get("model.embed_tokens.weight")
    want_v, want_h = expected["model.embed_tokens.weight"]
    if embed is not None and len(embed["shape"]) == 2:
        rows, cols = embed["shape"]
        file = where["model.embed_tokens.weight"].name
        if rows != want_v:
            raise ValueError(f"config.json has vocab_size={want_v} but model.embed_tokens.weight in {file} has "
                             f"{rows} rows; the config and the weights disagree")
        if cols != want_h:
            raise ValueError(f"config.json has hidden_size={want_h} but model.embed_tokens.weight in {file} has "
                             f"{cols} columns; the config and the weights disagree")
    want_layers = sum(1 for n in expected if n.endswith(".input_layernorm.weight"))
    found = {int(m.group(1)) for n in entries if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    have_layers = max(found) + 1 if found else 0
    if found and have_layers != want_layers:
        raise ValueError(f"checkpoint {directory}: config.json has num_hidden_layers={want_layers} but the weights "
                         f"hold layers 0..{have_layers - 1} ({have_layers} layers); the config and the weights "
                         "disagree")


def read_safetensors(directory: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Load exactly the ``expected`` tensors from the checkpoint's safetensors files, converted to dtype/device."""
    from safetensors import safe_open

    files = safetensors_files(directory)
    index_map = _index_map(directory)
    where: dict[str, Path] = {}
    entries: dict[str, dict] = {}
    problems: list[str] = []
    for file in files:
        for name, e in read_header(file).items():
            if name in where:
                problems.append(f"{name} appears in both {where[name].name} and {file.name}")
                continue
            where[name], entries[name] = file, e
    if index_map is not None:
        for name, shard in index_map.items():
            if name not in where:
                problems.append(f"{name} is listed in {INDEX_FILE} under {shard} but that shard does not hold it")
            elif where[name].name != shard:
                problems.append(f"{name} is listed in {INDEX_FILE} under {shard} but lies in {where[name].name}")

    _check_against_config(directory, expected, entries, where)
    missing = [n for n in expected if n not in entries]
    # Some writers store the tied head anyway; it is accepted only if it really equals the embedding (checked below).
    tied_copy = ("lm_head.weight" in entries and "lm_head.weight" not in expected
                 and tuple(entries["lm_head.weight"]["shape"]) == expected["model.embed_tokens.weight"])
    unexpected = [n for n in entries if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
                  and not (tied_copy and n == "lm_head.weight")]
    misshaped = [f"{n} has shape {tuple(entries[n]['shape'])}, expected {expected[n]} ({where[n].name})"
                 for n in expected if n in entries and tuple(entries[n]["shape"]) != expected[n]]
    not_float = [f"{n} has dtype {entries[n]['dtype']} ({where[n].name}); only float weights are supported "
                 "(quantized checkpoints are not)" for n in expected if n in entries
                 and entries[n]["dtype"] not in _ST_DTYPES]
    if missing:
        hint = ("; the config has tie_word_embeddings=false, so an lm_head is required"
                if "lm_head.weight" in missing else "")
        problems.append(f"missing tensors: {_listed(missing)}{hint}")
    if unexpected:
        hint = ("; the config has tie_word_embeddings=true, so lm_head.weight should not be stored"
                if "lm_head.weight" in unexpected else "")
        problems.append(f"unexpected tensors: {_listed(unexpected)}{hint}")
    for kind in (misshaped, not_float):
        problems.extend(kind[:_MAX_LISTED])
        if len(kind) > _MAX_LISTED:
            problems.append(f"... and {len(kind) - _MAX_LISTED} more like it")
    if problems:
        raise ValueError(f"checkpoint {directory} does not match its config.json "
                         f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems))

    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    if tied_copy:
        with safe_open(str(where["lm_head.weight"]), framework="pt", device="cpu") as f:
            head = f.get_tensor("lm_head.weight")
        with safe_open(str(where["model.embed_tokens.weight"]), framework="pt", device="cpu") as f:
            same = torch.equal(head, f.get_tensor("model.embed_tokens.weight"))
        if not same:
            raise ValueError(f"checkpoint {directory}: config.json has tie_word_embeddings=true but the stored "
                             f"lm_head.weight ({where['lm_head.weight'].name}) differs from model.embed_tokens.weight; "
                             "set tie_word_embeddings=false in config.json to use the stored head")
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except Exception as e:  # safetensors raises its own error types; keep the file in the message
            if isinstance(e, ValueError) and str(file) in str(e):
                raise
            raise ValueError(f"{file} could not be read by safetensors: {e}") from e
    return out


def _index_map(directory: Path) -> dict[str, str] | None:
    index = directory / INDEX_FILE
    if not index.is_file():
        return None
    return json.loads(index.read_text(encoding="utf-8"))["weight_map"]  # already validated by safetensors_files
