"""Linear layers on GGUF block-quantized weights, kept in memory as the file stores them.

- :class:`BlockWeight` holds one ``[N, K]`` GGUF tensor's bytes unchanged: ``blocks`` is uint8
  ``[N, K / block_size * type_size]``, each weight row a run of whole blocks (GGUF tensors are
  row-major with K the fastest axis and K a multiple of the block size). Formats: the legacy
  blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), the k-quants' super-blocks of 256 (Q4_K, Q5_K,
  Q6_K), and F32 / F16 / BF16 (a "block" of one value) for the small tensors a quantized file
  keeps in float.
- Each weight's value is what ``gguf.quants.dequantize`` defines, op for op in fp32 (for
  example Q4_K: ``(d * sc) * q - dmin * m``, each product and the difference rounded once, no
  fused multiply-add), so :func:`dequantize_ref` (torch) is bit-identical to the gguf package's
  numpy code, and so is the dequantization inside the C++ GEMM (``kernels/cpu/qgemm.cpp``).
- ``linear`` (``graphspec.kernels.linear``) dispatches a BlockWeight here: activations are fp32
  and stay fp32; on the CPU the C++ GEMM of the level in force (avx512, avx2, generic) sums
  each output in one fixed order whatever the number of rows and threads, so a row's result is
  bit-identical alone and inside a verify; at the torch level :func:`qlinear_ref`
  (dequantize, then an fp32 matmul). On CUDA (or backend="triton") the Triton kernels of
  :func:`qlinear_triton` runs: each program dequantizes its ``[BLOCK_N, BLOCK_K]`` weight tile in registers
  from the blocks' bytes (the same fp32 operations, fp fusion off) and multiplies it with fp32 ``tl.dot``
  (ieee precision), fp32 accumulation; a skinny launch (one 16-row tile over M, decode and verify) and a
  tiled one (prefill).
- Activations rounded to int8 (``BlockWeight(..., activations="int8")``, ``weights="gguf-a8"``): the
  k-quants (:data:`A8_TYPES`) then compute as llama.cpp does, each row of x rounded to int8 per super-block
  of 256 (``dx = max|x| / 127``, ``q = round-half-even(x * 127 / max|x|)``: :func:`quantize_activations_ref`)
  and multiplied with the blocks' integer quants in integer arithmetic, then scaled in fp32
  (``kernels/cpu/qgemm.cpp``, "a8"; the oracle is :func:`qlinear_a8_ref`). The weights are still the GGUF's
  values; the activations are not x, so this is a different model from the exact one, by the rounding of x
  (about 0.4% of each super-block's largest value). Rows stay exact (a row's bits do not depend on the row
  count, the threads or the level), so speculation on it stays lossless. Other formats ignore the setting
  and compute with fp32 activations. CPU only. Such a weight is kept as :func:`pack_a8`'s 16-row tiles once
  packed (:meth:`BlockWeight.pack`; the GGUF loader packs at load), the layout the kernel reads.
- :class:`StackedWeight` is several weights stacked along N (a fused q/k/v or gate/up whose
  parts a file stores in different formats): each part runs on its own, outputs concatenated.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphspec.kernels import cpu
from graphspec.kernels._dispatch import interpreter_enabled, use_triton

__all__ = ["A8_TYPES", "ACTIVATIONS", "FORMATS", "BlockWeight", "StackedWeight", "dequantize_ref", "qlinear",
           "qlinear_a8_ref", "qlinear_ref", "quantize_activations_ref"]

FORMATS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip
"""ggml type name -> (weights per block, bytes per block), as ggml's GGML_QUANT_SIZES."""

A8_TYPES = ("Q4_K", "Q5_K", "Q6_K")
"""The formats that take int8 activations where a weight asks for them (``activations="int8"``)."""

ACTIVATIONS = ("fp32", "int8")

TYPE_IDS = {name: i for i, name in enumerate(FORMATS)}
"""The type numbers the C++ GEMM takes (its own enum, in this order)."""


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 in two uint8 columns -> fp32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles of all n bytes, then the high nibbles (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _u32(b: torch.Tensor) -> torch.Tensor:
    b = b.long()
    return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def _bits32(b: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes of a little-endian uint32 -> [nb, 32] its bits, bit 0 first."""
    return ((_u32(b)[:, None] >> torch.arange(32, device=b.device)) & 1).to(torch.uint8)


def _k_scale_min_u8(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, uint8 (ggml's get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_low4(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 128 bytes -> [nb, 8, 32]: sub-block 2i the low nibbles of bytes 32i.., 2i+1 their high ones."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)


def dequantize_ref(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``blocks`` (uint8 ``[..., n * type_size]``) of type ``type_name``, 1-d.

    Bit-identical to ``gguf.quants.dequantize`` (tests/kernels/test_qlinear.py): the same fp32
    operations in the same order.
    """
    if type_name not in FORMATS:
        raise ValueError(f"type {type_name!r} is not a block format graphspec runs; supported: {list(FORMATS)}")
    size, nbytes = FORMATS[type_name]
    if blocks.dtype != torch.uint8 or blocks.numel() % nbytes:
        raise ValueError(f"{type_name} blocks must be uint8 with a multiple of {nbytes} bytes, got "
                         f"{blocks.dtype} with {blocks.numel()} bytes")
    b = blocks.reshape(-1, nbytes)
    if type_name == "F32":
        return b.contiguous().view(torch.float32).reshape(-1).clone()
    if type_name == "F16":
        return b.contiguous().view(torch.float16).float().reshape(-1)
    if type_name == "BF16":
        return b.contiguous().view(torch.bfloat16).float().reshape(-1)
    if type_name == "Q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).float()
        return (q * _f16(b[:, 0:2])).reshape(-1)
    if type_name == "Q4_0":
        q = _nibbles(b[:, 2:18]).float() - 8.0
        return (_f16(b[:, 0:2]) * q).reshape(-1)
    if type_name == "Q4_1":
        q = _nibbles(b[:, 4:20]).float()
        return (_f16(b[:, 0:2]) * q + _f16(b[:, 2:4])).reshape(-1)
    if type_name == "Q5_0":
        q = (_nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)).float() - 16.0
        return (_f16(b[:, 0:2]) * q).reshape(-1)
    if type_name == "Q5_1":
        q = (_nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)).float()
        return (_f16(b[:, 0:2]) * q + _f16(b[:, 2:4])).reshape(-1)
    q, sc, mn, d, dmin = _k_quants(type_name, b)  # the k-quants: integers first, then gguf's fp32 operations
    if type_name in ("Q4_K", "Q5_K"):
        ds = (_f16(d) * sc.float())[:, :, None]
        dm = (_f16(dmin) * mn.float())[:, :, None]
        return (ds * q.reshape(-1, 8, 32).float() - dm).reshape(-1)
    ds = (_f16(d) * sc.contiguous().view(torch.int8).float())[:, :, None]
    return (ds * (q.float() - 32.0).reshape(-1, 16, 16)).reshape(-1)


A8_TILE_ROWS = 16
"""Weight rows a tile of :func:`pack_a8` interleaves."""

A8_TILE_BYTES = {"Q4_K": 2368, "Q5_K": 2880, "Q6_K": 3360}
"""Bytes of one tile (16 weight rows of one super-block of 256) per format."""


def _k_quants(type_name: str, b: torch.Tensor):
    """k-quant super-blocks ``b`` ([nb, type_size] uint8) -> their fields as integers: the quants q ([nb, 256] uint8,
    in weight order: 0..15, 0..31 or 0..63), the scales ([nb, 8] uint8 six-bit, or Q6_K [nb, 16] int8 bytes), the
    mins ([nb, 8] or None), and the fp16 bytes of d and dmin ([nb, 2] each; dmin None for Q6_K)."""
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min_u8(b[:, 4:16])
        if type_name == "Q4_K":
            q = _k_low4(b[:, 16:144])
        else:
            qh = b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
            q = _k_low4(b[:, 48:176]) | ((qh & 1) << 4)
        return q.reshape(-1, 256), sc, mn, b[:, 0:2], b[:, 2:4]
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
    qh = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts[None, None, :, None]) & 3).reshape(-1, 8, 32)
    return (ql | (qh << 4)).reshape(-1, 256), b[:, 192:208], None, b[:, 208:210], None


def _k_encode(type_name: str, q, sc, mn, d, dmin) -> torch.Tensor:
    """The inverse of :func:`_k_quants`: the super-blocks' bytes, as the GGUF file holds them."""
    nb = q.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        scales = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], dim=1)
        low = (q & 0x0F).reshape(nb, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
        parts = [d, dmin, scales]
        if type_name == "Q5_K":
            hb = (q >> 4).reshape(nb, 8, 32)
            qh = torch.zeros(nb, 32, dtype=torch.uint8, device=q.device)
            for i in range(8):
                qh |= hb[:, i] << i
            parts.append(qh)
        return torch.cat(parts + [qs], dim=1)
    qv = q.reshape(nb, 2, 128)
    ql = ((qv[:, :, :64] & 0x0F) | ((qv[:, :, 64:] & 0x0F) << 4)).reshape(nb, 128)
    hh = (qv >> 4).reshape(nb, 2, 4, 32)
    qh = torch.zeros(nb, 2, 32, dtype=torch.uint8, device=q.device)
    for t in range(4):
        qh |= hh[:, :, t] << (2 * t)
    return torch.cat([ql, qh.reshape(nb, 64), sc, d], dim=1)


@functools.cache  # unpack_a8 runs on every embedding lookup of a packed tied embedding: build it once
def _a8_order(type_name: str) -> torch.Tensor:
    """Where each byte of a tile comes from in the plain layout (all low-nibble runs, the high runs, the scales
    [sub-block][row], the mins, d, dmin): the tile stores its runs and scales in the order the C++ kernels read them
    (sub-block pair by pair: one sequential stream per tile row), as kernels/cpu/qgemm.cpp's nib_off / high_off /
    sc_off place them."""
    tb = A8_TILE_BYTES[type_name]
    order = torch.empty(tb, dtype=torch.long)

    def put(new: int, old: int, size: int) -> None:
        order[new:new + size] = torch.arange(old, old + size)

    if type_name == "Q6_K":
        for j in range(32):
            put(832 * ((j % 16) // 4) + 256 * (j // 16) + 64 * (j % 4), 64 * j, 64)
        for h in range(16):
            put(832 * (h // 4) + 512 + 64 * (h % 4), 2048 + 64 * h, 64)
        for g in range(16):
            put(832 * (g % 4) + 768 + 16 * (0, 2, 1, 3)[g // 4], 3072 + 16 * g, 16)
        put(3328, 3328, 32)
        return order
    base = 512 if type_name == "Q5_K" else 0
    for h in range(8 if type_name == "Q5_K" else 0):
        put(64 * h, 2048 + 64 * h, 64)
    for j in range(32):
        put(base + 544 * (j // 8) + 64 * (j % 8), 64 * j, 64)
    for sb in range(8):
        put(base + 544 * (sb % 4) + 512 + 16 * (sb // 4), base + 2048 + 16 * sb, 16)
    put(base + 2176, base + 2176, 192)  # the mins, d and dmin, where the plain layout has them
    return order


@functools.cache
def _a8_unorder(type_name: str) -> torch.Tensor:
    """The inverse of :func:`_a8_order`: where each byte of the plain layout lies in a tile."""
    return torch.argsort(_a8_order(type_name))


def pack_a8(type_name: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A k-quant weight's GGUF bytes (``[n, row_bytes]``) -> the tiles the C++ int8-activation GEMM reads
    (``kernels/cpu/qgemm.cpp``, "a8"): uint8 ``[ceil(n / 16), k / 256 * A8_TILE_BYTES[type]]``, lossless
    (:func:`unpack_a8` gives the bytes back).

    Tile (g, b) holds super-block b of weight rows 16g .. 16g + 15 (rows past n are zeros), decoded and
    interleaved: 32 runs of 64 bytes, run j byte 4r + i holding weight 4j + i of row r in its low nibble and
    weight 128 + 4j + i in its high nibble (the quants' low 4 bits); Q5_K then 8 runs of 64 bytes, bit t of run h
    the fifth bit of quad h + 8t; Q6_K 16 runs, bits 2t, 2t + 1 of run h the top two bits of quad h + 16t (quad J:
    weights 4J .. 4J + 3); then the scales [sub-block][row] (Q6_K's 16 int8 ones), Q4_K / Q5_K the mins
    [pair p][row][sub-block 2p, 2p + 1], and the rows' d (fp16), then dmin. The runs and scales are then
    reordered into the order the kernel reads them (:func:`_a8_order`).
    """
    if type_name not in A8_TILE_BYTES:
        raise ValueError(f"int8 activations run {list(A8_TILE_BYTES)}, not {type_name!r}")
    if blocks.device.type == "cpu" and cpu.available():  # the same bytes, in C++ (a 1.5B model in seconds)
        return cpu.qops().pack_a8(blocks.contiguous(), TYPE_IDS[type_name], n, k)
    return pack_a8_ref(type_name, blocks, n, k)


def pack_a8_ref(type_name: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`pack_a8` in torch: the reference its C++ form is tested against, and the torch level's."""
    nsb, ts = k // 256, FORMATS[type_name][1]
    g = -(-n // A8_TILE_ROWS)
    pad = g * A8_TILE_ROWS - n
    q, sc, mn, d, dmin = _k_quants(type_name, blocks.reshape(n * nsb, ts))

    def tiled(t: torch.Tensor) -> torch.Tensor:  # [n * nsb, w] -> [g, nsb, 16, w], zero rows past n
        t = t.reshape(n, nsb, -1)
        if pad:
            t = torch.cat([t, t.new_zeros(pad, nsb, t.shape[-1])])
        return t.reshape(g, A8_TILE_ROWS, nsb, -1).transpose(1, 2)

    qq = tiled(q).reshape(g, nsb, A8_TILE_ROWS, 64, 4).permute(0, 1, 3, 2, 4)  # [g, nsb, quad, row, 4]
    low = qq & 0x0F
    parts = [(low[:, :, :32] | (low[:, :, 32:] << 4)).reshape(g, nsb, 2048)]
    if type_name != "Q4_K":
        bits, runs = (1, 8) if type_name == "Q5_K" else (2, 16)
        hb = (qq >> 4).reshape(g, nsb, 64 // runs, runs, A8_TILE_ROWS, 4)
        qh = torch.zeros(g, nsb, runs, A8_TILE_ROWS, 4, dtype=torch.uint8, device=blocks.device)
        for t in range(64 // runs):
            qh |= hb[:, :, t] << (bits * t)
        parts.append(qh.reshape(g, nsb, runs * 64))
    parts.append(tiled(sc).transpose(2, 3).reshape(g, nsb, -1))
    if mn is not None:
        parts.append(tiled(mn).reshape(g, nsb, A8_TILE_ROWS, 4, 2).permute(0, 1, 3, 2, 4).reshape(g, nsb, 128))
    parts.append(tiled(d).reshape(g, nsb, 32))
    if dmin is not None:
        parts.append(tiled(dmin).reshape(g, nsb, 32))
    tiles = torch.cat(parts, dim=2)[..., _a8_order(type_name).to(blocks.device)]
    return tiles.reshape(g, nsb * A8_TILE_BYTES[type_name]).contiguous()


def unpack_a8(type_name: str, tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_a8`: the GGUF bytes ``[n, row_bytes]`` of the first ``n`` rows ``tiles``
    hold."""
    nsb, tb = k // 256, A8_TILE_BYTES[type_name]
    g = tiles.numel() // (nsb * tb)
    t = tiles.reshape(g, nsb, tb)[..., _a8_unorder(type_name).to(tiles.device)]
    nib = t[..., :2048].reshape(g, nsb, 32, A8_TILE_ROWS, 4)
    q = torch.cat([nib & 0x0F, nib >> 4], dim=2)  # [g, nsb, quad, row, 4]
    off = 2048
    if type_name != "Q4_K":
        bits, runs = (1, 8) if type_name == "Q5_K" else (2, 16)
        h = t[..., off:off + runs * 64].reshape(g, nsb, runs, A8_TILE_ROWS, 4)
        mask = (1 << bits) - 1
        hb = torch.stack([(h >> (bits * s)) & mask for s in range(64 // runs)], dim=2)
        q = q | (hb.reshape(g, nsb, 64, A8_TILE_ROWS, 4) << 4)
        off += runs * 64

    def rows(x: torch.Tensor) -> torch.Tensor:  # [g, nsb, 16, w] -> [n * nsb, w]
        return x.transpose(1, 2).reshape(g * A8_TILE_ROWS, nsb, -1)[:n].reshape(n * nsb, -1)

    q = rows(q.permute(0, 1, 3, 2, 4).reshape(g, nsb, A8_TILE_ROWS, 256))
    nsc = 16 if type_name == "Q6_K" else 8
    sc = rows(t[..., off:off + 16 * nsc].reshape(g, nsb, nsc, A8_TILE_ROWS).transpose(2, 3))
    off += 16 * nsc
    mn = dmin = None
    if type_name != "Q6_K":
        mn = rows(t[..., off:off + 128].reshape(g, nsb, 4, A8_TILE_ROWS, 2).permute(0, 1, 3, 2, 4)
                  .reshape(g, nsb, A8_TILE_ROWS, 8))
        off += 128
    d = rows(t[..., off:off + 32].reshape(g, nsb, A8_TILE_ROWS, 2))
    if type_name != "Q6_K":
        dmin = rows(t[..., off + 32:off + 64].reshape(g, nsb, A8_TILE_ROWS, 2))
    return _k_encode(type_name, q, sc, mn, d, dmin).reshape(n, nsb * FORMATS[type_name][1])


class BlockWeight:
    """A ``[N, K]`` weight in a GGUF block format, its bytes as the file holds them (see the module docstring).

    ``linear`` accepts it wherever it accepts a weight tensor; activations are fp32 (``dtype``). ``dense()``
    gives the fp32 values (the dequantized model), ``rows(ids)`` some of them (an embedding lookup).

    With int8 activations (:attr:`int8_activations`) the weight is kept as :func:`pack_a8`'s tiles instead, from
    :meth:`pack` (the loaders call it; the first product does otherwise) on: the same bytes rearranged, so
    ``blocks`` then unpacks them (a copy) and ``rows`` unpacks only the tiles it needs.
    """

    __slots__ = ("type", "_blocks", "_tiles", "shape", "dtype", "device", "activations", "_native")

    def __init__(self, type_name: str, blocks: torch.Tensor, shape, activations: str = "fp32"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r} is not one of {ACTIVATIONS}")
        if type_name not in FORMATS:
            raise ValueError(f"type {type_name!r} is not a block format graphspec runs; supported: {list(FORMATS)}")
        shape = torch.Size(shape)
        if len(shape) != 2:
            raise ValueError(f"a BlockWeight is 2-d ([N, K]), got shape {tuple(shape)}")
        size, nbytes = FORMATS[type_name]
        n, k = shape
        if k % size:
            raise ValueError(f"a {type_name} weight needs K a multiple of {size}, got shape {tuple(shape)}")
        row_bytes = k // size * nbytes
        if blocks.dtype != torch.uint8 or blocks.numel() != n * row_bytes:
            raise ValueError(f"a {type_name} weight of shape {tuple(shape)} is {n * row_bytes} uint8 bytes, got "
                             f"{blocks.dtype} with {blocks.numel()} elements")
        self.type = type_name
        self._blocks = blocks.reshape(n, row_bytes).contiguous()
        self._tiles = None
        self.shape = shape
        self.dtype = torch.float32
        self.device = blocks.device
        self.activations = activations
        self._native = {}

    @property
    def ndim(self) -> int:
        return 2

    def native(self, level: str | None = None):
        """This weight as the C++ ``BlockLinear`` of ``level`` (default: the level in force; a C++ level), which
        the C++ forward (``graphspec.kernels.cpu.block_model``) takes: its own bytes (the tiles once packed), not
        a copy; made once per level."""
        return _native_linear(self, [self], level)

    @property
    def int8_activations(self) -> bool:
        """Whether this weight's products round x to int8 (asked for, and a format that does)."""
        return self.activations == "int8" and self.type in A8_TYPES

    @property
    def blocks(self) -> torch.Tensor:
        """The GGUF bytes, uint8 ``[N, row_bytes]`` (unpacked from the tiles, a copy, once packed)."""
        if self._blocks is None:
            return unpack_a8(self.type, self._tiles, self.shape[0], self.shape[1])
        return self._blocks

    @property
    def tiles(self) -> torch.Tensor:
        """:func:`pack_a8`'s tiles of an int8-activation weight on the CPU (packed now if not yet)."""
        self.pack()
        return self._tiles

    def pack(self) -> "BlockWeight":
        """Rearrange an int8-activation CPU weight into :func:`pack_a8`'s tiles, the layout its GEMM reads, and
        drop the GGUF layout (nothing is lost: ``blocks`` unpacks it). Others are left as they are."""
        blocks = self._blocks  # read once: another thread may pack at the same time (the tiles are set first)
        if self._tiles is None and blocks is not None and self.int8_activations and self.device.type == "cpu":
            self._tiles = pack_a8(self.type, blocks, self.shape[0], self.shape[1])
            self._blocks = None
        return self

    @property
    def nbytes(self) -> int:
        return (self._blocks if self._blocks is not None else self._tiles).numel()

    def dense(self) -> torch.Tensor:
        return dequantize_ref(self.type, self.blocks).reshape(self.shape)

    def _row_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """The GGUF bytes of rows ``flat`` (1-d int64)."""
        if self._blocks is not None:
            return self._blocks[flat]
        tiles = self._tiles[torch.div(flat, A8_TILE_ROWS, rounding_mode="floor")]
        got = unpack_a8(self.type, tiles, tiles.shape[0] * A8_TILE_ROWS, self.shape[1])
        return got[torch.arange(flat.numel(), device=flat.device) * A8_TILE_ROWS + flat % A8_TILE_ROWS]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 values of the weight rows ``ids`` (any shape of int64): ``[*ids.shape, K]``."""
        flat = ids.reshape(-1)
        return dequantize_ref(self.type, self._row_blocks(flat)).reshape(*ids.shape, self.shape[1])

    def select(self, ids: torch.Tensor) -> "BlockWeight":
        """The weight restricted to rows ``ids`` (1-d), still in blocks (and packed again if this one was)."""
        w = BlockWeight(self.type, self._row_blocks(ids), (ids.numel(), self.shape[1]), self.activations)
        return w.pack() if self._tiles is not None else w

    def __repr__(self) -> str:
        act = ", activations=int8" if self.int8_activations else ""
        return f"BlockWeight({self.type}, shape={tuple(self.shape)}{act})"


class StackedWeight:
    """Weights stacked along N (``[sum N_i, K]``), each a BlockWeight; ``linear`` runs each and concatenates."""

    __slots__ = ("parts", "shape", "dtype", "device", "_native")

    def __init__(self, parts):
        parts = list(parts)
        if not parts or any(not isinstance(p, BlockWeight) for p in parts):
            raise ValueError("a StackedWeight stacks one or more BlockWeights")
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError(f"stacked weights must share K, got {[tuple(p.shape) for p in parts]}")
        self.parts = parts
        self.shape = torch.Size((sum(p.shape[0] for p in parts), k))
        self.dtype = torch.float32
        self.device = parts[0].device
        self._native = {}

    @property
    def ndim(self) -> int:
        return 2

    def native(self, level: str | None = None):
        """The parts as one C++ ``BlockLinear`` of ``level`` (see :meth:`BlockWeight.native`)."""
        return _native_linear(self, self.parts, level)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts])

    def __repr__(self) -> str:
        return f"StackedWeight({', '.join(repr(p) for p in self.parts)})"


def _native_linear(owner, parts, level):
    """``owner``'s BlockLinear of ``level`` over ``parts``, kept on the owner (rebuilt if a part's bytes were
    replaced, as ``pack`` does)."""
    level = cpu.level() if level is None else level
    if level == "torch" or owner.device.type != "cpu":
        raise ValueError(f"{owner!r}: the C++ block forward runs at a C++ level on the CPU, not at {level!r} on "
                         f"{owner.device.type}")
    for p in parts:
        p.pack()
    data = [p._tiles if p.int8_activations else p.blocks for p in parts]
    key = tuple(id(t) for t in data)
    found = owner._native.get(level)
    if found is None or found[0] != key:
        obj = cpu.qclasses(level).BlockLinear(data, [TYPE_IDS[p.type] for p in parts], [p.shape[0] for p in parts],
                                              [int(p.int8_activations) for p in parts], owner.shape[1])
        found = owner._native[level] = (key, obj)
    return found[1]


def stack(parts) -> BlockWeight | StackedWeight:
    """``parts`` (BlockWeights sharing K) stacked along N: neighbours of one format become one BlockWeight (their
    blocks concatenated); one BlockWeight where all share it, else a StackedWeight of the runs."""
    runs: list[list[BlockWeight]] = []
    for p in parts:
        if runs and (runs[-1][0].type, runs[-1][0].activations) == (p.type, p.activations):
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [r[0] if len(r) == 1 else BlockWeight(r[0].type, torch.cat([p.blocks for p in r]),
                                                   (sum(p.shape[0] for p in r), r[0].shape[1]), r[0].activations)
              for r in runs]
    return merged[0] if len(merged) == 1 else StackedWeight(merged)


def qlinear_ref(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: ``x`` (fp32) times the dequantized weight, an fp32 matmul, plus ``bias``."""
    return torch.nn.functional.linear(x.float(), weight.dense().to(x.device), None if bias is None else bias.float())


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (K a multiple of 256) rounded to int8 per super-block of 256, as the C++ a8 GEMM does it:
    ``q`` (int8 values as fp32, [M, K / 256, 256]) and ``dx`` ([M, K / 256]), x ~ q * dx.

    ``dx = amax / 127`` and ``q = round-half-even(x * (127 / amax))`` in fp32 (all zeros where amax is 0); a NaN or
    infinity in a super-block makes its dx NaN.
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // 256, 256)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])
    dx = amax / 127.0
    dx = torch.where(torch.isfinite(xb).all(-1), dx, torch.full_like(dx, float("nan")))
    return torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0), dx


def qlinear_a8_ref(x: torch.Tensor, weight: "BlockWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of int8 activations: ``x`` rounded by :func:`quantize_activations_ref` times the dequantized
    weight, summed in float64, returned as fp32."""
    x2 = x.reshape(-1, weight.shape[1])
    q, dx = quantize_activations_ref(x2)
    xr = (q.double() * dx.double()[..., None]).reshape(x2.shape)
    y = xr @ weight.dense().to(x.device).double().t()
    if bias is not None:
        y = y + bias.double()
    return y.float().reshape(*x.shape[:-1], weight.shape[0])


def qlinear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[..., K] @ weight^T (+ bias)`` for a BlockWeight / StackedWeight; fp32 in, fp32 out.

    CPU: graphspec's C++ block GEMM at the level in force (every C++ level), else :func:`qlinear_ref`.
    CUDA / Triton requested: the Triton block GEMMs. Shapes and dtypes are checked by ``linear``.
    """
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if isinstance(weight, StackedWeight):
        y = torch.cat([qlinear(x2, p) for p in weight.parts], dim=1)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    if weight.int8_activations:
        if x.device.type != "cpu":
            raise ValueError(f"{weight!r}: int8 activations (weights='gguf-a8') run on the CPU only; on "
                             f"{x.device.type} load the model with weights='gguf'")
        lv = cpu.level()  # once: each call costs microseconds, and a decode step makes over a hundred of these
        if lv != "torch":
            y = cpu.qops(lv).qlinear_a8(x2.float().contiguous(), weight.tiles, TYPE_IDS[weight.type],
                                        weight.shape[0], k, None if bias is None else bias.float().contiguous())
        else:
            y = qlinear_a8_ref(x2, weight, bias)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if use_triton(x):
        y = qlinear_triton(x2, weight, bias)
    elif x.device.type == "cpu" and cpu.available():
        y = cpu.qops().qlinear(x2.float().contiguous(), weight.blocks, TYPE_IDS[weight.type], weight.shape[0], k,
                               None if bias is None else bias.float().contiguous())
    else:
        y = qlinear_ref(x2, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def bytes_per_weight(type_name: str) -> float:
    """Bytes a weight of ``type_name`` takes in memory (what a decode step reads)."""
    size, nbytes = FORMATS[type_name]
    return nbytes / size



# ----------------------------------------------------------------------------------------------
# Triton: weight-only block GEMMs (dequantize in the kernel, fp32 accumulation)


@triton.jit
def _tl_u8(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _tl_f16(ptr, off, mask):
    bits = _tl_u8(ptr, off, mask) | (_tl_u8(ptr, off + 1, mask) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(w_ptr, rows, ks, row_bytes, mask, TYPE: tl.constexpr):
    """fp32 weights [BLOCK_N, BLOCK_K] of rows ``rows`` and columns ``ks``, as gguf.quants.dequantize computes them.

    TYPE is ``TYPE_IDS``' number; each element finds its block (k // block size) and its bytes in it.
    """
    if TYPE == 0:  # F32
        base = rows[:, None] * row_bytes + ks[None, :] * 4
        bits = (_tl_u8(w_ptr, base, mask) | (_tl_u8(w_ptr, base + 1, mask) << 8) | (_tl_u8(w_ptr, base + 2, mask) << 16)
                | (_tl_u8(w_ptr, base + 3, mask) << 24))
        w = bits.to(tl.float32, bitcast=True)
    elif TYPE == 1:  # F16
        w = _tl_f16(w_ptr, rows[:, None] * row_bytes + ks[None, :] * 2, mask)
    elif TYPE == 2:  # BF16
        base = rows[:, None] * row_bytes + ks[None, :] * 2
        w = ((_tl_u8(w_ptr, base, mask) | (_tl_u8(w_ptr, base + 1, mask) << 8)) << 16).to(tl.float32, bitcast=True)
    elif TYPE <= 7:  # blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
        TS: tl.constexpr = 18 if TYPE == 3 else 20 if TYPE == 4 else 22 if TYPE == 5 else 24 if TYPE == 6 else 34
        base = rows[:, None] * row_bytes + (ks // 32)[None, :] * TS
        j = (ks % 32)[None, :]
        d = _tl_f16(w_ptr, base, mask)
        if TYPE == 7:  # Q8_0: int8 quants times d
            w = _tl_u8(w_ptr, base + 2 + j, mask).to(tl.int8).to(tl.float32) * d
        else:
            QS: tl.constexpr = 2 if TYPE == 3 else 4 if TYPE == 4 else 6 if TYPE == 5 else 8
            q = (_tl_u8(w_ptr, base + QS + j % 16, mask) >> ((j // 16) * 4)) & 0xF
            if TYPE == 5 or TYPE == 6:  # the fifth bit, bit j of the little-endian qh word
                QH: tl.constexpr = 2 if TYPE == 5 else 4
                q = q | (((_tl_u8(w_ptr, base + QH + j // 8, mask) >> (j % 8)) & 1) << 4)
            if TYPE == 3:
                w = d * (q - 8).to(tl.float32)
            elif TYPE == 5:
                w = d * (q - 16).to(tl.float32)
            else:  # Q4_1, Q5_1: d * q + m
                w = d * q.to(tl.float32) + _tl_f16(w_ptr, base + 2, mask)
    elif TYPE <= 9:  # Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins
        TS: tl.constexpr = 144 if TYPE == 8 else 176
        base = rows[:, None] * row_bytes + (ks // 256)[None, :] * TS
        j = (ks % 256)[None, :]
        s = j // 32
        t = s % 4
        a = _tl_u8(w_ptr, base + 4 + t, mask)
        b = _tl_u8(w_ptr, base + 8 + t, mask)
        c = _tl_u8(w_ptr, base + 12 + t, mask)
        sc = tl.where(s < 4, a & 63, (c & 0xF) | ((a >> 6) << 4))
        mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
        QS: tl.constexpr = 16 if TYPE == 8 else 48
        q = (_tl_u8(w_ptr, base + QS + (s // 2) * 32 + j % 32, mask) >> ((s % 2) * 4)) & 0xF
        if TYPE == 9:
            q = q | (((_tl_u8(w_ptr, base + 16 + j % 32, mask) >> s) & 1) << 4)
        ds = _tl_f16(w_ptr, base, mask) * sc.to(tl.float32)
        dm = _tl_f16(w_ptr, base + 2, mask) * mn.to(tl.float32)
        w = ds * q.to(tl.float32) - dm
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        base = rows[:, None] * row_bytes + (ks // 256)[None, :] * 210
        j = (ks % 256)[None, :]
        g = j // 32
        h = g // 4
        s = g % 4
        ql = (_tl_u8(w_ptr, base + 64 * h + 32 * (s % 2) + j % 32, mask) >> ((s // 2) * 4)) & 0xF
        qh = (_tl_u8(w_ptr, base + 128 + 32 * h + j % 32, mask) >> (2 * s)) & 3
        scale = _tl_u8(w_ptr, base + 192 + j // 16, mask).to(tl.int8).to(tl.float32)
        ds = _tl_f16(w_ptr, base + 208, mask) * scale
        w = ds * ((ql | (qh << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _qlinear_kernel(
    x_ptr,  # [M, K] fp32
    w_ptr,  # [N, row_bytes] uint8: the GGUF blocks
    b_ptr,  # [N] fp32 (only read when HAS_BIAS)
    y_ptr,  # [M, N] fp32, contiguous
    stride_xm, stride_xk,
    M, N, K, row_bytes,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), w dequantized per tile; grid (cdiv(M, BM), cdiv(N, BN))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(w_ptr, rows, ks, row_bytes, n_mask[:, None] & k_mask[None, :], TYPE)  # [BN, BK]
        w = tl.where(n_mask[:, None] & k_mask[None, :], w, 0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee", out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y, acc, mask=m_mask[:, None] & n_mask[None, :])


SKINNY_MAX_M = 16
"""Up to this many rows (decode, verify) one 16-row tile spans M and programs split N only."""

_INTERPRET = interpreter_enabled()


def _qconfig(m: int) -> dict:
    if m <= SKINNY_MAX_M:  # weight-read bound: small N tiles, long K tiles, many programs
        return {"BLOCK_M": 16, "BLOCK_N": 32 if not _INTERPRET else 64, "BLOCK_K": 128 if not _INTERPRET else 64,
                "num_warps": 4}
    return {"BLOCK_M": 64 if not _INTERPRET else 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}


def qlinear_triton(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher: ``x [M, K]`` fp32 times a BlockWeight on x's device; fp32 ``[M, N]``."""
    if weight.blocks.device != x.device:
        raise ValueError(f"the BlockWeight is on {weight.blocks.device} but x is on {x.device}")
    n, k = weight.shape
    x2 = x.reshape(-1, k).float()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = _qconfig(m)
    has_bias = bias is not None
    b = bias.float().contiguous() if has_bias else y
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    extra = {} if _INTERPRET else {"enable_fp_fusion": False}  # no fused multiply-adds in the dequantization
    _qlinear_kernel[grid](
        x2, weight.blocks, b, y,
        x2.stride(0), x2.stride(1),
        m, n, k, weight.blocks.shape[1],
        TYPE=TYPE_IDS[weight.type], HAS_BIAS=has_bias,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], **extra,
    )
    return y
