"""A toy language model that honours the graphspec model contract, for fast framework tests.

``ToyLM`` is a second-order Markov model: the logits of the next token are a table lookup on the
last two tokens (``START`` stands in before the first one). It has the same surface as a
graphspec ``Transformer`` (``config``, ``tokenizer``, ``device``, ``dtype``, ``backend``,
``new_cache``, ``step`` with ``logits_for``, ``__call__``) and a KV cache with the same
``length`` / ``truncate`` semantics, so the pipeline cannot tell it from a real model, while a
forward costs microseconds. Its exact output distribution is a product of table rows, which
makes the statistical tests cheap. Every ``step`` call is logged (``calls``) so tests can check
what the pipeline fed.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


class ToyCache:
    def __init__(self, capacity: int, batch_size: int, device):
        self.tokens = torch.full((batch_size, capacity), -1, dtype=torch.int64, device=device)
        self.length = 0
        self.capacity = capacity
        self.batch_size = batch_size

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate(n={n}) needs 0 <= n <= length={self.length}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, slots) -> None:
        slots = list(slots)
        self.tokens[:, start:start + len(slots)] = self.tokens[:, slots].clone()
        self.length = start + len(slots)


class ToyLM:
    def __init__(self, vocab_size: int = 16, seed: int = 0, scale: float = 2.0, table: torch.Tensor | None = None,
                 max_position_embeddings: int = 4096, eos_token_ids=(), tokenizer=None, device="cpu",
                 log: list | None = None, name: str = "toy"):
        g = torch.Generator().manual_seed(seed)
        if table is None:
            table = torch.randn(vocab_size + 1, vocab_size, vocab_size, generator=g) * scale
        self.table = table.float()  # [prev (+START), cur, next]
        V = self.table.shape[-1]
        self.START = self.table.shape[0] - 1
        self.config = SimpleNamespace(vocab_size=V, max_position_embeddings=max_position_embeddings,
                                      eos_token_ids=list(eos_token_ids))
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.backend = None
        self.calls: list[list[int]] = []
        self.log = log  # shared between models: (name, cached prefix, fed tokens) in call order
        self.name = name

    def new_cache(self, max_seq_len: int, batch_size: int = 1) -> ToyCache:
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError("max_seq_len beyond max_position_embeddings")
        return ToyCache(max_seq_len, batch_size, self.device)

    def _logits(self, seq: torch.Tensor, start: int) -> torch.Tensor:
        """Logits for positions start.. of seq [B, L]: next-token tables of (seq[j-1], seq[j])."""
        prev = torch.cat([torch.full_like(seq[:, :1], self.START), seq[:, :-1]], dim=1)[:, start:]
        return self.table[prev, seq[:, start:]]  # [B, T, V]

    def step(self, token_ids: torch.Tensor, cache: ToyCache, positions=None, logits_for="all",
             tree=None) -> torch.Tensor:
        B, T = token_ids.shape
        self.calls.append(token_ids[0].tolist())
        L = cache.length
        if self.log is not None:
            self.log.append((self.name, cache.tokens[0, :L].tolist(), token_ids[0].tolist()))
        if L + T > cache.capacity:
            raise ValueError("toy cache overflow")
        cache.tokens[:, L:L + T] = token_ids
        cache.length = L + T
        if tree is not None:  # a draft tree: each row's previous token is its parent's (the nearest ancestor)
            m = tree.shape[1]  # the tree masks the last m slots (m > T: a beam's cached nodes, then the new ones)
            start = L + T - m
            last = cache.tokens[:, start - 1] if start else torch.full_like(token_ids[:, 0], self.START)
            prev = []
            for i in range(T):
                anc = [j for j in range(m - T + i) if bool(tree[i, j])]
                prev.append(cache.tokens[:, start + anc[-1]] if anc else last)
            logits = self.table[torch.stack(prev, dim=1), token_ids]
        else:
            logits = self._logits(cache.tokens[:, :L + T], L)
        if isinstance(logits_for, str):
            return logits if logits_for == "all" else logits[:, -1:]
        return logits[:, logits_for]

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._logits(input_ids, 0)

    # -------------------------------------------------------------- exact distributions

    def next_probs(self, seq: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        """Warped next-token distribution after each row of ``seq [N, L]``."""
        from graphspec.kernels.sampling import warp_logits

        return warp_logits(self._logits(seq, seq.shape[1] - 1)[:, 0], temperature, top_k, top_p)


class ScriptLM(ToyLM):
    """A model whose greedy output is a fixed script: the logits at position j point at ``script[j + 1]``.

    Useful with a real tokenizer (hundreds of ids, where a trigram table would be too big) to force
    exact texts: split UTF-8 characters, stop strings, EOS.
    """

    def __init__(self, script: list[int], vocab_size: int, wrong_every: int = 0, **kw):
        super().__init__(table=torch.zeros(1, 1, vocab_size), **kw)
        self.script = torch.tensor(list(script), dtype=torch.int64)
        self.wrong_every = wrong_every  # a draft that deviates from the script every n positions

    def _logits(self, seq: torch.Tensor, start: int) -> torch.Tensor:
        B, L = seq.shape
        V = self.config.vocab_size
        pos = torch.arange(start, L)
        nxt = self.script[(pos + 1).clamp(max=len(self.script) - 1)]
        if self.wrong_every:
            nxt = torch.where(pos % self.wrong_every == 0, (nxt + 1) % V, nxt)
        logits = torch.full((B, L - start, V), -10.0)
        logits[:, torch.arange(L - start), nxt] = 10.0
        return logits
