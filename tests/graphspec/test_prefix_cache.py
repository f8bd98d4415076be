"""Prefix caching (graphspec.prefix_cache): a run that reuses stored rows gives the cold run's tokens and rows.

The target here is wide enough (hidden 256, MLP 704) that a batched prefill rounds its rows unlike one-token steps
(``test_a_batched_prefill_would_not_do``), so the bit-for-bit comparisons below can fail.
"""

import gc

import pytest
import torch

import graphspec
from graphspec.drafters import prefill
from graphspec.engine import Engine
from graphspec.kernels import EXACT_CHAIN_ROWS_MAX, EXACT_ROWS_MAX, cpu
from graphspec.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, check_prefix_cache
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target = make_checkpoint(root / "target", "qwen2", hidden_size=256, intermediate_size=704, layers=2, heads=4,
                             kv_heads=2, seed=0, chat_template="chatml")
    draft = make_checkpoint(root / "draft", "qwen2", hidden_size=64, layers=1, heads=4, kv_heads=2, seed=1,
                            chat_template="chatml")
    return target, draft


@pytest.fixture(scope="module")
def models(dirs):
    return {dtype: (graphspec.load_model(dirs[0], dtype=dtype), graphspec.load_model(dirs[1], dtype=dtype))
            for dtype in (torch.float32, torch.bfloat16)}


IDS = [(7 * i + 3) % 380 + 5 for i in range(150)]  # 150 tokens: blocks of 64, 64 and 22, or one of 150


def _rows(model, ids, how):
    """K and V of every layer, rows 0 .. len(ids) - 1, after feeding ``ids`` ``how``."""
    cache = model.new_cache(len(ids) + 1)
    if how == "steps":
        for t in ids:
            model.step(torch.tensor([[t]]), cache)
    elif how == "split":  # a hit's shape: 70 rows from one exact prefill, the rest from another
        prefill(model, cache, ids[:70], "cpu", exact=True)
        prefill(model, cache, ids[70:], "cpu", exact=True)
    else:
        prefill(model, cache, ids, "cpu", exact=how == "exact")
    return [t[:, :len(ids)].clone() for t in (*cache.k, *cache.v)]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_prefill_rows_are_the_one_token_steps_rows(dirs, model_level, dtype):
    with cpu.use_level(model_level):
        model = graphspec.load_model(dirs[0], dtype=dtype)
        # bf16 on graphspec's C++ linear runs IDS as one block (two when split), past EXACT_ROWS_MAX
        native = dtype == torch.bfloat16 and cpu.bf16_linear()
        assert model.exact_block_rows() == (EXACT_CHAIN_ROWS_MAX if native else EXACT_ROWS_MAX)
        steps = _rows(model, IDS, "steps")
        assert _equal(_rows(model, IDS, "exact"), steps)
        assert _equal(_rows(model, IDS, "split"), steps)


def test_a_batched_prefill_would_not_do(models):
    """The batched prefill rounds some row unlike one-token steps here, so the tests below have teeth."""
    differs = [not _equal(_rows(t, IDS, "batched"), _rows(t, IDS, "steps")) for t, _ in models.values()]
    assert any(differs)


def _target_entry(store, model):
    entries = [e for e in store._entries if e.model() is model]
    return max(entries, key=lambda e: e.tokens.numel())


def _pipes(target, draft, kind, store):
    kw = dict(prefix_cache=store)
    if kind == "plain":
        return graphspec.Pipeline(target, **kw)
    if kind == "chain":  # the target drafting for itself: every draft is accepted, so verify rows fill the cache
        return graphspec.Pipeline(target, target, num_speculative_tokens=4, draft_confidence_threshold=None,
                                  draft_siblings=0, draft_quantize=None, **kw)
    if kind == "tree":
        return graphspec.Pipeline(target, target, num_speculative_tokens=5, draft_confidence_threshold=None,
                                  draft_siblings=2, draft_quantize=None, **kw)
    if kind == "beam":
        return graphspec.Pipeline(target, draft, num_speculative_tokens=5, draft_beam=2, draft_quantize=None, **kw)
    if kind == "hybrid":
        return graphspec.Pipeline(target, [draft, "suffix"], num_speculative_tokens=4, draft_quantize=None, **kw)
    return graphspec.Pipeline(target, "ngram", num_speculative_tokens=3, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "chain", "tree", "beam", "hybrid", "ngram"])
def test_a_hit_gives_the_cold_runs_tokens_and_rows(models, dtype, kind):
    target, draft = models[dtype]
    warm = _pipes(target, draft, kind, PrefixCache())
    first = warm.run(IDS[:90], max_new_tokens=20, ignore_eos=True)
    prompt = IDS[:90] + first.token_ids + IDS[100:140]  # the history, then a new turn
    hot = warm.run(prompt, max_new_tokens=24, ignore_eos=True)
    assert hot.stats.cached_prompt_tokens == 90 + 20 - 1  # every row the first run's cache held
    cold_store = PrefixCache()
    cold = _pipes(target, draft, kind, cold_store).run(prompt, max_new_tokens=24, ignore_eos=True)
    assert cold.stats.cached_prompt_tokens == 0
    assert hot.token_ids == cold.token_ids
    if kind == "chain":
        assert hot.stats.mean_accepted_length > 2  # verify rows went into the cache
    a, b = _target_entry(warm.prefix_cache, target), _target_entry(cold_store, target)
    assert torch.equal(a.tokens, b.tokens) and a.tokens.numel() == len(prompt) + 24 - 1
    assert _equal(a.k + a.v, b.k + b.v)
    # and autoregressive decoding with a prefix cache gives the same tokens
    assert graphspec.Pipeline(target, prefix_cache=True).run(prompt, max_new_tokens=24,
                                                             ignore_eos=True).token_ids == cold.token_ids


def test_a_seeded_sample_is_the_cold_runs_sample(models):
    """The target's rows are exact and a sampled run's draft prefills afresh: a seed gives one sample, hit or not."""
    target, draft = models[torch.float32]
    store = PrefixCache()
    warm = graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_quantize=None, prefix_cache=store)
    warm.run(IDS[:100], max_new_tokens=8, ignore_eos=True)
    hits = store.hits
    kw = dict(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    hot = warm.run(IDS[:120], **kw)
    assert store.hits == hits + 1  # the target's; the draft did not look
    assert hot.stats.cached_prompt_tokens == 100  # IDS[:100]; the first output is not in this prompt
    cold = graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_quantize=None,
                              prefix_cache=True).run(IDS[:120], **kw)
    assert hot.token_ids == cold.token_ids


def test_a_greedy_runs_draft_reuses_its_rows(models):
    target, draft = models[torch.float32]
    store = PrefixCache()
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_quantize=None, prefix_cache=store)
    pipe.run(IDS[:100], max_new_tokens=8, ignore_eos=True)
    assert len([e for e in store._entries if e.model() is draft]) == 1
    hits = store.hits
    pipe.run(IDS[:120], max_new_tokens=8, ignore_eos=True)
    assert store.hits == hits + 2  # target and draft


def test_the_hybrid_prices_no_catch_up_for_stored_draft_rows(models):
    """A hybrid's rule prices its model draft's catch-up prefill; the rows a prefix cache holds are copied instead."""
    from graphspec.state import RunInfo, SamplingParams, State

    target, draft = models[torch.float32]
    store = PrefixCache()
    pipe = graphspec.Pipeline(target, [draft, "suffix"], num_speculative_tokens=4, draft_quantize=None,
                              prefix_cache=store)
    hybrid = pipe.graph["draft"]
    cache = draft.new_cache(100)
    prefill(draft, cache, IDS[:60], "cpu")
    store.store(draft, cache, IDS[:60])

    def behind(tokens, prefix_cache):
        run = RunInfo(target=target, vocab_size=target.vocab_size, device=torch.device("cpu"),
                      capacity=len(tokens) + 8, prompt_len=len(tokens), num_speculative_tokens=4,
                      prefix_cache=prefix_cache)
        state = State(run)
        state.tokens, state.params, state.generator = list(tokens), SamplingParams(), torch.Generator()
        hybrid.begin(state)
        return hybrid.catch_up_tokens(state)

    assert behind(IDS[:90], None) == 89
    assert behind(IDS[:90], store) == 89 - 60
    assert behind(IDS[:61], store) == 0  # the stored rows cover all but the pending token


def test_batched_engine_with_a_prefix_cache_gives_each_cold_run(models):
    target, draft = models[torch.bfloat16]
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_siblings=2, draft_quantize=None,
                              prefix_cache=True)
    pipe.run(IDS[:80], max_new_tokens=10, ignore_eos=True)
    prompts = [IDS[:80 + 10 * i] + IDS[140 - i:150] for i in range(4)] + [IDS[40:100]]
    kws = [dict(max_new_tokens=12, ignore_eos=True), dict(max_new_tokens=9, temperature=0.8, seed=5, ignore_eos=True)]
    want = [graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_siblings=2, draft_quantize=None,
                               prefix_cache=True).run(p, **kws[i % 2]) for i, p in enumerate(prompts)]
    engine = Engine(pipe, max_batch=4, policy="off")
    try:
        seqs = [engine.submit(p, **kws[i % 2]) for i, p in enumerate(prompts)]
        got = [s.result(timeout=300) for s in seqs]
    finally:
        engine.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert sum(g.stats.cached_prompt_tokens for g in got) >= 4 * 79
    assert engine.live_caches() == 0


def test_a_stream_closed_early_stores_its_rows_and_a_failed_step_none(models):
    target, _ = models[torch.float32]
    store = PrefixCache()
    pipe = graphspec.Pipeline(target, prefix_cache=store)
    stream = pipe.stream(IDS[:60], max_new_tokens=40, ignore_eos=True)
    for _ in range(3):
        next(stream)
    stream.close()
    entry = _target_entry(store, target)
    cold = PrefixCache()
    graphspec.Pipeline(target, prefix_cache=cold).run(entry.tokens.tolist() + [1], max_new_tokens=1)
    ref = _target_entry(cold, target)
    assert _equal(entry.k + entry.v, [t[:, :entry.tokens.numel()] for t in ref.k + ref.v])

    class Boom(graphspec.Stage):
        reads, writes = ("target_logits",), ()

        def __init__(self):
            super().__init__("boom")
            self.calls = 0

        def run(self, state):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom")

    store = PrefixCache()
    failing = graphspec.Pipeline(target, prefix_cache=store).insert_stage(Boom(), after="verify")
    with pytest.raises(RuntimeError, match="boom"):
        failing.run(IDS[:60], max_new_tokens=10)
    assert len(store) == 0


def test_the_store_keeps_the_longest_rows_evicts_the_oldest_and_separates_models(models):
    target, draft = models[torch.float32]

    def cache_of(model, ids):
        c = model.new_cache(len(ids) + 4)
        prefill(model, c, ids, "cpu", exact=True)
        return c

    per_token = sum(2 * k.shape[2] * k.shape[3] * k.element_size() for k in target.new_cache(1).k)
    store = PrefixCache(max_bytes=per_token * 100)
    store.store(target, cache_of(target, IDS[:30]), IDS[:30])
    store.store(target, cache_of(target, IDS[:50]), IDS[:50])  # extends the first: replaces it
    assert len(store) == 1 and store.stats()["tokens"] == 50
    store.store(target, cache_of(target, IDS[:40]), IDS[:40])  # a prefix of a stored one: nothing new
    assert store.stats()["tokens"] == 50
    store.store(target, cache_of(target, IDS[60:100]), IDS[60:100])
    assert store.stats()["tokens"] == 90
    store.store(target, cache_of(target, IDS[100:140]), IDS[100:140])  # over 100 tokens: the oldest goes
    assert store.stats()["tokens"] == 80 and store.evictions == 1
    c = target.new_cache(200)
    assert store.fill(target, c, IDS[:45]) == 0  # evicted
    assert store.fill(target, c, IDS[60:90] + [1, 2]) == 30
    with pytest.raises(ValueError, match="empty cache"):
        store.fill(target, c, IDS[60:90])
    assert store.fill(draft, draft.new_cache(50), IDS[60:90]) == 0  # another model's rows are never used
    store.store(target, cache_of(target, IDS[:150]), IDS[:150])  # alone over the budget: not kept
    assert store.stats()["tokens"] == 80


def test_a_dead_models_rows_are_dropped(dirs):
    store = PrefixCache()
    model = graphspec.load_model(dirs[1])
    c = model.new_cache(20)
    prefill(model, c, IDS[:10], "cpu", exact=True)
    store.store(model, c, IDS[:10])
    del model, c
    gc.collect()
    other = graphspec.load_model(dirs[1])
    c = other.new_cache(20)
    prefill(other, c, IDS[20:30], "cpu", exact=True)
    store.store(other, c, IDS[20:30])
    assert len(store) == 1


def test_bad_settings_are_errors_that_say_what_to_do(models, dirs):
    target, _ = models[torch.float32]
    for bad in ("yes", 0, -5, 1.5):
        with pytest.raises(ValueError, match="prefix_cache"):
            graphspec.Pipeline(target, prefix_cache=bad)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=0)
    assert graphspec.Pipeline(target, prefix_cache=4096).prefix_cache.max_bytes == 4096
    assert graphspec.Pipeline(target, prefix_cache=True).prefix_cache.max_bytes == DEFAULT_PREFIX_CACHE_BYTES
    assert graphspec.Pipeline(target).prefix_cache is None
    shared = PrefixCache()
    assert graphspec.Pipeline(target, prefix_cache=shared).prefix_cache is shared

    class OnGPU:
        device = torch.device("cuda")

    with pytest.raises(ValueError, match="CPU backend"):
        check_prefix_cache(True, OnGPU())
    with pytest.raises(ValueError, match="Triton"):
        graphspec.Pipeline(graphspec.load_model(dirs[0], backend="triton"), prefix_cache=True)
    assert "prefix cache" in graphspec.Pipeline(target, prefix_cache=True).describe()


def test_the_server_reports_cached_prompt_tokens(models):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from graphspec.server import background

    target, draft = models[torch.float32]
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=3, draft_quantize=None, prefix_cache=True)
    engine = Engine(pipe, max_batch=2, policy="off")
    with background(engine, "tiny") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "the cat sat on the mat " * 4}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        alone = graphspec.Pipeline(target, prefix_cache=True).run(messages, max_new_tokens=6)
        assert second.choices[0].message.content == alone.text


def test_serve_takes_a_prefix_cache_size(dirs, capsys):
    from graphspec.cli import _build_parser, _prefix_cache_setting, main

    args = _build_parser().parse_args(["serve", "--target", str(dirs[0]), "--prefix-cache", "64"])
    assert args.prefix_cache == 64 and _prefix_cache_setting(64) == 64 * 2**20
    assert _build_parser().parse_args(["serve", "--target", str(dirs[0]), "--prefix-cache", "0"]).prefix_cache == 0
    assert _prefix_cache_setting(0) is False
    assert _build_parser().parse_args(["serve", "--target", str(dirs[0])]).prefix_cache == "auto"
    assert _prefix_cache_setting("auto") == "auto"
    for bad in ("lots", "-1"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--target", str(dirs[0]), "--prefix-cache", bad])
        assert exit_.value.code == 2 and "--prefix-cache: expected an integer >= 0" in capsys.readouterr().err


def test_auto_prefix_cache_is_on_where_a_miss_costs_nothing(dirs, model_level):
    """prefix_cache="auto": a cache for a bf16 target on the C++ linear (row-exact prefill in long blocks), none for
    fp32 (oneDNN's row-exact blocks cost more) or at the torch level; describe() says which and why."""
    with cpu.use_level(model_level):
        bf16 = graphspec.Pipeline(graphspec.load_model(dirs[0], dtype=torch.bfloat16), prefix_cache="auto")
        fp32 = graphspec.Pipeline(graphspec.load_model(dirs[0], dtype=torch.float32), prefix_cache="auto")
        assert (bf16.prefix_cache is not None) == cpu.bf16_linear()
        assert fp32.prefix_cache is None
        assert "auto:" in bf16.describe() and "prefix cache: none (auto" in fp32.describe()


def test_the_engines_policy_prices_no_catch_up_for_stored_draft_rows(models):
    """A greedy request's draft copies the rows the prefix cache holds, so the policy counts only the rest."""
    from graphspec.engine import _Running

    target, draft = models[torch.float32]
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_quantize=None, prefix_cache=True)
    pipe.run(IDS[:80], max_new_tokens=6, ignore_eos=True)  # the draft's rows of the prompt are stored
    engine = Engine(pipe, max_batch=2, policy="auto")
    try:
        assert engine._deferred
        assert engine._catch_up(_Running(greedy=True, max_new=8, context=100, stored=85)) == 15
        assert engine._catch_up(_Running(greedy=True, max_new=8, context=100)) == 100
        seq = engine.submit(IDS[:100], max_new_tokens=300, ignore_eos=True)
        with engine._lock:
            running = engine._seqs.get(seq)
        assert running is not None and running.stored == 80  # IDS[:80]: the first output is not in this prompt
        seq.cancel()
    finally:
        engine.close()


def test_a_budget_beyond_the_machines_memory_stores_nothing_and_warns_once(models, monkeypatch):
    import graphspec.prefix_cache as pc

    target, _ = models[torch.float32]
    cache = target.new_cache(40)
    prefill(target, cache, IDS[:30], "cpu", exact=True)
    store = PrefixCache()
    monkeypatch.setattr(pc, "available_bytes", lambda device: 1000)  # 1000 bytes free
    with pytest.warns(RuntimeWarning, match="lower its budget"):
        store.store(target, cache, IDS[:30])
    assert len(store) == 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.store(target, cache, IDS[:20])  # once only
    monkeypatch.setattr(pc, "available_bytes", lambda device: None)  # unknown: the budget alone decides
    store.store(target, cache, IDS[:30])
    assert len(store) == 1


def test_a_model_that_drafts_elsewhere_never_gives_its_draft_rows_to_its_own_target_runs(models):
    """A shared cache holds a model's rows from both roles: as a target only its row-exact ones may be used."""
    target, draft = models[torch.float32]
    store = PrefixCache()
    graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_quantize=None,
                       prefix_cache=store).run(IDS[:100], max_new_tokens=6, ignore_eos=True)
    assert store.match(draft, IDS[:110]) == 100 and store.match(draft, IDS[:110], exact=True) == 0
    as_target = graphspec.Pipeline(draft, prefix_cache=store)
    out = as_target.run(IDS[:120], max_new_tokens=8, ignore_eos=True)
    assert out.stats.cached_prompt_tokens == 0  # the draft's batched rows were not taken
    cold = graphspec.Pipeline(draft, prefix_cache=True).run(IDS[:120], max_new_tokens=8, ignore_eos=True)
    assert out.token_ids == cold.token_ids
    assert store.match(draft, IDS[:120], exact=True) == 120  # its own target rows are there now
    again = as_target.run(IDS[:120] + out.token_ids + [5, 6], max_new_tokens=8, ignore_eos=True)
    assert again.stats.cached_prompt_tokens == 120 + 8 - 1
