"""Cross-vocabulary mapping between a draft and a target with different tokenizers.

Tokens of two tokenizer families are compared as the raw BYTES they stand for:

- byte-level BPE (GPT-2 style, ``ByteLevel`` pre-tokenizer/decoder): every character of a token
  is one byte through GPT-2's byte-to-unicode table (``Ġ`` -> space, ``Ċ`` -> newline);
- SentencePiece style (``Metaspace``, or a ``Replace("▁", " ")`` decoder): ``▁`` -> space, the
  rest UTF-8; with byte fallback, ``<0xNN>`` -> that single byte;
- anything else (word-level, WordPiece without ``##``): the token's UTF-8 text.

Special tokens (added tokens flagged special, plus the tokenizer's named specials) are kept
out of the intersection: their meaning is model-specific. When one vocabulary spells the same
bytes twice (a ``<0x41>`` fallback and a plain ``A``), the plain token is the canonical one,
then the lowest id, so the draft<->target tables are a bijection on the intersection (which
keeps the draft's own token list and the mapped target tokens interchangeable).

Tables are sized by the MODELS' vocab_size (embedding rows may exceed the tokenizer's ids:
padding rows map to -1). They are cached per tokenizer pair under
``$GRAPHSPEC_CACHE/vocab_maps/`` (default ``~/.cache/graphspec/vocab_maps/``) as ``.npz`` read
with ``allow_pickle=False``, keyed by both tokenizers' fingerprints and written atomically; a
cache file that cannot be read is rebuilt (with a warning), never trusted.

``ByteEncoder`` tokenizes raw bytes with one tokenizer so that the tokens spell exactly those
bytes (tokenizers that prepend a space to a fragment, incomplete UTF-8 at the end, invalid
bytes): the cross-vocabulary stages re-tokenize text with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from graphspec.models.tokenizer import byte_alphabet

__all__ = [
    "TokenizerFamily", "family_of", "normalize_token", "TokenTable", "token_table",
    "VocabMapping", "build_vocab_mapping", "ByteEncoder", "vocab_cache_dir",
    "SMALL_INTERSECTION_FRACTION", "SMALL_INTERSECTION_TOKENS",
]

_FORMAT_VERSION = 1

# Below either threshold the draft can propose too little of the target's text to pay off.
SMALL_INTERSECTION_FRACTION = 0.5
SMALL_INTERSECTION_TOKENS = 1000

# Token flags stored per id.
_NORMAL, _SPECIAL, _MISSING, _FALLBACK = 0, 1, 2, 3

_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


_UNICODE_TO_BYTE = {c: b for b, c in byte_alphabet().items()}


# ----------------------------------------------------------------------------- normalisation

@dataclass(frozen=True)
class TokenizerFamily:
    """How a tokenizer spells bytes in its token strings."""
    byte_level: bool = False      # GPT-2 byte-to-unicode characters
    metaspace: bool = False       # "▁" stands for a space
    byte_fallback: bool = False   # "<0xNN>" tokens stand for one byte
    continuing_prefix: str = ""   # WordPiece's "##": a word-internal piece (no space before it)


def _walk(node) -> Iterable[dict]:
    """Every component dict inside a tokenizer.json section (Sequence nests them)."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _backend(tokenizer):
    """The raw ``tokenizers.Tokenizer`` behind graphspec's Tokenizer (or the raw one itself)."""
    return getattr(tokenizer, "backend", tokenizer)


def family_of(tokenizer) -> TokenizerFamily:
    """Read the tokenizer family from its tokenizer.json (pre-tokenizer, decoder, model)."""
    spec = json.loads(_backend(tokenizer).to_str())
    parts = [spec.get("pre_tokenizer"), spec.get("decoder"), spec.get("normalizer")]
    types = [c.get("type") for c in _walk(parts)]
    model = spec.get("model") or {}
    metaspace = "Metaspace" in types
    for c in _walk([spec.get("decoder"), spec.get("normalizer")]):
        if c.get("type") == "Replace":
            pat = (c.get("pattern") or {}).get("String")
            if (pat, c.get("content")) in (("▁", " "), (" ", "▁")):
                metaspace = True
    return TokenizerFamily(
        byte_level="ByteLevel" in types,
        metaspace=metaspace,
        byte_fallback=bool(model.get("byte_fallback")) or "ByteFallback" in types,
        continuing_prefix=(model.get("continuing_subword_prefix") or "") if model.get("type") == "WordPiece" else "",
    )


def normalize_token(token: str, family: TokenizerFamily) -> tuple[bytes | None, bool]:
    """The bytes a vocabulary token stands for, and whether it is a byte-fallback token.

    Returns ``(None, False)`` for a byte-level token holding a character outside GPT-2's
    byte table (it cannot be expressed as bytes, so it is left out of the intersection).
    """
    if family.byte_fallback:
        m = _BYTE_FALLBACK_RE.match(token)
        if m:
            return bytes([int(m.group(1), 16)]), True
    if family.byte_level:
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in token), False
        except KeyError:
            return None, False
    if family.continuing_prefix and token.startswith(family.continuing_prefix) and len(token) > len(family.continuing_prefix):
        token = token[len(family.continuing_prefix):]
    if family.metaspace:
        token = token.replace("▁", " ")
    return token.encode("utf-8"), False


@dataclass
class TokenTable:
    """Per token id of one tokenizer: the bytes it spells and a flag (normal/special/missing/fallback)."""
    pieces: list[bytes]
    flags: np.ndarray  # int8 [n]

    def __len__(self) -> int:
        return len(self.pieces)

    def canonical(self) -> dict[bytes, int]:
        """bytes -> the one id that represents them (plain token before fallback, then lowest id).

        Computed once per table (a few hundred ms for a 150k vocabulary) and shared; do not mutate.
        """
        cached = self.__dict__.get("_canonical")
        if cached is not None:
            return cached
        out: dict[bytes, int] = {}
        fallback_held: set[bytes] = set()
        for i, (b, f) in enumerate(zip(self.pieces, self.flags.tolist())):
            if f == _SPECIAL or f == _MISSING or not b:
                continue
            if b not in out:
                out[b] = i
                if f == _FALLBACK:
                    fallback_held.add(b)
            elif b in fallback_held and f != _FALLBACK:
                out[b] = i
                fallback_held.discard(b)
        self.__dict__["_canonical"] = out
        return out

    def special_ids(self) -> set[int]:
        return set(np.nonzero(self.flags == _SPECIAL)[0].tolist())

    def join(self, ids: Iterable[int]) -> bytes:
        pieces = self.pieces
        n = len(pieces)
        return b"".join(pieces[i] if 0 <= i < n else b"" for i in ids)

    # npz round trip: the pieces as one uint8 buffer plus offsets (no pickled objects)
    def _arrays(self, prefix: str) -> dict[str, np.ndarray]:
        lengths = np.fromiter((len(p) for p in self.pieces), dtype=np.int64, count=len(self.pieces))
        offsets = np.zeros(len(self.pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = np.frombuffer(b"".join(self.pieces), dtype=np.uint8)
        return {f"{prefix}_data": data, f"{prefix}_offsets": offsets, f"{prefix}_flags": self.flags.astype(np.int8)}

    @classmethod
    def _from_arrays(cls, z, prefix: str) -> "TokenTable":
        data = z[f"{prefix}_data"].tobytes()
        offsets = z[f"{prefix}_offsets"].tolist()
        flags = z[f"{prefix}_flags"].astype(np.int8)
        if len(offsets) != len(flags) + 1 or offsets[0] != 0 or offsets[-1] != len(data):
            raise ValueError(f"inconsistent {prefix} token table")
        return cls([data[offsets[i]:offsets[i + 1]] for i in range(len(flags))], flags)


def token_table(tokenizer) -> TokenTable:
    """Normalise every id of ``tokenizer`` (graphspec Tokenizer or raw ``tokenizers.Tokenizer``) to bytes."""
    backend = _backend(tokenizer)
    family = family_of(tokenizer)
    n = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    special.update(getattr(tokenizer, "special_ids", ()) or ())
    pieces: list[bytes] = [b""] * n
    flags = np.full(n, _MISSING, dtype=np.int8)
    for tok, i in backend.get_vocab(with_added_tokens=True).items():
        if i >= n:
            continue
        if i in added:
            # Added tokens are matched and decoded as their raw content, not in the model's spelling.
            pieces[i] = added[i].content.encode("utf-8")
            flags[i] = _SPECIAL if i in special else _NORMAL
            continue
        b, is_fallback = normalize_token(tok, family)
        if b is None:
            continue
        pieces[i] = b
        flags[i] = _SPECIAL if i in special else (_FALLBACK if is_fallback else _NORMAL)
    return TokenTable(pieces, flags)


# ----------------------------------------------------------------------------- mapping tables

@dataclass
class VocabMapping:
    """Draft<->target id tables over the models' vocabularies, plus both token tables.

    ``draft_to_target[d]`` is the target id spelling the same bytes as draft id ``d`` (or -1);
    ``target_to_draft`` the reverse. On the intersection the two are inverse bijections.
    """
    draft_to_target: torch.Tensor   # int64 [draft vocab_size]
    target_to_draft: torch.Tensor   # int64 [target vocab_size]
    draft_tokens: TokenTable
    target_tokens: TokenTable
    key: str
    source: str = "built"           # "built" or "cache"
    seconds: float = 0.0            # time to build or load
    cache_path: Path | None = None
    _device_tables: dict = field(default_factory=dict, repr=False)

    @property
    def intersection_size(self) -> int:
        return int((self.draft_to_target >= 0).sum())

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_to_target.shape[0]

    @property
    def target_vocab_size(self) -> int:
        return self.target_to_draft.shape[0]

    def tables_on(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft_to_target, target_to_draft) on ``device``, copied once per device."""
        device = torch.device(device)
        key = str(device)
        if key not in self._device_tables:
            self._device_tables[key] = (self.draft_to_target.to(device), self.target_to_draft.to(device))
        return self._device_tables[key]

    def describe(self) -> str:
        d = self.draft_vocab_size
        return (f"vocabulary intersection: {self.intersection_size} tokens ({100.0 * self.intersection_size / max(d, 1):.1f}% "
                f"of the draft's {d}, target {self.target_vocab_size}); {self.source} in {self.seconds * 1e3:.1f} ms")


def _fingerprint(tokenizer) -> str:
    fp = getattr(tokenizer, "fingerprint", "") or ""
    if fp:
        return fp
    # A raw tokenizers.Tokenizer (or one built in memory): hash its full serialisation and specials.
    h = hashlib.sha256(_backend(tokenizer).to_str().encode("utf-8"))
    h.update(repr(sorted(getattr(tokenizer, "special_ids", ()) or ())).encode())
    return h.hexdigest()


def vocab_cache_dir() -> Path:
    """``$GRAPHSPEC_CACHE/vocab_maps`` (default ``~/.cache/graphspec/vocab_maps``)."""
    root = os.environ.get("GRAPHSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "graphspec")
    return Path(root) / "vocab_maps"


def _intersect(draft: TokenTable, target: TokenTable) -> tuple[np.ndarray, np.ndarray]:
    """Tables over the tokenizers' own ids (-1 where the bytes have no counterpart)."""
    d_canon = draft.canonical()
    t_canon = target.canonical()
    d2t = np.full(len(draft), -1, dtype=np.int64)
    t2d = np.full(len(target), -1, dtype=np.int64)
    if len(d_canon) > len(t_canon):
        pairs = [(d_canon[b], t) for b, t in t_canon.items() if b in d_canon]
    else:
        pairs = [(d, t_canon[b]) for b, d in d_canon.items() if b in t_canon]
    if pairs:
        d_ids, t_ids = np.array(pairs, dtype=np.int64).T
        d2t[d_ids] = t_ids
        t2d[t_ids] = d_ids
    return d2t, t2d


def _fit(table: np.ndarray, size: int, other_size: int) -> torch.Tensor:
    """Resize a tokenizer-sized table to the model's vocab_size; ids past the other model's rows drop out."""
    out = np.full(size, -1, dtype=np.int64)
    n = min(size, table.shape[0])
    out[:n] = table[:n]
    out[out >= other_size] = -1
    return torch.from_numpy(out)


def _save(path: Path, key: str, draft: TokenTable, target: TokenTable, d2t: np.ndarray, t2d: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"format_version": np.array([_FORMAT_VERSION], dtype=np.int64),
              "key": np.frombuffer(key.encode("ascii"), dtype=np.uint8),
              "draft_to_target": d2t, "target_to_draft": t2d}
    arrays.update(draft._arrays("draft"))
    arrays.update(target._arrays("target"))
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _load(path: Path, key: str):
    with np.load(path, allow_pickle=False) as z:
        version = int(z["format_version"][0])
        if version != _FORMAT_VERSION:
            raise ValueError(f"format version {version}, expected {_FORMAT_VERSION}")
        if z["key"].tobytes().decode("ascii") != key:
            raise ValueError("the file's key does not match its name")
        draft = TokenTable._from_arrays(z, "draft")
        target = TokenTable._from_arrays(z, "target")
        d2t = z["draft_to_target"].astype(np.int64)
        t2d = z["target_to_draft"].astype(np.int64)
    if d2t.shape != (len(draft),) or t2d.shape != (len(target),):
        raise ValueError("table sizes do not match the token tables")
    return draft, target, d2t, t2d


def build_vocab_mapping(draft_tokenizer, target_tokenizer, *, draft_vocab_size: int | None = None,
                        target_vocab_size: int | None = None, cache: bool = True,
                        cache_dir: str | os.PathLike | None = None) -> VocabMapping:
    """Build (or load from the cache) the draft<->target tables for two tokenizers.

    ``draft_vocab_size`` / ``target_vocab_size`` are the models' embedding rows (default: the
    tokenizers' sizes). Raises ValueError when the vocabularies share no token; warns when the
    intersection is small (< 50% of the draft's vocabulary or < 1000 tokens).
    """
    t0 = time.perf_counter()
    key = hashlib.sha256(f"graphspec-vocab-map-v{_FORMAT_VERSION}\0{_fingerprint(draft_tokenizer)}\0"
                         f"{_fingerprint(target_tokenizer)}".encode()).hexdigest()
    path = Path(cache_dir) / f"{key}.npz" if cache_dir is not None else vocab_cache_dir() / f"{key}.npz"
    loaded = None
    if cache and path.is_file():
        try:
            loaded = _load(path, key)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as e:
            warnings.warn(f"vocabulary map cache {path} is unreadable ({e}); rebuilding it", RuntimeWarning,
                          stacklevel=2)
    if loaded is not None:
        draft, target, d2t, t2d = loaded
        source = "cache"
    else:
        draft, target = token_table(draft_tokenizer), token_table(target_tokenizer)
        d2t, t2d = _intersect(draft, target)
        source = "built"
        if cache:
            try:
                _save(path, key, draft, target, d2t, t2d)
            except OSError as e:
                warnings.warn(f"could not write the vocabulary map cache {path}: {e}", RuntimeWarning, stacklevel=2)

    vd = len(draft) if draft_vocab_size is None else int(draft_vocab_size)
    vt = len(target) if target_vocab_size is None else int(target_vocab_size)
    for name, v in (("draft_vocab_size", vd), ("target_vocab_size", vt)):
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    mapping = VocabMapping(
        draft_to_target=_fit(d2t, vd, vt), target_to_draft=_fit(t2d, vt, vd),
        draft_tokens=draft, target_tokens=target, key=key, source=source,
        cache_path=path if cache else None,
    )
    # _fit may drop one side of a pair (an id past the other model's rows): keep the tables inverse.
    d2t_t, t2d_t = mapping.draft_to_target, mapping.target_to_draft
    valid_d = d2t_t >= 0
    back = torch.full_like(d2t_t, -1)
    back[valid_d] = t2d_t[d2t_t[valid_d]]
    d2t_t[back != torch.arange(vd)] = -1
    valid_t = t2d_t >= 0
    back_t = torch.full_like(t2d_t, -1)
    back_t[valid_t] = d2t_t[t2d_t[valid_t]]
    t2d_t[back_t != torch.arange(vt)] = -1
    mapping.seconds = time.perf_counter() - t0

    n = mapping.intersection_size
    if n == 0:
        raise ValueError("the draft and target tokenizers share no token (empty vocabulary intersection), so the "
                         "draft can propose nothing the target can verify; pick a draft whose tokenizer overlaps "
                         "the target's")
    # The absolute floor only flags a partial overlap: a tiny draft vocabulary that maps entirely is fine.
    draft_plain = int(((draft.flags[:vd] != _SPECIAL) & (draft.flags[:vd] != _MISSING)).sum())
    if n < SMALL_INTERSECTION_FRACTION * vd or (n < SMALL_INTERSECTION_TOKENS and n < draft_plain):
        warnings.warn(f"small vocabulary intersection: {n} of the draft's {vd} tokens have a counterpart in the "
                      f"target's vocabulary; expect a low acceptance rate", UserWarning, stacklevel=2)
    return mapping


# ----------------------------------------------------------------------------- byte-exact tokenization

def _utf8_runs(data: bytes) -> list[tuple[bool, int, int]]:
    """Split ``data`` into (valid, start, end) runs: valid UTF-8 text and single undecodable bytes."""
    runs = []
    pos, n = 0, len(data)
    while pos < n:
        try:
            data[pos:].decode("utf-8")
            runs.append((True, pos, n))
            break
        except UnicodeDecodeError as e:
            if e.start > 0:
                runs.append((True, pos, pos + e.start))
            bad_end = pos + max(e.end, e.start + 1)
            runs.append((False, pos + e.start, bad_end))
            pos = bad_end
    return runs


def _incomplete_tail(data: bytes) -> int:
    """Length of a UTF-8 character at the end of ``data`` that is begun but not finished (else 0)."""
    for k in range(1, min(3, len(data)) + 1):
        b = data[-k]
        if 0x80 <= b < 0xC0:
            continue  # continuation byte: keep looking for the lead byte
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return k if k < need else 0
        return 0
    return 0


class ByteEncoder:
    """Tokenize raw bytes so that the tokens spell exactly those bytes.

    The tokenizer's own encoding is used when it is byte-exact; a space it prepended to the
    fragment (Metaspace, add_prefix_space) is removed from the first token; anything else that
    does not spell the input (a normalizer, invalid UTF-8) falls back to a greedy longest match
    over the vocabulary's byte strings. Text that cannot be spelled at all (a word-level
    vocabulary without the word) keeps the tokenizer's best effort and is reported inexact.
    """

    def __init__(self, tokenizer, table: TokenTable, max_piece: int = 64):
        self._tokenizer = tokenizer
        self._table = table
        self._max_piece_limit = max_piece
        self._lookup: tuple[dict[bytes, int], int] | None = None  # built on first use

    @property
    def _by_bytes(self) -> dict[bytes, int]:
        return self._tables()[0]

    @property
    def _max_piece(self) -> int:
        return self._tables()[1]

    def _tables(self) -> tuple[dict[bytes, int], int]:
        if self._lookup is None:
            by_bytes = self._table.canonical()
            self._lookup = (by_bytes, min(self._max_piece_limit, max((len(b) for b in by_bytes), default=1)))
        return self._lookup

    def _tokenizer_encode(self, text: str) -> list[int]:
        backend = _backend(self._tokenizer)
        return list(backend.encode(text, add_special_tokens=False).ids)

    def _greedy(self, data: bytes) -> list[int] | None:
        out, pos, n = [], 0, len(data)
        by_bytes, max_piece = self._tables()
        while pos < n:
            for length in range(min(max_piece, n - pos), 0, -1):
                i = by_bytes.get(data[pos:pos + length])
                if i is not None:
                    out.append(i)
                    pos += length
                    break
            else:
                return None
        return out

    def _encode_text(self, data: bytes) -> tuple[list[int], bool]:
        ids = self._tokenizer_encode(data.decode("utf-8"))
        got = self._table.join(ids)
        if got == data:
            return ids, True
        if ids and got == b" " + data:
            first = self._table.pieces[ids[0]]
            if first == b" ":
                return ids[1:], True
            head = self._greedy(first[1:]) if first.startswith(b" ") else None
            if head is not None:  # respell only the first token; the rest keeps the tokenizer's merges
                return head + ids[1:], True
        greedy = self._greedy(data)
        if greedy is not None:
            return greedy, True
        return ids, False

    def encode(self, data: bytes, final: bool = True) -> tuple[list[int], int, bool]:
        """Tokens for ``data``: ``(ids, bytes consumed, exact)``.

        With ``final=False`` an incomplete UTF-8 character at the very end is left unconsumed
        (the next call, with more bytes, completes it).
        """
        ids: list[int] = []
        exact = True
        consumed = len(data) if final else len(data) - _incomplete_tail(data)
        runs = _utf8_runs(data[:consumed])
        for valid, s, e in runs:
            if valid:
                part, ok = self._encode_text(data[s:e])
            else:
                part = self._greedy(data[s:e])
                ok = part is not None
                part = part or []
            ids.extend(part)
            exact = exact and ok
        return ids, consumed, exact
