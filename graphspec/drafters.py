"""Draft stages: they propose up to ``num_draft`` tokens for the target to verify.

Both write ``draft_ids [1, k]`` (``0 <= k <= num_draft``; proposing fewer, or none, is allowed)
and ``draft_probs`` (``[1, k, V_target]`` fp32, or None when the draft carries no distribution).

- ``ModelDrafter``: a smaller graphspec model with its own KV cache. Its cache follows the same
  invariant as the target's: it holds every committed token but the last. At the start of each
  draft it rolls back whatever the acceptance threw away (its cache then holds the longest prefix
  that is still committed) and feeds the committed tokens it has not seen: one normally, two after
  all K drafts were accepted (the last draft, which it sampled but never fed, and the bonus
  token). It then drafts one token per forward (``logits_for="last"``). Greedy runs take the
  argmax and pass no probabilities; sampled runs draw every token from the draft's own *warped*
  distribution q (temperature, top-k, top-p, fp32, exponential race with the run's generator)
  and pass q on, because the acceptance ratio p/q is only lossless for the q the token came from.
  The draft's logits are cut (or q zero-padded) to the target's vocabulary width, so it never
  proposes an id the target does not have (embedding tables are often padded differently).
  With ``siblings=n`` it proposes a draft tree: after its chain, up to n sibling leaves (the
  draft's next choices at the depths where reaching them and being wrong is likeliest:
  ``sibling_slots``, ``draw_siblings``, shared with the cross-vocabulary drafter) fill the verify
  rows the chain left unused, and it writes ``draft_parents`` (see ``TreeVerify``). Its own cache
  then keeps only the chain tokens that were committed, since the target may take a sibling.
  With ``beam=w`` (greedy runs, CPU) it grows the tree best first instead (``grow_beam``, shared with
  the cross-vocabulary drafter): each forward after the first feeds the w likeliest nodes of the
  newest level as w rows under a tree mask over the cached nodes, and the K likeliest nodes are
  proposed; the next step keeps the cached nodes of the path the target took (``KVCache.keep``).
  With a prefix cache (``graphspec.prefix_cache``) a greedy run's draft copies the stored rows of its
  prompt's longest stored prefix before prefilling the rest, and hands its committed rows back at the end.
- ``NgramDrafter`` (prompt lookup): proposes the continuation of the most recent earlier
  occurrence of the last n committed tokens, n = max_ngram .. min_ngram. An index from n-gram to
  its latest end position is updated with the new tokens only, so a step costs O(new tokens);
  the proposal is a slice of the device copy of the committed ids. No model, no probabilities
  (one-hot q).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from graphspec.graph import Stage
from graphspec.kernels import EXACT_ROWS_MAX, batched_rows
from graphspec.kernels.sampling import exponential_noise, sample, warp_logits
from graphspec.prefix_cache import check_exact_rows

__all__ = ["AUTO_DRAFT_SIBLINGS", "AUTO_DRAFT_VOCAB", "BEAM_STOP_PROBABILITY", "BeamTree", "DraftHead", "ModelDrafter",
           "NgramDrafter", "SAME_VOCAB_BEAM_STOP_PROBABILITY", "draft_vocab_ids", "draw_siblings", "grow_beam",
           "rows_logits", "sibling_slots"]

DRAFT_READS = ("tokens", "token_buffer", "num_draft", "params", "generator")
DRAFT_WRITES = ("draft_ids", "draft_probs")


def _empty_draft(state) -> None:
    state.draft_ids = torch.empty(1, 0, dtype=torch.int64, device=state.run.device)
    state.draft_probs = None


def prefill(model, cache, tokens: list[int], device, exact: bool = False) -> None:
    """Feed ``tokens`` into ``cache`` without computing any logits (no final norm / lm_head).

    Batched (``graphspec.kernels.batched_rows``): a prefill's rows are never compared with one-token
    steps, since the target is prefilled the same way with a draft and without one. ``exact``: in blocks of
    ``model.exact_block_rows()`` rows (``EXACT_ROWS_MAX``, more where the C++ kernels run them all), each row the
    bits a one-token step computes at its position (on the CPU), so the rows are the same whoever computed them:
    what a prefix cache needs (``graphspec.prefix_cache``).
    """
    if not tokens:
        return
    ids = torch.tensor([tokens], dtype=torch.int64, device=device)
    none = torch.empty(0, dtype=torch.int64, device=device)
    if exact:
        block = model.exact_block_rows() if hasattr(model, "exact_block_rows") else EXACT_ROWS_MAX
        for start in range(0, len(tokens), block):
            model.step(ids[:, start:start + block], cache, logits_for=none)
        return
    with batched_rows():
        model.step(ids, cache, logits_for=none)


def fill_from_store(model, cache, state, target: bool) -> int:
    """Copy the rows of the longest stored prefix of the committed tokens (all but the pending one) into the empty
    ``cache`` from the run's prefix cache; returns how many (0: none, no prefix cache, or a sampled run's draft,
    whose rows must be the cold run's for a seed to keep giving one sample: ``graphspec.prefix_cache``)."""
    store = state.run.prefix_cache
    if store is None or not (target or state.params.greedy):
        return 0
    return store.fill(model, cache, state.tokens[:-1], exact=target)


# draft_siblings="auto" (graphspec.defaults): a model draft proposes up to this many siblings in the verify
# rows its chain leaves unused. Siblings raise the tokens a verify emits at the price of fuller verifies, so
# they pay where a verify of K + 1 rows costs about a one-token step; the benchmarks chose 4 (perf/RESULTS.md).
AUTO_DRAFT_SIBLINGS = 4


def check_siblings(value, allow_auto: bool = False) -> int | str:
    if allow_auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"draft_siblings must be an int >= 0 (0: a plain chain of drafts)"
                         f"{' or auto' if allow_auto else ''}, got {value!r}")
    return value


def check_beam(value, model=None) -> int:
    """A beam width (0: none); given the draft ``model``, a beam is refused off the CPU."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"draft_beam must be an int >= 0 (0: no beam; 2: expand the two likeliest paths per "
                         f"draft forward), got {value!r}")
    if value and model is not None and torch.device(model.device).type != "cpu":
        raise ValueError(f"a draft beam grows its tree over cached nodes, which the attention op masks on the CPU "
                         f"only; the draft is on {model.device}: use draft_beam=0 there")
    return value


def check_beam_threshold(value, auto: float) -> float:
    """A beam's stop probability: ``value`` in [0, 1), ``auto`` for "auto", 0.0 (never stop) for None."""
    if value == "auto":
        return auto
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ValueError(f"beam_threshold must be a probability in [0, 1), 'auto' or None, got {value!r}")
    return float(value)


def check_confidence_threshold(value, allow_auto: bool = False) -> float | str | None:
    if value is None or (allow_auto and value == "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"draft_confidence_threshold must be None{', auto' if allow_auto else ''} or a number "
                         f"in [0, 1), got {value!r}")
    return float(value) or None


def draft_confidence(logits: torch.Tensor, token: torch.Tensor, q: torch.Tensor | None) -> float:
    """The draft's own probability of the token it just proposed (q when sampling, softmax(logits) greedy).

    Stopping a draft when this falls below a threshold keeps the output lossless: how many tokens
    are proposed depends only on the draft's own state, never on the target's.
    """
    if q is not None:
        return float(q[0, token[0]])
    return float(torch.exp(logits[0, token[0]] - torch.logsumexp(logits[0], dim=-1)))


def sibling_slots(chain: list[int], dists: list[torch.Tensor], budget: int, greedy: bool,
                  min_score: float = 0.0) -> list[tuple[float, int, int]]:
    """The ``budget`` best places for a sibling leaf beside ``chain``: ``(score, depth, token)``, best first.

    ``dists[i]`` ``[1, V]`` is what the draft chose ``chain[i]`` from: its logits (greedy) or its warped q
    (sampling). A slot (depth i, rank r) scores P(the draft reaches depth i along the chain) x the r-th
    largest probability among the other tokens at depth i: the draft's own guess of how often the target
    takes that leaf. ``token`` is that r-th token (the leaf itself when greedy; sampled leaves are drawn by
    ``draw_siblings``). Slots scoring below ``min_score`` are left out.
    """
    if budget <= 0:
        return []
    slots: list[tuple[float, int, int]] = []
    reach = 1.0
    for depth, (a, d) in enumerate(zip(chain, dists)):
        p = torch.softmax(d[0], dim=-1) if greedy else d[0]
        vals, idx = torch.topk(p, min(budget + 1, p.shape[-1]))
        others = [(v, t) for v, t in zip(vals.tolist(), idx.tolist()) if t != a and v > 0][:budget]
        slots.extend((reach * v, depth, t) for v, t in others if reach * v >= min_score)
        reach *= float(p[a])
    return sorted(slots, key=lambda s: -s[0])[:budget]  # stable: ties keep the shallower slot


def draw_siblings(chain: list[int], dists: list[torch.Tensor], slots: list[tuple[float, int, int]], greedy: bool,
                  generator) -> tuple[list[int], list[int]]:
    """The leaves for ``slots`` (``sibling_slots``): ``(ids, depths)``, depth-major, in draw order.

    Greedy: each slot's own token. Sampling: how many leaves a depth gets is decided before any is
    drawn, then they are drawn from q without replacement (the chain's token removed first), which is
    what ``TreeAcceptance``'s recursive rejection sampling needs. The chain is never cut to make room:
    whether a sampled token is offered must not depend on its own value (a version that did was biased,
    and tests/graphspec/test_tree.py's chi-square test caught it).
    """
    chosen = sorted(slots, key=lambda s: s[1])  # depth-major, stable
    if greedy:
        return [t for _, _, t in chosen], [depth for _, depth, _ in chosen]
    ids: list[int] = []
    depths: list[int] = []
    for depth in sorted({depth for _, depth, _ in chosen}):
        q = dists[depth][0].clone()
        q[chain[depth]] = 0.0
        for _ in range(sum(1 for _, d_, _ in chosen if d_ == depth)):
            t = int(sample(q.view(1, -1), exponential_noise((1, q.shape[-1]), generator, q.device))[0])
            ids.append(t)
            depths.append(depth)
            q[t] = 0.0
    return ids, depths


def start_cache(model, state):
    """A fresh KV cache for this run holding every committed token but the pending last one.

    Returns ``(cache, forwards)``: 1 if a prefill forward ran, 0 for a one-token prompt (or one the run's
    prefix cache held whole). With a prefix cache, the rows of the longest stored prefix are copied in first,
    and the target's prefill is row-exact (``prefill(exact=True)``), hit or miss.
    """
    run = state.run
    cache = model.new_cache(run.capacity, batch_size=1)
    target = model is run.target
    if target and run.prefix_cache is not None:
        check_exact_rows(model)
    want = state.tokens[:-1]
    reused = fill_from_store(model, cache, state, target)
    if target:
        run.extra["prefix_reused"] = reused
    prefill(model, cache, want[reused:], run.device, exact=target and run.prefix_cache is not None)
    return cache, int(len(want) > reused)


def storing_rows(state) -> bool:
    """Whether a stage's ``end`` hands its rows to a prefix cache: the run has one and ended between steps
    (``run.extra["settled"]``, set by the pipeline), not inside a step that failed (then nothing is stored)."""
    return state.run.prefix_cache is not None and bool(state.run.extra.get("settled"))


def store_rows(model, cache, state, n: int) -> None:
    """Hand the first ``n`` rows of ``cache`` (they hold the committed tokens ``0 .. n - 1``) to the run's prefix
    cache (``storing_rows`` said yes). The target's rows are marked row-exact; a draft's (batched prefills, tree
    forwards) are not."""
    if n > 0:
        state.run.prefix_cache.store(model, cache, state.tokens[:n], exact=model is state.run.target)


# draft_vocab="auto" (graphspec.defaults): an int8 draft keeps this many ids (plus specials), any other draft
# all of them. An int8 draft's lm_head is the largest share of the bytes a draft step reads; the ids kept must
# still cover the target's common answers (fewer lost acceptance in the sweeps, perf/RESULTS.md).
# Vocabularies up to this size are kept whole.
AUTO_DRAFT_VOCAB = 65536


def draft_vocab_ids(model, keep) -> torch.Tensor | None:
    """The draft vocabulary ids a pruned draft head keeps (sorted int64), or None to keep them all.

    ``keep``: an int n, the ids below n plus every special or added token of the model's tokenizer
    and its eos/bos ids (a byte-level BPE vocabulary lists tokens in merge order, and merges follow
    their frequency in the tokenizer's training text, so the lowest ids are the most common
    tokens); or an explicit collection of ids (say, the ids seen in a corpus); or "auto":
    ``AUTO_DRAFT_VOCAB`` for an int8 model (``quantize="int8"``, whose head is the largest share of
    its bytes), everything otherwise. None (or n at least the vocabulary size) keeps everything.
    """
    if keep is None:
        return None
    if isinstance(keep, str):
        if keep != "auto":
            raise ValueError(f"draft_vocab must be None, 'auto', a positive int or a collection of token ids, "
                             f"got {keep!r}")
        if not getattr(model, "quantize", None):
            return None
        keep = AUTO_DRAFT_VOCAB
    vocab = model.config.vocab_size
    if isinstance(keep, bool):
        raise ValueError(f"draft_vocab must be None, a positive int or a collection of token ids, got {keep!r}")
    if isinstance(keep, int):
        if keep < 1:
            raise ValueError(f"draft_vocab={keep}; keep at least one token id (or None for the whole vocabulary)")
        if keep >= vocab:
            return None
        extra: set[int] = set(model.config.eos_token_ids)
        if model.config.bos_token_id is not None:
            extra.add(model.config.bos_token_id)
        tok = getattr(model, "tokenizer", None)
        if tok is not None:
            extra.update(tok.special_ids)
            extra.update(tok.eos_token_ids)
            extra.update(tok.backend.get_added_tokens_decoder())
        ids = sorted(set(range(keep)) | {i for i in extra if 0 <= i < vocab})
        return torch.tensor(ids, dtype=torch.int64)
    try:
        ids = sorted({int(i) for i in keep})
    except (TypeError, ValueError):
        raise ValueError(f"draft_vocab must be None, a positive int or a collection of int token ids, got "
                         f"{type(keep).__name__}") from None
    if not ids or ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(f"draft_vocab ids must be a non-empty collection in [0, {vocab}), got "
                         f"{len(ids)} ids" + (f" in [{ids[0]}, {ids[-1]}]" if ids else ""))
    return torch.tensor(ids, dtype=torch.int64)


class DraftHead:
    """A draft's logits over part of its vocabulary (draft vocabulary pruning).

    The lm_head of a small draft is a large share of what a draft step reads (Qwen2.5-0.5B: 136M of
    its 494M parameters); keeping only ``ids`` computes ``len(ids)`` logits and leaves the rest at
    -inf, so the draft never proposes them. Lossless whatever is kept: the draft only proposes,
    and when sampling, q is the draft's (renormalised) distribution over the kept ids, which is
    what rejection sampling divides by.
    """

    def __init__(self, model, ids: torch.Tensor):
        self.ids = ids.to(model.device)  # sorted int64, from draft_vocab_ids
        self.width = model.config.vocab_size
        self.weight = model.head_rows(self.ids)

    @classmethod
    def build(cls, model, keep) -> "DraftHead | None":
        """The head keeping ``draft_vocab_ids(model, keep)``, or None when that is the whole vocabulary."""
        ids = draft_vocab_ids(model, keep)
        return None if ids is None else cls(model, ids)

    def __len__(self) -> int:
        return self.ids.numel()

    def logits(self, model, new: torch.Tensor, cache) -> torch.Tensor:
        """The next-token logits ``[1, V]`` fp32 after feeding ``new``, -inf outside the kept ids."""
        part = model.step(new, cache, logits_for="last", head=self.weight)[:, -1]  # [1, n]
        full = part.new_full((1, self.width), float("-inf"))
        return full.index_copy_(1, self.ids, part)


def next_logits(model, head: DraftHead | None, new: torch.Tensor, cache) -> torch.Tensor:
    """One draft forward: feed ``new`` and return the last position's logits ``[1, V]`` fp32."""
    if head is None:
        return model.step(new, cache, logits_for="last")[:, -1]
    return head.logits(model, new, cache)


def rows_logits(model, head: DraftHead | None, new: torch.Tensor, cache, positions: torch.Tensor,
                tree: torch.Tensor) -> torch.Tensor:
    """One draft forward over tree nodes ``new [1, T]``: every row's next-token logits ``[T, V]`` fp32."""
    if head is None:
        return model.step(new, cache, positions=positions, tree=tree)[0]
    part = model.step(new, cache, positions=positions, tree=tree, head=head.weight)[0]  # [T, n]
    full = part.new_full((part.shape[0], head.width), float("-inf"))
    return full.index_copy_(1, head.ids, part)


# A beam (``draft_beam=w``) stops growing once its likeliest path's draft probability falls below its
# threshold or after BEAM_MAX_DEPTH forwards, and keeps this many children per node beyond its width
# (the root: twice as many): the settings of the replay that chose the design (perf/RESULTS.md).
# The threshold "auto" means: BEAM_STOP_PROBABILITY across tokenizers (CrossVocabDrafter) and
# SAME_VOCAB_BEAM_STOP_PROBABILITY with the target's tokenizer (ModelDrafter), whose longer tokens make a
# deep low-probability path less likely to be taken; both come from paired sweeps.
BEAM_STOP_PROBABILITY = 0.15
SAME_VOCAB_BEAM_STOP_PROBABILITY = 0.25
BEAM_EXTRA_CHILDREN = 2
BEAM_MAX_DEPTH = 6  # forwards a step at most (deeper limits gained nothing in the sweeps: the path score stops first)


@dataclasses.dataclass
class BeamTree:
    """A draft tree grown by :func:`grow_beam`, as proposed: ``ids[r]`` with parent ``parents[r]`` (0: the
    root, else the parent's row + 1, as ``draft_parents``), ``slots[r]`` the draft-cache slot that node was
    fed at (-1: a leaf, never fed), ``base`` the cache length before the first node."""

    ids: list[int]
    parents: list[int]
    slots: list[int]
    base: int

    def taken_slots(self, committed: list[int]) -> list[int]:
        """The cache slots of the tree path ``committed`` (the tokens committed after ``base``) spells, while fed."""
        out, row_of_parent = [], 0
        for tok in committed:
            row = next((r for r, (t, p) in enumerate(zip(self.ids, self.parents)) if p == row_of_parent and t == tok),
                       None)
            if row is None or self.slots[row] < 0:
                break
            out.append(self.slots[row])
            row_of_parent = row + 1
        return out


def grow_beam(model, head: DraftHead | None, cache, new: torch.Tensor, k: int, width: int, threshold: float,
              log_probs, run, skip=frozenset()) -> BeamTree:
    """A greedy draft tree grown best first (after EAGLE-2's dynamic trees): up to ``k`` draft tokens.

    The first forward feeds ``new`` (what the cache lacks) and ranks the first tokens. Each later forward
    feeds the ``width`` likeliest nodes of the deepest level as ``width`` rows of one draft step: the
    cache holds earlier levels' nodes, and a ``[rows, m]`` tree mask over them lets each row see only its
    own ancestors. A node's score is its path's draft probability; growth stops at depth ``k`` (or
    BEAM_MAX_DEPTH forwards), once the level's best path scores below ``threshold``, once the cache is
    full, or once k nodes outscore it (a child never scores above its parent, so nothing deeper could
    be proposed). The tree proposed is the ``k`` best-scoring nodes (each with its parent: scores only
    fall along a path). Greedy acceptance takes the longest branch the target agrees with, so any tree
    is lossless; sampled runs never come here (rejection sampling needs drafted, not ranked, tokens).
    ``log_probs(logits [n, V]) -> [n, V']``: the draft's log-probabilities over what it may propose;
    ``skip``: ids never proposed. Counts its forwards in ``run.draft_forwards``.
    """
    base = cache.length + new.shape[1]
    capacity = cache.capacity
    toks: list[int] = []
    parent: list[int] = []   # node index, -1: the root
    score: list[float] = []  # log of the path's draft probability
    depth: list[int] = []
    slot: list[int] = []     # cache slot once fed, else -1

    def children(lp: torch.Tensor, of: int, how_many: int) -> list[int]:
        """Add node ``of``'s ``how_many`` likeliest children from its log-probabilities ``lp [V]``."""
        vals, idx = torch.topk(lp, min(how_many + len(skip), lp.shape[-1]))
        at = 0.0 if of < 0 else score[of]
        added = []
        for v, t in zip(vals.tolist(), idx.tolist()):
            if v == float("-inf") or t in skip:
                continue
            if len(added) == how_many:
                break
            toks.append(t)
            parent.append(of)
            score.append(at + v)
            slot.append(-1)
            depth.append(1 if of < 0 else depth[of] + 1)
            added.append(len(toks) - 1)
        return added

    root = log_probs(next_logits(model, head, new, cache))
    run.draft_forwards += 1
    level = children(root[0], -1, 2 * (width + BEAM_EXTRA_CHILDREN))
    floor = math.log(threshold) if threshold > 0 else float("-inf")
    for _ in range(min(k, BEAM_MAX_DEPTH) - 1):
        level = sorted(level, key=lambda n: -score[n])[:width]
        if not level or score[level[0]] < floor or cache.length + len(level) > capacity:
            break
        if sum(1 for x in score if x > score[level[0]]) >= k:  # no descendant could make the k best
            break
        m = cache.length - base + len(level)  # tree columns: cached nodes, then this level
        mask = torch.zeros(len(level), m, dtype=torch.bool)
        for r, n in enumerate(level):
            mask[r, m - len(level) + r] = True
            a = parent[n]
            while a >= 0:
                mask[r, slot[a] - base] = True
                a = parent[a]
        ids = torch.tensor([[toks[n] for n in level]], dtype=torch.int64, device=run.device)
        positions = torch.tensor([[base + depth[n] - 1 for n in level]], dtype=torch.int64, device=run.device)
        first = cache.length
        out = log_probs(rows_logits(model, head, ids, cache, positions, mask.to(run.device)))
        run.draft_forwards += 1
        nxt: list[int] = []
        for r, n in enumerate(level):
            slot[n] = first + r
            nxt.extend(children(out[r], n, width + BEAM_EXTRA_CHILDREN))
        level = nxt
    chosen: dict[int, int] = {}  # node -> row
    out_ids: list[int] = []
    out_parents: list[int] = []
    for n in sorted(range(len(toks)), key=lambda n: (-score[n], depth[n])):
        if len(out_ids) >= k:
            break
        a = parent[n]
        if a >= 0 and a not in chosen:
            continue
        chosen[n] = len(out_ids)
        out_ids.append(toks[n])
        out_parents.append(0 if a < 0 else chosen[a] + 1)
    return BeamTree(out_ids, out_parents, [slot[n] for n in chosen], base)


class ModelDrafter(Stage):
    """Draft with a (smaller) language model that shares the target's vocabulary."""

    reads = DRAFT_READS
    writes = DRAFT_WRITES
    # Sibling leaves scoring below this (the draft's own probability that the target takes them) are left
    # out. 0: every free row gets one (a free verify row costs little; a floor saved siblings but no time in
    # perf/draft_sweep.py --sibling-min-score), so the library keeps 0; a knob for experiments.
    sibling_min_score = 0.0

    def __init__(self, model, name: str = "draft", confidence_threshold: float | None = None, draft_vocab=None,
                 siblings: int = 0, beam: int = 0, beam_threshold: float | str | None = "auto"):
        super().__init__(name)
        self.siblings = check_siblings(siblings)
        for attr in ("step", "new_cache", "config"):
            if not hasattr(model, attr):
                raise ValueError(f"ModelDrafter needs a graphspec model (with .{attr}); got {type(model).__name__}")
        # A beam (greedy runs): the tree grows best first, each forward after the first feeding the ``beam``
        # likeliest paths as rows (grow_beam); sampled runs draft a chain (with siblings) as without it.
        self.beam = check_beam(beam, model)
        self.beam_threshold = check_beam_threshold(beam_threshold, SAME_VOCAB_BEAM_STOP_PROBABILITY)
        self.tree = bool(self.siblings or self.beam)
        if self.tree:  # a draft tree: the verify and accept stages must read its shape
            self.writes = DRAFT_WRITES + ("draft_parents",)
        self.model = model
        # draft vocabulary pruning (see DraftHead); None computes every logit
        self.head = DraftHead.build(model, draft_vocab)
        # Stop drafting early once the draft itself gives its proposal less than this probability:
        # such tokens are rarely accepted, and each costs a draft forward (None: always draft K).
        self.confidence_threshold = check_confidence_threshold(confidence_threshold)

    def begin(self, state, fill: bool = True) -> None:
        """A fresh cache, prefilled with the prompt (``fill=False``: empty; the caller feeds it later)."""
        if self.head is not None and int(self.head.ids[0]) >= state.run.vocab_size:
            raise ValueError(f"draft_vocab keeps no id below the target's vocabulary size {state.run.vocab_size}: "
                             "the draft could never propose a token; keep lower ids")
        if fill:
            cache, forwards = start_cache(self.model, state)
            state.run.draft_forwards += forwards
        else:
            cache = self.model.new_cache(state.run.capacity, batch_size=1)
        state.scratch(self)["cache"] = cache

    def drop_uncommitted(self, state, scratch: dict, cache) -> None:
        """Cut ``cache`` back to the committed tokens (the pending one stays out) after a chain or tree step."""
        n = len(state.tokens)
        if self.siblings:
            # The target may have taken a sibling where this cache holds the chain's token: keep only
            # the chain tokens that were committed.
            start, fed = scratch.get("fed", (n, []))
            same = 0
            for a, b in zip(fed, state.tokens[start:n - 1]):
                if a != b:
                    break
                same += 1
            cache.truncate(min(cache.length, start + same, n - 1))
        else:
            # Everything past n - 1 is either the pending token or a rejected draft.
            cache.truncate(min(cache.length, n - 1))

    def end(self, state) -> None:
        """After a generation: the rows of committed tokens go to the run's prefix cache, if it has one (a beam's
        cache may hold other nodes past the prompt, so a beam gives the prompt's rows only)."""
        if not storing_rows(state):
            return
        sc = state.scratch(self)
        cache = sc.get("cache")
        if cache is None:
            return
        if self.beam:
            n = min(cache.length, state.run.prompt_len - 1)
        else:
            self.drop_uncommitted(state, sc, cache)
            n = min(cache.length, len(state.tokens) - 1)
        store_rows(self.model, cache, state, n)

    def catch_up(self, state) -> None:
        """Feed the committed tokens (all but the pending one) that this draft's cache lacks as one batched
        prefill: after steps it did not draft, or at its first step when it began with ``fill=False``. A draft
        step would feed them itself, but as the rows of one step, which the CPU's few-row kernels compute a row
        at a time; one or two are left to it. A beam keeps the taken path's cached nodes itself: left alone."""
        if self.beam:
            return
        sc = state.scratch(self)
        cache = sc.get("cache")
        n = len(state.tokens)
        if cache is None or n - 1 - cache.length < 2:
            return
        self.drop_uncommitted(state, sc, cache)
        if cache.length == 0:  # first feed of a cache begun empty (a hybrid's model draft): stored rows first
            fill_from_store(self.model, cache, state, target=False)
        missed = state.tokens[cache.length:n - 1]
        if len(missed) >= 2:
            prefill(self.model, cache, missed, state.run.device)
            state.run.draft_forwards += 1
        sc["fed"] = (cache.length, [])

    def draw(self, logits: torch.Tensor, params, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next draft token from ``logits [1, V]`` fp32: ``(token [1], q [1, V] fp32 or None)``.

        Greedy: the argmax, no distribution. Sampling: a draw from the warped q, and q itself.
        """
        if params.greedy:
            return logits.argmax(dim=-1), None
        q = warp_logits(logits, params.temperature, params.top_k, params.top_p)
        return sample(q, exponential_noise(q.shape, generator, q.device)), q

    def run(self, state) -> None:
        k = state.num_draft
        if k <= 0:
            _empty_draft(state)
            if self.tree:
                state.draft_parents = ()
            return
        run = state.run
        scratch = state.scratch(self)
        cache = scratch["cache"]
        n = len(state.tokens)
        last: BeamTree | None = scratch.pop("beam", None)
        if last is not None:
            # The last step was a beam: keep the cached nodes of the path the target took, drop the rest
            # (the pending token stays out, as ever).
            kept = last.taken_slots(state.tokens[last.base:n - 1])
            if kept and cache.length > last.base:
                cache.keep(last.base, kept)
            else:
                cache.truncate(min(cache.length, last.base))
        else:
            self.drop_uncommitted(state, scratch, cache)
        new = state.token_buffer[cache.length:n].view(1, -1)
        V = run.vocab_size
        if self.beam and state.params.greedy:
            tree = grow_beam(self.model, self.head, cache, new, k, self.beam, self.beam_threshold,
                             lambda logits: torch.log_softmax(logits[:, :V], dim=-1), run)
            scratch["beam"] = tree
            state.draft_ids = torch.tensor([tree.ids], dtype=torch.int64, device=run.device).view(1, -1)
            state.draft_probs = None
            state.draft_parents = tuple(tree.parents)
            return
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []  # per depth, the distribution siblings are ranked (and drawn) by
        for i in range(k):
            logits = next_logits(self.model, self.head, new, cache)[:, :V]  # [1, <=V] fp32
            run.draft_forwards += 1
            tok, q = self.draw(logits, state.params, state.generator)
            ids.append(tok)
            if q is not None:
                probs.append(q)
            if self.siblings:
                dists.append(q if q is not None else logits)
            if (self.confidence_threshold is not None and i < k - 1
                    and draft_confidence(logits, tok, q) < self.confidence_threshold):
                break
            new = tok.view(1, 1)
        if self.siblings:
            chain = [int(t) for t in ids]
            scratch["fed"] = (n, chain[:-1])  # the last proposal was never fed
            sib_ids, sib_depths = self._siblings(chain, dists, min(self.siblings, k - len(chain)), state)
            state.draft_parents = tuple(range(len(chain))) + tuple(sib_depths)
            for t, depth in zip(sib_ids, sib_depths):
                ids.append(torch.tensor([t], dtype=torch.int64, device=run.device))
                if probs:
                    probs.append(probs[depth])
        elif self.tree:  # a beam drafter's sampled run: a chain, written as a tree
            state.draft_parents = tuple(range(len(ids)))
        state.draft_ids = torch.stack(ids, dim=1)  # [1, k]
        if not probs:
            state.draft_probs = None
            return
        q = torch.stack(probs, dim=1)  # [1, k, Vd]
        if q.shape[-1] < V:
            q = torch.nn.functional.pad(q, (0, V - q.shape[-1]))
        state.draft_probs = q

    def _siblings(self, chain: list[int], dists: list[torch.Tensor], budget: int, state) -> tuple[list[int], list[int]]:
        """Up to ``budget`` sibling leaves for ``chain``: ``(ids, depths)``, depth-major (``sibling_slots``)."""
        slots = sibling_slots(chain, dists, budget, state.params.greedy, self.sibling_min_score)
        return draw_siblings(chain, dists, slots, state.params.greedy, state.generator)


class NgramDrafter(Stage):
    """Prompt-lookup drafting: continue the latest earlier match of the last ``max_ngram..min_ngram`` tokens."""

    reads = ("tokens", "token_buffer", "num_draft")
    writes = DRAFT_WRITES

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "draft"):
        super().__init__(name)
        for pname, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{pname} must be an int >= 1, got {v!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} is larger than max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, state) -> None:
        # index[n][ngram] = the position right after the latest occurrence of ngram
        state.scratch(self).update(index={n: {} for n in range(self.min_ngram, self.max_ngram + 1)}, upto=0)

    def propose(self, tokens: list[int], k: int, scratch: dict) -> list[int]:
        """The continuation (at most k ids) of the latest earlier occurrence of the longest matching suffix."""
        start, n = self._match(tokens, k, scratch)
        return tokens[start:start + n]

    def _match(self, tokens: list[int], k: int, scratch: dict) -> tuple[int, int]:
        """Where the proposal starts in ``tokens`` and how long it is (0: nothing to propose)."""
        L = len(tokens)
        index = scratch["index"]
        # Index every n-gram ending at or before L - 1: the suffix itself (ending at L) must not
        # match itself, and a match ending at e <= L - 1 always has at least one token after it.
        for e in range(max(scratch["upto"] + 1, 1), L):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                index[n][tuple(tokens[e - n:e])] = e
        scratch["upto"] = max(scratch["upto"], L - 1)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            e = index[n].get(tuple(tokens[L - n:]))
            if e is not None:
                return e, min(k, L - e)
        return 0, 0

    def run(self, state) -> None:
        k = state.num_draft
        if k <= 0:
            _empty_draft(state)
            return
        start, n = self._match(state.tokens, k, state.scratch(self))
        # the proposal is a stretch of committed tokens: a view of the device copy, no host->device transfer
        state.draft_ids = state.token_buffer[start:start + n].view(1, n)
        state.draft_probs = None
