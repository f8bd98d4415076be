"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2025) and a hybrid drafter that picks per step.

- ``SuffixAutomaton``: an online suffix automaton over token ids. Chosen over a suffix tree because
  it grows by one token in amortised O(1) (Blumer et al. 1985; no active-point bookkeeping as in
  Ukkonen's tree), has at most 2n states and 3n transitions (flat int arrays here, no per-node
  objects), and answers the one question a drafter asks, "the longest suffix of the committed tokens
  that occurred before", by following one transition or suffix link per committed token. The
  occurrences of a matched string are the non-clone states of its subtree in the suffix-link tree,
  which is kept as linked child lists, so up to ``max_occurrences`` of them are enumerated in
  O(that many) and continuation frequencies are counted from the text itself.
- ``SuffixStore``: the global structure over the outputs of earlier requests (one automaton over
  ``doc SEP doc SEP ...``; a query never holds SEP, so no match spans two documents). Memory is
  bounded by ``max_tokens``: when a new document would pass it, the oldest documents are dropped
  until the kept ones fill at most three quarters of it and the automaton is rebuilt from them
  (FIFO eviction; each token is rebuilt a bounded number of times, so updates stay amortised O(1)).
  A store can be shared by the pipelines of one target tokenizer (it remembers the tokenizer's
  fingerprint and refuses another) and saved to / loaded from JSON (never pickle), validated on load.
- ``SuffixDrafter`` (``draft="suffix"``): each step matches the committed tokens against the
  request's own automaton (prompt + output, updated per committed token) and the store, reads the
  continuations of up to ``max_occurrences`` occurrences of the longest match into a trie with
  counts, and proposes the best-first tree of its most frequent paths: a node's score is the share of
  occurrences that continue with its path (an estimate of its acceptance), nodes below ``min_prob``
  are left out, and at most ``ceil(spec_factor * match length)`` tokens (and ``num_draft``) are
  proposed. The source (this request or the store) with the longer match is taken, and at equal lengths the
  occurrences of both count in one tree (chosen over taking the tree of the higher total score by a replay of
  saved outputs: perf/RESULTS.md). No match: no
  proposal (a plain decode step). Greedy runs verify the tree as is. Sampled runs need a q for
  ``TreeAcceptance``'s recursive rejection sampling: each node's children are put in an order drawn
  without replacement from q = their counts, normalised over the proposed children (one-hot for a
  single child, as prompt lookup), and that q goes with them; since the *set* of children is fixed
  by the draft side and the order is a draw from q, every sibling test is a valid speculative step,
  so the output keeps the target's distribution.
- ``HybridDrafter`` (``draft=[model, "suffix"]``): per step whichever of the two should give more tokens
  per unit of time. A suffix step costs one verify and no draft forward: it yields 1 + its tree's score,
  calibrated by how far the trees built so far agreed with the tokens then committed (every step's tree,
  the ones not proposed too, so that a few early misses cannot rule suffix trees out for good). A model
  step costs one verify plus its draft forwards (``draft_cost`` of a verify each: in greedy runs measured once
  per draft model, target and thread count by ``measure_draft_cost``, a one-token draft forward timed against a
  verify of K + 1 rows): it yields the tokens model steps yielded so far. Both are measured over the drafter's
  life (across requests, as the store learns across them). The model draft
  (any model drafter, with the target's tokenizer or another: the suffix structure is in the target's
  tokens) is prefilled only when it first drafts, so a request that suffix trees serve throughout never
  pays for it. In greedy runs a model step also pays its share of that catch-up prefill (the committed
  tokens the draft's cache lacks: the whole prompt at a request's first model step), spread over the tokens
  model steps are expected to produce (the tokens the request may still produce times the share of the
  committed tokens that model steps produced so far), priced by one short prefill timed against one-token
  draft forwards
  (``measure_prefill_cost``, once per draft model and thread count); a step with no suffix tree is a plain
  step when the model draft, so priced, would yield less than one token a verify. The choice reads only the
  draft side and committed tokens, so the output stays lossless.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from array import array
from pathlib import Path

import torch

from graphspec.drafters import ModelDrafter, next_logits, prefill
from graphspec.graph import Stage
from graphspec.kernels.sampling import exponential_noise

__all__ = ["SuffixAutomaton", "SuffixStore", "SuffixDrafter", "HybridDrafter", "SUFFIX_SPEC_FACTOR",
           "SUFFIX_MIN_PROB", "SUFFIX_MAX_OCCURRENCES", "SUFFIX_STORE_TOKENS", "HYBRID_SWITCH", "HYBRID_MODEL_K",
           "HYBRID_DRAFT_COST", "HYBRID_PREFILL_PROBE", "measure_prefill_cost", "measure_draft_cost", "SuffixLength"]

SEP = -1     # document separator in a store's text (never a token id)
_NONE = -2   # "no transition" in the first-transition slot

# Defaults (docs/suffix.md). spec_factor: a replay of the 1.5B's greedy outputs on perf/workloads.json
# (perf/workloads.py --replay) at K=5, the pipeline's default and about the last size at which this CPU's verify
# costs a one-token step (perf/cpu_step.py: 5 rows 1.01x, 9 rows 1.69x, 17 rows 1.99x): code_edit 3.06 / 3.13 /
# 3.16 / 3.20 tokens per target forward at 1 / 2 / 4 / 8, agentic 2.35 / 2.57 / 2.64 / 2.64. min_prob 0.05-0.3
# and min_match 1-3 (1 best) moved nothing or lost.
SUFFIX_SPEC_FACTOR = 4.0       # tokens proposed per matched token (SuffixDecoding's alpha)
SUFFIX_MIN_PROB = 0.1          # nodes whose path continues fewer occurrences than this share are left out
SUFFIX_MAX_OCCURRENCES = 64    # occurrences of the match whose continuations are counted
SUFFIX_STORE_TOKENS = 1 << 18  # tokens a SuffixStore keeps before evicting its oldest documents (about 40 MB)
# draft_length="auto" (SuffixLength): verify row counts timed once per target, best of two (linear in between;
# the CPU kernels pass over the weights once per block of 8 rows for bf16, 4-6 for a8 GGUF, so the curve has steps
# and 9, 17, 33 time the first row of a new block), and the weight of each match-length class's prior acceptance
# rate, 2^b / (2^b + 1) for matches of 2^b to 2^(b+1) - 1 tokens, in trees.
SUFFIX_AUTO_ROWS = (1, 2, 4, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64)
# ...and again, fewer of them, after SUFFIX_AUTO_CONTEXT tokens: attention over a long context makes rows dearer (the
# bf16 1.5B on a Zen 4 core: 8 rows 1.16x one row after 16 tokens, 1.43x after 1024), so costs are interpolated
# in the context as well
SUFFIX_AUTO_LONG_ROWS = (1, 8, 9, 17, 33, 64)
SUFFIX_AUTO_CONTEXT = 1024
SUFFIX_AUTO_PRIOR = 1.0
HYBRID_SWITCH = 1.0            # suffix when its tokens per unit of time >= this x the model draft's (see HybridDrafter)
HYBRID_MODEL_K = 5             # a hybrid's model draft proposes at most this many (the 0.5B tree's K, perf/RESULTS.md)
# A model draft forward's time over a target verify's, for sampled runs (a timed figure must not move a seeded
# sample) and wherever it cannot be measured: the int8 Qwen2.5-0.5B draft (pruned head) against the bf16 1.5B
# target on the CPUs measured (perf/RESULTS.md). Greedy runs measure it (measure_draft_cost) unless
# HybridDrafter(draft_cost=...) sets it.
HYBRID_DRAFT_COST = 0.2
HYBRID_PRIOR_MODEL = 3.0       # tokens a model step is assumed to yield before one is measured (one step's weight)
# Suffix trees' calibration starts at 1 with this many tokens of score behind it: one early tree that misses (a match
# of one token with one occurrence scores 1 a node) must not put suffix trees out of use for good.
HYBRID_PRIOR_SUFFIX = 4.0
# Tokens of the one prefill that measure_prefill_cost times. The 0.5B int8 draft on an AMD EPYC Zen 4 (1 thread,
# 2026-12-03, perf/RESULTS.md): a prefill costs 0.27-0.31 of a one-token forward per token from 32 to 900 tokens,
# 0.29 at 32; below 16 tokens the fixed part of a forward shows (2 tokens: 0.53 a token), so 32 is about the
# smallest probe that prices a prompt's prefill; measuring takes 0.7 s there (1.6 s on a model's first forwards).
# Since int8 drafts prefill on bf16 activations (8 or more tokens, avx512 and amx; kernels/cpu/int8_draft.py) it
# measured 0.22-0.24 there (2026-12-08); a catch-up of 2-7 tokens still runs the fp32 GEMM, at about twice the
# probe's price a token: a few draft forwards at most, which the rule prices low.
HYBRID_PREFILL_PROBE = 32


class SuffixAutomaton:
    """Online suffix automaton over int tokens, with the suffix-link tree for listing occurrences.

    ``extend(token)`` appends one token (amortised O(1)); ``text`` holds everything appended. A state
    stands for a set of substrings with the same end positions; ``occurrences(state, limit)`` lists up
    to ``limit`` of those end positions (indices into ``text`` of the substring's last token).
    """

    def __init__(self):
        self.text = array("i")
        self.len = array("i", [0])
        self.link = array("i", [-1])
        self.pos = array("i", [-1])        # end position a non-clone state was created at; -1 for clones
        self._tok = array("i", [_NONE])    # first transition: token ...
        self._nxt = array("i", [-1])       # ... and target state
        self._more: dict[int, dict[int, int]] = {}  # further transitions of states that have several
        self._child = array("i", [-1])     # suffix-link tree as doubly linked child lists
        self._sib = array("i", [-1])
        self._prev = array("i", [-1])      # previous sibling, -1 for a first child
        self.last = 0

    def __len__(self) -> int:
        return len(self.text)

    @property
    def num_states(self) -> int:
        return len(self.len)

    def nbytes(self) -> int:
        """Bytes held by the arrays and the transition dicts (Python objects counted by their sizes)."""
        import sys

        total = sum(a.buffer_info()[1] * a.itemsize for a in (self.text, self.len, self.link, self.pos, self._tok,
                                                              self._nxt, self._child, self._sib, self._prev))
        total += sys.getsizeof(self._more)
        for d in self._more.values():
            total += sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in d.items())
        return total

    def next(self, s: int, c: int) -> int:
        """The state reached from ``s`` by token ``c``, or -1."""
        if self._tok[s] == c:
            return self._nxt[s]
        m = self._more.get(s)
        return m.get(c, -1) if m else -1

    def _set(self, s: int, c: int, t: int) -> None:
        tok = self._tok[s]
        if tok == c or tok == _NONE:
            self._tok[s] = c
            self._nxt[s] = t
        else:
            self._more.setdefault(s, {})[c] = t

    def _new(self, length: int, pos: int) -> int:
        for a, v in ((self.len, length), (self.link, -1), (self.pos, pos), (self._tok, _NONE), (self._nxt, -1),
                     (self._child, -1), (self._sib, -1), (self._prev, -1)):
            a.append(v)
        return len(self.len) - 1

    def _add_child(self, parent: int, s: int) -> None:
        head = self._child[parent]
        self._sib[s] = head
        self._prev[s] = -1
        if head >= 0:
            self._prev[head] = s
        self._child[parent] = s

    def _replace_child(self, parent: int, old: int, new: int) -> None:
        """Put ``new`` where ``old`` is in ``parent``'s child list (a clone takes its original's place)."""
        nxt, prv = self._sib[old], self._prev[old]
        self._sib[new], self._prev[new] = nxt, prv
        if nxt >= 0:
            self._prev[nxt] = new
        if prv >= 0:
            self._sib[prv] = new
        else:
            self._child[parent] = new

    def extend(self, c: int) -> None:
        i = len(self.text)
        self.text.append(c)
        cur = self._new(self.len[self.last] + 1, i)
        p = self.last
        while p != -1 and self.next(p, c) == -1:
            self._set(p, c, cur)
            p = self.link[p]
        if p == -1:
            link = 0
        else:
            q = self.next(p, c)
            if self.len[p] + 1 == self.len[q]:
                link = q
            else:
                clone = self._new(self.len[p] + 1, -1)
                self._tok[clone], self._nxt[clone] = self._tok[q], self._nxt[q]
                if q in self._more:
                    self._more[clone] = dict(self._more[q])
                parent = self.link[q]
                self.link[clone] = parent
                self._replace_child(parent, q, clone)
                self.link[q] = clone
                self._add_child(clone, q)
                while p != -1 and self.next(p, c) == q:
                    self._set(p, c, clone)
                    p = self.link[p]
                link = clone
        self.link[cur] = link
        self._add_child(link, cur)
        self.last = cur

    def extend_all(self, tokens) -> None:
        for t in tokens:
            self.extend(t)

    def occurrences(self, s: int, limit: int) -> list[int]:
        """Up to ``limit`` end positions of state ``s``'s substrings (most recent children first)."""
        out: list[int] = []
        stack = [s]
        pos, child, sib = self.pos, self._child, self._sib
        while stack and len(out) < limit:
            v = stack.pop()
            if pos[v] >= 0:
                out.append(pos[v])
            c = child[v]
            kids = []
            while c >= 0:
                kids.append(c)
                c = sib[c]
            stack.extend(reversed(kids))
        return out

    def walk(self, state: int, length: int, c: int) -> tuple[int, int]:
        """Matching statistics: from a match ``(state, length)`` of a query's suffix, the match after ``c``."""
        while state > 0 and self.next(state, c) == -1:
            state = self.link[state]
            length = self.len[state]
        t = self.next(state, c)
        if t == -1:
            return 0, 0
        return t, length + 1


def _check_int(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


class SuffixStore:
    """The global suffix structure: an automaton over earlier requests' outputs, at most ``max_tokens`` of them.

    ``add(tokens)`` stores one document (a request's output); when the store would hold more than
    ``max_tokens``, the oldest documents are dropped until the rest (the new one included) fill at most
    three quarters of it, and the automaton is rebuilt from them; a document longer than that keeps
    its last tokens. One store may serve several pipelines whose targets share a tokenizer.
    """

    VERSION = 1

    def __init__(self, max_tokens: int = SUFFIX_STORE_TOKENS, tokenizer_fingerprint: str | None = None):
        self.max_tokens = _check_int("max_tokens", max_tokens, 1)
        self.fingerprint = tokenizer_fingerprint
        self.docs: list[list[int]] = []
        self.automaton = SuffixAutomaton()
        self.evictions = 0
        # Held while the automaton is extended or read: the batched engine runs generations in threads, and a
        # walk must not see a half-made extension.
        self.lock = threading.RLock()

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.docs)

    def bind(self, fingerprint: str | None) -> None:
        """Tie the store to one tokenizer: ids mean nothing across tokenizers."""
        if not fingerprint:
            return
        if self.fingerprint is None:
            self.fingerprint = fingerprint
        elif self.fingerprint != fingerprint:
            raise ValueError("this SuffixStore holds token ids of another tokenizer (its fingerprint differs from "
                             "the target's); give each target tokenizer its own SuffixStore")

    def add(self, tokens) -> None:
        with self.lock:
            self._add(tokens)

    def _add(self, tokens) -> None:
        doc = [int(t) for t in tokens]
        if not doc:
            return
        if any(t < 0 for t in doc):
            raise ValueError("a SuffixStore document holds a negative token id; token ids are >= 0")
        if self.num_tokens + len(doc) + 1 <= self.max_tokens:
            self.docs.append(doc)
            self.automaton.extend_all(doc)
            self.automaton.extend(SEP)
            return
        keep = (3 * self.max_tokens) // 4
        doc = doc[-max(keep - 1, 1):]
        kept: list[list[int]] = [doc]
        total = len(doc) + 1
        for d in reversed(self.docs):
            if total + len(d) + 1 > keep:
                break
            kept.append(d)
            total += len(d) + 1
        self.evictions += len(self.docs) + 1 - len(kept)
        self.docs = kept[::-1]
        self._rebuild()

    def _rebuild(self) -> None:
        self.automaton = SuffixAutomaton()
        for d in self.docs:
            self.automaton.extend_all(d)
            self.automaton.extend(SEP)

    def save(self, path) -> None:
        """Write the store as JSON (atomically: a temporary file, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}-{threading.get_ident()}")
        with self.lock:
            docs = [list(d) for d in self.docs]
        tmp.write_text(json.dumps({"format": "graphspec-suffix-store", "version": self.VERSION,
                                   "max_tokens": self.max_tokens, "tokenizer_fingerprint": self.fingerprint,
                                   "docs": docs}))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path, max_tokens: int | None = None) -> "SuffixStore":
        """A store from ``save``'s JSON, checked field by field (a bad file says what is wrong)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the suffix store {path}: {e}; delete it to start an empty store") from None
        if not isinstance(data, dict) or data.get("format") != "graphspec-suffix-store":
            raise ValueError(f"{path} is not a graphspec suffix store (no format: graphspec-suffix-store)")
        if data.get("version") != cls.VERSION:
            raise ValueError(f"{path} is a suffix store of version {data.get('version')!r}; this graphspec reads "
                             f"version {cls.VERSION}: delete it to start an empty store")
        docs = data.get("docs")
        if not isinstance(docs, list) or not all(
                isinstance(d, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in d)
                for d in docs):
            raise ValueError(f"{path}: 'docs' must be a list of lists of token ids >= 0")
        fp = data.get("tokenizer_fingerprint")
        if fp is not None and not isinstance(fp, str):
            raise ValueError(f"{path}: 'tokenizer_fingerprint' must be a string or null")
        store = cls(max_tokens if max_tokens is not None else _check_int("max_tokens", data.get("max_tokens"), 1), fp)
        for d in docs:
            store.add(d)
        return store


class _Node:
    __slots__ = ("token", "count", "recent", "kids")

    def __init__(self, token: int):
        self.token = token
        self.count = 0
        self.recent = -1
        self.kids: dict[int, _Node] = {}


def continuation_tree(text, ends: list[int], stop: int, budget: int, min_prob: float, more=()
                      ) -> tuple[list[int], list[int], list[float], list[int]]:
    """The best-first tree of the continuations of the occurrences ending at ``ends`` in ``text``.

    Each occurrence continues with ``text[e + 1 : ...]`` up to ``budget`` tokens, ending at a SEP or
    at ``stop`` (exclusive). ``more``: further ``(text, ends, stop)`` sources whose occurrences count in the
    same trie (a store's, where its match is as long as this request's). Node score: the share of the
    occurrences with a continuation whose continuation starts with the node's path. Returns ``(tokens, parents,
    scores, counts)`` of up to ``budget`` nodes with scores >= ``min_prob``, best first (a parent always before its
    children; parents index the returned nodes, -1 the root); ties go to the shallower node, then to the most
    recent occurrence (an earlier source's before any later one's).
    """
    root = _Node(-1)
    n = 0
    sources = [(text, ends, stop), *more]
    for rank, (src, src_ends, src_stop) in enumerate(sources):
        bonus = (len(sources) - 1 - rank) << 40  # recency: the first source's occurrences rank as the most recent
        for e in src_ends:
            a = e + 1
            b = min(src_stop, a + budget)
            if a >= b or src[a] == SEP:
                continue
            n += 1
            node = root
            for i in range(a, b):
                t = src[i]
                if t == SEP:
                    break
                nxt = node.kids.get(t)
                if nxt is None:
                    nxt = node.kids[t] = _Node(t)
                nxt.count += 1
                if e + bonus > nxt.recent:
                    nxt.recent = e + bonus
                node = nxt
    if n == 0:
        return [], [], [], []
    cand: list[tuple[float, int, int, int, _Node, int]] = []  # (-score, depth, -recent, seq, node, parent idx)
    import heapq

    seq = 0
    for kid in root.kids.values():
        cand.append((-kid.count / n, 1, -kid.recent, seq, kid, -1))
        seq += 1
    heapq.heapify(cand)
    toks: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    counts: list[int] = []
    while cand and len(toks) < budget:
        neg, depth, _, _, node, parent = heapq.heappop(cand)
        if -neg < min_prob:
            break
        idx = len(toks)
        toks.append(node.token)
        parents.append(parent)
        scores.append(-neg)
        counts.append(node.count)
        for kid in node.kids.values():
            heapq.heappush(cand, (-kid.count / n, depth + 1, -kid.recent, seq, kid, idx))
            seq += 1
    return toks, parents, scores, counts


# target -> {(threads, rows): its CostTable of verify forwards}, for SuffixLength.measure; weak, as _DRAFT_COSTS
_VERIFY_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _depths(parents: list[int]) -> list[int]:
    """Each node's depth (1 under the root); parents come before their children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


class SuffixLength:
    """How much of a suffix tree to propose (``Pipeline(draft="suffix", draft_length="auto")``, greedy runs): the
    first n of its best-first nodes, n in 0..K, with the most expected tokens per second of a verify,
    ``(1 + sum of p_i for the first n) / seconds(verify of n + 1 rows)``.

    ``p_i = score_i x r ** depth_i``: the node's share of the match's occurrences that continue with its path, times
    the chance that the match still predicts that far, ``r`` per token. ``r`` is measured per class of match length
    (1, 2-3, 4-7, 8-15, 16-31, 32+ tokens: in copied code a long match keeps agreeing, a one-token match rarely
    does) as a geometric rate over the trees proposed so far: tokens accepted over tokens accepted plus trees that
    stopped short, from a prior of ``2^b / (2^b + 1)`` weighed as ``prior`` trees. The seconds are this machine's
    (``CostTable`` s of the target's verify forwards after a short and a long context, timed once per target in a
    process, interpolated in the step's context: ``seconds``), so a long chain is proposed where more rows cost
    little (bf16 on a CPU up to a kernel's row block, a GPU) and a short one where each row costs (the a8 GGUF
    kernels, long contexts). n = 0 is a plain step. Counts are kept over the drafter's life, across requests."""

    def __init__(self, costs, prior: float = SUFFIX_AUTO_PRIOR, long_costs=None, long_context: int = 0):
        self.costs = costs
        # the same forwards after long_context tokens (None: costs taken as independent of the context)
        self.long_costs = long_costs if long_context > 16 else None
        self.long_context = long_context
        self.max_k = max(costs.target) - 1  # the most nodes its table prices
        self.prior = float(prior)
        self.accepted = [0] * 6   # per match-length class: tokens accepted from proposed trees
        self.stopped = [0] * 6    # trees whose accepted path ended before their deepest node
        self.chosen: list[int] = []  # n of each proposed step, over the drafter's life (bounded)

    @classmethod
    def measure(cls, target, max_k: int) -> "SuffixLength":
        """A rule with counts of its own and ``target``'s verify costs for 1..max_k + 1 rows, timed once per target,
        thread count and max_k in a process (pipelines on one target share the table)."""
        from graphspec.engine import CostTable

        rows = tuple(r for r in SUFFIX_AUTO_ROWS if r <= max_k + 1)
        rows = rows if max_k + 1 in rows else rows + (max_k + 1,)
        model = _unbatched(target)
        try:
            known = _VERIFY_COSTS.setdefault(model, {})
        except TypeError:  # a model object that takes no weak reference: measured each time
            known = {}
        key = (torch.get_num_threads(), rows)
        if key not in known:
            long = min(SUFFIX_AUTO_CONTEXT, target.config.max_position_embeddings - max_k - 2)
            long_rows = tuple(r for r in SUFFIX_AUTO_LONG_ROWS if r <= max_k + 1)
            long_rows = long_rows if max_k + 1 in long_rows else long_rows + (max_k + 1,)
            known[key] = (CostTable.measure(target, None, rows=rows, repeats=2, prefill_tokens=()),
                          CostTable.measure(target, None, rows=long_rows, repeats=2, prefill_tokens=(), context=long)
                          if long > 16 else None, long)
        short, long_costs, long = known[key]
        return cls(short, long_costs=long_costs, long_context=long)

    def seconds(self, rows: int, context: int = 16) -> float:
        """A verify of ``rows`` rows after ``context`` tokens: the short-context table, plus the long one's extra
        time scaled linearly in the context (attention's share grows with it; never below the short table)."""
        base = self.costs.target_cost(rows)
        if self.long_costs is None or context <= 16:
            return base
        extra = max(self.long_costs.target_cost(rows) - base, 0.0)
        return base + extra * (context - 16) / (self.long_context - 16)

    @staticmethod
    def _class(match: int) -> int:
        return min(max(match, 1).bit_length() - 1, 5)

    def rate(self, match: int) -> float:
        b = self._class(match)
        lo = 1 << b
        a, f = self.accepted[b], self.stopped[b]
        return (a + self.prior * lo / (lo + 1)) / (a + f + self.prior)

    def choose(self, scores: list[float], parents: list[int], match: int, context: int = 16) -> int:
        """n for a best-first tree (``scores``, ``parents``) of a match of ``match`` tokens, after ``context``."""
        if not scores:
            return 0
        r = self.rate(match)
        best, n_best, tokens = 1.0 / self.seconds(1, context), 0, 1.0
        for n, (s, d) in enumerate(zip(scores, _depths(parents)), 1):
            tokens += s * r ** d
            v = tokens / self.seconds(n + 1, context)
            if v > best:
                best, n_best = v, n
        if len(self.chosen) < 1 << 16:
            self.chosen.append(n_best)
        return n_best

    def record(self, match: int, depth: int, accepted: int) -> None:
        """A proposed tree of ``depth`` levels for a match of ``match`` tokens, of which ``accepted`` were taken."""
        b = self._class(match)
        self.accepted[b] += accepted
        if accepted < depth:
            self.stopped[b] += 1


def _check_prob(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    return float(v)


class SuffixDrafter(Stage):
    """Propose a tree of frequent continuations of the longest earlier match (this request, then the store)."""

    reads = ("tokens", "num_draft", "params", "generator")
    writes = ("draft_ids", "draft_probs", "draft_parents")

    def __init__(self, store: SuffixStore | None = None, *, spec_factor: float = SUFFIX_SPEC_FACTOR,
                 min_prob: float = SUFFIX_MIN_PROB, max_occurrences: int = SUFFIX_MAX_OCCURRENCES,
                 min_match: int = 1, learn: bool = True, save_path=None, name: str = "draft"):
        super().__init__(name)
        if isinstance(spec_factor, bool) or not isinstance(spec_factor, (int, float)) or not spec_factor > 0:
            raise ValueError(f"spec_factor must be a number > 0 (tokens proposed per matched token), got "
                             f"{spec_factor!r}")
        if store is not None and not isinstance(store, SuffixStore):
            raise ValueError(f"store must be a graphspec.suffix.SuffixStore or None, got {type(store).__name__}")
        self.spec_factor = float(spec_factor)
        self.min_prob = _check_prob("min_prob", min_prob)
        self.max_occurrences = _check_int("max_occurrences", max_occurrences, 1)
        self.min_match = _check_int("min_match", min_match, 1)
        self.learn = bool(learn)
        self.save_path = None if save_path is None else Path(save_path)
        if store is None and self.save_path is not None and self.save_path.exists():
            store = SuffixStore.load(self.save_path)
        self.store = store if store is not None else SuffixStore()
        # draft_length="auto": a SuffixLength sizes each greedy step's tree (Pipeline sets it at its first greedy run);
        # None: up to spec_factor x the match length, and K
        self.length: SuffixLength | None = None

    def begin(self, state) -> None:
        tok = getattr(state.run.target, "tokenizer", None)
        self.store.bind(getattr(tok, "fingerprint", None))
        sam = SuffixAutomaton()
        sam.extend_all(state.tokens)
        m = (0, 0)
        with self.store.lock:
            g = self.store.automaton
            for t in state.tokens:
                m = g.walk(*m, t)
        state.scratch(self).update(local=sam, match=m, automaton=g, proposed_from=None)
        state.run.extra.setdefault("suffix", {"steps": 0, "proposals": 0, "local": 0, "global": 0, "both": 0,
                                              "match_tokens": 0})

    def end(self, state) -> None:
        """After a generation: its output goes into the store (and the store to its file, if one is set)."""
        if self.length is not None:
            with self.store.lock:
                self._settle(state, state.scratch(self))
        if not self.learn:
            return
        out = state.tokens[state.run.prompt_len:]
        if out:
            self.store.add(out)
            if self.save_path is not None:
                self.store.save(self.save_path)

    def _sync(self, state) -> dict:
        sc = state.scratch(self)
        sam: SuffixAutomaton = sc["local"]
        tokens = state.tokens
        g = sc["automaton"]
        if g is not self.store.automaton:  # the store was rebuilt under a running generation: rematch
            g = sc["automaton"] = self.store.automaton
            m = (0, 0)
            for t in tokens[:len(sam)]:
                m = g.walk(*m, t)
            sc["match"] = m
        m = sc["match"]
        for t in tokens[len(sam):]:
            sam.extend(t)
            m = g.walk(*m, t)
        sc["match"] = m
        return sc

    def propose(self, state, k: int) -> tuple[list[int], list[int], list[float], list[int], int]:
        """The tree for this step: ``(tokens, parents, scores, counts, match length)``, parents -1 for the root."""
        with self.store.lock:
            return self._propose(state, k)

    def _propose(self, state, k: int, capped: bool = True) -> tuple[list[int], list[int], list[float], list[int], int]:
        """``capped``: at most ``ceil(spec_factor x match length)`` nodes; else up to ``k`` (``length`` sizes them)."""
        sc = self._sync(state)
        factor = self.spec_factor if capped else math.inf
        sc["proposed_from"] = None
        if k <= 0:
            return [], [], [], [], 0
        sam: SuffixAutomaton = sc["local"]
        # (match length, name, [(text, ends, stop)]): this request's longest earlier match, then the store's
        options = []
        s = sam.link[sam.last]
        if s > 0 and sam.len[s] >= self.min_match:
            options.append((sam.len[s], "local", [(sam.text, sam.occurrences(s, self.max_occurrences + 1),
                                                   len(sam.text))]))
        g: SuffixAutomaton = sc["automaton"]
        gs, glen = sc["match"]
        if gs > 0 and glen >= self.min_match:
            options.append((glen, "global", [(g.text, g.occurrences(gs, self.max_occurrences), len(g.text))]))
        # The longer match is the more specific context; at equal lengths both sources' occurrences count together.
        if len(options) == 2 and options[0][0] == options[1][0]:
            options.insert(0, (options[0][0], "both", options[0][2] + options[1][2]))
        else:
            options.sort(key=lambda o: -o[0])  # (stable: this request's first on a tie)
        for length, name, sources in options:
            budget = k if factor == math.inf else min(k, math.ceil(factor * length))
            tree = continuation_tree(*sources[0], budget, self.min_prob, more=sources[1:])
            if tree[0]:
                sc["proposed_from"] = name
                return (*tree, length)
        return [], [], [], [], 0

    def propose_sized(self, state, k: int) -> tuple[list[int], list[int], list[float], list[int], int]:
        """As ``propose``, the tree sized by ``length`` (set, greedy runs) after the previous sized tree is settled;
        the caller that proposes it sets ``scratch["auto_last"]`` so that the next step settles it."""
        with self.store.lock:
            self._settle(state, state.scratch(self))
            toks, parents, scores, counts, match = self._propose(state, k, capped=False)
            n = self.length.choose(scores, parents, match, len(state.tokens))
        return toks[:n], parents[:n], scores[:n], counts[:n], match

    def _settle(self, state, sc: dict) -> None:
        """The previous step's tree under ``length`` against the tokens committed since: its rates learn from it."""
        last = sc.get("auto_last")
        if last is not None:
            n0, toks, parents, match = last
            sc["auto_last"] = None
            self.length.record(match, max(_depths(parents)), _followed(toks, parents, state.tokens[n0:]))

    def run(self, state) -> None:
        k = state.num_draft
        if self.length is not None and state.params.greedy:
            toks, parents, scores, counts, length = self.propose_sized(state, k)
            if toks:
                state.scratch(self)["auto_last"] = (len(state.tokens), toks, parents, length)
        else:
            toks, parents, scores, counts, length = self.propose(state, k)
        extra = state.run.extra["suffix"]
        extra["steps"] += 1
        if toks:
            extra["proposals"] += 1
            extra[state.scratch(self)["proposed_from"]] += 1
            extra["match_tokens"] += length
        write_tree(state, toks, parents, counts)


def write_tree(state, toks: list[int], parents: list[int], counts: list[int]) -> None:
    """Set ``draft_ids`` / ``draft_parents`` / ``draft_probs`` for a tree of deterministic proposals.

    ``parents`` index ``toks`` (-1: the root); rows are laid out depth first. Greedy: children in
    best-first order, no q. Sampling: each node's children in an order drawn without replacement from
    q = their counts normalised over those children (an exponential race), and each child's row
    carries its parent's q: what ``TreeAcceptance``'s recursive rejection sampling needs to stay exact.
    """
    device = state.run.device
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    greedy = state.params.greedy
    rows: list[int] = []
    row_parent: list[int] = []
    row_q: list[list[tuple[int, float]]] = []

    def visit(node: int, row: int) -> None:
        children = kids.get(node, [])
        if not children:
            return
        if greedy:
            order = children
            q = []
        else:
            w = torch.tensor([float(counts[c]) for c in children], dtype=torch.float64)
            w = w / w.sum()
            race = exponential_noise((1, len(children)), state.generator, device)[0].cpu().double() / w
            order = [children[i] for i in torch.argsort(race).tolist()]
            q = [(toks[c], float(w[i])) for i, c in enumerate(children)]
        for c in order:
            rows.append(toks[c])
            row_parent.append(row)
            row_q.append(q)
            visit(c, len(rows))

    visit(-1, 0)
    state.draft_ids = torch.tensor([rows], dtype=torch.int64, device=device).view(1, len(rows))
    state.draft_parents = tuple(row_parent)
    if greedy or not rows:
        state.draft_probs = None
        return
    probs = torch.zeros(1, len(rows), state.run.vocab_size, dtype=torch.float32)
    for j, q in enumerate(row_q):
        for t, w in q:
            probs[0, j, t] = w
    state.draft_probs = probs.to(device)


def _followed(toks: list[int], parents: list[int], committed: list[int]) -> int:
    """How many tokens of a tree (``parents`` index ``toks``, -1 the root) ``committed`` follows from its root."""
    cur, got = -1, 0
    for t in committed:
        cur = next((i for i, (a, p) in enumerate(zip(toks, parents)) if p == cur and a == t), None)
        if cur is None:
            break
        got += 1
    return got


def _unbatched(model):
    from graphspec.engine import _BatchedModel  # the engine's proxy would queue a probe behind batched steps

    return model.model if isinstance(model, _BatchedModel) else model


# draft model -> {(threads, head width): a prefill's seconds per token over a draft forward's}; weak, so that a
# model's measurement goes with it
_PREFILL_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def measure_prefill_cost(drafter: ModelDrafter, tokens: int = HYBRID_PREFILL_PROBE, repeats: int = 2) -> float:
    """A batched prefill's time per token over one draft forward's, for ``drafter``'s model on this machine.

    Times a prefill of ``tokens`` tokens (``graphspec.drafters.prefill``, as ``ModelDrafter.catch_up`` runs
    it) and one-token draft forwards (``next_logits``, with the drafter's head) in a scratch cache, best of
    ``repeats`` each, both in the same moment so that the host's load falls on both. Kept per model, thread
    count and head width: measured once (0.7 s for the 0.5B int8 draft on one Zen 4 core, warm).
    A ratio, so it carries over to the rule's unit through ``draft_cost`` (a draft forward in verifies).
    """
    _check_int("tokens", tokens, 1)
    model = _unbatched(drafter.model)
    key = (torch.get_num_threads(), None if drafter.head is None else int(drafter.head.ids.numel()))
    try:
        known = _PREFILL_COSTS.setdefault(model, {})
    except TypeError:  # a model object that takes no weak reference: measured each time
        known = {}
    if key in known:
        return known[key]
    device = getattr(model, "device", torch.device("cpu"))
    cache = model.new_cache(tokens + 1)
    ids = [0] * tokens
    one = torch.zeros(1, 1, dtype=torch.int64, device=device)
    fill = step = float("inf")
    for _ in range(max(repeats, 1)):
        cache.truncate(0)
        t0 = time.perf_counter()
        prefill(model, cache, ids, device)
        fill = min(fill, time.perf_counter() - t0)
        for _ in range(2):
            cache.truncate(tokens)
            t0 = time.perf_counter()
            next_logits(model, drafter.head, one, cache)
            step = min(step, time.perf_counter() - t0)
    known[key] = ratio = fill / tokens / max(step, 1e-9)
    return ratio


# draft model -> target -> {(threads, head width, verify rows): a draft forward's seconds over a verify's}
_DRAFT_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def measure_draft_cost(drafter, target, rows: int, repeats: int = 2) -> float:
    """One draft forward's time over one target verify of ``rows`` rows, for this pair on this machine.

    Times, in scratch caches and in the same moment (so that the host's load falls on both), a one-token
    draft forward (``next_logits`` with the drafter's head, as a chain draft runs) and a target forward of
    ``rows`` tokens with logits for every row (``model.step(..., logits_for="all")``, as a verify runs),
    best of ``repeats`` each. Both at the start of a cache: attention over a long context adds to both and
    is left out. Kept per draft model, target, thread count, head width and rows, so it is measured once
    (two 6-row verifies of the 1.5B and four 0.5B int8 forwards: 0.5-0.6 s on one Zen 4 core, 1.3 s on models
    that had not run yet; perf/RESULTS.md).
    """
    _check_int("rows", rows, 1)
    model, target = _unbatched(drafter.model), _unbatched(target)
    head = getattr(drafter, "head", None)
    key = (torch.get_num_threads(), None if head is None else int(head.ids.numel()), rows)
    try:
        known = _DRAFT_COSTS.setdefault(model, weakref.WeakKeyDictionary()).setdefault(target, {})
    except TypeError:  # a model object that takes no weak reference: measured each time
        known = {}
    if key in known:
        return known[key]
    d_cache, t_cache = model.new_cache(2), target.new_cache(rows)
    one = torch.zeros(1, 1, dtype=torch.int64, device=getattr(model, "device", torch.device("cpu")))
    ids = torch.zeros(1, rows, dtype=torch.int64, device=getattr(target, "device", torch.device("cpu")))
    verify = step = float("inf")
    for _ in range(max(repeats, 1)):
        for _ in range(2):
            d_cache.truncate(0)
            t0 = time.perf_counter()
            next_logits(model, head, one, d_cache)
            step = min(step, time.perf_counter() - t0)
        t_cache.truncate(0)
        t0 = time.perf_counter()
        target.step(ids, t_cache, logits_for="all")
        verify = min(verify, time.perf_counter() - t0)
    known[key] = ratio = step / max(verify, 1e-9)
    return ratio


class HybridDrafter(Stage):
    """Per step, the suffix tree when it should be accepted well, else a model draft (lossless either way).

    ``model``: the model draft's stages in order (a ``ModelDrafter``, or a ``CrossVocabDrafter`` and
    its ``VocabMap``); ``model_k``: at most this many model draft tokens a step (None: ``num_draft``), so
    that K can be set for long suffix trees without lengthening the model's chains.

    Rule, in tokens per unit of time (a verify costs about the same for the few rows of either proposal):
    with ``s`` the suffix tree's score (its nodes' scores summed: the tokens it expects accepted), ``c`` the
    tokens of the suffix trees built so far that the committed tokens then followed, over their scores
    (both plus a prior of ``HYBRID_PRIOR_SUFFIX``, so 1 before any; a tree not proposed is checked against
    what the model step committed), ``m`` the
    tokens a model step yielded (the bonus token included) and ``f`` the draft forwards it ran, both
    averaged over the model steps so far plus one prior step of ``prior_model`` tokens and ``model_k``
    forwards, the suffix tree is proposed when

        1 + c * s >= switch * m / (1 + draft_cost * f)

    (a suffix step costs one verify; a model step one verify and ``f`` draft forwards of ``draft_cost``
    verifies each). Where the suffix drafter has a ``SuffixLength`` (``draft_length="auto"``, greedy runs), its
    tree is sized by it and the left side is multiplied by a model step's verify time over the tree's (a tree of
    n nodes verifies n + 1 rows). The figures are kept over the drafter's life, across requests. ``draft_cost``: a draft
    forward's time over a verify's; None (the default) measures it in greedy runs (``measure_draft_cost``, once
    per draft model, target, thread count and verify rows) and takes ``HYBRID_DRAFT_COST`` in sampled runs.

    Catch-up (greedy runs, a same-tokenizer chain or tree draft): a model step first feeds the draft the ``T``
    committed tokens its cache lacks (the whole prompt at a request's first model step, the tokens of the
    suffix steps since the last one after that) as one prefill, ``p`` draft forwards a token (``prefill_cost``;
    None: ``measure_prefill_cost``). That buys model steps for the rest of the request, but only for the tokens
    model steps will produce: of the ``r`` tokens the request may still produce, a share ``w`` (the committed
    tokens model steps produced over all that steps produced, counted over this request's steps so far with one
    prior step of ``prior_model`` tokens of each kind: 1/2 before any). So a model step pays its expected tokens'
    share of the catch-up, ``m`` over ``w * r`` (at least one token), as the engine's ``SpeculationPolicy``
    spreads a deferred draft's catch-up over the tokens it will draft:

        model rate = m / (1 + draft_cost * f + draft_cost * p * T * min(m / max(w * r, 1), 1))

    Where suffix trees produce most tokens (code editing: a file restated), a prompt's prefill bought for a
    few model steps thus costs what it costs; a long prompt with a short budget left keeps the model out
    unless suffix trees do badly. With no suffix tree the step is a plain one (no proposal) when the model
    rate is below a plain step's: one token a verify, or with ``draft_length="auto"`` (timed verify costs)
    seconds(verify of model_k + 1 rows) / seconds(one row), so on a target whose extra rows cost several steps
    the model must beat plain decoding there (a sized suffix tree, where there is one, is taken instead). Sampled
    runs leave the catch-up out: it is timed, and a seeded sample must not depend on the host's load.
    """

    reads = ("tokens", "num_draft", "params", "generator")
    writes = ("draft_ids", "draft_probs", "draft_parents")

    def __init__(self, model, suffix: SuffixDrafter | None = None, *, switch: float = HYBRID_SWITCH,
                 model_k: int | None = HYBRID_MODEL_K, draft_cost: float | None = None,
                 prior_model: float = HYBRID_PRIOR_MODEL, prefill_cost: float | None = None, name: str = "draft"):
        super().__init__(name)
        stages = list(model) if isinstance(model, (list, tuple)) else [model]
        if not stages or not all(isinstance(s, Stage) for s in stages):
            raise ValueError("HybridDrafter needs the model draft's stages (a ModelDrafter, or a CrossVocabDrafter "
                             "and its VocabMap)")
        if len(stages) > 2:
            raise ValueError(f"HybridDrafter takes a model drafter and at most one map stage, got {len(stages)} stages")
        # two attributes, not a list: code that rebinds a pipeline's models finds stages held as attributes
        self.model_drafter = stages[0]
        self.model_map = stages[1] if len(stages) > 1 else None
        self.suffix = suffix if suffix is not None else SuffixDrafter()
        if isinstance(switch, bool) or not isinstance(switch, (int, float)) or not switch >= 0:
            raise ValueError(f"switch must be a number >= 0, got {switch!r}")
        self.switch = float(switch)
        self.model_k = None if model_k is None else _check_int("model_k", model_k, 1)
        for what, v in (("draft_cost", draft_cost), ("prior_model", prior_model)):
            if what == "draft_cost" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{what} must be a number >= 0, got {v!r}"
                                 + (" (None: measured in greedy runs)" if what == "draft_cost" else ""))
        # a draft forward's cost in verifies (None: measure_draft_cost in greedy runs, HYBRID_DRAFT_COST in sampled)
        self.draft_cost = None if draft_cost is None else float(draft_cost)
        self.prior_model = float(prior_model)
        if prefill_cost is not None and (isinstance(prefill_cost, bool) or not isinstance(prefill_cost, (int, float))
                                         or not prefill_cost >= 0):
            raise ValueError(f"prefill_cost must be a number >= 0 (a prefill's cost per token in draft forwards) or "
                             f"None (measured), got {prefill_cost!r}")
        # a draft prefill's cost per token in draft forwards (None: measured when a catch-up is first priced)
        self.prefill_cost = None if prefill_cost is None else float(prefill_cost)
        # what each kind of step earned so far, over every request (lock: the engine's threads share the stage)
        # (step_tokens: the tokens every step committed, model_tokens those of model steps: the share of the
        # catch-up's rule)
        self.measured = {"suffix_score": 0.0, "suffix_accepted": 0, "model_steps": 0, "model_tokens": 0,
                         "model_forwards": 0, "step_tokens": 0}
        self._lock = threading.Lock()
        # the model stages read step inputs and each other's outputs only
        self.reads = tuple(dict.fromkeys(self.reads + tuple(
            f for s in stages for f in s.reads if f not in {w for t in stages for w in t.writes})))
        self._model_tree = any("draft_parents" in s.writes for s in stages)

    @property
    def model_stages(self) -> list[Stage]:
        return [self.model_drafter] + ([self.model_map] if self.model_map is not None else [])

    @property
    def store(self) -> SuffixStore:
        return self.suffix.store

    def check(self, params) -> None:
        for s in self.model_stages:
            s.check(params)

    def begin(self, state) -> None:
        self.suffix.begin(state)
        d = self.model_drafter
        if isinstance(d, ModelDrafter) and not d.beam:
            d.begin(state, fill=False)  # prefilled by _catch_up before its first step, if it ever drafts
        else:
            d.begin(state)
        if self.model_map is not None:
            self.model_map.begin(state)
        state.scratch(self).update(last=None, request_tokens=0, request_model_tokens=0)
        state.run.extra["hybrid"] = {"suffix_steps": 0, "model_steps": 0, "plain_steps": 0}

    def model_share(self, state=None) -> float:
        """``w``: the share of the committed tokens that model steps produced, with one prior step of
        ``prior_model`` tokens of each kind (1/2 before any); see the class docstring. With a run's ``state``:
        over that request's steps so far (what the rule uses); without: over the drafter's life."""
        if state is None:
            m = self.measured
            produced, by_model = m["step_tokens"], m["model_tokens"]
        else:
            sc = state.scratch(self)
            produced, by_model = sc["request_tokens"], sc["request_model_tokens"]
        total = produced + 2 * self.prior_model
        return (by_model + self.prior_model) / total if total > 0 else 1.0

    def model_rate(self, k: int, catch_up: int = 0, remaining: int = 1, *, draft_cost: float | None = None,
                   share: float | None = None) -> float:
        """Tokens a verify of a model step of at most ``k`` drafts, with ``catch_up`` tokens to prefill first and
        ``remaining`` tokens left to the request (see the class docstring). ``draft_cost``: None takes
        ``self.draft_cost`` (``HYBRID_DRAFT_COST`` if that is None too); ``share``: None takes ``model_share()``
        (1 spreads the catch-up over every token left, the rule of 6cd2a51)."""
        m = self.measured
        steps = m["model_steps"] + 1  # one prior step
        tokens = (m["model_tokens"] + self.prior_model) / steps
        forwards = (m["model_forwards"] + k) / steps
        if draft_cost is None:
            draft_cost = HYBRID_DRAFT_COST if self.draft_cost is None else self.draft_cost
        cost = 1.0 + draft_cost * forwards
        if catch_up > 0:
            if self.prefill_cost is None:
                raise ValueError("HybridDrafter.prefill_cost is not measured yet; set it (draft forwards a prefill "
                                 "token costs) or let run() measure it")
            share = self.model_share() if share is None else share
            cost += draft_cost * self.prefill_cost * catch_up * min(tokens / max(remaining * share, 1.0), 1.0)
        return tokens / cost

    def prefers_suffix(self, score: float, k: int, catch_up: int = 0, remaining: int = 1, *,
                       draft_cost: float | None = None, share: float | None = None, verify_ratio: float = 1.0) -> bool:
        """The rule (see the class docstring) for a suffix tree of ``score`` against a model step of at most ``k``
        that must first prefill ``catch_up`` tokens, with ``remaining`` tokens left to the request.
        ``verify_ratio``: a model step's verify time over the suffix tree's (1: the same rows' cost; a long tree
        sized by ``SuffixLength`` costs more)."""
        m = self.measured
        c = (m["suffix_accepted"] + HYBRID_PRIOR_SUFFIX) / (m["suffix_score"] + HYBRID_PRIOR_SUFFIX)
        return (1.0 + c * score) * verify_ratio >= self.switch * self.model_rate(
            k, catch_up, remaining, draft_cost=draft_cost, share=share)

    def _model_rows(self, k: int) -> int:
        """Verify rows of a model step with the run's K."""
        return (k if self.model_k is None else min(k, self.model_k)) + 1

    def step_draft_cost(self, state) -> float:
        """The ``draft_cost`` of this step: the one set, else measured in a greedy run (``measure_draft_cost`` at
        the run's K + 1 verify rows), else ``HYBRID_DRAFT_COST`` (a sampled run: a timed figure must not move a seeded
        sample; or a model drafter with no model to time)."""
        if self.draft_cost is not None:
            return self.draft_cost
        d = self.model_drafter
        if not state.params.greedy or state.num_draft < 1 or getattr(d, "model", None) is None \
                or state.run.target is None:
            return HYBRID_DRAFT_COST
        # the run's K (capped by model_k: a model step's rows), not this step's (fewer near a request's end): one
        # measurement a pipeline
        return measure_draft_cost(d, state.run.target, self._model_rows(state.run.num_speculative_tokens))

    def catch_up_tokens(self, state) -> int:
        """Committed tokens the model draft must be fed before it drafts (what ``ModelDrafter.catch_up`` prefills;
        0 where it prefills nothing: fewer than two, a beam, a draft with another tokenizer, a sampled run). An
        empty cache first takes the rows a prefix cache holds (``fill_from_store``): those cost a copy, not a
        prefill."""
        d = self.model_drafter
        if not state.params.greedy or not isinstance(d, ModelDrafter) or d.beam:
            return 0
        cache = state.scratch(d).get("cache")
        if cache is None:
            return 0
        behind = len(state.tokens) - 1 - cache.length
        store = state.run.prefix_cache
        if cache.length == 0 and store is not None:
            behind -= store.match(d.model, state.tokens[:-1])
        return behind if behind >= 2 else 0

    def end(self, state) -> None:
        self.suffix.end(state)
        end = getattr(self.model_drafter, "end", None)  # a model draft's rows go to the prefix cache
        if end is not None:
            end(state)

    def _settle(self, state) -> None:
        """Right after a model step: cut a same-tokenizer draft's cache to the committed tokens it holds.

        A ``ModelDrafter`` drops its rejected drafts at its next run, from the committed length it then
        sees; after suffix steps that length has moved on, so the hybrid does it at once instead.
        (A ``CrossVocabDrafter`` matches its cache against the committed text itself.)
        """
        d = self.model_drafter
        if not isinstance(d, ModelDrafter) or d.beam and state.params.greedy:
            return  # a beam keeps the taken path's nodes from the committed tokens, whenever it runs
        dsc = state.scratch(d)
        cache = dsc.get("cache")
        if cache is None:
            return
        d.drop_uncommitted(state, dsc, cache)
        dsc["fed"] = (cache.length, [])

    def _catch_up(self, state) -> None:
        """Before a model step: a same-tokenizer draft fed the committed tokens it missed, as one batched prefill
        (the whole prompt at a request's first model step)."""
        d = self.model_drafter
        if isinstance(d, ModelDrafter):
            d.catch_up(state)

    def run(self, state) -> None:
        sc = state.scratch(self)
        n = len(state.tokens)
        last = sc["last"]
        if last is not None:  # what the previous step earned: the tokens it committed, minus one
            kind, n0, tree, forwards = last
            got = n - n0 - 1
            m = self.measured
            sc["request_tokens"] += got + 1
            if kind == "model":
                sc["request_model_tokens"] += got + 1
            with self._lock:
                m["step_tokens"] += got + 1
                if tree[0]:  # the step's suffix tree, proposed or not, against the tokens committed
                    m["suffix_score"] += sum(tree[2])
                    m["suffix_accepted"] += _followed(tree[0], tree[1], state.tokens[n0:n])
                if kind == "model":
                    m["model_steps"] += 1
                    m["model_tokens"] += got + 1
                    m["model_forwards"] += forwards
            if kind == "model":
                self._settle(state)
            sc["last"] = None
        k = state.num_draft
        model_k = k if self.model_k is None else min(k, self.model_k)
        length = self.suffix.length if state.params.greedy else None
        verify_ratio = 1.0
        plain_rate = 1.0  # a plain step's tokens per model-step verify: 1 where rows cost alike
        if length is not None:  # draft_length="auto": the tree sized by this machine's verify costs, as suffix alone
            toks, parents, scores, counts, match = self.suffix.propose_sized(state, k)
            model_seconds = length.seconds(model_k + 1, n)
            if toks:
                verify_ratio = model_seconds / length.seconds(len(toks) + 1, n)
            # one token for a one-row verify; where a model step's rows cost several one-row steps (the block
            # GEMMs' multi-row passes) the model draft must beat that, not one token a verify
            plain_rate = model_seconds / length.seconds(1, n)
        else:
            toks, parents, scores, counts, _ = self.suffix.propose(state, k)
        tree = (toks, parents, scores)
        extra = state.run.extra["hybrid"]
        behind = self.catch_up_tokens(state) if k > 0 else 0
        if behind and self.prefill_cost is None:
            self.prefill_cost = measure_prefill_cost(self.model_drafter)
        remaining = state.run.capacity - n  # tokens the request may still produce (capacity: prompt + max_new)
        cost = self.step_draft_cost(state)
        share = self.model_share(state) if behind else None
        suffix = bool(toks) and self.prefers_suffix(sum(scores), model_k, behind, remaining, draft_cost=cost,
                                                    share=share, verify_ratio=verify_ratio)
        if not suffix and k > 0 and (length is not None or not toks) \
                and self.model_rate(model_k, behind, remaining, draft_cost=cost, share=share) < plain_rate:
            # the model would yield less than a plain step: a sized suffix tree (its sizing found it worth more than
            # nothing), else a plain step
            if not toks:
                write_tree(state, [], [], [])
                sc["last"] = ("plain", n, tree, 0)
                extra["plain_steps"] += 1
                return
            suffix = True
        if suffix:
            if length is not None:  # settled by the suffix drafter's rates at the next step
                state.scratch(self.suffix)["auto_last"] = (n, toks, parents, match)
            write_tree(state, toks, parents, counts)
            sc["last"] = ("suffix", n, tree, 0)
            extra["suffix_steps"] += 1
            return
        if k > 0:  # a step that may draft nothing (the request's last token) must not pay a catch-up for nothing
            self._catch_up(state)
        state.num_draft = model_k
        f0 = state.run.draft_forwards
        for st in self.model_stages:
            st.run(state)
        state.num_draft = k
        if not self._model_tree:
            state.draft_parents = tuple(range(state.draft_ids.shape[1]))
        if k > 0:
            sc["last"] = ("model", n, tree, state.run.draft_forwards - f0)
            extra["model_steps"] += 1
