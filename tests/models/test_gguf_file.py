"""graphspec's own GGUF reader (models/gguf_file.py): the same fields and tensor bytes as the gguf package's
reader on files the gguf package wrote, and one clear ValueError for every broken or hostile file."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from graphspec.models.gguf_file import read_gguf
from tests.models.test_gguf import write_tiny_gguf

Q = gguf.GGMLQuantizationType


def _same_as_gguf_package(path):
    ours = read_gguf(path)
    ref = gguf.GGUFReader(path, "r")
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == want.keys()
    for key, value in want.items():
        mine = ours.fields[key]
        if isinstance(mine, list) and mine and isinstance(mine[0], list):
            mine = [x for inner in mine for x in inner]  # the gguf package flattens arrays of arrays
        assert mine == value, key
        assert type(mine) is type(value), key
    theirs = {t.name: t for t in ref.tensors}
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t in ours.tensors:
        u = theirs[t.name]
        assert t.tensor_type == u.tensor_type
        assert list(t.shape) == [int(d) for d in u.shape]
        assert (t.n_elements, t.n_bytes, t.data_offset) == (int(u.n_elements), int(u.n_bytes), int(u.data_offset))
        assert t.data.dtype == u.data.dtype and t.data.shape == u.data.shape
        assert np.array_equal(t.data, u.data), t.name
        assert not t.data.flags.writeable
    return ours


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_read_as_the_gguf_package_reads_them(tmp_path, arch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch)
    got = _same_as_gguf_package(path)
    assert got.version == 3 and got.fields["general.architecture"] == arch
    assert len(got.fields["tokenizer.ggml.tokens"]) > 0


def _every_kind(path, alignment=None):
    """A file with every metadata type (nested arrays included) and tensors of plain and block types."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü" * 40])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    block, nbytes = gguf.GGML_QUANT_SIZES[Q.Q4_K]
    w.add_tensor("q4k", rng.integers(0, 256, (3, 2 * nbytes), dtype=np.uint8), raw_dtype=Q.Q4_K)
    block, nbytes = gguf.GGML_QUANT_SIZES[Q.Q8_0]
    w.add_tensor("q8", rng.integers(0, 256, (2, 3, 4 * nbytes), dtype=np.uint8), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind(tmp_path, alignment):
    path = tmp_path / "kinds.gguf"
    _every_kind(path, alignment)
    got = _same_as_gguf_package(path)
    assert got.fields["t.nested"] == [[1, 2], [3]] and got.fields["t.bools"] == [True, False, True]
    assert got.fields["t.str"] == "héllo ✓" and got.fields["t.true"] is True
    assert got.alignment == (alignment or 32) and got.data_start % got.alignment == 0
    q8 = {t.name: t for t in got.tensors}["q8"]
    assert q8.shape == (128, 3, 2) and q8.data.shape == (2, 3, 4 * 34)


# --- broken and hostile files ------------------------------------------------------------------------------


def test_every_truncation_is_a_value_error(tmp_path):
    src = tmp_path / "kinds.gguf"
    _every_kind(src)
    data = src.read_bytes()
    tensors_end = read_gguf(src).tensors[-1]
    end = tensors_end.data_offset + tensors_end.n_bytes
    cut = tmp_path / "cut.gguf"
    # every prefix of the header and tables, and a few inside the tensor data
    for n in [*range(0, read_gguf(src).data_start + 1), end - 1, end - 100]:
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="truncated|not a GGUF"):
            read_gguf(cut)


def _header(version=3, n_tensors=0, n_fields=0):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_fields)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _kv(key: bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tensor(name=b"w", dims=(32,), qtype=0, offset=0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack(
        "<IQ", qtype, offset)


def _file(tmp_path, fields=(), tensors=(), data=b"", pad=True) -> str:
    body = _header(n_tensors=len(tensors), n_fields=len(fields)) + b"".join(fields) + b"".join(tensors)
    if pad:
        body += b"\0" * (-len(body) % 32)
    path = tmp_path / "bad.gguf"
    path.write_bytes(body + data)
    return path


@pytest.mark.parametrize("fields, tensors, data, match", [
    # lengths and counts sized by the file, never allocated
    ([struct.pack("<Q", 2**62) + b"key"], [], b"", "metadata key 0 needs"),
    ([_kv(b"k", 8, struct.pack("<Q", 2**40) + b"abc")], [], b"", "needs .* bytes"),
    ([_kv(b"k", 9, struct.pack("<IQ", 4, 2**60))], [], b"", "declares .* elements"),
    ([_kv(b"k", 9, struct.pack("<IQ", 8, 2**60))], [], b"", "declares .* strings"),
    ([_kv(b"k", 9, struct.pack("<IQ", 9, 2**60))], [], b"", "declares .* arrays"),
    ([_kv(b"k", 9, struct.pack("<IQ", 8, 2) + _s(b"a") + struct.pack("<Q", 99))], [], b"", "item 1"),
    # types and values
    ([_kv(b"k", 13, b"\0" * 8)], [], b"", "value type 13"),
    ([_kv(b"k", 9, struct.pack("<IQ", 77, 1) + b"\0" * 8)], [], b"", "element type 77"),
    ([_kv(b"k", 8, _s(b"\xff\xfe"))], [], b"", "not UTF-8"),
    ([_kv(b"k", 9, struct.pack("<IQ", 8, 1) + _s(b"\xc3"))], [], b"", "not UTF-8"),
    ([_kv(b"k", 4, b"\1\0\0\0"), _kv(b"k", 4, b"\2\0\0\0")], [], b"", "appears twice"),
    ([_kv(b"k", 9, struct.pack("<IQ", 9, 1) * 5 + struct.pack("<IQ", 4, 0))], [], b"\0" * 64, "deeper"),
    ([_kv(b"general.alignment", 4, struct.pack("<I", 24))], [], b"", "power of two"),
    # the tensor table
    ([], [_tensor(dims=())], b"\0" * 128, "1 to 4"),
    ([], [_tensor(dims=(1, 1, 1, 1, 1))], b"\0" * 128, "1 to 4"),
    ([], [_tensor(dims=(32, 0))], b"\0" * 128, "every dimension"),
    ([], [_tensor(qtype=1234)], b"\0" * 128, "type number 1234"),
    ([], [_tensor(dims=(33,), qtype=int(Q.Q8_0))], b"\0" * 128, "whole blocks of 32"),
    ([], [_tensor(offset=8)], b"\0" * 256, "not a multiple of the alignment"),
    ([], [_tensor(dims=(64,))], b"\0" * 128, "truncated: tensor 'w'"),
    ([], [_tensor(dims=(2**39, 2**39))], b"\0" * 128, "truncated: tensor 'w'"),
    ([], [_tensor(), _tensor(offset=128)], b"\0" * 512, "appears twice"),
])
def test_broken_files_raise_one_clear_value_error(tmp_path, fields, tensors, data, match):
    with pytest.raises(ValueError, match=match):
        read_gguf(_file(tmp_path, fields, tensors, data))


def test_counts_larger_than_the_file_are_refused_before_reading(tmp_path):
    path = tmp_path / "count.gguf"
    path.write_bytes(_header(n_fields=2**50) + b"\0" * 64)
    with pytest.raises(ValueError, match="metadata count"):
        read_gguf(path)
    path.write_bytes(_header(n_tensors=2**50) + b"\0" * 64)
    with pytest.raises(ValueError, match="tensor count"):
        read_gguf(path)


def test_a_well_formed_hand_made_file_reads(tmp_path):
    """The builder above makes files the reader accepts: the error cases differ from it in one part each."""
    f32 = np.arange(32, dtype=np.float32)
    got = read_gguf(_file(tmp_path, [_kv(b"k", 8, _s(b"v"))], [_tensor()], f32.tobytes()))
    assert got.fields == {"k": "v"}
    assert np.array_equal(got.tensors[0].data, f32)


def test_not_gguf_and_versions(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)
    path.write_bytes(_header(version=1) + b"\0" * 64)
    with pytest.raises(ValueError, match="version 1"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + struct.pack(">I", 3) + b"\0" * 64)
    with pytest.raises(ValueError, match="big-endian"):
        read_gguf(path)
    with pytest.raises(ValueError, match="is not a file"):
        read_gguf(tmp_path / "missing.gguf")


def test_random_corruption_is_read_or_refused_with_a_value_error(tmp_path):
    """Bytes of the header and tables overwritten at random (a seeded sweep): the reader either reads the file or
    raises ValueError; never another exception, never a hang or an allocation the file does not back."""
    src = tmp_path / "kinds.gguf"
    _every_kind(src)
    data = bytearray(src.read_bytes())
    head = read_gguf(src).data_start
    rng = np.random.default_rng(0)
    bad = tmp_path / "mutated.gguf"
    refused = 0
    for _ in range(400):
        mutated = bytearray(data)
        for pos in rng.integers(4, head, size=int(rng.integers(1, 4))):
            mutated[pos] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(mutated))
        try:
            read_gguf(bad)
        except ValueError:
            refused += 1
    assert refused > 100  # most corruptions of lengths, types and counts are caught
