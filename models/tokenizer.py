"""Tokenizer and chat template from a Hugging Face checkpoint directory, without transformers.

- Text <-> ids through the ``tokenizers`` library reading ``tokenizer.json``; its own
  post-processor decides which special tokens ``add_special_tokens`` adds (transformers 5
  does the same for a tokenizer.json, ignoring ``add_bos_token`` in tokenizer_config.json).
- Named special tokens (bos/eos/unk/pad...) come from ``tokenizer_config.json`` (a plain
  string or an AddedToken object), else from the legacy ``special_tokens_map.json``.
- End-of-sequence ids: those of ``config.json`` first, then ``generation_config.json``,
  then the tokenizer's ``eos_token``, without duplicates.
- The chat template (``chat_template.jinja``, else tokenizer_config's ``chat_template``) is
  rendered the way transformers renders it: a jinja2 ImmutableSandboxedEnvironment with
  trim_blocks and lstrip_blocks, ``raise_exception``, a non-escaping ``tojson``,
  ``strftime_now``, the special tokens as variables, and ``add_generation_prompt``.
- ``StreamDecoder`` turns ids into text incrementally and never emits half a UTF-8
  character (a trailing U+FFFD is held back until the next ids complete it).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import tokenizers

# transformers' named special tokens, in its order (the chat template sees them by these names).
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies: printable Latin-1
    bytes stand for themselves, the other 68 bytes shift to code points 256 and up (``Ġ`` is a space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


class Tokenizer:
    """Encode/decode like transformers' fast tokenizer loaded from the same directory."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict | None = None, chat_template: str | dict | None = None,
                 eos_token_ids: Sequence[int] = (), fingerprint: str = "", source: str = "tokenizer"):
        self.backend = backend
        self.source = source
        self.fingerprint = fingerprint
        config = dict(config or {})
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))

        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            content = _token_content(config.get(name), f"{source}: {name}")
            if content is not None:
                self.special_tokens[name] = content
        # Like transformers: a named special token missing from the vocabulary is added as a special token.
        missing = [c for c in self.special_tokens.values() if backend.token_to_id(c) is None]
        if missing:
            backend.add_special_tokens([tokenizers.AddedToken(c, special=True, normalized=False) for c in missing])

        self.bos_token_id = self._id_of("bos_token")
        self.pad_token_id = self._id_of("pad_token")
        self.unk_token_id = self._id_of("unk_token")
        eos = list(eos_token_ids)
        tok_eos = self._id_of("eos_token")
        if tok_eos is not None:
            eos.append(tok_eos)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))

        self.special_ids: set[int] = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.special_ids.update(i for i in (self._id_of(n) for n in self.special_tokens) if i is not None)

        if isinstance(chat_template, list):  # tokenizer_config.json form: [{"name": ..., "template": ...}]
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template = chat_template
        self._compiled: dict[str, Any] = {}

    # --- loading -------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} does not exist; graphspec reads tokenizers from tokenizer.json "
                                    "(convert a SentencePiece-only checkpoint with transformers first)")
        raw_tok = tok_file.read_bytes()
        try:
            backend = tokenizers.Tokenizer.from_str(raw_tok.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{tok_file} could not be parsed by the tokenizers library: {e}") from e

        cfg_file = path / "tokenizer_config.json"
        raw_cfg = cfg_file.read_bytes() if cfg_file.is_file() else b""
        config = _read_json(cfg_file) if raw_cfg else {}
        legacy = path / "special_tokens_map.json"
        if legacy.is_file() and "added_tokens_decoder" not in config:
            for k, v in _read_json(legacy).items():
                config.setdefault(k, v)

        chat_template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # the standalone file wins, as in transformers
            chat_template = jinja_file.read_text(encoding="utf-8")

        eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            f = path / name
            if f.is_file():
                eos.extend(_eos_list(_read_json(f).get("eos_token_id"), f))
        fingerprint = hashlib.sha256(raw_tok + b"\0" + raw_cfg).hexdigest()
        return cls(backend, config, chat_template, eos, fingerprint, source=str(path))

    def _id_of(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    # --- text <-> ids ------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (ids run 0 .. vocab_size-1)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode(text=...) takes a str, got {type(text).__name__}")
        check_text(text, "the text to encode")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- chat template -----------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) to the prompt string."""
        template = self._pick_template(chat_template, kwargs.get("tools"))
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("apply_chat_template(messages=...) needs a non-empty list of {'role', 'content'} dicts")
        chat = []
        for i, m in enumerate(messages):
            check_message(m, i)
            chat.append({k: v for k, v in m.items() if v is not None})  # transformers drops None values too
        compiled = self._compiled.get(template)
        if compiled is None:
            compiled = self._compiled[template] = _compile_template(template)
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        import jinja2

        try:
            return compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:  # raise_exception() in the template, or what it cannot render
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def _pick_template(self, name_or_template: str | None, tools) -> str:
        t = self.chat_template
        if isinstance(t, dict):
            if name_or_template in t:
                return t[name_or_template]
            if name_or_template is None:
                if tools is not None and "tool_use" in t:
                    return t["tool_use"]
                if "default" in t:
                    return t["default"]
                raise ValueError(f"{self.source} has several chat templates ({sorted(t)}) and none named 'default'; "
                                 "pass chat_template=<name>")
        if name_or_template is not None:
            return name_or_template
        if not t:
            raise ValueError(f"{self.source} has no chat template (neither chat_template.jinja nor a chat_template "
                             "entry in tokenizer_config.json); pass a plain prompt string instead of messages")
        return t


def check_text(text: str, what: str) -> None:
    """Raise ValueError if ``text`` cannot be UTF-8 encoded: lone surrogates, which is what invalid UTF-8 bytes
    in a command-line argument become (Python decodes argv with surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text (character {e.start} is {text[e.start]!r}, an undecodable "
                         "byte); pass UTF-8 text") from None


def check_message(m, i: int) -> None:
    """A chat message is a dict with a str "role" and a str "content" (more keys are passed to the template)."""
    if not isinstance(m, dict):
        raise ValueError(f"chat message #{i} is a {type(m).__name__}; expected a dict like "
                         "{'role': 'user', 'content': '...'}")
    for key in ("role", "content"):
        if key not in m:
            raise ValueError(f"chat message #{i} has no {key!r} key; expected a dict like "
                             "{'role': 'user', 'content': '...'}")
        v = m[key]
        if not isinstance(v, str):
            raise ValueError(f"chat message #{i} has {key}={_brief(v)} ({type(v).__name__}); {key} must be a string")
        check_text(v, f"chat message #{i}'s {key}")


def _brief(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:50] + "..."


class StreamDecoder:
    """Incremental detokenisation: ``push(ids)`` returns only new, complete text.

    It decodes a short window of recent ids twice (with and without the newest ones) and
    emits the difference, so decoders that depend on neighbours (SentencePiece's leading
    space, byte fallback) see the same context as a full decode would.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the ids before it are already emitted and no longer needed as context
        self._read = 0  # ids before this index have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids) -> str:
        """Add token ids (an int, a list, or a tensor) and return the text they complete."""
        if hasattr(ids, "tolist"):  # torch / numpy
            ids = ids.tolist()
        self._ids.extend([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an incomplete UTF-8 character waiting for its next bytes
        out = new_text[len(prefix_text):]
        # Only the ids from the new window start on are needed again: drop the rest.
        self._ids = self._ids[self._read:]
        self._prefix, self._read = 0, len(self._ids)
        return out

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a genuinely invalid byte sequence) and start afresh."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._ids, self._prefix, self._read = [], 0, 0
        return new_text[len(prefix_text):]


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization, applied only where it applies it (never to BPE by default)
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _token_content(v, where: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise ValueError(f"{where} is {v!r}; expected a string or an AddedToken object with 'content'")


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep, an int too long
        raise ValueError(f"{path} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _eos_list(v, path: Path) -> list[int]:
    if v is None:
        return []
    ids = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path} has eos_token_id={v!r}; expected a non-negative int or a list of them")
    return ids


# --- jinja, configured like transformers' chat template renderer -------------------------------------------------

def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # transformers' {% generation %} marks assistant spans for training masks; rendering just keeps the body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class _Namespace(jinja2.utils.Namespace):
        # Reject dunder-ish attribute names so a template cannot reach Python internals through namespace().
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse as jinja2 (line {e.lineno}: {e.message})") from e
