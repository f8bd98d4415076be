"""Prefix caching: the KV rows of finished runs, reused by later runs that begin with the same tokens.

A multi-turn chat or an agent loop sends each request with the whole history before it: without a cache
every request prefills that history again. ``Pipeline(..., prefix_cache=True)`` (or a ``PrefixCache`` shared
by several pipelines) keeps, after each run, the KV rows of the tokens its caches hold (prompt and output for
the target; the prompt for a model draft), and a later run copies the rows of the longest stored prefix of its
prompt into its fresh cache and prefills only the rest.

Exactness. A cached row must be the very bits a cold run computes, or a cache hit could change the output.
On the CPU every op is row-exact for blocks of up to ``EXACT_ROWS_MAX`` rows (a row's bits do not depend on
the other rows: ``graphspec.kernels._dispatch``), and decode steps and verify rows already run so. With a
prefix cache the target's prefill runs so too, in blocks of ``EXACT_ROWS_MAX`` rows instead of one batched
forward (``graphspec.drafters.prefill(exact=True)``), so every row the target's cache holds is a function of
the tokens before it alone, however it was computed: a prefill, a decode step, a verify, a copy from here. A
run with a hit then gives the cold run's tokens and logits bit for bit (greedy: the same tokens; sampling:
the same sample for a seed). The price is the row-exact prefill (measured per CPU in perf/RESULTS.md).
The draft's rows do not decide the output, so a greedy run's draft reuses them too; a sampled run's draft
prefills afresh (batched, as without a cache), since its q enters the sampled draws and a seed must keep
giving one sample. Entries say whether their rows are row-exact (a target's) and a target takes only those, so a
model that drafts in one pipeline and is the target of another never takes its draft rows as a target. CPU
targets only, at a C++ level for GGUF weights (``check_exact_rows``).

Memory: entries are compact copies (``[1, length, kv_heads, head_dim]`` per layer, K and V) counted in bytes
against ``max_bytes``; storing evicts the least recently used entries until the total fits, an entry whose
tokens are a prefix of the new one's is dropped (the new one serves every prompt it served), and a run whose
tokens are a prefix of a stored entry's stores nothing; an entry over the whole budget is not kept, nor one over
half the memory the machine has free (with a warning, once: the budget is beyond what it can hold). Entries name
their model by identity (a weak reference): two models never share rows, and a model that is gone frees its
entries on the next store.
Thread-safe: the batched engine's sequences look up and store concurrently.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from graphspec.models.kv_cache import available_bytes

__all__ = ["PrefixCache", "DEFAULT_PREFIX_CACHE_BYTES", "check_exact_rows", "check_prefix_cache"]

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
"""``prefix_cache=True``'s budget: 1 GiB, about 37k tokens of a bf16 Qwen2.5-1.5B's KV (28 KiB a token) or 18k in
fp32; a 0.5B draft's prompt rows take 12 KiB a token in bf16."""


def _unwrapped(model):
    """The loaded model behind an engine proxy (``graphspec.engine._BatchedModel.unwrapped``), else itself."""
    return getattr(model, "unwrapped", model)


@dataclass
class _Entry:
    model: weakref.ref
    tokens: torch.Tensor           # int64 [length], on the CPU
    k: list[torch.Tensor]          # per layer [1, length, kv_heads, head_dim]
    v: list[torch.Tensor]
    nbytes: int
    used: int                      # the store's clock at the last hit or store
    exact: bool                    # rows a row-exact forward wrote (a target's): the only ones a target may take


class PrefixCache:
    """KV rows of earlier runs, keyed by their tokens; at most ``max_bytes`` bytes of them (LRU eviction).

    ``hits`` / ``misses`` count lookups, ``reused_tokens`` the rows copied into runs; ``stats()`` has them all.
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"PrefixCache(max_bytes={max_bytes!r}): give a positive number of bytes, "
                             f"say {DEFAULT_PREFIX_CACHE_BYTES} (1 GiB)")
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.evictions = 0
        self._warned_memory = False

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "tokens": sum(int(e.tokens.numel()) for e in self._entries), "hits": self.hits,
                    "misses": self.misses, "reused_tokens": self.reused_tokens, "evictions": self.evictions}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PrefixCache({s['entries']} entries, {s['tokens']} tokens, {s['bytes'] / 2**20:.1f} of "
                f"{self.max_bytes / 2**20:.0f} MiB; {s['hits']} hits, {s['misses']} misses)")

    @staticmethod
    def _common(a: torch.Tensor, b: torch.Tensor) -> int:
        """The length of the longest common prefix of two int64 vectors."""
        m = min(a.numel(), b.numel())
        if m == 0:
            return 0
        diff = (a[:m] != b[:m]).nonzero()
        return int(diff[0, 0]) if diff.numel() else m

    def _longest(self, model, tokens: list[int], exact: bool) -> tuple[_Entry | None, int]:
        """The entry of ``model`` holding the longest prefix of ``tokens`` (row-exact ones only if ``exact``) and
        that prefix's length; ``(None, 0)`` for none. Under the lock."""
        owner = _unwrapped(model)
        want = torch.tensor(tokens, dtype=torch.int64)
        best, n = None, 0
        for e in self._entries:
            if e.model() is not owner or (exact and not e.exact):
                continue
            c = self._common(e.tokens, want)
            if c > n:
                best, n = e, c
        return best, n

    def match(self, model, tokens: list[int], exact: bool = False) -> int:
        """How many leading ``tokens`` a ``fill`` would copy for ``model`` now (counts neither hit nor miss)."""
        if not tokens:
            return 0
        with self._lock:
            return self._longest(model, tokens, exact)[1]

    def fill(self, model, cache, tokens: list[int], exact: bool = False) -> int:
        """Copy the rows of the longest stored prefix of ``tokens`` into the empty ``cache`` of ``model``.

        ``exact``: from row-exact entries only (a target's; a model that drafts in one pipeline and is the target
        of another stores both kinds). Returns how many rows it holds now (0 on a miss); the caller prefills
        ``tokens`` from there.
        """
        if cache.length != 0:
            raise ValueError(f"PrefixCache.fill needs an empty cache, got one holding {cache.length} positions")
        if not tokens:
            return 0
        with self._lock:
            best, n = self._longest(model, tokens, exact)
            if best is None:
                self.misses += 1
                return 0
            n = min(n, cache.capacity)
            self._clock += 1
            best.used = self._clock
            self.hits += 1
            self.reused_tokens += n
            for layer in range(cache.num_layers):
                cache.k[layer][:, :n] = best.k[layer][:, :n]
                cache.v[layer][:, :n] = best.v[layer][:, :n]
        cache.advance(n)
        return n

    def store(self, model, cache, tokens: list[int], exact: bool = False) -> None:
        """Keep rows ``0 .. len(tokens) - 1`` of ``model``'s ``cache``, which hold ``tokens``; ``exact``: a row-exact
        forward wrote every one of them (a target's cache with a prefix cache)."""
        n = len(tokens)
        if n == 0:
            return
        if n > cache.length:
            raise ValueError(f"PrefixCache.store: {n} tokens but the cache holds {cache.length} positions")
        if cache.batch_size != 1:
            raise ValueError(f"PrefixCache.store takes one sequence's cache, got batch_size={cache.batch_size}")
        owner = _unwrapped(model)
        per_token = sum(2 * k.shape[2] * k.shape[3] * k.element_size() for k in cache.k)
        nbytes = per_token * n
        if nbytes > self.max_bytes:  # it alone would not fit: keep what is there
            return
        free = available_bytes(cache.device)
        if free is not None and nbytes > free // 2:  # a budget beyond this machine's memory: keep what is there
            if not self._warned_memory:
                self._warned_memory = True
                warnings.warn(f"prefix cache: not storing {nbytes / 2**20:.0f} MiB of rows with {free / 2**20:.0f} MiB "
                              f"of memory free; lower its budget (max_bytes={self.max_bytes}) to what this machine "
                              f"can hold", RuntimeWarning, stacklevel=2)
            return
        ids = torch.tensor(tokens, dtype=torch.int64)
        with self._lock:
            self._clock += 1
            keep: list[_Entry] = []
            for e in self._entries:
                other = e.model()
                if other is None:  # its model is gone
                    continue
                if other is owner:
                    c = self._common(e.tokens, ids)
                    if c == n and (e.exact or not exact):  # a stored entry already serves every one of these rows
                        e.used = self._clock
                        return
                    if c == e.tokens.numel() and (exact or not e.exact):  # these rows extend it and serve as much
                        continue
                keep.append(e)
            entry = _Entry(weakref.ref(owner), ids, [k[:, :n].clone() for k in cache.k],
                           [v[:, :n].clone() for v in cache.v], nbytes, self._clock, exact)
            keep.append(entry)
            total = sum(e.nbytes for e in keep)
            keep.sort(key=lambda e: e.used)
            while total > self.max_bytes:
                total -= keep.pop(0).nbytes
                self.evictions += 1
            self._entries = keep


def free_exact_prefill(target) -> str | None:
    """Why ``target``'s row-exact prefill costs about what its batched prefill does (so a prefix cache's miss costs
    nothing), or None: a bf16 target on graphspec's C++ linear (row-exact blocks of ``EXACT_CHAIN_ROWS_MAX`` rows,
    ``Transformer.exact_block_rows``) and GGUF blocks with int8 activations at a C++ level (their products are
    row-exact at any row count). Measured by perf/prefix_cache.py (docs/prefix-cache.md)."""
    from graphspec.kernels import EXACT_ROWS_MAX, cpu

    device = torch.device(getattr(target, "device", "cpu"))
    if device.type != "cpu" or getattr(target, "backend", None) == "triton":
        return None
    rows = target.exact_block_rows() if hasattr(target, "exact_block_rows") else EXACT_ROWS_MAX
    if rows > EXACT_ROWS_MAX:
        return f"bf16 target on the C++ linear: row-exact prefill blocks of {rows} rows cost what a batched one does"
    if getattr(target, "weights", None) == "gguf-a8" and cpu.level() != "torch":
        return "GGUF blocks with int8 activations: their prefill costs the same row-exact or batched"
    return None


def check_prefix_cache(value, target) -> PrefixCache | None:
    """``Pipeline(prefix_cache=...)``: None / False (off), True (a ``PrefixCache`` of the default size), an int
    (a budget in bytes), a ``PrefixCache`` (shared), or "auto" (the default size where ``free_exact_prefill``
    says a miss costs nothing, else off). Refused where the target's prefill cannot be row-exact
    (``check_exact_rows``)."""
    if isinstance(value, str) and value == "auto":
        return PrefixCache() if free_exact_prefill(target) else None
    if value is None or value is False:
        return None
    if isinstance(value, PrefixCache):
        store = value
    elif value is True:
        store = PrefixCache()
    elif isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"prefix_cache={value}: a budget in bytes must be positive (True: "
                             f"{DEFAULT_PREFIX_CACHE_BYTES} bytes; False: no prefix cache)")
        store = PrefixCache(value)
    else:
        raise ValueError(f"prefix_cache must be False, True, 'auto', a budget in bytes or a PrefixCache, got "
                         f"{value!r}")
    check_exact_rows(target)
    return store


def check_exact_rows(target) -> None:
    """Raise ValueError where ``target``'s rows are not promised row-exact, so a cache hit could change the output:
    a target off the CPU or pinned to the Triton kernels, and GGUF block weights at the CPU backend's torch level
    (its ``F.linear`` on the dequantized weights makes no such promise). Checked again at each run's start, since
    the level may change (``graphspec.kernels.cpu.use_level``)."""
    from graphspec.kernels import cpu

    device = torch.device(getattr(target, "device", "cpu"))
    if device.type != "cpu" or getattr(target, "backend", None) == "triton":
        where = f"on {device}" if device.type != "cpu" else "pinned to the Triton kernels"
        raise ValueError(f"prefix_cache keeps output exact through the CPU backend's row-exact prefill only, and the "
                         f"target is {where}; run the target on the CPU backend or leave prefix_cache off")
    if getattr(target, "weights", None) is not None and cpu.level() == "torch":
        raise ValueError(f"prefix_cache needs row-exact GGUF block products, which the CPU backend's torch level does "
                         f"not promise; the target has {target.weights} weights: use a C++ level "
                         f"(GRAPHSPEC_CPU=auto) or leave prefix_cache off")
