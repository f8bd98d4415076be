"""graphspec.models: the Llama family from scratch (config, transformer, KV cache, loaders, tokenizer)."""

from graphspec.models.config import ModelConfig  # noqa: F401
from graphspec.models.kv_cache import KVCache  # noqa: F401
from graphspec.models.tokenizer import StreamDecoder, Tokenizer  # noqa: F401
from graphspec.models.transformer import Transformer  # noqa: F401
from graphspec.models.loader import load_model  # noqa: F401
