"""Cross-vocabulary tables: token normalisation, the draft<->target tables, their cache, ByteEncoder."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from graphspec.vocab import (ByteEncoder, TokenizerFamily, build_vocab_mapping, family_of, normalize_token,
                             token_table)
from tests.checkpoints import train_tokenizer

BYTE_LEVEL = TokenizerFamily(byte_level=True)
SPM = TokenizerFamily(metaspace=True, byte_fallback=True)

TEXTS = [
    "def f(x):\n    return x  # two  spaces\n",
    "   leading spaces\n\n\n\ttab",
    "café crème, naïve déjà vu",
    "日本語のテキスト",
    "emoji 🙂🎉 and 👩‍💻",
    "",
]


def _word_level(words, specials=("[UNK]", "<eos>")) -> tokenizers.Tokenizer:
    vocab = {w: i for i, w in enumerate(list(specials) + list(words))}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in specials])
    return tok


@pytest.fixture(scope="module")
def bytelevel():
    return train_tokenizer("bytelevel", 400)


@pytest.fixture(scope="module")
def metaspace():
    return train_tokenizer("metaspace", 400)


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize("token, family, expected, fallback", [
    ("Ġhello", BYTE_LEVEL, b" hello", False),
    ("Ċ", BYTE_LEVEL, b"\n", False),
    ("ĊĊĠĠ", BYTE_LEVEL, b"\n\n  ", False),
    ("Ã©", BYTE_LEVEL, "é".encode(), False),           # é is two bytes, each its own GPT-2 character
    ("ðŁĻĤ", BYTE_LEVEL, "🙂".encode(), False),
    ("ĉ", BYTE_LEVEL, b"\t", False),
    ("▁hello", SPM, b" hello", False),
    ("▁▁x", SPM, b"  x", False),
    ("<0x0A>", SPM, b"\n", True),
    ("<0xE6>", SPM, b"\xe6", True),
    ("日本", SPM, "日本".encode(), False),
    ("<0x0A>", TokenizerFamily(metaspace=True), b"<0x0A>", False),  # no byte fallback: a literal string
    ("##ing", TokenizerFamily(continuing_prefix="##"), b"ing", False),
    ("hello", TokenizerFamily(), b"hello", False),
])
def test_normalize_token(token, family, expected, fallback):
    assert normalize_token(token, family) == (expected, fallback)


def test_byte_level_character_outside_the_byte_table_has_no_bytes():
    assert normalize_token("€", BYTE_LEVEL) == (None, False)


def test_family_detection(bytelevel, metaspace):
    assert family_of(bytelevel) == TokenizerFamily(byte_level=True)
    assert family_of(metaspace) == TokenizerFamily(metaspace=True, byte_fallback=True)
    # Llama-2 style: no Metaspace component, "▁" comes from a normalizer and a Replace decoder.
    llama2 = tokenizers.Tokenizer(models.BPE(vocab={"▁a": 0, "<0x41>": 1}, merges=[], byte_fallback=True))
    llama2.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert family_of(llama2) == TokenizerFamily(metaspace=True, byte_fallback=True)
    assert family_of(_word_level(["a"])) == TokenizerFamily()


def test_token_table_spells_every_token_as_the_tokenizer_decodes_it(bytelevel, metaspace):
    # Concatenating per-token bytes must give the decoded text of a whole encoding (decoders add nothing).
    for tok in (bytelevel, metaspace):
        table = token_table(tok)
        for text in TEXTS[:-1]:
            ids = tok.encode(text, add_special_tokens=False).ids
            got = table.join(ids).decode("utf-8")
            # Metaspace prepends "▁" to the first word (the Strip decoder removes it again).
            assert got in (text, " " + text), (tok, text, got)


def test_specials_flagged_and_kept_out_of_the_intersection(bytelevel, metaspace, quiet):
    bt, mt = token_table(bytelevel), token_table(metaspace)
    for tok, table in ((bytelevel, bt), (metaspace, mt)):
        sid = tok.token_to_id("<|im_end|>")
        assert sid in table.special_ids()
        assert table.pieces[sid] == b"<|im_end|>"
    m = build_vocab_mapping(metaspace, bytelevel, cache=False)
    # Both tokenizers carry <|im_end|>, <|im_start|>, ... as specials: none of them may map.
    for s in ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|eot_id|>"):
        assert m.draft_to_target[metaspace.token_to_id(s)] == -1
        assert m.target_to_draft[bytelevel.token_to_id(s)] == -1
    for s in ("<s>", "</s>", "<unk>"):
        assert m.draft_to_target[metaspace.token_to_id(s)] == -1


# ----------------------------------------------------------------------------- tables

def _check_inverse(m):
    d2t, t2d = m.draft_to_target, m.target_to_draft
    d = (d2t >= 0).nonzero().squeeze(1)
    t = (t2d >= 0).nonzero().squeeze(1)
    assert len(d) == len(t) == m.intersection_size
    assert (t2d[d2t[d]] == d).all(), "draft -> target -> draft is not the identity on the intersection"
    assert (d2t[t2d[t]] == t).all(), "target -> draft -> target is not the identity on the intersection"
    for i in d.tolist():
        assert m.draft_tokens.pieces[i] == m.target_tokens.pieces[int(d2t[i])]


def test_tables_bytelevel_vs_metaspace(bytelevel, metaspace, quiet):
    m = build_vocab_mapping(metaspace, bytelevel, cache=False)
    _check_inverse(m)
    assert 100 < m.intersection_size < 400
    # Every single byte exists in both (GPT-2 alphabet; <0xNN> fallbacks): all 256 are in the intersection.
    single = [i for i, b in enumerate(m.target_tokens.pieces) if len(b) == 1 and m.target_tokens.flags[i] == 0]
    assert len(single) == 256 and all(m.target_to_draft[i] >= 0 for i in single)
    # A byte that also has a plain token maps through the plain token, not its <0xNN> fallback.
    plain_a, fallback_a = metaspace.token_to_id("a"), metaspace.token_to_id("<0x61>")
    assert m.draft_to_target[plain_a] == bytelevel.token_to_id("a")
    assert m.draft_to_target[fallback_a] == -1
    # A byte only the fallback spells (0xC3, the first byte of é) maps through the fallback.
    assert m.draft_to_target[metaspace.token_to_id("<0xC3>")] == bytelevel.token_to_id("Ã")
    # Spaces: byte-level "Ġ" and metaspace "▁" are the same byte.
    assert m.draft_to_target[metaspace.token_to_id("▁")] == bytelevel.token_to_id("Ġ")
    # Multi-byte merges that only one side learned have no counterpart.
    only_target = [t for t, i in bytelevel.get_vocab().items() if m.target_to_draft[i] < 0 and i not in
                   token_table(bytelevel).special_ids()]
    assert only_target, "expected some byte-level merges without a metaspace counterpart"


def test_word_level_partial_overlap(quiet):
    draft = _word_level(["the", "cat", "sat", "on", "mat", "dog"])
    target = _word_level(["a", "dog", "the", "sat", "bird", "mat", "tree"], specials=("<unk>", "[UNK]"))
    m = build_vocab_mapping(draft, target, cache=False)
    _check_inverse(m)
    shared = {"the", "sat", "mat", "dog"}
    got = {draft.id_to_token(i) for i in (m.draft_to_target >= 0).nonzero().squeeze(1).tolist()}
    assert got == shared  # "[UNK]" is in both vocabularies but special, so it stays out
    for w in shared:
        assert m.draft_to_target[draft.token_to_id(w)] == target.token_to_id(w)
    for w in ("cat", "on"):
        assert m.draft_to_target[draft.token_to_id(w)] == -1
    for w in ("a", "bird", "tree"):
        assert m.target_to_draft[target.token_to_id(w)] == -1


def test_tables_sized_by_model_vocab(bytelevel, metaspace, quiet):
    m = build_vocab_mapping(metaspace, bytelevel, draft_vocab_size=448, target_vocab_size=512, cache=False)
    assert m.draft_to_target.shape == (448,) and m.target_to_draft.shape == (512,)
    assert (m.draft_to_target[400:] == -1).all() and (m.target_to_draft[400:] == -1).all()
    _check_inverse(m)
    # A model smaller than its tokenizer: ids past the embedding drop out on both sides.
    small = build_vocab_mapping(metaspace, bytelevel, target_vocab_size=300, cache=False)
    assert small.target_to_draft.shape == (300,)
    assert int(small.draft_to_target.max()) < 300
    _check_inverse(small)
    assert small.intersection_size < m.intersection_size


def test_small_intersection_warns_and_empty_is_an_error(bytelevel):
    with pytest.warns(UserWarning, match="small vocabulary intersection"):
        build_vocab_mapping(_word_level(["the", "cat", "x1", "x2"]), _word_level(["the", "dog"]), cache=False)
    with pytest.raises(ValueError, match="share no token"):
        build_vocab_mapping(_word_level(["cat"]), _word_level(["dog"]), cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # byte-level with itself: full intersection, no warning
        build_vocab_mapping(bytelevel, bytelevel, cache=False)


# ----------------------------------------------------------------------------- cache

def test_cache_second_build_loads_from_disk(bytelevel, metaspace, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(tmp_path))
    first = build_vocab_mapping(metaspace, bytelevel)
    assert first.source == "built"
    files = list((tmp_path / "vocab_maps").iterdir())
    assert [f.suffix for f in files] == [".npz"], files  # one file, no temporary left behind
    with np.load(files[0], allow_pickle=False) as z:  # readable without pickle
        assert "draft_to_target" in z.files
    second = build_vocab_mapping(metaspace, bytelevel)
    assert second.source == "cache"
    assert second.draft_to_target.equal(first.draft_to_target)
    assert second.target_to_draft.equal(first.target_to_draft)
    assert second.draft_tokens.pieces == first.draft_tokens.pieces
    assert (second.target_tokens.flags == first.target_tokens.flags).all()
    # The reverse pair is a different key.
    assert build_vocab_mapping(bytelevel, metaspace).source == "built"
    assert len(list((tmp_path / "vocab_maps").iterdir())) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncate", "wrong_key"])
def test_corrupt_cache_is_rebuilt(bytelevel, metaspace, tmp_path, damage, quiet):
    first = build_vocab_mapping(metaspace, bytelevel, cache_dir=tmp_path)
    path = first.cache_path
    if damage == "garbage":
        path.write_bytes(b"not a zip file at all")
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    else:
        other = build_vocab_mapping(bytelevel, metaspace, cache_dir=tmp_path)
        path.write_bytes(other.cache_path.read_bytes())
    with pytest.warns(RuntimeWarning, match="unreadable"):
        again = build_vocab_mapping(metaspace, bytelevel, cache_dir=tmp_path)
    assert again.source == "built"
    assert again.draft_to_target.equal(first.draft_to_target)
    assert build_vocab_mapping(metaspace, bytelevel, cache_dir=tmp_path).source == "cache"  # repaired on disk


def test_cache_disabled_writes_nothing(bytelevel, metaspace, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("GRAPHSPEC_CACHE", str(tmp_path))
    assert build_vocab_mapping(metaspace, bytelevel, cache=False).source == "built"
    assert not (tmp_path / "vocab_maps").exists()


def test_graphspec_tokenizer_fingerprint_keys_the_cache(tmp_path, quiet):
    from graphspec.models.tokenizer import Tokenizer
    from tests.checkpoints import save_tokenizer

    save_tokenizer(tmp_path / "a", "bytelevel", chat_template="chatml")
    save_tokenizer(tmp_path / "b", "metaspace")
    a, b = Tokenizer.from_dir(tmp_path / "a"), Tokenizer.from_dir(tmp_path / "b")
    m1 = build_vocab_mapping(b, a, cache_dir=tmp_path / "cache")
    m2 = build_vocab_mapping(Tokenizer.from_dir(tmp_path / "b"), Tokenizer.from_dir(tmp_path / "a"),
                             cache_dir=tmp_path / "cache")
    assert (m1.source, m2.source) == ("built", "cache")
    assert m1.key == m2.key and a.fingerprint and b.fingerprint
    for i in a.special_ids:
        assert m1.target_to_draft[i] == -1


# ----------------------------------------------------------------------------- byte-exact tokenization

@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("text", TEXTS + [" starts with a space", "x\n\n\n   y", "a" * 50])
def test_byte_encoder_spells_exact_bytes(kind, text):
    tok = train_tokenizer(kind, 400)
    table = token_table(tok)
    enc = ByteEncoder(tok, table)
    data = text.encode("utf-8")
    ids, consumed, exact = enc.encode(data)
    assert exact and consumed == len(data)
    assert table.join(ids) == data


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_byte_encoder_holds_back_an_incomplete_character(kind):
    tok = train_tokenizer(kind, 400)
    table = token_table(tok)
    enc = ByteEncoder(tok, table)
    data = "ok 日🙂".encode()
    for cut in range(len(data) + 1):
        ids, consumed, exact = enc.encode(data[:cut], final=False)
        assert exact and table.join(ids) == data[:consumed]
        data[:consumed].decode("utf-8")  # whole characters only (raises otherwise)
        assert cut - consumed < 4
        assert consumed == len(data[:cut].decode("utf-8", errors="ignore").encode())
    # Invalid bytes in the middle (a model may emit any byte) are spelled byte by byte.
    bad = b"a\xff\xfeb\xe6\x97c"
    ids, consumed, exact = enc.encode(bad)
    assert exact and consumed == len(bad) and table.join(ids) == bad


def test_byte_encoder_reports_what_a_word_level_vocabulary_cannot_spell():
    tok = _word_level(["hello", "world"])
    enc = ByteEncoder(tok, token_table(tok))
    ids, consumed, exact = enc.encode(b"helloworld")
    assert exact and ids == [tok.token_to_id("hello"), tok.token_to_id("world")]
    ids, consumed, exact = enc.encode(b"hello there")
    assert not exact and ids[0] == tok.token_to_id("hello")


# ----------------------------------------------------------------------------- the real pair (slow)

@pytest.mark.slow
def test_real_smollm2_and_qwen25_tokenizers(tmp_path):
    """SmolLM2's 49,152-token BPE against Qwen2.5's 151,936-token BPE (both byte-level)."""
    import time

    from graphspec.models import zoo
    from graphspec.models.tokenizer import Tokenizer

    draft = Tokenizer.from_dir(zoo.resolve("smollm2-135m-instruct"))
    target = Tokenizer.from_dir(zoo.resolve("qwen2.5-coder-0.5b-instruct"))
    t0 = time.perf_counter()
    m = build_vocab_mapping(draft, target, draft_vocab_size=49152, target_vocab_size=151936, cache_dir=tmp_path)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = build_vocab_mapping(draft, target, draft_vocab_size=49152, target_vocab_size=151936, cache_dir=tmp_path)
    loaded = time.perf_counter() - t0
    print(f"\n{m.describe()}\nbuilt in {built:.2f} s, loaded from the cache in {loaded:.2f} s")
    assert again.source == "cache" and again.draft_to_target.equal(m.draft_to_target)
    # Measured: 39,234 shared tokens (79.8% of SmolLM2's vocabulary).
    assert 35000 < m.intersection_size < 45000
    _check_inverse(m)
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert m.draft_to_target[draft.token_to_id(name)] == -1
    assert m.draft_to_target[draft.token_to_id("Ġthe")] == target.token_to_id("Ġthe")
    # Qwen's padding rows (151,665 tokenizer ids, 151,936 embedding rows) map to nothing.
    assert (m.target_to_draft[target.vocab_size:] == -1).all()
    for tok, table in ((draft, m.draft_tokens), (target, m.target_tokens)):
        enc = ByteEncoder(tok, table)
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            assert table.join(ids) == text.encode()
            got, consumed, exact = enc.encode(text.encode())
            assert exact and table.join(got) == text.encode()
