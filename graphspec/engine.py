"""The batched engine: many generations at once, each the very code of ``Pipeline.run``, sharing forwards.

- Each sequence runs ``Pipeline``'s own generation loop (its graph, its ``State``, its generator and stop
  rules) in a worker thread of its own. The stages of the engine's graph call ``model.step`` on a proxy
  (``_BatchedModel``) that does not run the forward: it hands the call to the ``_Batcher`` and waits.
- When every running sequence waits on a forward, the batcher runs the pending calls of the cheapest model
  first (so every sequence that still drafts gets its next draft token from one batched draft forward),
  and the target's calls only when nothing else is pending: one target forward then verifies every
  sequence's block (ragged rows: chains, trees, plain one-row steps side by side), through
  ``Transformer.step_many`` (GEMMs over all rows at once, attention per sequence against its own cache).
- Exactness: a call's logits are the bits its own ``step`` gives, because the CPU kernels are row-exact for
  blocks of up to ``EXACT_ROWS_MAX`` rows (the batcher never packs more rows into one forward) and attention
  runs per sequence. So a greedy request gives token for token what ``Pipeline.run`` gives alone, and a
  seeded sampled request the same sample, whatever else is in the batch. Prefills (``batched_rows``) run one
  sequence at a time, exactly as ``Pipeline.run`` runs them. With a prefix cache (``graphspec.prefix_cache``) the
  target's prefills are row-exact blocks instead, which may share a forward with other sequences' rows; the
  sequences share the pipeline's cache, and the policy counts a draft's stored rows as no catch-up.
- Requests join between forwards and leave when they finish or are cancelled (continuous batching); a
  sequence's caches are freed with its generation. At most ``max_batch`` sequences run; the rest wait in a
  FIFO queue of at most ``max_queue`` (beyond it ``submit`` raises ``QueueFull``).
- The speculation policy (``SpeculationPolicy``) picks each greedy sequence's draft length per step from its
  acceptance so far and the measured cost of forwards at the current batch size; sampled requests keep the
  pipeline's K so that a seed gives the same sample alone and batched.
"""

from __future__ import annotations

import collections
import contextvars
import gc
import itertools
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from graphspec.acceptance import TreeAcceptance, greedy_accept
from graphspec.drafters import ModelDrafter, prefill
from graphspec.graph import Stage
from graphspec.kernels import EXACT_ROWS_MAX
from graphspec.kernels._dispatch import _override, rows_exact
from graphspec.verify import TreeVerify, Verify

__all__ = ["Engine", "EngineSequence", "QueueFull", "SpeculationPolicy", "SequenceView", "CostTable", "FINISHED"]


class QueueFull(RuntimeError):
    """``Engine.submit`` found every slot busy and the waiting queue at its limit."""


# ------------------------------------------------------------------------------------------ batching

@dataclass
class _Call:
    proxy: "_BatchedModel"
    kwargs: dict
    context: contextvars.Context
    done: bool = False
    result: object = None
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        return int(self.kwargs["token_ids"].shape[-1])

    def key(self) -> tuple:
        """Calls that may share a forward: same model, same head, same row-exactness and backend pin."""
        exact, backend = self.context.run(lambda: (rows_exact(), _override.get()))
        return id(self.proxy), id(self.kwargs.get("head")), exact, backend


class _Batcher:
    """The rendezvous of the engine's worker threads: a forward runs once every member waits on one."""

    def __init__(self, max_rows: int = EXACT_ROWS_MAX):
        self.max_rows = max_rows
        self._cv = threading.Condition()
        self._members = 0
        self._pending: list[_Call] = []
        self._flushing = False
        self._local = threading.local()
        self.forwards: dict[str, int] = {}  # model name -> batched forwards run
        self.rows: dict[str, int] = {}      # model name -> rows run in them

    def is_member(self) -> bool:
        return getattr(self._local, "member", False)

    def join_for(self, thread: threading.Thread) -> None:
        """Count ``thread`` (about to start) as a member: forwards wait for its first call from now on."""
        with self._cv:
            self._members += 1

    def enter(self) -> None:
        """Mark the calling thread (counted by ``join_for``) as a member: its model calls go through here."""
        self._local.member = True

    def leave(self) -> None:
        with self._cv:
            self._members -= 1
            self._local.member = False
            self._cv.notify_all()  # the others may all be waiting now
        self._maybe_flush()

    def call(self, proxy: "_BatchedModel", kwargs: dict):
        c = _Call(proxy, kwargs, contextvars.copy_context())
        with self._cv:
            self._pending.append(c)
        self._maybe_flush()
        with self._cv:
            while not c.done:
                self._cv.wait(timeout=0.5)
                if not c.done and self._ready():
                    self._cv.release()
                    try:
                        self._maybe_flush()
                    finally:
                        self._cv.acquire()
        if c.error is not None:
            raise c.error
        return c.result

    def _ready(self) -> bool:
        return bool(self._pending) and not self._flushing and len(self._pending) >= self._members

    def _maybe_flush(self) -> None:
        """Run forwards while every member waits: the cheapest model's calls first."""
        while True:
            with self._cv:
                if not self._ready():
                    return
                self._flushing = True
                cheapest = min(c.proxy.priority for c in self._pending)
                batch = [c for c in self._pending if c.proxy.priority == cheapest]
                self._pending = [c for c in self._pending if c.proxy.priority != cheapest]
            try:
                self._run(batch)
            finally:
                with self._cv:
                    self._flushing = False
                    self._cv.notify_all()

    def _run(self, calls: list[_Call]) -> None:
        groups: dict[tuple, list[_Call]] = {}
        for c in calls:
            groups.setdefault(c.key(), []).append(c)
        for (_, _, exact, _), group in groups.items():
            if not exact:  # prefills: one at a time, as Pipeline.run runs them
                for c in group:
                    self._execute([c])
                continue
            chunk: list[_Call] = []
            for c in group:
                if chunk and sum(x.rows for x in chunk) + c.rows > self.max_rows:
                    self._execute(chunk)
                    chunk = []
                chunk.append(c)
            if chunk:
                self._execute(chunk)

    def _execute(self, chunk: list[_Call]) -> None:
        proxy = chunk[0].proxy
        model = proxy.model
        try:
            if len(chunk) > 1 and hasattr(model, "step_many"):
                try:
                    out = chunk[0].context.run(model.step_many, [c.kwargs for c in chunk])
                except BaseException as e:  # every caller of the shared forward sees the failure
                    for c in chunk:
                        c.error = e
                else:
                    for c, r in zip(chunk, out):
                        c.result = r
            else:
                for c in chunk:
                    try:
                        c.result = c.context.run(lambda: model.step(**c.kwargs))
                    except BaseException as e:
                        c.error = e
        finally:
            self.forwards[proxy.name] = self.forwards.get(proxy.name, 0) + 1
            self.rows[proxy.name] = self.rows.get(proxy.name, 0) + sum(c.rows for c in chunk)
            with self._cv:
                for c in chunk:
                    c.done = True
                self._cv.notify_all()


class _BatchedModel:
    """A loaded model whose ``step`` goes through the batcher when called from an engine worker thread;
    everything else (config, tokenizer, ``new_cache``, ``head_rows``...) is the model's own."""

    def __init__(self, model, batcher: _Batcher, name: str, priority: int):
        self.model = model
        self.unwrapped = model  # what a prefix cache keys rows by (graphspec.prefix_cache)
        self.name = name
        self.priority = priority
        self._batcher = batcher
        self.caches: weakref.WeakSet = weakref.WeakSet()

    def step(self, token_ids, cache, **kwargs):
        kwargs = dict(token_ids=token_ids, cache=cache, **kwargs)  # only what the caller gave: models differ
        if not self._batcher.is_member():
            return self.model.step(**kwargs)
        return self._batcher.call(self, kwargs)

    def new_cache(self, *args, **kwargs):
        cache = self.model.new_cache(*args, **kwargs)
        self.caches.add(cache)
        return cache

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"Batched({self.model!r})"


class _DeferredDraft(Stage):
    """A model drafter (``ModelDrafter``, ``CrossVocabDrafter``) whose begin, and so its prefill, waits for the
    first step that drafts: a greedy sequence the policy keeps plain never prefills the draft at all.

    Sampled sequences begin at once, exactly as ``Pipeline.run`` (their draft's bits are part of their sample).
    A greedy sequence begins when it first drafts, with every committed token but the pending one prefilled
    (batched, as a prompt). After steps it did not draft, its draft catches up the same way, in one batched
    prefill rather than as the rows of a draft step (``ModelDrafter.catch_up``; ``_cross_catch_up`` for a
    cross-tokenizer draft, in the draft's own tokens). Greedy output never depends on the draft's bits, only on
    the target's.
    """

    def __init__(self, inner: Stage):
        super().__init__(inner.name, inner.reads, inner.writes)
        self.inner = inner
        self._cross = not isinstance(inner, ModelDrafter)

    def check(self, params) -> None:
        self.inner.check(params)

    def begin(self, state) -> None:
        begun = not state.params.greedy
        state.scratch(self)["begun"] = begun
        if begun:
            self.inner.begin(state)

    def run(self, state) -> None:
        sc = state.scratch(self)
        if not sc["begun"]:
            if state.num_draft <= 0:
                self._empty(state)
                return
            self.inner.begin(state)
            sc["begun"] = True
            if self._cross:  # its begin feeds the prompt only; the tokens committed since are behind
                _cross_catch_up(self.inner, state)
        elif state.num_draft > 0 and state.params.greedy:
            if not self._cross:
                self.inner.catch_up(state)
            elif not sc.get("drafted", True):
                # only after a plain step: after a drafting step the few tokens behind (the bonus token, in the
                # draft's tokens) share the batched draft forward better than they would make a prefill of their own
                _cross_catch_up(self.inner, state)
        sc["drafted"] = state.num_draft > 0
        self.inner.run(state)

    def _empty(self, state) -> None:
        """An empty draft from a drafter that has not begun (what its own run writes for num_draft=0)."""
        inner = self.inner
        if self._cross:
            from graphspec.vocab_stages import resolve_mode

            inner._empty(state)
            state.scratch(inner)["mode"] = resolve_mode(inner.mode, state.params)  # what the map stage reads
            return
        state.draft_ids = torch.empty(1, 0, dtype=torch.int64, device=state.run.device)
        state.draft_probs = None
        if inner.tree:
            state.draft_parents = ()

    def __getattr__(self, name):  # end(), store, ... of the drafter it wraps
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _cross_catch_up(drafter, state) -> None:
    """``ModelDrafter.catch_up`` for a ``CrossVocabDrafter``: feed the draft tokens its cache lacks (all but the
    last of the committed text in the draft's tokens) as one batched prefill, where its run would feed them as the
    rows of its first draft forward, which the CPU's few-row kernels compute a row at a time (and which hold up
    the batched draft forward every other sequence shares). What the run then does is what it does after a step
    that drafted: the text is in step, one token to feed. Fewer than two left behind, a beam's last tree (its run
    keeps the taken path itself), or a cache that cannot grow to hold them: left to the run."""
    if drafter.beam:
        return
    sc = state.scratch(drafter)
    text, cache = sc.get("text"), sc.get("cache")
    if text is None or cache is None:
        return
    drafter._sync(text, state.tokens)  # what its run does first (then a no-op there)
    if text.tree is not None:
        return
    own, fed = text.own, text.fed
    common, limit = 0, min(len(fed), len(own) - 1, cache.length)
    while common < limit and fed[common] == own[common]:
        common += 1
    missed = own[common:len(own) - 1]
    if len(missed) < 2 or drafter._room(state, sc, len(own) + state.num_draft) < len(own):
        return
    cache = sc["cache"]
    cache.truncate(common)
    del fed[common:]
    prefill(drafter.model, cache, missed, state.run.device)
    fed.extend(missed)
    state.run.draft_forwards += 1


class _Undrafted(Stage):
    """A tree stage (``TreeVerify``, ``TreeAcceptance``) that takes its plain twin's path (``Verify``'s one-row step,
    ``greedy_accept``) on a step with no draft, where the two compute the same thing: the same forward call on the
    same cache and the target's argmax, without the tree bookkeeping (the last tree's kept branch, the children of
    each row, a new tensor of the emitted row). A step with no draft is every step of a greedy sequence the policy
    keeps plain; a 16-stream step runs the stage 16 times, one thread after another under the GIL, between two
    target forwards (perf/RESULTS.md).

    The verify takes the plain path only when the last step left no tree to resolve: none, or the tree of the
    pending token alone, whose kept branch is already in place. The acceptance takes it for greedy sequences only
    (a sampled one draws its token from its generator as ``TreeAcceptance`` does), and records the empty tree's
    sibling counts as ``TreeAcceptance`` would, so the stats are the same.
    """

    def __init__(self, inner: Stage):
        super().__init__(inner.name, inner.reads, inner.writes)
        self.inner = inner
        self._accept = isinstance(inner, TreeAcceptance)

    def check(self, params) -> None:
        self.inner.check(params)

    def begin(self, state) -> None:
        self.inner.begin(state)

    def run(self, state) -> None:
        if state.draft_ids.shape[1] == 0:
            if self._accept:
                if state.params.greedy:
                    state.emitted = greedy_accept(state.draft_ids, state.target_logits)
                    state.run.extra.setdefault("tree", {"siblings_proposed": 0, "siblings_accepted": 0})
                    return
            else:
                scratch = state.scratch(self.inner)
                last = scratch.get("tree")
                if last is None or not last[2]:
                    scratch.pop("tree", None)
                    Verify.run(self.inner, state)
                    return
        self.inner.run(state)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _deferrable(stage) -> bool:
    """Whether the engine may defer ``stage``'s begin (see ``_DeferredDraft``)."""
    from graphspec.vocab_stages import CrossVocabDrafter

    return type(stage) in (ModelDrafter, CrossVocabDrafter)


# ------------------------------------------------------------------------------------------ policy

def _rising(table: dict[int, float]) -> dict[int, float]:
    """A measured cost table made non-decreasing in rows: more rows never cost less than fewer, so a dip is timing
    noise, and it would make extra verify rows look free."""
    out: dict[int, float] = {}
    top = 0.0
    for r in sorted(table):
        top = out[r] = max(table[r], top)
    return out


@dataclass
class CostTable:
    """Seconds of one forward by rows: the target's for R verify rows, the draft's for n sequences' tokens, and
    the draft's batched prefill of T tokens (what a sequence that has not been drafting pays to start)."""

    target: dict[int, float]
    draft: dict[int, float] = field(default_factory=dict)
    draft_prefill: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def _at(table: dict[int, float], rows: int) -> float:
        if not table:
            return 0.0
        keys = sorted(table)
        if rows <= keys[0]:
            return table[keys[0]]
        for lo, hi in zip(keys, keys[1:]):
            if rows <= hi:  # linear between measured row counts
                return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
        return table[keys[-1]] * rows / keys[-1]  # past the table: proportional to rows

    def target_cost(self, rows: int) -> float:
        return self._at(self.target, rows)

    def draft_cost(self, rows: int) -> float:
        return self._at(self.draft, rows) if rows > 0 else 0.0

    def draft_prefill_cost(self, tokens: int) -> float:
        """A draft prefill of ``tokens`` tokens (``batched_rows``); 0 for none."""
        return self._at(self.draft_prefill, tokens) if tokens > 0 else 0.0

    @classmethod
    def measure(cls, target, draft=None, rows: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 3,
                draft_batched: bool = True, prefill_tokens: Sequence[int] = (16, 64, 256),
                context: int = 16) -> "CostTable":
        """Time forwards on this machine: the target with R rows after a short context (``context`` tokens), the
        draft with one token for n sequences (one forward of n rows where it batches, else n one-token forwards),
        and the draft's batched prefill of T tokens."""

        def step_once(model, n_rows: int):
            cache = model.new_cache(min(model.config.max_position_embeddings, context + n_rows))
            if context > 16 and hasattr(cache, "advance"):
                # a long context is not computed: the cache's zeros cost attention what real keys would, and a
                # prefill of a thousand tokens would take seconds per entry on a CPU
                cache.advance(context)
            else:
                model.step(torch.zeros(1, context, dtype=torch.int64, device=model.device), cache, logits_for="last")
            new = torch.zeros(1, n_rows, dtype=torch.int64, device=model.device)

            def once() -> float:
                cache.truncate(context)
                t0 = time.perf_counter()
                model.step(new, cache, logits_for="all")
                return time.perf_counter() - t0
            return once

        def prefill_once(model, n_tokens: int):
            cache = model.new_cache(n_tokens)
            ids = [0] * n_tokens

            def once() -> float:
                cache.truncate(0)
                t0 = time.perf_counter()
                prefill(model, cache, ids, model.device)
                return time.perf_counter() - t0
            return once

        # Every entry timed once per round, round after round, keeping each one's best: a busy moment on a shared
        # host then inflates one sample of each entry, not every sample of a few (which would bend the curve).
        limit = target.config.max_position_embeddings - context
        timers = {("target", r): step_once(target, r) for r in rows if r <= limit}
        if draft is not None:
            timers.update({("draft", r): step_once(draft, r) for r in rows if r == 1 or draft_batched})
            timers.update({("prefill", t): prefill_once(draft, t) for t in prefill_tokens
                           if t <= draft.config.max_position_embeddings})
        best = {key: float("inf") for key in timers}
        for _ in range(max(repeats, 1)):
            for key, once in timers.items():
                best[key] = min(best[key], once())
        target_t = _rising({r: v for (kind, r), v in best.items() if kind == "target"})
        prefill_t = _rising({t: v for (kind, t), v in best.items() if kind == "prefill"})
        draft_t: dict[int, float] = {}
        if draft is not None:
            draft_t = _rising({r: best[("draft", r)] if ("draft", r) in best else best[("draft", 1)] * r for r in rows})
        return cls(target_t, draft_t, prefill_t)


@dataclass
class SequenceView:
    """What the policy knows of one running sequence when it plans a step.

    ``rates``: its acceptance per draft position (or one number); ``greedy``: False for a sampled sequence, which
    drafts K whatever the plan (its seed must give the same sample alone and batched); ``catch_up``: tokens its
    draft must be fed before it can draft again (its whole context while its draft was never prefilled, the
    tokens of the steps it did not draft since; 0 when its draft is in step); ``remaining``: tokens it may still
    produce, over which a catch-up is spread.
    """

    rates: Sequence[float] | float
    greedy: bool = True
    catch_up: int = 0
    remaining: int = 1 << 30


def _tested_stand_in(accepted: Sequence[int], proposed: Sequence[int]) -> list[int]:
    """``tested_per_position`` where a sequence's stats lack it: position i judged ``min(proposed[i], accepted[i -
    1])`` times, exact for chains that always reach their length (an upper bound where chains end early)."""
    return [p if i == 0 else min(p, accepted[i - 1]) for i, p in enumerate(proposed)]


class SpeculationPolicy:
    """How many tokens each running sequence drafts this step: the choice with the most expected tokens per
    second of the step.

    A chain of k drafts with acceptance a yields ``1 + a + ... + a^k`` tokens a step (the bonus token
    included); the step costs k draft forwards for the n running sequences plus one target forward of about
    ``n (k + 1)`` rows, read from the measured ``CostTable``; the sequences share the step, so one k serves
    them all (``choose_batch``: the sum of their expected tokens over the step's seconds). k = 0 is a plain
    decode step. Each ``a`` is that sequence's acceptance so far at each draft position (a draft tree's
    siblings count where they stand), starting from ``prior`` (as ``prior_weight`` proposals) so that one
    unlucky step does not switch a sequence off.

    ``plan`` (what the engine uses) chooses per sequence: a k and the set of greedy sequences that draft it,
    the others taking a plain step in the same forward. A sequence whose draft is behind (never prefilled, or
    not fed while it did not draft) joins only if it pays for its catch-up too: the draft's prefill of those
    tokens, which holds up the whole batch, spread over the steps it has left. Drafting is chosen only when it
    promises ``margin`` more tokens per second than plain steps.
    """

    def __init__(self, costs: CostTable, prior: float = 0.6, prior_weight: float = 4.0, margin: float = 0.1):
        self.costs = costs
        self.prior = prior
        self.prior_weight = prior_weight
        self.margin = margin
        self._may_draft_cache: dict[tuple, bool] = {}

    def acceptance(self, accepted: int, proposed: int, prior: float | None = None) -> float:
        prior = self.prior if prior is None else prior
        return (accepted + prior * self.prior_weight) / (proposed + self.prior_weight)

    def choose(self, max_k: int, running: int, accepted: int, proposed: int) -> int:
        """The k for one sequence, as if each of the ``running`` sequences drafted like it."""
        return self.choose_batch(max_k, [self.acceptance(accepted, proposed)] * max(running, 1))

    def position_rates(self, accepted_per_position: Sequence[int], proposed_per_position: Sequence[int],
                       rested: int = 0, tested_per_position: Sequence[int] | None = None) -> list[float]:
        """A sequence's acceptance at each draft position given the positions before it were kept (what
        ``expected_tokens`` multiplies): ``accepted[i] / tested[i]``, where ``tested[i]`` counts the steps in which
        the target judged position i (it was proposed and every position before it kept;
        ``GenerationStats.tested_per_position``). Without those counts, ``min(proposed[i], accepted[i - 1])``
        stands in (exact for chains that always reach their length). ``accepted[i] / proposed[i]`` would be the
        chance that positions 0..i are all kept, and multiplying those undercounts every deeper position.

        Drafts grow less sure with depth, and a draft tree keeps more than a chain. The first position starts
        from ``prior``, each later one from the position before it, so that positions a short draft never
        reached are expected to do as the deepest one measured (else they would stay at the prior and never
        be tried). ``rested``: plain steps the sequence has taken since it last drafted; each moves its rates a
        tenth of the way back to the prior, so that a sequence switched off by a few early misses is tried again
        (else its rates, no longer measured, would keep it off for good)."""
        if tested_per_position is None or len(tested_per_position) < len(accepted_per_position):
            tested_per_position = _tested_stand_in(accepted_per_position, proposed_per_position)
        rates: list[float] = []
        for a, n in zip(accepted_per_position, tested_per_position):
            rates.append(self.acceptance(a, n, rates[-1] if rates else None))
        if rested:
            keep = 0.9 ** rested
            rates = [self.prior + (r - self.prior) * keep for r in rates]
        return rates

    @staticmethod
    def expected_tokens(a, k: int) -> float:
        """Tokens a step of k drafts yields: 1 + a1 + a1 a2 + ... for acceptance ``a`` per position (a list),
        or 1 + a + ... + a^k for one acceptance at every position (a float)."""
        total, reach = 1.0, 1.0
        for i in range(k):
            rate = a if isinstance(a, (int, float)) else (a[i] if i < len(a) else (a[-1] if a else 0.0))
            reach *= min(max(float(rate), 0.0), 0.999)
            total += reach
        return total

    def choose_batch(self, max_k: int, acceptances: Sequence, fixed_rows: int = 0,
                     fixed_tokens: float = 0.0, min_k: int = 0) -> int:
        """The one k in ``min_k``..max_k for a batch whose sequences share every step: the most expected tokens of
        all of them per second of the step. ``acceptances``: per sequence, one acceptance or one per draft
        position (see ``expected_tokens``). ``fixed_rows`` / ``fixed_tokens``: the verify rows and expected tokens
        of sequences that draft their K whatever (sampled ones)."""
        n = max(len(acceptances), 1)
        best_k, best = min_k, -1.0
        for k in range(min_k, max_k + 1):
            tokens = sum(self.expected_tokens(a, k) for a in acceptances) + fixed_tokens or 1.0
            seconds = (k * self.costs.draft_cost(n) if k else 0.0) + self.costs.target_cost(n * (k + 1) + fixed_rows)
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        return best_k

    def plan(self, max_k: int, sequences: Sequence[SequenceView]) -> list[int]:
        """The draft length of each of ``sequences`` for the step they share: ``max_k`` for sampled ones, and for
        greedy ones k or 0, for the one k in 0..max_k and the set of greedy sequences that draft it that give the
        most expected tokens per second of the step.

        A step where m greedy and s sampled sequences draft costs the draft forwards (k of m + s sequences, then
        max_k - k of the s sampled ones), one target forward of every sequence's rows (k + 1 for a drafting
        sequence, 1 for a plain one), and each drafting sequence's catch-up prefill times its share of it this
        step (its expected tokens over its remaining tokens). For each k the greedy sequences are taken in order
        of extra tokens per second they add (verify rows at the marginal row cost, plus catch-up), and every
        prefix of that order is tried: O(max_k n log n).
        """
        ks = [0] * len(sequences)
        if not sequences:
            return ks
        greedy = [i for i, q in enumerate(sequences) if q.greedy]
        sampled = [i for i, q in enumerate(sequences) if not q.greedy]
        for i in sampled:
            ks[i] = max_k
        s = len(sampled)
        if not greedy or not self.may_draft(max_k, len(greedy), s):
            return ks
        s_tokens = sum(self.expected_tokens(sequences[i].rates, max_k) for i in sampled)
        s_rows = s * (max_k + 1)
        costs = self.costs

        def seconds(k: int, m: int, catch_up: float) -> float:
            return self._step_seconds(max_k, len(greedy), s, k, m) + catch_up

        base = float(len(greedy)) + s_tokens
        # Drafting must beat plain steps by ``margin``: what the table does not see (the threads' Python work
        # between forwards, timing noise) falls on the drafting side.
        best, chosen = (1 + self.margin) * base / max(seconds(0, 0, 0.0), 1e-12), (0, [])
        for k in range(1, max_k + 1):
            rows_all = len(greedy) * (k + 1) + s_rows
            row = (costs.target_cost(rows_all) - costs.target_cost(len(greedy) + s_rows)) / max(len(greedy) * k, 1)
            items = []
            for i in greedy:
                q = sequences[i]
                e = self.expected_tokens(q.rates, k)
                share = costs.draft_prefill_cost(q.catch_up) * min(e / max(q.remaining, 1), 1.0)
                items.append((-(e - 1.0) / max(k * row + share, 1e-12), i, e, share))
            items.sort()
            tokens, catch_up = base, 0.0
            for m, (_, i, e, share) in enumerate(items, start=1):
                tokens += e - 1.0
                catch_up += share
                rate = tokens / max(seconds(k, m, catch_up), 1e-12)
                if rate > best * (1 + 1e-9):
                    best, chosen = rate, (k, [j for _, j, _, _ in items[:m]])
        k, who = chosen
        for i in who:
            ks[i] = k
        return ks

    def _step_seconds(self, max_k: int, g: int, s: int, k: int, m: int) -> float:
        """A step's forwards (no catch-up) when m of g greedy sequences draft k and s sampled ones draft max_k."""
        costs = self.costs
        drafts = k * costs.draft_cost(m + s) + (max_k - k) * costs.draft_cost(s)
        return drafts + costs.target_cost(g - m + m * (k + 1) + s * (max_k + 1))

    def may_draft(self, max_k: int, greedy: int, sampled: int = 0) -> bool:
        """Whether ``plan`` could have any of ``greedy`` greedy sequences draft, beside ``sampled`` sampled ones,
        from the costs alone: False when not even drafts that are always accepted and need no catch-up would beat
        plain steps by ``margin`` (then ``plan`` gives them all 0 without looking at their acceptance).

        A bound on ``plan``'s own test: m drafting sequences add fewer than m k tokens (each position's acceptance
        is capped below 1) for at least the step's forward seconds; and the sampled sequences' tokens, at least 1
        each, are taken at that least, which favours drafting wherever drafting's rows cost anything. Cached per
        (max_k, greedy, sampled): the costs are fixed, so at a batch size where verify rows cost what they return
        each step's planning is a dict look-up.
        """
        key = (max_k, greedy, sampled, self.margin, id(self.costs))
        cache = self._may_draft_cache
        verdict = cache.get(key)
        if verdict is None:
            base = float(greedy + sampled)
            plain = (1 + self.margin) * base / max(self._step_seconds(max_k, greedy, sampled, 0, 0), 1e-12)
            verdict = any((base + m * k) / max(self._step_seconds(max_k, greedy, sampled, k, m), 1e-12)
                          * (1 + 1e-6) > plain
                          for k in range(1, max_k + 1) for m in range(1, greedy + 1))
            cache[key] = verdict
        return verdict


class AutoDraftLength:
    """One sequence's draft length, chosen each step (``Pipeline(draft_length="auto")``, greedy runs): the cap k in
    1..K with the most expected tokens per second of a step, from this machine's forward costs (a ``CostTable`` of
    rows 1..K + 1, timed once per pipeline) and what the run's recent steps showed.

    A step of cap k yields ``1 + sum_i P(depth i drafted) a_0 ... a_i`` tokens, ``a_i`` the acceptance at position i
    given the positions before it were kept (``SpeculationPolicy.position_rates``). It costs the chain's expected
    draft forwards (a draft with a confidence threshold ends its chain where it is unsure, so a cap is not a length:
    ``P(depth i + 1 | depth i)`` is counted from the steps whose cap allowed it), a verify of ``k + 1`` rows for a
    tree (its siblings fill the rows the chain leaves) or of the chain's rows plus one, and the step's own time
    outside those forwards (the drafter's and the acceptance's work between them: measured as each step's wall time
    less the table's price of the forwards it ran).

    Never 0: a sequence that stops drafting leaves its draft's cache behind, and the catch-up prefill costs more than
    one step's drafts (``SpeculationPolicy`` weighs that for serving). Recent: each step's counts are added to
    counts that shrink by ``decay`` a step (about the last 10 steps), so a run that moves from prose to code drafts
    longer again. A position not measured lately starts from the one before it (``prior`` for the first acceptance,
    going on for the first depth), weighed as ``prior_weight`` steps: so a cap that has not been tried lately is
    expected to do as the deepest one measured, and is tried again where that pays. The output does not depend on
    k (greedy verification keeps the target's tokens)."""

    def __init__(self, costs: CostTable, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9,
                 siblings: int = 0):
        self.costs = costs
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.siblings = siblings
        # the acceptance rates are the serving policy's, for a batch of this one sequence
        self._policy = SpeculationPolicy(costs, prior=prior, prior_weight=prior_weight)
        self._stats = None
        self.chosen: list[int] = []  # the k of each step of the latest run

    @classmethod
    def measure(cls, target, draft, max_k: int, siblings: int = 0) -> "AutoDraftLength":
        return cls(CostTable.measure(target, draft, rows=tuple(range(1, max_k + 2)), prefill_tokens=()),
                   siblings=siblings)

    def for_run(self) -> "AutoDraftLength":
        """A rule with these costs and settings and counts of its own, for one run (runs of one pipeline in
        several threads then keep apart); its choices are this rule's ``chosen`` too, as the latest run's."""
        run = type(self)(self.costs, self.prior, self.prior_weight, self.decay, self.siblings)
        self.chosen = run.chosen
        return run

    def _learn(self, stats, max_k: int) -> None:
        """Fold the steps since the last call into the decayed counts."""
        a_all, p_all = stats.accepted_per_position, stats.proposed_per_position
        t_all = list(getattr(stats, "tested_per_position", None) or ())
        if len(t_all) < max_k:  # stats without the counts
            t_all = _tested_stand_in(a_all[:max_k], p_all[:max_k])
        seen = self._seen
        dp = [p_all[i] - seen["p"][i] for i in range(max_k)]
        d = self.decay
        for i in range(max_k):
            self._acc[i] = self._acc[i] * d + (a_all[i] - seen["a"][i])
            self._tested[i] = self._tested[i] * d + (t_all[i] - seen["t"][i])
            self._made[i] *= d
            self._allowed[i] *= d
        self._over *= d
        self._over_n *= d
        steps = getattr(stats, "steps", None)
        if steps is not None and steps - seen["steps"] == 1 and self.chosen:
            # one step, of the cap chosen last: how deep its chain went, and its time outside the priced forwards
            depth, cap = sum(dp), min(self.chosen[-1], max_k)
            for i in range(1, cap):
                self._allowed[i] += depth >= i
                self._made[i] += depth >= i + 1
            seconds = getattr(stats, "decode_seconds", 0.0) - seen["seconds"]
            nodes = getattr(stats, "proposed", 0) - seen["nodes"]
            if seconds > 0:
                priced = depth * self.costs.draft_cost(1) + self.costs.target_cost(nodes + 1)
                self._over += seconds - priced
                self._over_n += 1.0
        self._seen = {"a": list(a_all[:max_k]), "p": list(p_all[:max_k]), "t": list(t_all[:max_k]),
                      "steps": steps or 0, "seconds": getattr(stats, "decode_seconds", 0.0),
                      "nodes": getattr(stats, "proposed", 0)}

    def estimate(self, k: int) -> tuple[float, float, float]:
        """A step of cap k as the run's counts so far predict it: (tokens, draft forwards, seconds)."""
        return self._estimates()[min(k, len(self._acc)) - 1]

    def _estimates(self) -> list[tuple[float, float, float]]:
        """``estimate(k)`` for every cap k in 1..K, in one pass over the positions."""
        n = len(self._acc)
        rates = self._policy.position_rates(self._acc, self._tested, tested_per_position=self._tested)  # a_i
        # never below 0: a table slower than the forwards it priced says nothing of the time between them
        over = max(self._over / self._over_n, 0.0) if self._over_n else 0.0
        out = []
        tokens, forwards, reach, kept, go_on = 1.0, 0.0, 1.0, 1.0, 1.0
        for i in range(n):
            if i:  # P(the chain drafts position i | it drafted i - 1)
                go_on = (self._made[i] + go_on * self.prior_weight) / (self._allowed[i] + self.prior_weight)
            reach *= go_on
            kept *= min(max(float(rates[i]), 0.0), 0.999)
            forwards += reach
            tokens += reach * kept
            rows = 1.0 + (i + 1 if self.siblings else forwards)  # a tree's siblings fill the rows its chain leaves
            out.append((tokens, forwards, over + forwards * self.costs.draft_cost(1) + self.costs.target_cost(rows)))
        return out

    def __call__(self, stats, max_k: int) -> int:
        if stats is not self._stats:  # a new run
            self._stats = stats
            self._acc, self._tested = [0.0] * max_k, [0.0] * max_k
            self._made, self._allowed = [0.0] * max_k, [0.0] * max_k
            self._over, self._over_n = 0.0, 0.0
            self._seen = {"a": [0] * max_k, "p": [0] * max_k, "t": [0] * max_k, "steps": getattr(stats, "steps", 0),
                          "seconds": getattr(stats, "decode_seconds", 0.0), "nodes": getattr(stats, "proposed", 0)}
            self.chosen.clear()
        self._learn(stats, max_k)
        best_k, best = 1, -1.0
        for k, (tokens, _, seconds) in enumerate(self._estimates(), start=1):
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        self.chosen.append(best_k)
        return best_k


# ------------------------------------------------------------------------------------------ engine

@dataclass(eq=False)  # one per sequence, told apart by identity (two may hold equal fields)
class _Running:
    """A running sequence as the policy sees it (updated by its own worker thread at each step)."""

    greedy: bool
    max_new: int
    stats: object = None          # its GenerationStats, once it has taken a step
    context: int = 0              # committed tokens at its latest step
    synced: int | None = None     # context when its draft was last in step (None: never prefilled)
    stored: int = 0               # its prompt's draft rows that the prefix cache holds (copied, not prefilled)
    drafted: bool = False         # whether its latest step drafted
    rested: int = 0               # plain steps since it last drafted (once it has drafted)


FINISHED = object()
"""What ``on_piece`` receives after a sequence's last piece."""


class EngineSequence:
    """One request in the engine: iterate ``pieces()`` for its text as it is accepted, ``result()`` for the
    ``GenerationResult``, ``cancel()`` to stop it (its slot and caches are freed after the current step)."""

    def __init__(self, engine: "Engine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self.on_piece: Callable[[str | object], None] | None = None  # for async consumers (the server)
        self.submitted = time.perf_counter()
        self._callbacks: list[Callable[["EngineSequence"], None]] = []
        self._callbacks_lock = threading.Lock()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def cancel(self) -> None:
        self._cancel.set()

    def add_done_callback(self, fn: Callable[["EngineSequence"], None]) -> None:
        """Call ``fn(self)`` once the sequence has finished (at once if it has)."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _run_callbacks(self) -> None:
        with self._callbacks_lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback (metrics) must never fail the engine
                pass

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _emit(self, item) -> None:
        if self.on_piece is not None:
            self.on_piece(item)
        else:
            self._queue.put(item)

    def pieces(self) -> Iterator[str]:
        """Text pieces as they are committed (never half a UTF-8 character; stop strings held back)."""
        if self.on_piece is not None:
            raise ValueError("this sequence delivers its pieces through on_piece")
        while True:
            item = self._queue.get()
            if item is FINISHED:
                break
            yield item
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


class Engine:
    """Runs many generations of one ``Pipeline`` at once (continuous batching, batched speculation).

    ``max_batch``: sequences running at once (each holds its KV caches while it runs); ``max_queue``:
    requests waiting for a slot (first come, first served) beyond which ``submit`` raises ``QueueFull``.
    ``policy``: "auto" (a ``SpeculationPolicy`` from costs measured on first use, for greedy requests),
    "off" (every step drafts the pipeline's K), or a ``SpeculationPolicy``.
    """

    def __init__(self, pipeline, max_batch: int = 16, max_queue: int = 256, policy="auto",
                 costs: CostTable | None = None):
        from graphspec.pipeline import Pipeline

        if not isinstance(pipeline, Pipeline):
            raise ValueError(f"Engine needs a graphspec.Pipeline, got {type(pipeline).__name__}")
        for name, v, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not (isinstance(policy, SpeculationPolicy) or (isinstance(policy, str) and policy in ("auto", "off"))):
            raise ValueError(f"policy must be 'auto', 'off' or a SpeculationPolicy, got {policy!r}")
        self.pipeline = pipeline
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._batcher = _Batcher()
        self._target = _BatchedModel(pipeline.target, self._batcher, "target", priority=1)
        self._draft = (None if pipeline.draft is None
                       else _BatchedModel(pipeline.draft, self._batcher, "draft", priority=0))
        swaps = [(pipeline.target, self._target)] + ([] if self._draft is None else [(pipeline.draft, self._draft)])
        self._pipe = pipeline._rebound(swaps)
        self._pipe._draft_budget = self._budget
        self._policy_mode = policy if isinstance(policy, str) else "given"
        # With the policy on, a greedy sequence's draft is prefilled when it first drafts, not when it starts.
        self._deferred = False
        if self._policy_mode != "off":
            for stage in self._pipe._graph:
                if _deferrable(stage):
                    self._pipe._graph = self._pipe._graph.replace(stage.name, _DeferredDraft(stage))
                    self._deferred = True
                    break
        for stage in self._pipe._graph:
            if type(stage) in (TreeVerify, TreeAcceptance):
                self._pipe._graph = self._pipe._graph.replace(stage.name, _Undrafted(stage))
        self._policy = policy if isinstance(policy, SpeculationPolicy) else None
        self._costs = costs
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()  # (seq, args) waiting for a slot
        self._active: set[EngineSequence] = set()              # running
        self._threads: set[threading.Thread] = set()
        self._ids = itertools.count(1)
        self._closed = False
        self._local = threading.local()
        self._seqs: dict[EngineSequence, _Running] = {}  # running sequence -> what the policy reads of it
        self._plan_lock = threading.Lock()
        self._plan: dict[_Running, int] = {}   # each sequence's draft length in the step being planned
        self._plan_taken: set[_Running] = set()  # those that have taken theirs
        self.plans_made = 0  # policy plans made (one a step while the sequences keep in step)

    # ------------------------------------------------------------------------- state

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def live_caches(self) -> int:
        """KV caches of the engine's models still alive (a finished sequence's leave once collected)."""
        gc.collect()
        return len(self._target.caches) + (len(self._draft.caches) if self._draft is not None else 0)

    @property
    def forwards(self) -> dict[str, int]:
        """Forwards the batcher ran, per model ("target", "draft"), prefills included."""
        return dict(self._batcher.forwards)

    def policy(self) -> SpeculationPolicy | None:
        """The speculation policy in force (measuring the costs on first use), or None when it is off."""
        if self._policy_mode == "off" or not self.pipeline.speculative:
            return None
        if self._policy is None:
            with self._lock:
                if self._policy is None:
                    if self._costs is None:
                        self._costs = CostTable.measure(self.pipeline.target, self.pipeline.draft,
                                                        draft_batched=not self._draft_sequential())
                    self._policy = SpeculationPolicy(self._costs)
        return self._policy

    def _draft_sequential(self) -> bool:
        """Whether the draft's forwards run one sequence at a time (see ``Transformer.step_many``)."""
        from graphspec.kernels import cpu

        d = self.pipeline.draft
        quantize = getattr(d, "quantize", None)
        return d is not None and (not hasattr(d, "step_many") or quantize == "int4" or (
            bool(quantize) and not (getattr(d, "native_forward", False) and cpu.available())))

    def _budget(self, stats, k: int) -> int:
        """This step's draft length for the calling sequence: K for sampled ones (so that a seed gives the same
        sample alone and batched), 0 at a greedy sequence's first step where its draft waits to be prefilled,
        else what the policy's plan for all running sequences gives it, from each one's acceptance so far and how
        far its draft is behind."""
        with self._lock:
            mine = self._seqs.get(getattr(self._local, "seq", None))
            if mine is not None:
                mine.stats = stats
                mine.context = stats.prompt_tokens + stats.generated_tokens
                if mine.drafted:  # its draft was fed along with last step's drafts
                    mine.synced = mine.context
        if mine is None or not mine.greedy:
            return k
        policy = self.policy()
        if policy is None:
            return k
        if self._deferred and stats.generated_tokens == 0:
            # A sequence's first token is its first step's. That step stays plain, so the first token comes at
            # plain's time to first token, not after the draft's prefill of the whole prompt (its catch-up).
            mine.drafted = False
            return 0
        with self._plan_lock:
            # One plan a step for all the running sequences: the first of them to ask makes it, the others take
            # their share of it. A sequence asking again (its next step), or not in the plan (it joined since),
            # starts the next plan. Plans are made from what the sequences have recorded so far (some may not have
            # recorded the latest step yet), which is all a plan is: greedy output does not depend on it.
            if mine not in self._plan or mine in self._plan_taken:
                with self._lock:  # those still in their prefill too: they join the next steps
                    running = list(self._seqs.values())
                views = [SequenceView(policy.position_rates(r.stats.accepted_per_position,
                                                            r.stats.proposed_per_position, r.rested,
                                                            r.stats.tested_per_position)
                                      if r.stats is not None else policy.prior, greedy=r.greedy,
                                      catch_up=self._catch_up(r),
                                      remaining=r.max_new - (r.stats.generated_tokens if r.stats is not None else 0))
                         for r in running]
                self._plan = dict(zip(running, policy.plan(k, views)))
                self._plan_taken = set()
                self.plans_made += 1
            mine_k = self._plan[mine]
            self._plan_taken.add(mine)
        mine.drafted = mine_k > 0
        mine.rested = 0 if mine.drafted or not mine.stats.proposed else mine.rested + 1
        return mine_k

    def _catch_up(self, r: "_Running") -> int:
        """Tokens sequence ``r``'s draft must be fed in a prefill before it can draft (see ``_DeferredDraft``)."""
        if not (self._deferred and r.greedy):
            return 0
        if r.synced is None:  # never prefilled: the rows a prefix cache holds are copied, the rest prefilled
            return r.context - r.stored
        behind = r.context - r.synced
        return behind if behind >= 2 else 0

    # ------------------------------------------------------------------------- requests

    def submit(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False, stop=None,
               request_id: str | None = None, on_piece=None) -> EngineSequence:
        """Start a generation (``Pipeline.run``'s arguments) and return at once; arguments are checked here.

        ``on_piece``: called from the worker thread with each text piece and, last, ``engine.FINISHED``
        (instead of queueing them for ``pieces()``); it must not block.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        ids, params, stops = self._pipe._prepare(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop)
        seq = EngineSequence(self, request_id or f"req-{next(self._ids)}")
        seq.on_piece = on_piece
        seq.prompt_tokens = len(ids)
        args = (seq, ids, max_new_tokens, params, bool(ignore_eos), stops)
        with self._lock:
            if len(self._active) < self.max_batch and not self._queue:
                self._start(args)
            elif len(self._queue) < self.max_queue:
                self._queue.append(args)
            else:
                raise QueueFull(f"{len(self._active)} sequences are running (max_batch={self.max_batch}) and "
                                f"{len(self._queue)} wait (max_queue={self.max_queue}); retry later")
        return seq

    def _start(self, args) -> None:  # under self._lock
        seq, ids, max_new_tokens, params = args[:4]
        self._active.add(seq)
        # known to the policy from now on, so that the first sequence to step plans for those still prefilling
        store, draft = self.pipeline.prefix_cache, self.pipeline.draft
        stored = store.match(draft, ids[:-1]) if store is not None and draft is not None and params.greedy else 0
        self._seqs[seq] = _Running(greedy=params.greedy, max_new=max_new_tokens, context=len(ids), stored=stored)
        t = threading.Thread(target=self._work, args=args, name=f"graphspec-{seq.request_id}", daemon=True)
        self._threads.add(t)
        self._batcher.join_for(t)
        t.start()

    def _work(self, seq: EngineSequence, ids, max_new_tokens, params, ignore_eos, stops) -> None:
        self._local.params = params
        self._local.seq = seq
        self._batcher.enter()
        gen = None
        try:
            if not seq.cancelled:
                gen = self._pipe._generate(ids, max_new_tokens, params, ignore_eos, stops)
                while True:
                    try:
                        piece = next(gen)
                    except StopIteration as done:
                        seq._result = done.value
                        break
                    if seq.first_token_at is None:
                        seq.first_token_at = time.perf_counter()
                    seq._emit(piece)
                    if seq.cancelled:
                        break
        except BaseException as e:  # handed to whoever waits on the sequence
            seq._error = e
        finally:
            if gen is not None:
                gen.close()  # its State (caches, generator) goes with it
            gen = None
            self._batcher.leave()
            with self._lock:
                self._seqs.pop(seq, None)
                self._active.discard(seq)
                self._threads.discard(threading.current_thread())
                while self._queue and len(self._active) < self.max_batch:
                    nxt = self._queue.popleft()
                    if nxt[0].cancelled:
                        self._finish(nxt[0])
                    else:
                        self._start(nxt)
            # Done only once it has left the engine: whoever waits on it then sees its slot free.
            self._finish(seq)

    def _finish(self, seq: EngineSequence) -> None:
        seq.finished_at = time.perf_counter()
        seq._emit(FINISHED)
        seq._run_callbacks()

    def run_batch(self, prompts: Sequence, **kwargs) -> list:
        """``Pipeline.run`` for each prompt, run together; the results in the prompts' order."""
        seqs = [self.submit(p, **kwargs) for p in prompts]
        return [s.result() for s in seqs]

    def close(self, timeout: float = 30.0, cancel: bool = True) -> None:
        """Stop taking requests; cancel (or, ``cancel=False``, finish) the running and waiting ones, waiting
        up to ``timeout`` s for them to stop."""
        with self._lock:
            self._closed = True
            if cancel:
                for seq in self._active:
                    seq.cancel()
                for args in self._queue:
                    args[0].cancel()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
