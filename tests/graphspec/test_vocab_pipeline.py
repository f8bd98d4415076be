"""Speculative decoding across vocabularies (TLI and SLEM) is lossless.

- Greedy: tiny random Llama/Qwen2 checkpoints, one with a byte-level BPE and one with a
  metaspace BPE with byte fallback (both directions); the output (ids and text) equals the target
  alone, for code, runs of spaces and newlines, non-ASCII text and chat messages. Random drafts
  are rejected almost always, so a *scripted* draft that knows the target's text (it proposes the
  draft token continuing its own context along that text) checks the accepting paths too: its
  acceptance is high only if the drafter keeps its token list and KV cache in step with the text.
- Sampling (TLI): toy models over two small, partly overlapping vocabularies (some target
  characters cannot be spelled by the draft at all); the marginals of the first three tokens over
  2000 seeded runs match the target's exact distribution (chi-square), and a deliberately broken
  map stage (q restricted to the intersection but not renormalised) is detected by the same test.
"""

from __future__ import annotations

import warnings

import pytest
import tokenizers
import torch
from tokenizers import models

import graphspec
from graphspec import SamplingParams, Stage
from graphspec.models.tokenizer import Tokenizer
from graphspec.vocab import build_vocab_mapping
from graphspec.vocab_stages import VocabMap, _DraftText, resolve_mode
from tests.checkpoints import make_checkpoint
from tests.graphspec.oracle import marginal_pvalues
from tests.graphspec.toy import ToyCache, ToyLM

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "   indented    text\n\n\n\tand tabs  ",
    "café crème, 日本語のテキスト 🙂🎉 naïve",
]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(tmp_path / "gs-cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny vocabularies: "small intersection" warnings are expected
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("xvocab")
    return {
        # byte-level target with a ChatML template; metaspace draft whose embedding has padding rows
        "bl_target": make_checkpoint(root / "bl_t", "llama", tokenizer="bytelevel", chat_template="chatml", seed=1),
        "ms_draft": make_checkpoint(root / "ms_d", "llama", tokenizer="metaspace", seed=2, vocab_size=416),
        # the other direction: metaspace Qwen2 target, byte-level draft
        "ms_target": make_checkpoint(root / "ms_t", "qwen2", tokenizer="metaspace", seed=3),
        "bl_draft": make_checkpoint(root / "bl_d", "llama", tokenizer="bytelevel", seed=4, hidden_size=32, heads=2,
                                    kv_heads=1),
    }


@pytest.fixture(scope="module")
def models_(checkpoints):
    return {k: graphspec.load_model(v) for k, v in checkpoints.items()}


PAIRS = [("bl_target", "ms_draft"), ("ms_target", "bl_draft")]


# ----------------------------------------------------------------------------- greedy, random drafts

_baselines: dict = {}


def _baseline(target, prompt, max_new_tokens: int):
    key = (id(target), repr(prompt), max_new_tokens)
    if key not in _baselines:
        _baselines[key] = graphspec.Pipeline(target).run(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
    return _baselines[key]


@pytest.mark.parametrize("mode", ["tli", "slem"])
@pytest.mark.parametrize("pair", PAIRS, ids=["bytelevel-target", "metaspace-target"])
def test_greedy_equals_target_alone(models_, pair, mode):
    target, draft = models_[pair[0]], models_[pair[1]]
    spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping=mode)
    assert spec.graph.names == ["draft", "map", "verify", "accept"]
    for prompt in PROMPTS:
        a = _baseline(target, prompt, 16)
        b = spec.run(prompt, max_new_tokens=16, ignore_eos=True)
        assert b.token_ids == a.token_ids, (mode, prompt)
        assert b.text == a.text
        assert b.stats.proposed > 0 and b.stats.draft_forwards > 0
        mapping = spec.graph["draft"].mapping
        assert b.stats.vocab["mode"] == mode
        assert b.stats.vocab["intersection"] == mapping.intersection_size > 0
        assert b.stats.as_dict()["vocab"]["intersection"] == mapping.intersection_size
        assert a.stats.vocab is None


@pytest.mark.parametrize("mode", ["tli", "slem"])
def test_greedy_with_a_pruned_draft_vocabulary_equals_target_alone(models_, mode):
    target, draft = models_["bl_target"], models_["ms_draft"]
    spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping=mode, draft_vocab=150)
    head = spec.graph["draft"].head
    assert head is not None and 150 <= len(head) < draft.config.vocab_size
    for prompt in PROMPTS:
        out = spec.run(prompt, max_new_tokens=16, ignore_eos=True)
        assert out.token_ids == _baseline(target, prompt, 16).token_ids, (mode, prompt)
        assert out.stats.proposed > 0


def test_greedy_chat_messages_and_stream(models_):
    target, draft = models_["bl_target"], models_["ms_draft"]
    msgs = [{"role": "user", "content": "Write café code:\n  x = 1"}]
    base = _baseline(target, msgs, 16)
    for mode in ("tli", "slem"):
        spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4, vocab_mapping=mode)
        out = spec.run(msgs, max_new_tokens=16, ignore_eos=True)
        assert out.token_ids == base.token_ids
        assert "".join(spec.stream(msgs, max_new_tokens=16, ignore_eos=True)) == base.text


def test_draft_prompt_is_the_text_in_draft_tokens(models_):
    target, draft = models_["bl_target"], models_["ms_draft"]
    spec = graphspec.Pipeline(target, draft=draft, vocab_mapping="tli")
    drafter = spec.graph["draft"]
    tt, dt = target.tokenizer, draft.tokenizer
    msgs = [{"role": "user", "content": "hé  llo\n"}]
    ids = tt.encode(tt.apply_chat_template(msgs), add_special_tokens=False)
    own = drafter.prompt_tokens(ids)
    # ChatML specials carry over by content (the draft knows them), the rest is the same text.
    im_start = dt.token_to_id("<|im_start|>")
    assert own[0] == dt.token_to_id("<s>")  # the draft's own BOS (its tokenizer adds one)
    assert own.count(im_start) == ids.count(tt.token_to_id("<|im_start|>")) >= 2
    assert dt.decode(own, skip_special_tokens=True).replace(" ", "") == \
        tt.decode(ids, skip_special_tokens=True).replace(" ", "")


# ----------------------------------------------------------------------------- greedy, a draft that knows the text

class ScriptedDraft:
    """A draft 'model' that proposes the draft token continuing its context along a known text.

    Its logits after a context are +len(piece) for every draft token whose bytes continue the
    script there, +100 more when the piece ends where the target's next token ends (so the
    draft token spelling the target's next token wins; masks still apply), 0 elsewhere. It holds
    its context in a ToyCache, so it only stays on script if the drafter feeds and rolls back
    its cache exactly; ``wrong_every`` makes every n-th call pick a wrong token on purpose.
    """

    def __init__(self, tokenizer, vocab_size: int, table, wrong_every: int = 0, device="cpu"):
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=4096, eos_token_ids=[])
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.backend = None
        self.pieces = table.pieces
        self.script = b""
        self.boundaries: set[int] = set()  # byte offsets in script where a target token ends
        self.wrong_every = wrong_every
        self.calls = 0

    def new_cache(self, max_seq_len: int, batch_size: int = 1):
        return ToyCache(max_seq_len, batch_size, self.device)

    def _next_logits(self, ctx: list[int]) -> torch.Tensor:
        self.calls += 1
        logits = torch.zeros(self.config.vocab_size)
        have = b"".join(self.pieces[i] for i in ctx)
        if not self.script.startswith(have):
            return logits
        rest = self.script[len(have):]
        nearest = min((b for b in self.boundaries if b > len(have)), default=-1)
        for i, p in enumerate(self.pieces):
            if p and rest.startswith(p):
                logits[i] = float(len(p)) + (100.0 if len(have) + len(p) == nearest else 0.0)
        if self.wrong_every and self.calls % self.wrong_every == 0:
            logits = -logits
        return logits

    def step(self, token_ids, cache, positions=None, logits_for="all", tree=None):
        B, T = token_ids.shape
        L = cache.length
        cache.tokens[:, L:L + T] = token_ids
        cache.length = L + T
        ctx = cache.tokens[0, :L + T].tolist()
        if tree is not None:  # a beam's level: each row continues the cache prefix and its visible nodes
            m = tree.shape[1]
            assert logits_for == "all" and positions is not None
            rows = [ctx[:L + T - m] + [ctx[L + T - m + j] for j in range(m) if bool(tree[i, j])] for i in range(T)]
            for i, row in enumerate(rows):
                assert int(positions[0, i]) == len(row) - 1  # rope positions: the node's place on its path
            return torch.stack([self._next_logits(r) for r in rows]).view(1, T, -1)
        assert logits_for == "last" or (isinstance(logits_for, torch.Tensor) and logits_for.numel() == 0)
        if logits_for != "last":
            return torch.zeros(1, 0, self.config.vocab_size)
        return self._next_logits(ctx).view(1, 1, -1)


class _CacheProbe(Stage):
    """After each draft: the draft's cache begins with ``fed`` (its record of what it holds); after a beam,
    ``fed`` is the committed text's draft tokens."""

    def __init__(self, drafter, checks):
        super().__init__("probe", (), ())
        self.drafter, self.checks = drafter, checks

    def run(self, state):
        sc = state.scratch(self.drafter)
        text, cache = sc["text"], sc["cache"]
        fed, own = text.fed, text.own
        ok = cache.tokens[0, :len(fed)].tolist() == fed and cache.length >= len(fed)
        if text.tree is not None:  # a beam fed nothing but committed text, its tree sits after it
            ok = ok and fed == own[:len(fed)]
        self.checks.append(ok)


class _Recorder(Stage):
    """Wraps the map stage and records (committed length, proposals) every step."""

    def __init__(self, inner: Stage):
        super().__init__(inner.name, inner.reads, inner.writes)
        self.inner = inner
        self.steps: list[tuple[int, list[int]]] = []

    def check(self, params):
        self.inner.check(params)

    def run(self, state):
        self.inner.run(state)
        self.steps.append((len(state.tokens), state.draft_ids[0].tolist()))


@pytest.mark.parametrize("beam", [0, 2], ids=["chain", "beam"])
@pytest.mark.parametrize("mode", ["tli", "slem"])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_greedy_scripted_draft_is_accepted_and_stays_exact(models_, mode, wrong_every, beam):
    target, real_draft = models_["bl_target"], models_["ms_draft"]
    prompt = PROMPTS[2]
    base = _baseline(target, prompt, 40)
    mapping = build_vocab_mapping(real_draft.tokenizer, target.tokenizer,
                                  draft_vocab_size=real_draft.config.vocab_size,
                                  target_vocab_size=target.config.vocab_size)
    draft = ScriptedDraft(real_draft.tokenizer, real_draft.config.vocab_size, mapping.draft_tokens, wrong_every)
    # With a beam the draft also ranks its runners-up, in rows of the same forwards: it stays on script
    # only if the drafter keeps the cached nodes of the path the target took, and drops the others.
    spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4, vocab_mapping=mode,
                              draft_confidence_threshold=None, draft_beam=beam, draft_siblings=0)
    own_prompt = spec.graph["draft"].prompt_tokens(base.prompt_token_ids)
    draft.script = mapping.draft_tokens.join(own_prompt)
    for t in base.token_ids:
        draft.script += mapping.target_tokens.pieces[t]
        draft.boundaries.add(len(draft.script))
    recorder = _Recorder(spec.graph["map"])
    spec.replace_stage("map", recorder)
    checks = []
    spec.insert_stage(_CacheProbe(spec.graph["draft"], checks), after="draft")
    out = spec.run(prompt, max_new_tokens=40, ignore_eos=True)
    assert out.token_ids == base.token_ids and out.text == base.text
    assert len(checks) == out.stats.steps and all(checks)  # the draft's cache held its committed text's tokens
    # Random drafts are accepted about never. TLI's ceiling is low on this text: half the target's
    # tokens are byte-level merges the metaspace vocabulary lacks, and TLI can only propose shared ids.
    # A beam ranks by path probability, which this draft gives no meaning (a right piece beats others by
    # one logit), so its trees are bushier and it accepts less; its cache is what this test checks.
    floor = {("tli", 0): 0.12, ("tli", 3): 0.05, ("slem", 0): 0.8, ("slem", 3): 0.3}[(mode, wrong_every)]
    if beam:
        floor = {("tli", 0): 0.12, ("tli", 3): 0.005, ("slem", 0): 0.5, ("slem", 3): 0.05}[(mode, wrong_every)]
    assert out.stats.acceptance_rate > floor, out.stats
    if mode == "tli" and not wrong_every and not beam:
        # Exactly in step: whenever the target's next tokens have counterparts, the draft proposed them.
        P, gen, t2d = len(base.prompt_token_ids), base.token_ids, mapping.target_to_draft
        checked = 0
        for n, ids in recorder.steps:
            for i, d in enumerate(ids):
                t = gen[n - P + i]
                if t2d[t] < 0:
                    break
                assert d == t, (n, i, ids, gen[n - P:n - P + len(ids)])
                checked += 1
        assert checked >= 10


# ----------------------------------------------------------------------------- draft trees across tokenizers

@pytest.mark.parametrize("mode", ["tli", "slem"])
@pytest.mark.parametrize("pair", PAIRS, ids=["bytelevel-target", "metaspace-target"])
def test_greedy_tree_equals_target_alone(models_, pair, mode):
    target, draft = models_[pair[0]], models_[pair[1]]
    # the default confidence threshold ends the random draft's chains early, leaving rows for siblings
    spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4, vocab_mapping=mode, draft_siblings=3)
    proposed = 0
    for prompt in PROMPTS:
        out = spec.run(prompt, max_new_tokens=16, ignore_eos=True)
        assert out.token_ids == _baseline(target, prompt, 16).token_ids, (mode, prompt)
        proposed += out.stats.tree["siblings_proposed"]
    assert proposed > 0


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("mode", ["tli", "slem"])
@pytest.mark.parametrize("pair", PAIRS, ids=["bytelevel-target", "metaspace-target"])
def test_greedy_beam_equals_target_alone(models_, checkpoints, pair, mode, quantize):
    target = models_[pair[0]]
    draft = graphspec.load_model(checkpoints[pair[1]], quantize=quantize) if quantize else models_[pair[1]]
    spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=6, vocab_mapping=mode, draft_beam=2,
                              draft_confidence_threshold=None)
    assert spec.graph.names == ["draft", "map", "verify", "accept"]
    proposed = forwards = steps = 0
    for prompt in PROMPTS:
        out = spec.run(prompt, max_new_tokens=16, ignore_eos=True)
        assert out.token_ids == _baseline(target, prompt, 16).token_ids, (mode, prompt)
        proposed += out.stats.tree["siblings_proposed"]
        forwards, steps = forwards + out.stats.draft_forwards, steps + out.stats.steps
    assert proposed > 0  # branches beside the best path were verified
    assert forwards > 1.5 * steps  # the beam grows past its first forward (prefill and catch-up included)


def test_beam_tree_is_the_trie_of_its_leaves_texts(models_):
    """retokenize_tree on a beam's tree: each leaf's path text, in row order, merged into one trie."""
    target, draft = models_["bl_target"], models_["ms_draft"]
    mapper, dt = graphspec.Pipeline(target, draft=draft, vocab_mapping="slem", draft_beam=2).graph["map"], draft.tokenizer
    committed = target.tokenizer.encode("def f(x):\n", add_special_tokens=False)
    w = [dt.encode(x, add_special_tokens=False)[0] for x in (" return", " yield", " x", " y", " +")]
    own, parents = w, (0, 0, 1, 2, 3)  # rows: " return", " yield"; " x" under 0, " y" under 1; " +" under 2
    leaves = [[w[1], w[3]], [w[0], w[2], w[4]]]  # rows 3 and 4, in row order
    ids, tree = mapper.retokenize_tree(committed, own, parents, 32)
    expected_ids, expected_tree, kids = [], [], {}
    for leaf in leaves:
        cur = 0
        for t in mapper.retokenize(committed, leaf, 32):
            if (cur, t) not in kids:
                expected_ids.append(t), expected_tree.append(cur)
                kids[(cur, t)] = len(expected_ids)
            cur = kids[(cur, t)]
    assert (ids, tree) == (expected_ids, tuple(expected_tree)) and tree.count(0) >= 2  # both leaves branch


def test_spelled_path_takes_the_deepest_branch_the_bytes_spell():
    from graphspec.vocab_stages import _spelled_path

    pieces = [b"ab", b"a", b"c", b"bcd", b"x"]
    parents = [0, 0, 1, 2, 4]  # "ab" -> "c"; "a" -> "bcd" -> "x" (parents: 0 the root, else row + 1)
    assert _spelled_path([0] * 5, parents, pieces, b"abcdx!") == [1, 3, 4]
    assert _spelled_path([0] * 5, parents, pieces, b"abc") == [0, 2]
    assert _spelled_path([0] * 5, parents, pieces, b"q") == []


def test_slem_tree_is_the_trie_of_its_texts(models_):
    """retokenize_tree: the chain's target ids first, then each sibling's text merged into a trie of target ids."""
    target, draft = models_["bl_target"], models_["ms_draft"]
    spec = graphspec.Pipeline(target, draft=draft, vocab_mapping="slem", draft_siblings=3)
    mapper, dt = spec.graph["map"], draft.tokenizer
    committed = target.tokenizer.encode("def f(x):\n", add_special_tokens=False)
    chain = dt.encode(" return x + 1", add_special_tokens=False)[:5]
    alt = [dt.encode(w, add_special_tokens=False)[0] for w in (" yield", "pass", " x")]
    own = chain + alt
    parents = tuple(range(len(chain))) + (0, 2, 3)  # siblings beside chain tokens 0, 2 and 3
    texts = [chain] + [chain[:d] + [a] for d, a in zip(parents[len(chain):], alt)]
    seqs = [mapper.retokenize(committed, t, 32) for t in texts]
    ids, tree = mapper.retokenize_tree(committed, own, parents, 32)
    assert ids[:len(seqs[0])] == seqs[0] and tree[:len(seqs[0])] == tuple(range(len(seqs[0])))
    paths = {tuple(q[:i]) for q in seqs for i in range(1, len(q) + 1)}
    assert len(ids) == len(tree) == len(paths)  # one row per distinct prefix: shared prefixes are merged
    assert len(ids) < sum(map(len, seqs))      # (and some were shared here)
    spelled = set()
    for row in range(1, len(ids) + 1):
        path, r = [], row
        while r:
            path.append(ids[r - 1])
            r = tree[r - 1]
            assert r < row
        spelled.add(tuple(reversed(path)))
    assert spelled == paths  # every row is a prefix of some text, every prefix a row: children differ
    limit = len(seqs[0]) + 1
    short, short_tree = mapper.retokenize_tree(committed, own, parents, limit)
    assert len(short) == len(short_tree) == limit and short[:-1] == seqs[0]


def test_sync_keeps_the_draft_text_equal_to_the_committed_text(models_):
    """Fold random target tokens (specials, split UTF-8, ids without counterparts) into the draft's text."""
    target, draft = models_["bl_target"], models_["ms_draft"]
    drafter, _ = graphspec.pipeline._vocab_stage(target, draft, "tli")
    m = drafter.mapping
    gen = torch.Generator().manual_seed(0)
    n_tok = len(m.target_tokens)
    for trial in range(20):
        text = _DraftText(own=[7, 8], n_prompt=2, synced=1)
        text.add_boundary(0)
        tokens = [5]
        for _ in range(12):
            new = torch.randint(0, n_tok, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
            # sometimes the draft proposed exactly what then got committed
            if trial % 2 and m.target_to_draft[new[0]] >= 0:
                text.proposals = [int(m.target_to_draft[new[0]]), 3]
            tokens += new
            drafter._sync(text, tokens)
            spelled = m.draft_tokens.join(text.own[text.n_prompt:])
            assert spelled == m.target_tokens.join(tokens[1:]) == bytes(text.committed)
            assert text.own[:2] == [7, 8]
            assert text.safe_idx[-1] == len(text.own) and text.safe_off[-1] == len(text.committed)


# ----------------------------------------------------------------------------- modes, errors, cache

def test_modes_and_errors(models_, checkpoints, tmp_path):
    target, draft = models_["bl_target"], models_["ms_draft"]
    slem = graphspec.Pipeline(target, draft=draft, vocab_mapping="slem")
    with pytest.raises(ValueError, match="vocab_mapping='slem'.*temperature=0.7"):
        slem.run("hi", max_new_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="vocab_mapping='bogus'"):
        graphspec.Pipeline(target, draft=draft, vocab_mapping="bogus")
    auto = graphspec.Pipeline(target, draft=draft, vocab_mapping="auto")
    assert auto.run("hi", max_new_tokens=4, temperature=0.7, seed=1).token_ids  # auto samples through TLI
    assert resolve_mode("auto", SamplingParams(temperature=0.7)) == "tli"
    assert resolve_mode("auto", SamplingParams()) == "slem"  # measured to accept more for greedy
    assert resolve_mode("tli", SamplingParams()) == "tli"
    assert auto.run("hi", max_new_tokens=8, ignore_eos=True).token_ids == _baseline(target, "hi", 8).token_ids
    # same tokenizer: no map stage
    same = graphspec.Pipeline(target, draft=target, vocab_mapping="tli")
    assert "map" not in same.graph
    # draft trees across tokenizers: the map stage reads the draft's tree and writes the target's
    tree = graphspec.Pipeline(target, draft=draft, draft_siblings=2)
    assert "draft_own_parents" in tree.graph["map"].reads and "draft_parents" in tree.graph["map"].writes
    assert "draft_parents" in tree.graph["verify"].reads and "draft_parents" in tree.graph["accept"].reads
    chain = graphspec.Pipeline(target, draft=draft, draft_siblings=0)
    assert "draft_parents" not in chain.graph["verify"].reads and "draft_parents" not in chain.graph["map"].writes
    from graphspec.drafters import AUTO_DRAFT_SIBLINGS

    assert graphspec.Pipeline(target, draft=draft, draft_siblings="auto").graph["draft"].siblings == AUTO_DRAFT_SIBLINGS
    # the confidence threshold: "auto" (the default) is 0.3 across tokenizers and 0.4 with one tokenizer
    from graphspec.pipeline import CROSS_VOCAB_DRAFT_CONFIDENCE_THRESHOLD, DEFAULT_DRAFT_CONFIDENCE_THRESHOLD

    assert (CROSS_VOCAB_DRAFT_CONFIDENCE_THRESHOLD, DEFAULT_DRAFT_CONFIDENCE_THRESHOLD) == (0.3, 0.4)
    assert graphspec.Pipeline(target, draft=draft).graph["draft"].confidence_threshold == 0.3
    assert graphspec.Pipeline(target, draft=target).graph["draft"].confidence_threshold == 0.4
    for given in (None, 0.6):
        assert graphspec.Pipeline(target, draft=draft, draft_confidence_threshold=given).graph[
            "draft"].confidence_threshold == given


def test_beam_errors_say_what_to_fix(models_, checkpoints):
    target, draft = models_["bl_target"], models_["ms_draft"]
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="draft_beam must be an int >= 0"):
            graphspec.Pipeline(target, draft=draft, draft_beam=bad)
    with pytest.raises(ValueError, match="draft_beam=2 grows a model draft's tree"):
        graphspec.Pipeline(target, draft="ngram", draft_beam=2)
    with pytest.raises(ValueError, match="draft_beam=2 verifies a draft tree"):
        graphspec.Pipeline(target, draft=draft, draft_beam=2, acceptance="greedy")
    from graphspec.vocab_stages import CrossVocabDrafter

    mapping = graphspec.Pipeline(target, draft=draft).graph["draft"].mapping
    with pytest.raises(ValueError, match="beam_threshold must be a probability"):
        CrossVocabDrafter(draft, mapping, target.tokenizer, beam=2, beam_threshold=1.5)
    tree = graphspec.Pipeline(target, draft=draft, draft_beam=2)
    assert tree.graph["draft"].beam == 2 and "draft_parents" in tree.graph["map"].writes
    assert graphspec.Pipeline(target, draft=draft, draft_beam=2, draft_confidence_threshold=None).graph[
        "draft"].beam_threshold == 0.0


def test_second_pipeline_loads_the_tables_from_the_cache(models_):
    target, draft = models_["bl_target"], models_["ms_draft"]
    first = graphspec.Pipeline(target, draft=draft).graph["draft"].mapping
    second = graphspec.Pipeline(target, draft=draft).graph["draft"].mapping
    assert (first.source, second.source) == ("built", "cache")
    assert second.draft_to_target.equal(first.draft_to_target)


def _char_tokenizer(pieces: list[str], merges: list[tuple[str, str]], special: str) -> Tokenizer:
    vocab = {special: 0}
    for p in pieces:
        vocab[p] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.add_special_tokens([tokenizers.AddedToken(special, special=True)])
    return Tokenizer(backend, config={"eos_token": special})


def test_empty_intersection_is_an_error_when_the_pipeline_is_built():
    target = ToyLM(6, tokenizer=_char_tokenizer(["a", "b", "c", "ab", "bc"], [("a", "b"), ("b", "c")], "<t>"))
    draft = ToyLM(5, tokenizer=_char_tokenizer(["x", "y", "z", "xy"], [("x", "y")], "<d>"))
    with pytest.raises(ValueError, match="share no token"):
        graphspec.Pipeline(target, draft=draft)


# ----------------------------------------------------------------------------- sampling (TLI) is lossless

# Target: a b c d, space, and merges; the draft cannot spell "d" at all and has tokens of its own.
T_PIECES = ["a", "b", "c", "d", " ", "ab", "ba", "cd", "a ", "dd", "ca", "bb", "dc", "ac", "db"]
T_MERGES = [("a", "b"), ("b", "a"), ("c", "d"), ("a", " "), ("d", "d"), ("c", "a"), ("b", "b"), ("d", "c"),
            ("a", "c"), ("d", "b")]
D_PIECES = ["a", "b", "c", "e", " ", "ab", "ba", "abc", "ee", "ca", "ce", "a "]
D_MERGES = [("a", "b"), ("b", "a"), ("ab", "c"), ("e", "e"), ("c", "a"), ("c", "e"), ("a", " ")]
PROMPT = [1, 2, 3, 5, 6, 1]
N_RUNS = 2000


class _UnnormalisedMap(Stage):
    """A broken TLI map: q restricted to the intersection but not renormalised (here: a third of its
    mass), so the ratio p/q overstates how often the target would have chosen the draft's token.

    (Dropping q altogether would NOT be a bug: one-hot q is lossless for any proposal drawn
    independently of the target's randomness.)
    """

    def __init__(self, inner: VocabMap):
        super().__init__("map", inner.reads, inner.writes)
        self.inner = inner

    def run(self, state):
        self.inner.run(state)
        if state.draft_probs is not None:
            state.draft_probs = state.draft_probs / 3.0


def _toy_pair():
    ttok = _char_tokenizer(T_PIECES, T_MERGES, "<eos>")
    dtok = _char_tokenizer(D_PIECES, D_MERGES, "<s>")
    vt, vd = ttok.vocab_size, dtok.vocab_size + 2  # the draft's embedding has two padding rows
    target = ToyLM(vt, seed=11, scale=1.2, tokenizer=ttok)
    draft = ToyLM(vd, seed=12, scale=1.0, tokenizer=dtok)
    # Where the draft's last two tokens and the next one all map, copy the target's preferences
    # (plus noise), so drafts are often accepted and the test exercises accept and reject paths.
    m = build_vocab_mapping(dtok, ttok, draft_vocab_size=vd, target_vocab_size=vt, cache=False)
    d2t = m.draft_to_target.tolist()
    g = torch.Generator().manual_seed(5)
    for a in range(vd + 1):
        ta = target.START if a == draft.START else (d2t[a] if a < vd else -1)
        for b in range(vd):
            for c in range(vd):
                if ta >= 0 and d2t[b] >= 0 and d2t[c] >= 0:
                    draft.table[a, b, c] = target.table[ta, d2t[b], d2t[c]] + 0.5 * torch.randn((), generator=g)
    return target, draft


def _marginal_pvalues(pipe, params):
    return marginal_pvalues(pipe, PROMPT, params, N_RUNS)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["t1", "t0.7-top5"])
def test_tli_sampling_matches_the_target_distribution(params):
    target, draft = _toy_pair()
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, vocab_mapping="tli")
    pvalues, rate = _marginal_pvalues(pipe, params)
    assert min(pvalues) > 1e-3, pvalues
    assert 0.2 < rate < 0.95, rate  # both the accepting and the rejecting paths ran


@pytest.mark.parametrize("params, tree", [
    (SamplingParams(temperature=1.0), {"draft_siblings": 2}),
    (SamplingParams(temperature=0.7, top_k=5), {"draft_siblings": 2}),
    (SamplingParams(temperature=1.0), {"draft_beam": 2}),  # a beam pipeline samples with its chain
], ids=["t1", "t0.7-top5", "t1-beam"])
def test_tli_tree_sampling_matches_the_target_distribution(params, tree):
    target, draft = _toy_pair()
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping="tli",
                              draft_confidence_threshold=0.5, **tree)
    pvalues, rate = _marginal_pvalues(pipe, params)
    assert min(pvalues) > 1e-3, pvalues
    assert 0.1 < rate < 0.95, rate


def test_tli_sampling_test_detects_a_broken_map():
    target, draft = _toy_pair()
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=2, vocab_mapping="tli")
    pipe.replace_stage("map", _UnnormalisedMap(pipe.graph["map"]))
    pvalues, _ = _marginal_pvalues(pipe, SamplingParams(temperature=1.0))
    assert min(pvalues) < 1e-6, pvalues


@pytest.mark.parametrize("mode", ["tli", "slem"])
def test_greedy_tree_siblings_are_taken_and_the_output_stays_exact(mode):
    """On the toy pair the draft's first choice is about never the target's but its next ones often are.

    Siblings are accepted, the draft keeps its text and cache in step after the target took one (the
    output would change, or acceptance collapse, if not), and fewer target forwards are needed.
    """
    target, draft = _toy_pair()
    base = graphspec.Pipeline(target).run(PROMPT, max_new_tokens=60, ignore_eos=True)
    out = {}
    for siblings in (0, 2):
        # at 0.4 the unsure toy draft stops its chain early, which leaves rows for siblings
        pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4, vocab_mapping=mode,
                                  draft_siblings=siblings, draft_confidence_threshold=0.4)
        out[siblings] = pipe.run(PROMPT, max_new_tokens=60, ignore_eos=True)
        assert out[siblings].token_ids == base.token_ids
    assert out[2].stats.tree["siblings_accepted"] >= 5, out[2].stats.tree
    assert out[2].stats.steps < out[0].stats.steps


@pytest.mark.parametrize("mode", ["tli", "slem"])
def test_greedy_beam_is_taken_and_the_output_stays_exact(mode):
    """The toy draft's first choice is about never the target's, so a beam (its runners-up grown into
    branches) needs fewer target forwards than a chain of the same K, and the output stays the target's."""
    target, draft = _toy_pair()
    base = graphspec.Pipeline(target).run(PROMPT, max_new_tokens=60, ignore_eos=True)
    steps = {}
    for beam in (0, 2):
        pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=6, vocab_mapping=mode,
                                  draft_beam=beam, draft_confidence_threshold=None)
        out = pipe.run(PROMPT, max_new_tokens=60, ignore_eos=True)
        assert out.token_ids == base.token_ids
        steps[beam] = out.stats.steps
    assert out.stats.tree["siblings_accepted"] >= 5, out.stats.tree  # branches off the likeliest path were taken
    assert steps[2] < steps[0], steps


def test_beam_pipeline_samples_with_a_chain():
    """A beam ranks tokens rather than drawing them, so sampled runs draft a chain (still a tree verify)."""
    target, draft = _toy_pair()
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping="tli", draft_beam=2,
                              draft_siblings=0)  # siblings would branch a sampled chain too
    seen = []
    pipe.insert_stage(_ParentsProbe(seen), after="map")
    a = pipe.run(PROMPT, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    assert a.token_ids == pipe.run(PROMPT, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True).token_ids
    assert seen and all(p == tuple(range(len(p))) for p in seen)  # chains only
    greedy = pipe.run(PROMPT, max_new_tokens=12, ignore_eos=True)
    assert any(p != tuple(range(len(p))) for p in seen)  # ... and greedy runs branch


class _ParentsProbe(Stage):
    def __init__(self, seen):
        super().__init__("probe", ("draft_parents",), ())
        self.seen = seen

    def run(self, state):
        self.seen.append(tuple(state.draft_parents))


def test_tli_same_seed_same_output_and_greedy_exact():
    target, draft = _toy_pair()
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping="tli")
    a = pipe.run(PROMPT, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    b = pipe.run(PROMPT, max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    assert a.token_ids == b.token_ids
    base = graphspec.Pipeline(target).run(PROMPT, max_new_tokens=30, ignore_eos=True)
    for mode in ("tli", "slem"):
        spec = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, vocab_mapping=mode)
        assert spec.run(PROMPT, max_new_tokens=30, ignore_eos=True).token_ids == base.token_ids


def test_sync_when_the_draft_cannot_spell_the_text():
    """The toy draft has no "d": re-tokenizing drops it (best effort), and the end stays a safe boundary."""
    target, draft = _toy_pair()
    drafter, _ = graphspec.pipeline._vocab_stage(target, draft, "tli")
    ttok = target.tokenizer
    text = _DraftText(own=[], n_prompt=0, synced=0)
    text.add_boundary(0)
    tokens: list[int] = []
    for piece in ["ab", "d", "a ", "cd", "ba", "c"]:
        tokens.append(ttok.token_to_id(piece))
        drafter._sync(text, tokens)
        assert text.safe_idx[-1] == len(text.own) and text.safe_off[-1] == len(text.committed)
        assert drafter.mapping.draft_tokens.join(text.own) == bytes(text.committed).replace(b"d", b"")
    assert bytes(text.committed) == b"abda cdbac"
