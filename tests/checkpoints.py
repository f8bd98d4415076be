"""Tiny Hugging Face checkpoints for tests, written by transformers itself.

``make_checkpoint(dirpath, arch, ...)`` builds a randomly initialised Llama / Qwen2 /
Mistral model with transformers, saves it with ``save_pretrained`` (safetensors, optionally
sharded) and, if asked, a tokenizer trained here in milliseconds with the ``tokenizers``
library, saved through transformers (tokenizer.json, tokenizer_config.json,
chat_template.jinja). Such a directory is what a real checkpoint looks like on disk, so
``graphspec.load_model`` and transformers can both load it: transformers is the oracle.

Choices that keep tests meaningful and fast:

- Norm weights and all biases are randomised (HF initialises them to 1 and 0, which would
  let a forgotten bias or norm go unnoticed); weights use a wider init than HF's default
  so that greedy generation is not stuck on one token.
- Trained tokenizers are cached per process (``train_tokenizer`` is lru-cached on its
  arguments), so a test session trains each kind once.
- ``vocab_size`` follows the tokenizer when one is given (a larger value pads the
  embedding, like real checkpoints do); without a tokenizer it defaults to 320.

Reused by the framework and cross-vocabulary tests to build tiny pipelines.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHS = ("llama", "qwen2", "mistral")
TOKENIZER_KINDS = ("bytelevel", "metaspace")
CHAT_TEMPLATES = ("chatml", "llama3")

# Special tokens both chat styles need; every trained tokenizer carries all of them so
# that one cached tokenizer serves both templates.
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
SPM_SPECIALS = ("<unk>", "<s>", "</s>")

DEFAULT_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens, and the target verifies them.\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n\tprint(f\"{i}: {i * i}\")  # squares\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "Once upon a time, there was a little model that wanted to write code. It read the stars, then the trees.\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\nprint(x.shape, x.sum())\n",
    "Hello, world! How are you today? I am fine, thank you. Let's go to the park and play.\n",
    "if (a && b) { return a->next; } else { while (x != NULL) x = x->prev; }\n",
    "   indented    text with   runs of spaces\n\n\nand blank lines; 1234567890 + 42 = 1234567932.\n",
)

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    # plain tags below: their output depends on trim_blocks / lstrip_blocks, as Hub templates' often does
    "{% for message in messages %}\n"
    "    {% if message.role == 'system' and loop.first %}{% continue %}{% endif %}\n"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' }}\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- set date_string = strftime_now('%d %b %Y') %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message.tool_calls is defined %}{{- message.tool_calls | tojson }}{% endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


@functools.lru_cache(maxsize=None)
def _trained_json(kind: str, vocab_size: int, corpus: tuple[str, ...]) -> str:
    if kind == "bytelevel":
        return _train_bytelevel(vocab_size, corpus)
    if kind == "metaspace":
        return _train_metaspace(vocab_size, corpus)
    raise ValueError(f"tokenizer kind={kind!r} is not one of {TOKENIZER_KINDS}")


def train_tokenizer(kind: str, vocab_size: int = 400, corpus=None) -> tokenizers.Tokenizer:
    """A small BPE tokenizer trained on ``corpus`` (default: a built-in mix of prose and code).

    kind="bytelevel": GPT-2 / Llama-3 / Qwen style (ByteLevel pre-tokenizer and decoder; every
    byte is a base token, so ``vocab_size`` must exceed 256 + the special tokens).
    kind="metaspace": SentencePiece / Llama-2 style (Metaspace pre-tokenizer, ``<0xNN>``
    byte-fallback tokens, ByteFallback+Fuse+Strip decoders, "<s>" prepended on encode).
    Both carry the ChatML and Llama-3 control tokens as special tokens. Returns a fresh
    object each call (cached underneath), so callers may mutate it.
    """
    corpus = tuple(corpus) if corpus is not None else DEFAULT_CORPUS
    return tokenizers.Tokenizer.from_str(_trained_json(kind, vocab_size, corpus))


def _train_bytelevel(vocab_size: int, corpus: tuple[str, ...]) -> str:
    specials = list(CHATML_SPECIALS + LLAMA3_SPECIALS)
    if vocab_size < 256 + len(specials) + 16:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE (needs > {256 + len(specials) + 16})")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) * 4, trainer=trainer)
    return tok.to_str()


def _train_metaspace(vocab_size: int, corpus: tuple[str, ...]) -> str:
    specials = list(SPM_SPECIALS)
    extra = [t for t in CHATML_SPECIALS + LLAMA3_SPECIALS]
    n_fixed = len(specials) + 256
    if vocab_size < n_fixed + len(extra) + 64:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-fallback BPE (needs > {n_fixed + len(extra) + 64})")
    # Train the merges on a plain Metaspace BPE with a small alphabet (rarer characters then go
    # through byte fallback, as in Llama-2), then lay out the vocabulary SentencePiece style:
    # <unk> <s> </s>, the 256 <0xNN> byte tokens, then the learned pieces.
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_fixed - len(extra), show_progress=False,
                                  limit_alphabet=70)
    tok.train_from_iterator(list(corpus) * 4, trainer=trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = learned["merges"]
    model = models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges],
                       unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    out = tokenizers.Tokenizer(model)
    out.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    out.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    out.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials + extra])
    out.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    return out.to_str()


def _special_tokens(kind: str, chat_template: str | None) -> dict:
    if kind == "metaspace":
        return {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template == "llama3":
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def save_tokenizer(dirpath, kind: str, *, vocab_size: int = 400, chat_template: str | None = None, corpus=None):
    """Train (or reuse) a tokenizer and save it through transformers into ``dirpath``; returns it."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(kind, vocab_size, corpus)
    specials = _special_tokens(kind, chat_template)
    if kind == "bytelevel" and "bos_token" in specials:  # Llama-3 style: BOS prepended on encode
        bos = specials["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    template = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, None: None}
    if chat_template not in template:
        raise ValueError(f"chat_template={chat_template!r} is not one of {CHAT_TEMPLATES} or None")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template[chat_template], **specials)
    hf.save_pretrained(str(dirpath))
    return tok


def make_checkpoint(dirpath, arch: str = "llama", *, tokenizer: str | None = "bytelevel", vocab_size: int | None = None,
                    hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, tie: bool = False,
                    rope_scaling: dict | None = None, seed: int = 0, max_shard_size: int | str | None = None,
                    chat_template: str | None = None, max_position_embeddings: int = 512,
                    intermediate_size: int | None = None, tokenizer_vocab_size: int = 400,
                    extra_config: dict | None = None) -> Path:
    """Write a tiny random HF checkpoint into ``dirpath`` (created if needed) and return its Path.

    arch: "llama" | "qwen2" (q/k/v biases) | "mistral" (no sliding window).
    tokenizer: "bytelevel" | "metaspace" | None — a tokenizer trained here (``tokenizer_vocab_size``
        ids) saved next to the weights; its eos/bos ids go into config.json.
    vocab_size: model vocabulary; default = the tokenizer's size (320 without one). It may exceed
        the tokenizer's size (padded embedding, as in real checkpoints), never fall below it.
    hidden_size, layers, heads, kv_heads: model shape (head_dim = hidden_size // heads);
        intermediate_size defaults to 2 * hidden_size.
    tie: tie_word_embeddings (no lm_head.weight is saved).
    rope_scaling: e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}.
    seed: weights are a pure function of (seed, shapes).
    max_shard_size: passed to save_pretrained (e.g. "40KB") to get model.safetensors.index.json + shards.
    chat_template: "chatml" (Qwen style) | "llama3" | None.
    extra_config: more HF config fields, e.g. {"attention_bias": True} for a Llama with biases.
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)

    bos_id = eos_id = None
    if tokenizer is not None:
        tok = save_tokenizer(dirpath, tokenizer, vocab_size=tokenizer_vocab_size, chat_template=chat_template)
        specials = _special_tokens(tokenizer, chat_template)
        bos_id = tok.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
        eos_id = tok.token_to_id(specials["eos_token"])
        n_tok = tok.get_vocab_size(with_added_tokens=True)
        if vocab_size is None:
            vocab_size = n_tok
        elif vocab_size < n_tok:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n_tok} ids")
    elif chat_template is not None:
        raise ValueError("chat_template needs a tokenizer (tokenizer='bytelevel' or 'metaspace')")
    vocab_size = vocab_size or 320

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                  bos_token_id=bos_id, eos_token_id=eos_id, initializer_range=0.1)
    if rope_scaling is not None:
        common["rope_scaling"] = dict(rope_scaling)
    common.update(extra_config or {})
    if arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common, use_sliding_window=False), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.MistralConfig(**common, sliding_window=None), transformers.MistralForCausalLM

    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(dirpath), **kwargs)
    return dirpath
