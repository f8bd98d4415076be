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
  sequence at a time, exactly as ``Pipeline.run`` runs them.
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

from graphspec.kernels import EXACT_ROWS_MAX
from graphspec.kernels._dispatch import _override, rows_exact

__all__ = ["Engine", "EngineSequence", "QueueFull", "SpeculationPolicy", "CostTable", "FINISHED"]


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


# ------------------------------------------------------------------------------------------ policy

@dataclass
class CostTable:
    """Seconds of one forward by rows: the target's for R verify rows, the draft's for n sequences' tokens."""

    target: dict[int, float]
    draft: dict[int, float] = field(default_factory=dict)

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
        return self._at(self.draft, rows)

    @classmethod
    def measure(cls, target, draft=None, rows: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 2,
                draft_batched: bool = True) -> "CostTable":
        """Time forwards on this machine: the target with R rows after a short context, and the draft with
        one token for n sequences (one forward of n rows where it batches, else n one-token forwards)."""

        def timed(model, n_rows: int) -> float:
            cache = model.new_cache(min(model.config.max_position_embeddings, 16 + n_rows))
            ids = torch.zeros(1, 16, dtype=torch.int64, device=model.device)
            model.step(ids, cache, logits_for="last")
            best = float("inf")
            for _ in range(repeats):
                cache.truncate(16)
                new = torch.zeros(1, n_rows, dtype=torch.int64, device=model.device)
                t0 = time.perf_counter()
                model.step(new, cache, logits_for="all")
                best = min(best, time.perf_counter() - t0)
            return best

        limit = target.config.max_position_embeddings - 16
        target_t = {r: timed(target, r) for r in rows if r <= limit}
        draft_t: dict[int, float] = {}
        if draft is not None:
            one = timed(draft, 1)
            for r in rows:
                draft_t[r] = timed(draft, r) if draft_batched and r > 1 else one * r
        return cls(target_t, draft_t)


class SpeculationPolicy:
    """How many tokens the running sequences draft this step: the k in 0..K with the most expected tokens per
    second of the step.

    A chain of k drafts with acceptance a yields ``1 + a + ... + a^k`` tokens a step (the bonus token
    included); the step costs k draft forwards for the n running sequences plus one target forward of about
    ``n (k + 1)`` rows, read from the measured ``CostTable``; the sequences share the step, so one k serves
    them all (``choose_batch``: the sum of their expected tokens over the step's seconds). k = 0 is a plain
    decode step. Each ``a`` is that sequence's acceptance so far at each draft position (a draft tree's
    siblings count where they stand), starting from ``prior`` (as ``prior_weight`` proposals) so that one
    unlucky step does not switch a sequence off.
    """

    def __init__(self, costs: CostTable, prior: float = 0.6, prior_weight: float = 4.0):
        self.costs = costs
        self.prior = prior
        self.prior_weight = prior_weight

    def acceptance(self, accepted: int, proposed: int) -> float:
        return (accepted + self.prior * self.prior_weight) / (proposed + self.prior_weight)

    def choose(self, max_k: int, running: int, accepted: int, proposed: int) -> int:
        """The k for one sequence, as if each of the ``running`` sequences drafted like it."""
        return self.choose_batch(max_k, [self.acceptance(accepted, proposed)] * max(running, 1))

    def position_rates(self, accepted_per_position: Sequence[int], proposed_per_position: Sequence[int]
                       ) -> list[float]:
        """A sequence's acceptance at each draft position (that a proposal there is kept, given it was made),
        each from the same prior: drafts grow less sure with depth, and a draft tree keeps more than a chain."""
        return [self.acceptance(a, n) for a, n in zip(accepted_per_position, proposed_per_position)]

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
                     fixed_tokens: float = 0.0) -> int:
        """The one k for a batch whose sequences share every step: the most expected tokens of all of them per
        second of the step. ``acceptances``: per sequence, one acceptance or one per draft position (see
        ``expected_tokens``). ``fixed_rows`` / ``fixed_tokens``: the verify rows and expected tokens of sequences
        that draft their K whatever (sampled ones)."""
        n = max(len(acceptances), 1)
        best_k, best = 0, -1.0
        for k in range(max_k + 1):
            tokens = sum(self.expected_tokens(a, k) for a in acceptances) + fixed_tokens or 1.0
            seconds = (k * self.costs.draft_cost(n) if k else 0.0) + self.costs.target_cost(n * (k + 1) + fixed_rows)
            rate = tokens / seconds if seconds > 0 else tokens
            if rate > best * (1 + 1e-9):
                best_k, best = k, rate
        return best_k


# ------------------------------------------------------------------------------------------ engine

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
        self._policy = policy if isinstance(policy, SpeculationPolicy) else None
        self._costs = costs
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()  # (seq, args) waiting for a slot
        self._active: set[EngineSequence] = set()              # running
        self._threads: set[threading.Thread] = set()
        self._ids = itertools.count(1)
        self._closed = False
        self._local = threading.local()
        self._stats: dict[int, tuple] = {}  # worker thread -> (its generation's stats, greedy?), for the policy

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
            bool(quantize) and not (getattr(d, "lean_int8_forward", False) and cpu.available())))

    def _budget(self, stats, k: int) -> int:
        """This step's draft length for the calling sequence: K for sampled ones (so that a seed gives the same
        sample alone and batched), else the policy's one k for all running greedy sequences, from each one's
        acceptance so far: they share every step, so they should draft alike."""
        params = getattr(self._local, "params", None)
        me = threading.get_ident()
        with self._lock:
            self._stats[me] = (stats, params is not None and params.greedy)
        if params is None or not params.greedy:
            return k
        policy = self.policy()
        if policy is None:
            return k
        with self._lock:
            running = list(self._stats.values())
        rates = [(policy.position_rates(s.accepted_per_position, s.proposed_per_position), is_greedy)
                 for s, is_greedy in running]
        sampled = [a for a, is_greedy in rates if not is_greedy]
        return policy.choose_batch(k, [a for a, is_greedy in rates if is_greedy], fixed_rows=len(sampled) * (k + 1),
                                   fixed_tokens=sum(policy.expected_tokens(a, k) for a in sampled))

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
        seq = args[0]
        self._active.add(seq)
        t = threading.Thread(target=self._work, args=args, name=f"graphspec-{seq.request_id}", daemon=True)
        self._threads.add(t)
        self._batcher.join_for(t)
        t.start()

    def _work(self, seq: EngineSequence, ids, max_new_tokens, params, ignore_eos, stops) -> None:
        self._local.params = params
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
            self._finish(seq)
            with self._lock:
                self._stats.pop(threading.get_ident(), None)
                self._active.discard(seq)
                self._threads.discard(threading.current_thread())
                while self._queue and len(self._active) < self.max_batch:
                    nxt = self._queue.popleft()
                    if nxt[0].cancelled:
                        self._finish(nxt[0])
                    else:
                        self._start(nxt)

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
