"""The Llama-family decoder (Llama, Qwen2, Mistral) on graphspec's kernels.

- One forward serves prefill, decode and verify: ``step(token_ids[B, T], cache)`` appends
  T positions to the KV cache and attends causally over everything cached; T is 1 for a
  decode step, the prompt length for prefill, K+1 for a speculative verify.
- Each layer reads like the paper: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``. The
  residual add is fused into the following RMSNorm (``rmsnorm(..., residual=h)``).
- Weights are fused at load time: q/k/v into one ``wqkv`` and gate/up into one ``w13``, so a
  layer runs four GEMMs; biases (Qwen2's q/k/v) are fused the same way. Each GEMM weight (and
  the lm_head) then goes through ``kernels.linear.prepare_weight`` once: the kernels side picks
  the layout its ``linear`` runs fastest with (oneDNN-packed on CPU, unchanged on CUDA), so this
  file never knows which it got.
- RoPE: HF rotate-half convention, cos/sin from ``positions * inv_freq`` in fp32, computed once
  per forward (``rope_tables``) and shared by every layer.
- A draft tree verifies in the same forward: ``step(..., tree=ancestor_mask(parents), positions=...)``
  makes each new token attend to the cache, its ancestors and itself (the attention op's ``tree``);
  ``KVCache.keep`` then keeps the accepted branch.
- Only the rows asked for (``logits_for``) go through the final norm and the lm_head: a
  prefill needs one row, a draft step one row, a verify K+1 rows. Logits come back in fp32.
- ``quantize="int8"`` (draft models on a CPU): every GEMM weight and the lm_head is rounded to
  int8 per output row and run by graphspec's int8 GEMM (``kernels.linear.quantize_weight``); a
  bandwidth-bound draft step reads half the bytes of bf16. Approximate, so never for a target.
  That GEMM takes and returns fp32, so an int8 model computes in fp32 between its GEMMs (norms,
  biases, KV cache; ``dtype`` is fp32) and no casts sit between ops. Its cached forwards (a draft
  runs one per proposed token) take ``_forward_native``: C++ loops around the same GEMMs
  (``graphspec.kernels.cpu.int8_draft``) at every C++ level of the CPU backend, because at these
  sizes the per-op cost is a large part of a draft step; at the torch level, the general forward.
- ``quantize="int4"``: an int8 model whose C++ forward runs the layers' products of up to 3 rows
  with those int8 weights rounded again to 4 bits, one scale per 64 inputs (kernels/cpu/int4_gemm.h:
  0.56 bytes a weight); prefills and the lm_head stay int8. It needs the CPU backend's avx512 or avx2
  level, and says so at load where it is missing (no silent int8).
- Every op goes through ``graphspec.kernels`` and its dispatch; this file never knows whether
  Triton or torch runs underneath. ``backend`` pins the choice for this model's calls only.
- A model holds weights and nothing else: run state lives in the ``KVCache`` of each caller,
  so several pipelines can share one model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from graphspec.kernels import cpu
from graphspec.kernels._dispatch import EXACT_CHAIN_ROWS_MAX, EXACT_ROWS_MAX, use_backend
from graphspec.kernels.attention import attention, check_tree, tree_mask
from graphspec.kernels.cpu import block_model, int8_draft
from graphspec.kernels.linear import Int8Weight, NativeWeight, PackedWeight, linear, prepare_weight, quantize_weight
from graphspec.kernels.qlinear import BlockWeight, StackedWeight
from graphspec.kernels.rmsnorm import rmsnorm
from graphspec.kernels.rope import rope, rope_inv_freq, rope_tables
from graphspec.kernels.silu_mul import silu_mul
from graphspec.models.config import ModelConfig
from graphspec.models.kv_cache import KVCache


@dataclasses.dataclass
class Layer:
    input_norm: torch.Tensor  # [H]
    wqkv: torch.Tensor | PackedWeight | Int8Weight  # [(Hq + 2 Hk) * D, H]
    bqkv: torch.Tensor | None  # [(Hq + 2 Hk) * D]
    wo: torch.Tensor | PackedWeight | Int8Weight  # [H, Hq * D]
    bo: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    w13: torch.Tensor | PackedWeight | Int8Weight  # [2 * I, H]: gate rows then up rows
    w2: torch.Tensor | PackedWeight | Int8Weight  # [H, I]


QUANTIZE_MODES = (None, "int8", "int4")


def check_quantize(quantize, backend, device) -> None:
    """``quantize`` must be None, "int8" or "int4", and both need the CPU torch path (they are for drafts)."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE_MODES}")
    if quantize and (backend == "triton" or torch.device(device).type != "cpu"):
        raise ValueError(f"quantize={quantize!r} runs graphspec's and torch's int8 CPU GEMMs; it cannot run on "
                         f"{device} with backend={backend!r}: load this model without quantize")
    if quantize == "int4" and not cpu.have_int4():
        raise ValueError(f"quantize='int4' runs graphspec's int4 GEMM, which needs the CPU backend's avx512 or avx2 "
                         f"level, but the level here is {cpu.level()} ({cpu.ENV}): use quantize='int8'")


def _picked_rows(segments, rows, device) -> tuple[torch.Tensor, list[int]]:
    """The stacked rows whose logits are wanted (each segment's ``rows``, None: all, offset by the rows
    before it) and how many each segment has."""
    picked, counts, start = [], [], 0
    for (_, t, _), r in zip(segments, rows):
        r = torch.arange(t, device=device) if r is None else r
        picked.append(r + start)
        counts.append(r.numel())
        start += t
    return torch.cat(picked), counts


class Transformer:
    """Weights of one Llama-family model plus the forward pass over them."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor, tokenizer=None, backend: str | None = None, quantize: str | None = None,
                 weights: str | None = None):
        if backend not in (None, "auto", "torch", "triton"):
            raise ValueError(f"backend={backend!r} is not one of None, 'auto', 'torch', 'triton'")
        check_quantize(quantize, backend, embed.device)
        if weights not in (None, "gguf", "gguf-a8"):
            raise ValueError(f"weights={weights!r} is not one of None, 'gguf', 'gguf-a8'")
        if weights and quantize:
            raise ValueError(f"quantize={quantize!r} rounds dense weights; GGUF block weights (weights='gguf') are "
                             "quantized already: pass one of the two")
        # "gguf": GEMM weights and the embedding are BlockWeights (models/gguf_weights.py), activations fp32;
        # "gguf-a8": the same, the k-quants' products on activations rounded to int8 (kernels/qlinear.py)
        self.weights = weights
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.norm = norm  # [H]
        # [V, H]; with tie_word_embeddings the embedding tensor itself, unless prepared into a copy
        self.lm_head = lm_head
        self.tokenizer = tokenizer
        self.backend = backend
        self.quantize = quantize
        if quantize:  # the int8 GEMM computes in fp32: so does everything between the GEMMs
            for layer in layers:
                layer.input_norm, layer.post_norm = layer.input_norm.float(), layer.post_norm.float()
                layer.bqkv = None if layer.bqkv is None else layer.bqkv.float()
                layer.bo = None if layer.bo is None else layer.bo.float()
            self.norm = norm.float()
        inv_freq, self.rope_attention_scaling = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.inv_freq = inv_freq.to(embed.device)  # [D/2] fp32
        self.scale = config.head_dim ** -0.5
        self._prepare_weights()

    def _prepare_weights(self) -> None:
        # Under this model's backend: a model pinned to Triton keeps plain tensors.
        for layer in self.layers:
            layer.wqkv = self._prepare(layer.wqkv)
            layer.wo = self._prepare(layer.wo)
            layer.w13 = self._prepare(layer.w13)
            layer.w2 = self._prepare(layer.w2)
        self.lm_head = self._prepare(self.lm_head)

    def _prepare(self, weight: torch.Tensor):
        """One GEMM weight in this model's layout: int8 when quantized, else what the kernels side prefers."""
        if isinstance(weight, (BlockWeight, StackedWeight)):  # GGUF blocks run as they are
            return weight
        with use_backend(self.backend):
            return quantize_weight(weight.float()) if self.quantize else prepare_weight(weight)  # int4: int8 here

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and the KV cache's dtype: the weights' own, or fp32 for an int8 model."""
        return torch.float32 if self.quantize or self.weights else self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def __repr__(self) -> str:
        c = self.config
        return (f"Transformer({c.architecture}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_attention_heads}/{c.num_key_value_heads}, vocab={c.vocab_size}, dtype={self.dtype}, "
                f"device={self.device}, backend={self.backend}" + (f", quantize={self.quantize})" if self.quantize else ")"))

    def new_cache(self, max_seq_len: int, batch_size: int = 1) -> KVCache:
        """A KV cache for ``batch_size`` sequences of up to ``max_seq_len`` positions each."""
        c = self.config
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len={max_seq_len!r}; expected a positive integer")
        if max_seq_len > c.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{c.max_position_embeddings}; ask for a shorter cache")
        return KVCache(c.num_hidden_layers, batch_size, max_seq_len, c.num_key_value_heads, c.head_dim,
                       dtype=self.dtype, device=self.device)

    # --- forward ------------------------------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` fp32 for every position of ``input_ids [B, T]``, without a cache."""
        input_ids = self._check_ids(input_ids)
        b, t = input_ids.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        return self._forward(input_ids, positions, None, "all")

    def head_rows(self, ids: torch.Tensor):
        """The lm_head restricted to the vocabulary rows ``ids`` (1-d int64), in this model's GEMM layout.

        Pass it as ``step(..., head=...)`` to compute logits for those ids only: a draft with a pruned
        vocabulary (``graphspec.drafters.DraftHead``) reads a fraction of the lm_head per token.
        """
        if (not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.dtype != torch.int64 or ids.numel() == 0):
            raise ValueError(f"ids must be a non-empty 1-d int64 tensor, got {getattr(ids, 'dtype', type(ids))} "
                             f"{tuple(getattr(ids, 'shape', ()))}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.lm_head.shape[0]:
            raise ValueError(f"ids must lie in [0, {self.lm_head.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]")
        if isinstance(self.lm_head, BlockWeight):
            return self.lm_head.select(ids.to(self.device))
        if self.config.tie_word_embeddings:
            full = self.embed  # the lm_head's own values
        else:
            full = self.lm_head.dense() if hasattr(self.lm_head, "dense") else self.lm_head
        return self._prepare(full[ids.to(full.device)].to(self.dtype).contiguous())

    def step(self, token_ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
             logits_for="all", head=None, tree: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``token_ids [B, T]`` after what ``cache`` holds; append them to it; return logits.

        positions: ``[B, T]`` int64 RoPE positions (default: the cache slots they occupy).
        logits_for: "all" (T rows), "last" (1 row) or a LongTensor of row indices into T.
        head: None (the lm_head), or ``head_rows(ids)``: logits for those vocabulary rows only.
        tree: None (the T tokens are a sequence: causal), or a bool ``[T, T]`` ancestor mask
        (``graphspec.kernels.attention.ancestor_mask``): token i attends to the cache and to the new
        tokens j with ``tree[i, j]`` (a draft tree verified in one forward; pass each token's
        ``positions``, its depth after the cache). The cache then holds every branch: keep the
        accepted one with ``cache.keep``. A draft growing its tree over several forwards passes a
        wider ``[T, m]`` mask over the last m positions (cached nodes, then the new ones; CPU only).
        Returns ``[B, n, V]`` fp32 (``V = len(ids)`` with ``head``) and advances ``cache.length`` by T.
        """
        token_ids, positions = self._check_step(token_ids, cache, positions, head)
        logits = self._forward(token_ids, positions, cache, logits_for, head, tree)
        cache.advance(token_ids.shape[1])
        return logits

    def step_many(self, requests: list[dict]) -> list[torch.Tensor]:
        """Several sequences' ``step`` calls (each a dict of ``step``'s arguments, batch size 1, own cache) in
        one forward: the GEMMs run once over every request's rows and attention runs per request against its
        own cache, so the weights are read once for all of them (the batched engine's verify and draft steps).

        Each request's logits are the bits its own ``step`` call gives wherever the GEMMs are row-exact (blocks
        of up to ``EXACT_ROWS_MAX`` rows on the CPU: keep the rows of all requests within that). An int8 model
        takes its C++ forward for several sequences at once; an int4 one runs them one after another (its GEMM
        depends on the row count).
        """
        if not requests:
            return []
        # One at a time: int4 picks its GEMM by the row count, and an int8 model off the C++ levels runs
        # int8_linear_ref, whose torch matmul is not row-exact.
        native = self._native_model()
        if len(requests) == 1 or self.quantize == "int4" or (self.quantize and native is None):
            return [self.step(**r) for r in requests]
        ids, pos, segments, rows = [], [], [], []
        head = requests[0].get("head")
        for r in requests:
            unknown = set(r) - {"token_ids", "cache", "positions", "logits_for", "head", "tree"}
            if unknown:
                raise ValueError(f"step_many: unknown step arguments {sorted(unknown)}")
            if r.get("head") is not head:
                raise ValueError("step_many: every request must use the same head (None or one head_rows tensor)")
            t_ids, t_pos = self._check_step(r["token_ids"], r["cache"], r.get("positions"), head)
            if t_ids.shape[0] != 1:
                raise ValueError(f"step_many takes requests of batch size 1, got {t_ids.shape[0]}")
            if any(r["cache"] is seg[0] for seg in segments):
                raise ValueError("step_many: two requests share one cache")
            ids.append(t_ids)
            pos.append(t_pos)
            segments.append((r["cache"], t_ids.shape[1], r.get("tree")))
            rows.append(self._rows(r.get("logits_for", "all"), t_ids.shape[1]))
        if native is not None:
            with torch.no_grad():
                logits = self._forward_native_many(native, ids, pos, segments, rows, head)
        else:
            logits = self._run(torch.cat(ids, dim=1), torch.cat(pos, dim=1), segments, rows, head)
        for cache, t, _ in segments:
            cache.advance(t)
        return logits

    def _check_step(self, token_ids, cache, positions, head):
        """``step``'s argument checks; returns the ids (int64) and the positions (default: the cache slots)."""
        token_ids = self._check_ids(token_ids)
        b, t = token_ids.shape
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache from model.new_cache(...), got {type(cache).__name__}")
        if cache.batch_size != b:
            raise ValueError(f"token_ids has batch size {b} but the cache was made for {cache.batch_size}")
        c = self.config
        if (cache.num_layers, cache.k[0].shape[2], cache.k[0].shape[3]) != (
                c.num_hidden_layers, c.num_key_value_heads, c.head_dim):
            raise ValueError("this cache was made for a different model (layers, kv heads or head_dim differ); "
                             "make it with this model's new_cache()")
        if cache.dtype != self.dtype or cache.device != self.device:
            raise ValueError(f"cache holds {cache.dtype} on {cache.device} but the model runs {self.dtype} on "
                             f"{self.device}; make it with this model's new_cache()")
        cache.check_room(t)
        if positions is None:
            positions = torch.arange(cache.length, cache.length + t, device=self.device).expand(b, t)
        elif (not isinstance(positions, torch.Tensor) or positions.shape != (b, t) or positions.dtype != torch.int64
              or positions.device != self.device):
            raise ValueError(f"positions must be an int64 tensor of shape {(b, t)} on {self.device}, got "
                             f"{getattr(positions, 'dtype', type(positions).__name__)} "
                             f"{tuple(getattr(positions, 'shape', ()))}")
        if head is not None and (getattr(head, "ndim", 0) != 2 or head.shape[1] != c.hidden_size):
            raise ValueError(f"head must come from this model's head_rows(ids) ([n, {c.hidden_size}]), got "
                             f"{type(head).__name__} {tuple(getattr(head, 'shape', ()))}")
        return token_ids, positions

    def _check_ids(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be an integer tensor of shape [B, T], got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"token ids of shape {tuple(ids.shape)} are empty; pass at least one token per row")
        if ids.device != self.device:
            raise ValueError(f"token ids are on {ids.device} but the model is on {self.device}")
        if not ids.is_cuda:  # on a GPU this check would cost a host sync per step
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got values in [{lo}, {hi}]")
        return ids.long()

    def _rows(self, logits_for, t: int) -> torch.Tensor | None:
        if isinstance(logits_for, str):
            if logits_for == "all":
                return None
            if logits_for == "last":
                return torch.tensor([t - 1], device=self.device)
        elif isinstance(logits_for, torch.Tensor) and logits_for.ndim == 1 and not logits_for.dtype.is_floating_point:
            return logits_for.to(self.device, torch.long)
        raise ValueError(f"logits_for={logits_for!r}; expected 'all', 'last' or a 1-d LongTensor of row indices")

    def _forward(self, ids, positions, cache, logits_for, head=None, tree=None) -> torch.Tensor:
        rows = self._rows(logits_for, ids.shape[1])
        native = None if cache is None else self._native_model()
        if native is not None:
            with torch.no_grad():
                return self._forward_native(native, ids, positions, cache, rows, head, tree)
        return self._run(ids, positions, [(cache, ids.shape[1], tree)], [rows], head)[0]

    def _embed(self, ids) -> torch.Tensor:
        if isinstance(self.embed, BlockWeight):  # the rows dequantized as the GGUF defines them
            return self.embed.rows(ids)
        return F.embedding(ids, self.embed).to(self.dtype)

    def _run(self, ids, positions, segments, rows, head=None) -> list[torch.Tensor]:
        """The layers over ``ids [B, N]``: ``segments`` ``[(cache, T, tree)]`` split the N new tokens into
        sequences (one for a ``step``; several for ``step_many``, B = 1) that each attend to their own cache;
        ``rows[s]`` (None: all) are segment s's rows whose logits are wanted. Returns a ``[B, n_s, V]`` per
        segment."""
        c = self.config
        with use_backend(self.backend), torch.no_grad():
            x = self._embed(ids)  # [B, N, H]
            h = x
            tables = rope_tables(positions, self.inv_freq, self.rope_attention_scaling)
            normed = rmsnorm(x, self.layers[0].input_norm, c.rms_norm_eps)
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                a = self._attention(i, layer, normed, positions, tables, segments)
                normed, h = rmsnorm(a, layer.post_norm, c.rms_norm_eps, residual=h)  # h = h + attn(norm(h))
                m = self._mlp(layer, normed)
                if i < last:
                    normed, h = rmsnorm(m, self.layers[i + 1].input_norm, c.rms_norm_eps, residual=h)
            # Last residual add + final norm + lm_head only on the rows whose logits are wanted.
            if len(segments) == 1:
                if rows[0] is not None:
                    m, h = m[:, rows[0]], h[:, rows[0]]
                counts = None
            else:
                index, counts = _picked_rows(segments, rows, ids.device)
                m, h = m[:, index], h[:, index]
            out, _ = rmsnorm(m, self.norm, c.rms_norm_eps, residual=h)
            logits = linear(out, self.lm_head if head is None else head).float()  # [B, n, V]
            return [logits] if counts is None else list(logits.split(counts, dim=1))

    def _attention(self, i: int, layer: Layer, x, positions, tables, segments) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        hq, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = linear(x, layer.wqkv, layer.bqkv)  # [B, T, (Hq + 2 Hk) * D]
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(b, t, hq, d), k.view(b, t, hk, d), v.view(b, t, hk, d)
        q, k = rope(q, k, positions, self.inv_freq, self.rope_attention_scaling, tables)
        if len(segments) == 1:
            cache, _, tree = segments[0]
            if cache is not None:
                k, v = cache.append(i, k, v)  # [B, length + T, Hk, D] views of the cache
            o = attention(q, k, v, self.scale, tree=tree)  # [B, T, Hq, D]
        else:  # each sequence against its own cache, as its own step would
            outs, start = [], 0
            for cache, n, tree in segments:
                ks, vs = cache.append(i, k[:, start:start + n], v[:, start:start + n])
                outs.append(attention(q[:, start:start + n], ks, vs, self.scale, tree=tree))
                start += n
            o = torch.cat(outs, dim=1)
        return linear(o.reshape(b, t, hq * d), layer.wo, layer.bo)

    def exact_block_rows(self) -> int:
        """The most tokens one ``step`` of a chain may take with each row the bits a one-token step gives at its
        position: what a row-exact prefill (``graphspec.drafters.prefill(exact=True)``) feeds at a time.

        ``EXACT_CHAIN_ROWS_MAX`` for a bf16 model whose GEMMs all run graphspec's C++ bf16 linear at the level in
        force (its attention then runs in C++ too); ``EXACT_ROWS_MAX`` otherwise (oneDNN's products, int8 and GGUF
        models: exact in verify-sized blocks, ``graphspec.kernels.linear.INVARIANT_MAX_ROWS``). A ``NativeWeight`` is
        a bf16 CPU weight, never made for a model pinned to Triton, a quantized or a GGUF one."""
        if cpu.bf16_linear() and all(isinstance(getattr(layer, n), NativeWeight)
                                     for layer in self.layers for n in ("wqkv", "wo", "w13", "w2")):
            return EXACT_CHAIN_ROWS_MAX
        return EXACT_ROWS_MAX

    # Cached forwards of int8 models and of GGUF block-weight models run in C++ where the CPU backend has a C++
    # level (False: the general forward, for comparisons).
    native_forward = True

    def _native_model(self):
        """The C++ object that runs this model's cached forwards (``int8_draft.draft_for``: int8;
        ``block_model.model_for``: GGUF blocks), or None where the general forward runs them."""
        if not self.native_forward or self.device.type != "cpu" or not cpu.available() or self.backend == "triton":
            return None  # (a model pinned to Triton runs its Triton kernels, interpreted on a CPU)
        if self.quantize:
            return int8_draft.draft_for(self)
        if self.weights and all(isinstance(w, (BlockWeight, StackedWeight)) for w in [self.lm_head] + [
                getattr(layer, n) for layer in self.layers for n in ("wqkv", "wo", "w13", "w2")]):
            return block_model.model_for(self)
        return None

    def _forward_native(self, native, ids, positions, cache, rows, head, tree=None) -> torch.Tensor:
        """A cached forward in C++ (``graphspec.kernels.cpu.int8_draft`` / ``block_model``, both on
        ``layer_stack.h``): ``_forward``'s math as loops in place around the model's own GEMMs, at the CPU level
        in force; any batch, causal or through a draft tree's mask. Logits ``[B, n, V]`` fp32; tested against
        ``_forward``."""
        t = ids.shape[1]
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_attention_scaling)  # [B, T, 1, D]
        mask = None
        if tree is not None:  # the attention op's tree, checked by it: new tokens see their ancestors
            check_tree(tree, t, cache.length + t, ids.device)
            mask = tree_mask(tree, cache.length + t)
        head_w = (self.lm_head if head is None else head).native()
        h = self._embed(ids).float()  # [B, T, H]
        return native.forward(h, cos.contiguous(), sin.contiguous(), cache.length, cache.k, cache.v, head_w, rows,
                              mask)

    def _forward_native_many(self, native, ids, positions, segments, rows, head) -> list[torch.Tensor]:
        """``_forward_native`` for several sequences in one C++ forward (``forward_many``): the GEMMs over every
        sequence's rows, attention per sequence; each sequence's logits are its own forward's bits."""
        device = self.device
        cos, sin = rope_tables(torch.cat(positions, dim=1), self.inv_freq, self.rope_attention_scaling)
        masks = []
        for cache, t, tree in segments:
            if tree is None:
                masks.append(torch.empty(0, dtype=torch.bool))
            else:
                check_tree(tree, t, cache.length + t, device)
                masks.append(tree_mask(tree, cache.length + t))
        picked, counts = _picked_rows(segments, rows, device)
        head_w = (self.lm_head if head is None else head).native()
        h = self._embed(torch.cat(ids, dim=1)[0]).float()  # [N, H]
        kc = [k for cache, _, _ in segments for k in cache.k]
        vc = [v for cache, _, _ in segments for v in cache.v]
        out = native.forward_many(
            h, cos.contiguous(), sin.contiguous(), [cache.length for cache, _, _ in segments],
            [t for _, t, _ in segments], kc, vc, head_w, picked, masks)  # [n, V]
        return [x.unsqueeze(0) for x in out.split(counts)]

    def _mlp(self, layer: Layer, x) -> torch.Tensor:
        gate, up = linear(x, layer.w13).chunk(2, dim=-1)
        return linear(silu_mul(gate, up), layer.w2)
