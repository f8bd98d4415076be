"""Drafting across vocabularies: a draft model with its own tokenizer, and the map stage.

After Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms
for Heterogeneous Vocabularies" (ICML 2025). The step graph is
``draft (CrossVocabDrafter) -> map (VocabMap) -> verify -> accept``; verify and accept are the
same-vocabulary stages, unchanged.

- The draft conditions on the committed text in ITS OWN tokens. ``CrossVocabDrafter`` keeps a
  draft token list that spells exactly the committed text's bytes (``graphspec.vocab`` compares
  tokens as bytes): newly committed target tokens are first matched against the draft's own
  proposals (accepted drafts keep their KV entries), then mapped through the target->draft
  table when every one has a counterpart, else the tail of the text is re-tokenized with the
  draft's tokenizer from a look-behind window a few tokens back (so merges across the boundary
  come out as the draft would write them). The draft's KV cache is cut at the first token that
  changed and the rest is fed at the next draft.
- TLI (token-level intersection; greedy and sampling): the draft's logits are masked to the
  intersection *before* temperature / top-k / top-p, it samples (or argmaxes) there, and the
  map stage moves ids and q into the target's vocabulary (q is zero outside the intersection).
  Rejection sampling then runs unchanged, so the output is exactly the target's distribution.
- SLEM (string-level exact match; greedy only): the draft generates freely in its own
  vocabulary; the map stage re-tokenizes its text with the target's tokenizer after a
  look-behind window of committed target tokens (kept only if the tokenizer reproduces them,
  so a merge across the boundary does not shift the proposals) and the target verifies by exact
  match. Drafting stops at a draft special token (its meaning is model-specific).
- ``mode="auto"`` resolves per generation: SLEM at temperature 0, TLI when sampling. SLEM accepted
  more (or tied) on every prompt measured (perf/RESULTS.md): TLI loses where the draft's natural
  tokens are missing from the target's vocabulary (indentation runs, word pieces): masked, the draft
  must spell them differently.

- Draft trees (``siblings=n``, see ``graphspec.drafters.ModelDrafter``): the draft ranks its next-best
  tokens beside its chain with the same rule as a same-vocabulary draft and writes
  ``draft_own_parents``. TLI: every sibling is one shared id, so the tree maps one to one, q included,
  and ``TreeAcceptance`` samples it losslessly. SLEM: each sibling's text (the chain's draft tokens
  before its depth, then the sibling) is re-tokenized like the chain, and the target-id sequences are
  merged into a trie (``VocabMap.retokenize_tree``): a sibling that spells the same first target
  tokens as the chain shares its rows, the rest of it becomes a branch, up to ``num_draft`` rows in all.
  The draft's own text and cache need nothing new: ``_sync`` already folds in whatever the target
  committed, a taken sibling included.
- Draft beams (``beam=w``, greedy, CPU): the tree grows best first over several forwards, w rows a
  forward under a tree mask over the cached nodes (``CrossVocabDrafter._beam``); the K best nodes go to
  the map stage, which re-tokenizes each leaf's text into the same trie. ``_sync`` finds the deepest
  tree path the committed bytes spell, and the next step keeps that path's cached nodes.

Per-run bookkeeping lives in ``state.scratch(stage)``; the resolved mode and the intersection
size go to ``state.run.extra["vocab"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphspec.drafters import (BEAM_STOP_PROBABILITY, BeamTree, DraftHead, check_beam, check_beam_threshold,
                                check_confidence_threshold, check_siblings, draft_confidence, draw_siblings, grow_beam,
                                next_logits, prefill, sibling_slots)
from graphspec.graph import Stage
from graphspec.kernels.sampling import exponential_noise, sample, warp_logits
from graphspec.kernels.vocab_map import vocab_map, vocab_mask_logits
from graphspec.vocab import ByteEncoder, VocabMapping, build_vocab_mapping

__all__ = ["CrossVocabDrafter", "VocabMap", "vocab_stages", "VOCAB_MODES", "AUTO_GREEDY_MODE", "BEAM_STOP_PROBABILITY"]

VOCAB_MODES = ("auto", "tli", "slem")
AUTO_GREEDY_MODE = "slem"  # measured, see the module docstring

# Draft tokens re-tokenized before new text (draft side) / committed target tokens kept as
# context for SLEM's re-tokenization (target side): enough for a merge across the boundary.
DRAFT_LOOKBEHIND = 4
TARGET_LOOKBEHIND = 4

DRAFT_OWN_FIELDS = ("draft_own_ids", "draft_own_probs")

DRAFT_OWN_TREE = "draft_own_parents"  # a draft tree in the draft's own ids (``siblings``), as draft_parents


def resolve_mode(mode: str, params) -> str:
    if mode == "auto":
        return AUTO_GREEDY_MODE if params.greedy else "tli"
    return mode


def check_mode(mode: str, params) -> None:
    if mode not in VOCAB_MODES:
        raise ValueError(f"vocab_mapping={mode!r} is not one of {VOCAB_MODES}")
    if mode == "slem" and not params.greedy:
        raise ValueError(f"vocab_mapping='slem' verifies by exact string match, which is lossless only for greedy "
                         f"decoding, but temperature={params.temperature}; use vocab_mapping='tli' (or 'auto') "
                         f"to sample across vocabularies")


def _spelled_path(ids: list[int], parents: list[int], pieces: list[bytes], data: bytes) -> list[int]:
    """The rows of the deepest root path of a draft tree whose pieces, joined, begin ``data``."""
    best: list[int] = []
    todo: list[tuple[int, int, list[int]]] = [(0, 0, [])]  # (node: 0 the root, else row + 1; bytes; path)
    while todo:
        node, pos, path = todo.pop()
        if len(path) > len(best):
            best = path
        for j, p in enumerate(parents):
            if p == node and pieces[j] and data.startswith(pieces[j], pos):
                todo.append((j + 1, pos + len(pieces[j]), path + [j]))
    return best


@dataclass
class _DraftText:
    """The draft's own token list for one generation, kept spelling the committed text."""

    own: list[int]                 # draft ids: prompt part, then the generated text
    n_prompt: int
    committed: bytearray = field(default_factory=bytearray)  # generated text, as the target committed it
    # Boundaries (index into own, byte offset into committed) where own[n_prompt:i] spells committed[:off].
    safe_idx: list[int] = field(default_factory=list)
    safe_off: list[int] = field(default_factory=list)
    synced: int = 0                # target tokens folded in so far (prompt included)
    fed: list[int] = field(default_factory=list)        # draft ids in the draft's KV cache, in order
    proposals: list[int] = field(default_factory=list)  # the draft ids proposed by the last step
    tree: BeamTree | None = None  # a beam's last tree (its base: len(fed) then)
    kept: list[tuple[int, int]] = field(default_factory=list)  # (id, slot) of the taken path's cached nodes

    def add_boundary(self, off: int) -> None:
        self.safe_idx.append(len(self.own))
        self.safe_off.append(off)


class CrossVocabDrafter(Stage):
    """Draft with a model whose tokenizer differs from the target's (TLI or SLEM, chain or tree, see the module)."""

    reads = ("tokens", "num_draft", "params", "generator")
    writes = DRAFT_OWN_FIELDS

    def __init__(self, model, mapping: VocabMapping, target_tokenizer, mode: str = "auto", name: str = "draft",
                 confidence_threshold: float | None = None, draft_vocab=None, siblings: int = 0, beam: int = 0,
                 beam_threshold: float | str | None = "auto"):
        super().__init__(name)
        # A draft tree (see ModelDrafter): up to ``siblings`` next-best draft tokens beside the chain.
        # TLI maps them one to one; SLEM re-tokenizes each alternative text (VocabMap).
        self.siblings = check_siblings(siblings)
        # A beam (greedy runs): each forward after the first expands the ``beam`` likeliest paths (see _beam).
        self.beam = check_beam(beam, model)
        self.beam_threshold = check_beam_threshold(beam_threshold, BEAM_STOP_PROBABILITY)
        self.tree = bool(self.siblings or self.beam)  # writes draft_own_parents
        if self.tree:
            self.writes = DRAFT_OWN_FIELDS + (DRAFT_OWN_TREE,)
        self.confidence_threshold = check_confidence_threshold(confidence_threshold)  # see ModelDrafter
        if mode not in VOCAB_MODES:
            raise ValueError(f"vocab_mapping={mode!r} is not one of {VOCAB_MODES}")
        if model.config.vocab_size != mapping.draft_vocab_size:
            raise ValueError(f"the vocabulary mapping was built for a draft vocab_size of {mapping.draft_vocab_size} "
                             f"but the draft model has {model.config.vocab_size}")
        self.model = model
        self.mapping = mapping
        self.mode = mode
        self.draft_tokenizer = model.tokenizer
        self.target_tokenizer = target_tokenizer
        self.encoder = ByteEncoder(self.draft_tokenizer, mapping.draft_tokens)
        self._t2d = mapping.target_to_draft.tolist()
        self._draft_special = mapping.draft_tokens.special_ids()
        # SLEM drafts freely, but only ids that spell something: not the embedding's padding rows.
        dt = mapping.draft_tokens
        n = len(dt)
        self._spellable = torch.tensor([i if i < n and (dt.pieces[i] or i in self._draft_special) else -1
                                        for i in range(mapping.draft_vocab_size)], dtype=torch.int64)
        self._spellable_on: dict[str, torch.Tensor] = {}
        # draft vocabulary pruning (graphspec.drafters.DraftHead); TLI also needs shared ids among those kept
        self.head = DraftHead.build(model, draft_vocab)
        if self.head is not None and mode != "slem":
            kept = mapping.draft_to_target[self.head.ids.cpu()]
            if not bool((kept >= 0).any()):
                raise ValueError(f"draft_vocab keeps {len(self.head)} draft ids, none of them in the target's "
                                 "vocabulary: TLI could never propose a token; keep more ids")

    def check(self, params) -> None:
        check_mode(self.mode, params)

    # ------------------------------------------------------------------ prompt

    def prompt_tokens(self, target_ids: list[int]) -> list[int]:
        """The prompt in the draft's tokens: its text re-encoded by the draft's tokenizer.

        Special tokens carry over by content when the draft has the same special (ChatML's
        ``<|im_start|>`` in both families), else they are dropped; the target's BOS is replaced
        by whatever the draft's tokenizer adds itself.
        """
        dt, tt = self.draft_tokenizer, self.target_tokenizer
        t_special = self.mapping.target_tokens.special_ids()
        d_special_by_content = {self.mapping.draft_tokens.pieces[i]: i for i in self._draft_special}
        out = list(dt.backend.encode("", add_special_tokens=True).ids)  # the draft's own BOS, if it adds one
        bos = getattr(tt, "bos_token_id", None)
        run: list[int] = []

        def flush():
            if run:
                out.extend(dt.encode(tt.decode(run), add_special_tokens=False))
                run.clear()

        for i, t in enumerate(target_ids):
            if t in t_special:
                flush()
                if i == 0 and t == bos:
                    continue
                d = d_special_by_content.get(self.mapping.target_tokens.pieces[t])
                if d is not None:
                    out.append(d)
            else:
                run.append(t)
        flush()
        return out

    # ------------------------------------------------------------------ per generation

    def begin(self, state) -> None:
        run = state.run
        params = state.params
        mode = resolve_mode(self.mode, params)
        run.extra["vocab"] = {"mode": mode, "intersection": self.mapping.intersection_size,
                              "draft_vocab": self.mapping.draft_vocab_size,
                              "target_vocab": self.mapping.target_vocab_size}
        prompt = state.tokens[:run.prompt_len]
        own = self.prompt_tokens(prompt)
        limit = self.model.config.max_position_embeddings
        if len(own) > limit:
            raise ValueError(f"the prompt is {len(own)} tokens in the draft's vocabulary, beyond the draft's "
                             f"max_position_embeddings={limit}; shorten the prompt")
        text = _DraftText(own=own, n_prompt=len(own), synced=len(prompt))
        text.add_boundary(0)
        max_new = run.capacity - run.prompt_len
        capacity = min(limit, len(own) + 2 * max_new + run.num_speculative_tokens + 8)
        cache = self.model.new_cache(capacity, batch_size=1)
        if len(own) > 1:
            prefill(self.model, cache, own[:-1], run.device)
            run.draft_forwards += 1
        text.fed = own[:-1] if own else []
        sc = state.scratch(self)
        sc.update(cache=cache, text=text, mode=mode)
        # Fold in anything committed past the prompt (nothing, normally).
        self._sync(text, state.tokens)

    # ------------------------------------------------------------------ keeping the draft's tokens in step

    def _sync(self, text: _DraftText, tokens: list[int]) -> None:
        new = tokens[text.synced:]
        text.synced = len(tokens)
        if not new:
            return
        tpieces = self.mapping.target_tokens.pieces
        dpieces = self.mapping.draft_tokens.pieces
        pieces = [tpieces[t] if t < len(tpieces) else b"" for t in new]
        data = b"".join(pieces)
        base = len(text.committed)
        text.committed += data

        # 1) The draft's own proposals that the target kept (byte for byte) stay as they are.
        pos = 0
        if text.tree is not None:  # a beam's tree: the deepest path the committed bytes spell
            ids, parents, slots = text.tree.ids, text.tree.parents, text.tree.slots
            path = _spelled_path(ids, parents, [dpieces[d] if d < len(dpieces) else b"" for d in ids], data)
            text.proposals = [ids[j] for j in path]
            text.kept = []
            for j in path:
                if slots[j] < 0:
                    break
                text.kept.append((ids[j], slots[j]))
        for d in text.proposals:
            b = dpieces[d] if d < len(dpieces) else b""
            if not b or not data.startswith(b, pos):
                break
            text.own.append(d)
            pos += len(b)
            text.add_boundary(base + pos)
        text.proposals = []
        if pos == len(data):
            return

        # 2) The rest, token for token through the table, when it starts on a target token boundary.
        starts, acc = {}, 0
        for j, b in enumerate(pieces):
            starts[acc] = j
            acc += len(b)
        j = starts.get(pos)
        if j is not None:
            mapped = [self._t2d[t] if t < len(self._t2d) else -1 for t in new[j:]]
            if all(m >= 0 for m in mapped):
                for t, m in zip(new[j:], mapped):
                    text.own.append(m)
                    pos += len(tpieces[t])
                    text.add_boundary(base + pos)
                return

        # 3) Re-tokenize with the draft's tokenizer from a safe boundary a few tokens back.
        k = len(text.safe_idx) - 1
        while k > 0 and text.safe_idx[k] > len(text.own) - DRAFT_LOOKBEHIND:
            k -= 1
        idx, off = text.safe_idx[k], text.safe_off[k]
        del text.safe_idx[k + 1:], text.safe_off[k + 1:]
        del text.own[idx:]
        ids, consumed, exact = self.encoder.encode(bytes(text.committed[off:]), final=True)
        if exact:
            for d in ids:
                text.own.append(d)
                off += len(dpieces[d])
                text.add_boundary(off)
        else:  # the draft cannot spell this text (e.g. a word-level vocabulary): only the end is a boundary
            text.own.extend(ids)
            text.add_boundary(len(text.committed))

    def _room(self, state, sc, need: int) -> int:
        """Make the draft cache hold ``need`` positions if the model allows; returns the positions available."""
        cache = sc["cache"]
        if need <= cache.capacity:
            return cache.capacity
        limit = self.model.config.max_position_embeddings
        if cache.capacity >= limit:
            return cache.capacity
        bigger = self.model.new_cache(min(limit, max(need, 2 * cache.capacity)), batch_size=1)
        fed = sc["text"].fed[:cache.length]
        prefill(self.model, bigger, fed, state.run.device)
        if fed:
            state.run.draft_forwards += 1
        sc["cache"] = bigger
        return bigger.capacity

    # ------------------------------------------------------------------ one draft

    def run(self, state) -> None:
        run = state.run
        device = run.device
        sc = state.scratch(self)
        text: _DraftText = sc["text"]
        self._sync(text, state.tokens)
        if text.tree is not None:  # the last step was a beam: keep its taken path's cached nodes, drop the rest
            base, cache = text.tree.base, sc["cache"]
            if text.kept and cache.length > base == len(text.fed):
                cache.keep(base, [slot for _, slot in text.kept])
                text.fed.extend(t for t, _ in text.kept)
            else:
                cache.truncate(min(cache.length, base))
            text.tree, text.kept = None, []
        k = state.num_draft
        own = text.own
        if k <= 0 or not own:
            self._empty(state)
            return

        cache = sc["cache"]
        fed = text.fed
        common = 0
        limit = min(len(fed), len(own) - 1, cache.length)
        while common < limit and fed[common] == own[common]:
            common += 1
        cache.truncate(common)
        del fed[common:]
        params = state.params
        beam = self.beam if params.greedy else 0  # sampled runs draft a chain (with siblings): see _beam
        capacity = self._room(state, sc, len(own) + k * max(beam, 1))
        cache = sc["cache"]
        k = min(k, capacity - len(own) + 1)
        if k <= 0:
            self._empty(state)
            return

        tli = sc["mode"] == "tli"
        d2t = self.mapping.tables_on(device)[0]
        spellable = self._spellable_on.get(str(device))
        if spellable is None:
            spellable = self._spellable_on.setdefault(str(device), self._spellable.to(device))
        vd = self.mapping.draft_vocab_size
        new = torch.tensor([own[common:]], dtype=torch.int64, device=device)
        fed.extend(own[common:])
        if beam:
            self._beam(state, text, sc["cache"], new, k, beam, d2t if tli else spellable, tli)
            return
        picks: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []  # per depth, what siblings are ranked (and drawn) by
        for i in range(k):
            logits = next_logits(self.model, self.head, new, cache)[:, :vd]  # [1, Vd] fp32
            run.draft_forwards += 1
            logits = vocab_mask_logits(logits, d2t if tli else spellable)
            q = None
            if params.greedy:
                tok = logits.argmax(dim=-1)
            else:
                q = warp_logits(logits, params.temperature, params.top_k, params.top_p)
                tok = sample(q, exponential_noise(q.shape, state.generator, q.device))
                probs.append(q)
            picks.append(tok)
            if self.siblings:
                dists.append(q if q is not None else logits)
            if (self.confidence_threshold is not None and i < k - 1
                    and draft_confidence(logits, tok, q) < self.confidence_threshold):
                break
            new = tok.view(1, 1)
        ids = torch.stack(picks, dim=1)  # [1, k] draft ids
        chain = proposals = ids[0].tolist()
        fed.extend(proposals[:-1])
        if not tli:
            for i, d in enumerate(proposals):
                if d in self._draft_special:
                    proposals = proposals[:i]
                    ids = ids[:, :i]
                    break
        text.proposals = proposals
        if self.siblings:
            if tli:  # one target row per sibling: fill the rows the chain left unused, as ModelDrafter
                slots = sibling_slots(chain, dists, min(self.siblings, k - len(chain)), params.greedy)
                sib_ids, sib_depths = draw_siblings(chain, dists, slots, params.greedy, state.generator)
            else:  # SLEM: best first, the map stage takes them while the target rows last
                slots = sibling_slots(chain, dists, self.siblings, True)
                slots = [s for s in slots if s[1] <= len(proposals) and s[2] not in self._draft_special]
                sib_ids, sib_depths = [s[2] for s in slots], [s[1] for s in slots]
            state.draft_own_parents = tuple(range(len(proposals))) + tuple(sib_depths)
            if sib_ids:
                ids = torch.cat([ids, torch.tensor([sib_ids], dtype=torch.int64, device=device)], dim=1)
                if probs:
                    probs.extend([probs[d] for d in sib_depths])
        elif self.tree:  # a beam drafter's sampled run: a chain, written as a tree
            state.draft_own_parents = tuple(range(len(proposals)))
        state.draft_own_ids = ids
        state.draft_own_probs = torch.stack(probs, dim=1) if probs else None  # [1, k, Vd]

    def _beam(self, state, text: _DraftText, cache, new: torch.Tensor, k: int, width: int, allowed: torch.Tensor,
              tli: bool) -> None:
        """A greedy draft tree grown best first (``graphspec.drafters.grow_beam``) in the draft's own ids.

        SLEM proposes no special token (see the chain). The next step keeps the cached nodes of the path the
        target took (``_sync`` finds it, ``cache.keep``) and drops the rest.
        """
        vd = self.mapping.draft_vocab_size

        def log_probs(logits: torch.Tensor) -> torch.Tensor:  # [n, V]: masked to what the mode may propose
            return torch.log_softmax(vocab_mask_logits(logits[:, :vd], allowed), dim=-1)

        tree = grow_beam(self.model, self.head, cache, new, k, width, self.beam_threshold, log_probs, state.run,
                         skip=frozenset() if tli else frozenset(self._draft_special))
        text.tree = tree
        text.proposals = []
        state.draft_own_ids = torch.tensor([tree.ids], dtype=torch.int64, device=state.run.device).view(1, -1)
        state.draft_own_probs = None
        state.draft_own_parents = tuple(tree.parents)

    def _empty(self, state) -> None:
        state.draft_own_ids = torch.empty(1, 0, dtype=torch.int64, device=state.run.device)
        state.draft_own_probs = None
        if self.tree:
            state.draft_own_parents = ()


class VocabMap(Stage):
    """Move the draft's proposals into the target's vocabulary (TLI: ids and q; SLEM: re-tokenized text)."""

    reads = ("tokens", "num_draft") + DRAFT_OWN_FIELDS
    writes = ("draft_ids", "draft_probs")

    def __init__(self, drafter: CrossVocabDrafter, name: str = "map"):
        super().__init__(name)
        if drafter.tree:
            self.reads = VocabMap.reads + (DRAFT_OWN_TREE,)
            self.writes = VocabMap.writes + ("draft_parents",)
        self.drafter = drafter
        self.mapping = drafter.mapping
        self.encoder = ByteEncoder(drafter.target_tokenizer, self.mapping.target_tokens)
        self._target_special = self.mapping.target_tokens.special_ids()

    def check(self, params) -> None:
        check_mode(self.drafter.mode, params)

    def run(self, state) -> None:
        mode = state.scratch(self.drafter)["mode"]
        own_ids = state.draft_own_ids
        device = own_ids.device
        tree = self.drafter.tree
        if own_ids.shape[1] == 0:
            state.draft_ids = torch.empty(1, 0, dtype=torch.int64, device=device)
            state.draft_probs = None
            if tree:
                state.draft_parents = ()
            return
        if mode == "tli":
            d2t = self.mapping.tables_on(device)[0]
            state.draft_ids = d2t[own_ids]  # the draft sampled inside the intersection: every id maps
            q = state.draft_own_probs
            if q is None:
                state.draft_probs = None
            else:
                k, vd = q.shape[1], q.shape[2]
                state.draft_probs = vocab_map(q.view(k, vd), d2t, self.mapping.target_vocab_size).view(1, k, -1)
            if tree:
                state.draft_parents = tuple(state.draft_own_parents)  # one target id per draft id: same tree
            return
        state.draft_probs = None
        own = own_ids[0].tolist()
        if not tree:
            ids = self.retokenize(state.tokens, own, state.num_draft)
        else:
            ids, parents = self.retokenize_tree(state.tokens, own, tuple(state.draft_own_parents), state.num_draft)
            state.draft_parents = parents
        state.draft_ids = torch.tensor([ids], dtype=torch.int64, device=device).view(1, -1)

    def retokenize_tree(self, committed: list[int], own: list[int], parents: tuple[int, ...],
                        limit: int) -> tuple[list[int], tuple[int, ...]]:
        """SLEM for a draft tree: the target-token trie of the texts of the tree's root-to-leaf paths.

        ``own``/``parents``: the draft's tree (``parents[j]``: 0 for the root, else the parent's row + 1;
        parents before children): a chain then siblings beside it, or a beam's best-first tree. Each
        leaf's text (its path's draft ids), in row order, is re-tokenized as for a chain (up to ``limit``
        target ids) and merged into a trie of target ids: where it agrees with a branch already there it
        follows it, the rest becomes new rows. Rows stop at ``limit`` in all, so a step verifies no more
        rows than a chain of ``limit``. Children of a row differ, as TreeVerify needs.
        """
        has_child = set(parents)
        rows: list[int] = []
        tree: list[int] = []
        kids: dict[tuple[int, int], int] = {}

        def merge(seq: list[int]) -> None:
            cur = 0
            for t in seq:
                nxt = kids.get((cur, t))
                if nxt is None:
                    if len(rows) >= limit:
                        return
                    rows.append(t)
                    tree.append(cur)
                    nxt = kids[(cur, t)] = len(rows)
                cur = nxt

        for j in range(len(own)):
            if j + 1 in has_child:
                continue
            if len(rows) >= limit:
                break
            path, a = [], j + 1
            while a:
                path.append(own[a - 1])
                a = parents[a - 1]
            merge(self.retokenize(committed, path[::-1], limit))
        return rows, tuple(tree)

    def retokenize(self, committed: list[int], own_ids: list[int], limit: int) -> list[int]:
        """SLEM: the target's tokens for the draft's text, continuing ``committed`` (at most ``limit``)."""
        text = self.mapping.draft_tokens.join(own_ids)
        if not text or limit <= 0:
            return []
        tpieces = self.mapping.target_tokens.pieces
        window = committed[-TARGET_LOOKBEHIND:]
        for i in range(len(window) - 1, -1, -1):
            if window[i] in self._target_special or window[i] >= len(tpieces):
                window = window[i + 1:]
                break
        vt = self.mapping.target_vocab_size
        for w in range(len(window), -1, -1):
            ctx = window[len(window) - w:]
            ids, _, _ = self.encoder.encode(b"".join(tpieces[t] for t in ctx) + text, final=False)
            if ids[:w] == ctx:
                out = []
                for t in ids[w:w + limit]:
                    if t >= vt:
                        break
                    out.append(t)
                return out
        return []


def vocab_stages(target, draft, mode: str = "auto", *, cache: bool = True, confidence_threshold: float | None = None,
                 draft_vocab=None, siblings: int = 0, beam: int = 0,
                 beam_threshold: float | str | None = "auto") -> tuple[CrossVocabDrafter, VocabMap]:
    """The draft and map stages for a target and draft with different tokenizers.

    Builds (or loads from the cache) the vocabulary tables; an empty intersection is a
    ValueError, a small one a warning. ``beam_threshold``: the path probability a beam stops growing
    below, "auto" (``BEAM_STOP_PROBABILITY``) or None (never).
    """
    if mode not in VOCAB_MODES:
        raise ValueError(f"vocab_mapping={mode!r} is not one of {VOCAB_MODES}")
    tt, dt = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if tt is None or dt is None:
        which = "the target" if tt is None else "the draft"
        raise ValueError(f"cross-vocabulary drafting needs both tokenizers, but {which} has none")
    mapping = build_vocab_mapping(dt, tt, draft_vocab_size=draft.config.vocab_size,
                                  target_vocab_size=target.config.vocab_size, cache=cache)
    drafter = CrossVocabDrafter(draft, mapping, tt, mode, confidence_threshold=confidence_threshold,
                                draft_vocab=draft_vocab, siblings=siblings, beam=beam,
                                beam_threshold=beam_threshold)
    return drafter, VocabMap(drafter)
