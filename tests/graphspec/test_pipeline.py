"""Pipeline on toy models: greedy speculative == autoregressive, stats, stop rules, text, streaming, limits."""

import pytest
import torch

import graphspec
from tests.checkpoints import save_tokenizer
from tests.graphspec.toy import ScriptLM, ToyLM

pytestmark = pytest.mark.usefixtures("single_thread")

V = 16


def _ar(target, prompt, n, **kw):
    return graphspec.Pipeline(target).run(prompt, max_new_tokens=n, **kw)


# ------------------------------------------------------------------------------ greedy == autoregressive

@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_autoregressive_for_every_k(k):
    target = ToyLM(V, seed=0)
    long_prompt = [int(x) for x in torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(k))]
    for prompt in ([7], long_prompt, [1, 2, 3, 1, 2, 3, 1, 2]):
        ref = _ar(target, prompt, 37).token_ids
        same = graphspec.Pipeline(target, draft=ToyLM(table=target.table.clone()), num_speculative_tokens=k,
                                  draft_siblings=0)  # a chain: every proposed token is accepted
        unrelated = graphspec.Pipeline(target, draft=ToyLM(V, seed=100 + k), num_speculative_tokens=k,
                                       draft_confidence_threshold=None)
        # a draft that stops at its first unsure token (threshold 0.9): shorter drafts, same tokens
        hesitant = graphspec.Pipeline(target, draft=ToyLM(V, seed=200 + k), num_speculative_tokens=k,
                                      draft_confidence_threshold=0.9)
        ngram = graphspec.Pipeline(target, draft="ngram", num_speculative_tokens=k)
        for pipe in (same, unrelated, hesitant, ngram):
            out = pipe.run(prompt, max_new_tokens=37)
            assert out.token_ids == ref, (k, len(prompt), pipe)
            assert len(out.token_ids) == 37
        assert same.run(prompt, max_new_tokens=37).stats.acceptance_rate == 1.0
        assert unrelated.run(prompt, max_new_tokens=37).stats.acceptance_rate < 0.3


def test_stats_with_a_draft_identical_to_the_target():
    k, n = 4, 30  # 30 = 6 steps of k + 1 tokens
    target = ToyLM(V, seed=0)
    draft = ToyLM(table=target.table.clone())
    out = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=k,
                             draft_confidence_threshold=None).run([1, 2, 3], max_new_tokens=n)
    s = out.stats
    assert s.acceptance_rate == 1.0 and s.mean_accepted_length == k + 1
    assert s.steps == 6 and s.proposed == s.accepted == 24
    assert s.accepted_per_position == s.proposed_per_position == [6] * k
    assert s.target_forwards == 7  # prefill + 6 verifies
    assert s.draft_forwards == len(draft.calls) == 1 + 6 * k  # prefill + k per step (catch-up included)
    assert set(s.stage_seconds) == {"draft", "verify", "accept"}
    assert s.prefill_seconds > 0 and s.decode_seconds > 0
    assert s.tokens_per_second == pytest.approx(n / (s.prefill_seconds + s.decode_seconds))
    assert s.decode_tokens_per_second == pytest.approx(n / s.decode_seconds)
    assert s.as_dict()["acceptance_rate"] == 1.0 and "acceptance 1.00" in str(s)


def test_stats_of_plain_decoding_and_partial_acceptance():
    target = ToyLM(V, seed=0)
    ar = _ar(target, [1, 2], 10).stats
    assert (ar.steps, ar.proposed, ar.acceptance_rate, ar.mean_accepted_length) == (10, 0, 0.0, 1.0)
    assert ar.draft_forwards == 0 and ar.target_forwards == 11 and ar.accepted_per_position == []
    draft = ToyLM(table=target.table.clone())
    draft.table[:, :, 5] += 3.0  # the draft over-proposes token 5
    s = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3, draft_siblings=0).run(
        [1, 2], max_new_tokens=40).stats  # a chain: accepted positions are a prefix of the proposed ones
    assert 0 < s.acceptance_rate < 1
    assert s.accepted == sum(s.accepted_per_position) and s.proposed == sum(s.proposed_per_position)
    # a later position can only be accepted when every earlier one was
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert s.mean_accepted_length == pytest.approx(40 / s.steps)


@pytest.mark.parametrize("n", [1, 2, 5, 11])
def test_max_new_tokens_is_never_exceeded(n):
    target = ToyLM(V, seed=0)
    pipe = graphspec.Pipeline(target, draft=ToyLM(table=target.table.clone()), num_speculative_tokens=8)
    for temperature in (0.0, 1.0):
        out = pipe.run([3, 4], max_new_tokens=n, temperature=temperature, seed=0)
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stops_at_any_eos_and_keeps_it_in_token_ids():
    target = ToyLM(V, seed=0)
    ref = _ar(target, [1, 2, 3], 40).token_ids
    eos = ref[17]
    first = ref.index(eos)
    t2 = ToyLM(table=target.table, eos_token_ids=[99, eos])
    for draft in (None, "ngram", ToyLM(table=target.table.clone())):
        out = graphspec.Pipeline(t2, draft=draft, num_speculative_tokens=5).run([1, 2, 3], max_new_tokens=40)
        assert out.token_ids == ref[:first + 1] and out.finish_reason == "eos"
        more = graphspec.Pipeline(t2, draft=draft).run([1, 2, 3], max_new_tokens=40, ignore_eos=True)
        assert more.token_ids == ref and more.finish_reason == "length"


# ------------------------------------------------------------------------------ limits and errors

def test_limits_are_checked_before_any_work():
    target = ToyLM(V, seed=0, max_position_embeddings=64)
    draft = ToyLM(V, seed=1, max_position_embeddings=64)
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(60\) = 70 exceeds the target's "
                                         r"max_position_embeddings=64"):
        pipe.run(list(range(10)), max_new_tokens=60)
    assert target.calls == [] and draft.calls == []
    assert len(pipe.run(list(range(10)), max_new_tokens=54).token_ids) == 54  # exactly at the limit
    short_draft = ToyLM(V, seed=1, max_position_embeddings=32)
    with pytest.raises(ValueError, match="draft's max_position_embeddings=32"):
        graphspec.Pipeline(target, draft=short_draft).run([1], max_new_tokens=40)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 99]), r"outside \[0, 16\)"),
    (dict(prompt="text"), "no tokenizer"),
    (dict(prompt=[1.5]), "prompt must be"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop="x"), "stop strings need text"),
    (dict(seed="1"), "seed"),
])
def test_bad_arguments_name_the_parameter(kwargs, match):
    target = ToyLM(V, seed=0)
    pipe = graphspec.Pipeline(target, draft="ngram")
    args = dict(prompt=[1, 2], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pipe.run(args.pop("prompt"), **args)
    assert target.calls == []


def test_bad_pipeline_arguments():
    target = ToyLM(V, seed=0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        graphspec.Pipeline(target, draft="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens=64 makes a verify block of 65 rows.*use at most 63"):
        graphspec.Pipeline(target, draft="ngram", num_speculative_tokens=64)
    assert graphspec.Pipeline(target, draft="ngram", num_speculative_tokens=63).num_speculative_tokens == 63
    with pytest.raises(ValueError, match="draft is on meta but target is on cpu"):
        graphspec.Pipeline(target, draft=ToyLM(V, seed=1, device="meta"))
    with pytest.raises(ValueError, match="different vocabularies"):
        graphspec.Pipeline(target, draft=ToyLM(V + 4, seed=1))
    with pytest.raises(ValueError, match="vocab_mapping='bogus' is not one of"):
        graphspec.Pipeline(target, draft=ToyLM(V, seed=1), vocab_mapping="bogus")
    for bad in (1.0, -0.1, "0.5", "Auto", True):
        with pytest.raises(ValueError, match="draft_confidence_threshold must be None, auto or a number in"):
            graphspec.Pipeline(target, draft=ToyLM(V, seed=1), draft_confidence_threshold=bad)
    with pytest.raises(ValueError, match="acceptance must be"):
        graphspec.Pipeline(target, acceptance="typical")
    with pytest.raises(ValueError, match="target must be a checkpoint directory"):
        graphspec.Pipeline(object())
    with pytest.raises(ValueError, match="no tokenizer"):
        graphspec.Pipeline(target).stream([1], max_new_tokens=2)


def test_a_model_serves_two_pipelines_at_once():
    target = ToyLM(V, seed=0)
    ar = graphspec.Pipeline(target)
    spec = graphspec.Pipeline(target, draft=ToyLM(V, seed=4), num_speculative_tokens=3)
    ref = ar.run([2, 3], max_new_tokens=25).token_ids
    # interleave two generations step by step on the same model objects
    a = spec._generate([2, 3], 25, graphspec.SamplingParams(), False, [])
    b = ar._generate([5, 6], 25, graphspec.SamplingParams(), False, [])
    results = {}
    while len(results) < 2:
        for name, g in (("a", a), ("b", b)):
            if name in results:
                continue
            try:
                next(g)
            except StopIteration as done:
                results[name] = done.value
    assert results["a"].token_ids == ref
    assert results["b"].token_ids == ar.run([5, 6], max_new_tokens=25).token_ids


# ------------------------------------------------------------------------------ text: tokenizer, chat, stream

def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character table, used by byte-level BPE vocabularies
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from graphspec.models.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d, "bytelevel", chat_template="chatml")
    return Tokenizer.from_dir(d)


def _byte_ids(tok, text: str) -> list[int]:
    table = _bytes_to_unicode()
    return [tok.token_to_id(table[b]) for b in text.encode("utf-8")]


def _scripted(tok, prompt_ids, continuation_ids, **kw):
    script = list(prompt_ids) + list(continuation_ids) + [0] * 8
    return ScriptLM(script, tok.vocab_size, tokenizer=tok, eos_token_ids=[tok.token_to_id("<|im_end|>")], **kw)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_stream_never_splits_a_utf8_character_and_matches_run(tok, k):
    text = "h€llo wörld 😀!"
    cont = _byte_ids(tok, text) + [tok.token_to_id("<|im_end|>")]
    prompt = tok.encode("The quick")
    target = _scripted(tok, prompt, cont)
    draft = _scripted(tok, prompt, cont, wrong_every=3) if k else None
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=max(k, 1))
    pieces = []
    gen = pipe.stream("The quick", max_new_tokens=40)
    while True:
        try:
            pieces.append(next(gen))
        except StopIteration as done:
            result = done.value
            break
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces) and len(pieces) > 3
    out = pipe.run("The quick", max_new_tokens=40)
    assert out.text == text == result.text and out.token_ids == cont and out.finish_reason == "eos"


def test_stop_strings_cut_text_and_tokens(tok):
    body = tok.encode("Hello world. Stop here, please.", add_special_tokens=False)
    prompt = tok.encode("Say:")
    target = _scripted(tok, prompt, body)
    for draft in (None, _scripted(tok, prompt, body, wrong_every=4)):
        pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=3)
        out = pipe.run("Say:", max_new_tokens=30, stop=["Stop", "never"])
        assert out.text == "Hello world. " and out.finish_reason == "stop"
        # token_ids end with the token that completed the stop string
        assert tok.decode(out.token_ids).startswith("Hello world. Stop")
        assert "Stop" not in tok.decode(out.token_ids[:-1])
        pieces = list(pipe.stream("Say:", max_new_tokens=30, stop="Stop"))
        assert "".join(pieces) == "Hello world. "
        # a stop string that never appears changes nothing
        assert pipe.run("Say:", max_new_tokens=len(body), stop="zzz").text == tok.decode(body)


def test_prompt_forms_string_ids_and_chat(tok):
    messages = [{"role": "user", "content": "Write hello."}]
    chat_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    cont = tok.encode(" hello there", add_special_tokens=False)
    target = _scripted(tok, chat_ids, cont)
    draft = _scripted(tok, chat_ids, cont, wrong_every=2)
    pipe = graphspec.Pipeline(target, draft=draft, num_speculative_tokens=4)
    out = pipe.run(messages, max_new_tokens=len(cont))
    assert out.prompt_token_ids == chat_ids and out.token_ids == cont and out.text == " hello there"
    assert pipe.run(chat_ids, max_new_tokens=len(cont)).token_ids == cont
    assert pipe.run(torch.tensor(chat_ids), max_new_tokens=3).token_ids == cont[:3]
    s = pipe.run("Write hello.", max_new_tokens=2)
    assert s.prompt_token_ids == tok.encode("Write hello.")
    with pytest.raises(ValueError, match="chat message #0 has no 'content' key"):
        pipe.run([{"role": "user"}], max_new_tokens=2)


def test_vocabulary_check(tok):
    target = ScriptLM([1, 2], tok.vocab_size, tokenizer=tok)
    # same tokenizer, padded embedding: one vocabulary, no map stage
    pipe = graphspec.Pipeline(target, draft=ScriptLM([1, 2], tok.vocab_size + 64, tokenizer=tok))
    assert pipe.graph.names == ["draft", "verify", "accept"]
    with pytest.raises(ValueError, match="different vocabularies: the draft has no tokenizer"):
        graphspec.Pipeline(target, draft=ScriptLM([1, 2], tok.vocab_size))
