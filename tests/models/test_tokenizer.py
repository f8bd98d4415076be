"""graphspec's Tokenizer against transformers' on tokenizers trained here (byte-level and metaspace BPE)."""

import json
import shutil

import pytest

from graphspec.models.tokenizer import StreamDecoder, Tokenizer
from tests.checkpoints import save_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "   leading spaces and\ttabs\t\tand  double  spaces   ",
    "\n\nnewlines\r\nand CRLF\n",
    "café naïve é",
    "日本語のテキスト",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "",
    " ",
    "x" * 50,
]


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def tok_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tok_{request.param}")
    save_tokenizer(d, request.param, chat_template="chatml")
    return d


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def ours(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, hf_tok, tok_dir, add_special_tokens):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    for text in TEXTS:
        want = hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.encode(text, add_special_tokens=add_special_tokens) == want, text
        assert fast(text, add_special_tokens=add_special_tokens)["input_ids"] == want, text


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(ours, hf_tok, skip_special_tokens):
    for text in TEXTS:
        ids = hf_tok(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf_tok.decode(
            ids, skip_special_tokens=skip_special_tokens), text
    # Arbitrary id sequences (not only ones an encoder produces), including broken UTF-8 bytes.
    ids = list(range(0, ours.vocab_size, 7))
    assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf_tok.decode(
        ids, skip_special_tokens=skip_special_tokens)


def test_roundtrip_and_vocab(ours, hf_tok):
    assert ours.decode(ours.encode("def add(a, b):\n    return a + b", add_special_tokens=False)) == \
        "def add(a, b):\n    return a + b"
    assert ours.vocab_size == len(hf_tok)
    assert ours.get_vocab() == hf_tok.get_vocab()
    assert ours.id_to_token(ours.encode("<|im_end|>", add_special_tokens=False)[0]) == "<|im_end|>"
    assert ours.eos_token_ids == [hf_tok.eos_token_id]
    assert ours.bos_token_id == hf_tok.bos_token_id
    assert ours.pad_token_id == hf_tok.pad_token_id
    assert set(hf_tok.all_special_ids) <= ours.special_ids
    assert ours.token_to_id("<|im_start|>") in ours.special_ids


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tmp_path, style, add_generation_prompt):
    save_tokenizer(tmp_path, "bytelevel", chat_template=style)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.has_chat_template
    conversations = [
        [{"role": "user", "content": "Write a haiku about tensors."}],
        [{"role": "system", "content": "  Be terse.  "}, {"role": "user", "content": "Hi <b>&</b> \"quotes\" é"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語?"}],
    ]
    for messages in conversations:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == want
        assert ours.encode(got, add_special_tokens=False) == hf(want, add_special_tokens=False)["input_ids"]


def test_chat_template_tojson_and_none_fields(tmp_path):
    # tojson must not HTML-escape and None-valued message keys are dropped (both as transformers does).
    save_tokenizer(tmp_path, "bytelevel", chat_template="llama3")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "call it", "tool_calls": [{"name": "f", "arguments": {"x": "<&>é"}}]},
                {"role": "assistant", "content": "ok", "tool_calls": None}]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == want
    assert '"<&>é"' in want


def test_chat_template_from_tokenizer_config_and_raise_exception(tmp_path):
    save_tokenizer(tmp_path, "bytelevel", chat_template="llama3")
    # Older checkpoints keep the template inside tokenizer_config.json.
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "user", "content": "a"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="chat template refused these messages: Conversation roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_no_chat_template_is_a_clear_error(tmp_path):
    save_tokenizer(tmp_path, "metaspace", chat_template=None)
    ours = Tokenizer.from_dir(tmp_path)
    assert not ours.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_config_first_then_tokenizer(tmp_path):
    save_tokenizer(tmp_path, "bytelevel", chat_template="chatml")
    ours0 = Tokenizer.from_dir(tmp_path)
    im_end, eot = ours0.token_to_id("<|im_end|>"), ours0.token_to_id("<|eot_id|>")
    endoftext = ours0.token_to_id("<|endoftext|>")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [eot, im_end, endoftext]


def test_fingerprint_tracks_tokenizer_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_tokenizer(a, "metaspace")
    shutil.copytree(a, b)
    assert Tokenizer.from_dir(a).fingerprint == Tokenizer.from_dir(b).fingerprint
    assert len(Tokenizer.from_dir(a).fingerprint) == 64
    cfg = json.loads((b / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<unk>"
    (b / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(a).fingerprint != Tokenizer.from_dir(b).fingerprint


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_decoder_never_splits_characters(ours, chunk):
    text = "Hi é 日本語 🙂👍🏽 done\n  x"
    ids = ours.encode(text, add_special_tokens=False)
    full = ours.decode(ids)
    dec = StreamDecoder(ours)
    import torch
    pieces = [dec.push(ids[i:i + chunk] if chunk > 1 else torch.tensor(ids[i])) for i in range(0, len(ids), chunk)]
    pieces.append(dec.flush())
    assert "".join(pieces) == full
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 3  # it really streams, not everything at the end


def test_stream_decoder_flushes_invalid_bytes(ours):
    # A lone UTF-8 lead byte never completes: held back while streaming, emitted by flush().
    lead = ours.token_to_id("<0xF0>") if ours.token_to_id("<0xF0>") is not None else ours.token_to_id("ð")
    ids = ours.encode("ab", add_special_tokens=False) + [lead]
    dec = StreamDecoder(ours)
    streamed = dec.push(ids)
    assert "\ufffd" not in streamed
    assert streamed + dec.flush() == ours.decode(ids)
