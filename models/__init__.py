"""graphspec.models: the Llama family from scratch (config, transformer, KV cache, loaders, tokenizer)."""
