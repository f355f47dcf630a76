"""Storage layouts of KV rows in pages (pure torch; runs on any device).

A *page buffer* holds pages of ``page_size`` rows; row ``r`` lives at offset ``r % page_size`` of
page ``r // page_size``. The cache keeps one page buffer per layer and kind: the window ring of
every request is one page of ``sliding_window`` rows (page = request slot), the compressed entries
are pages of the entry pool. Three layouts:

- ``FloatRows``: plain float rows (the CPU path; fp32 keeps the model bit-comparable to the oracle).
- ``V4Fp8Rows``: FlashMLA's V4 KV layout (v4_architecture.md §9). A row is the nope part as
  e4m3 (448 B) + the rope part as bf16 (128 B) = 576 data bytes, then one ue8m0 scale byte per 64
  nope values (7) + 1 pad byte. A page is ``[P x 576 data][P x 8 scales]`` padded to a multiple of
  576 bytes (the kernel's TMA row stride); the kernel reads it viewed as ``[pages, P, 1, 584]``.
  The scales are the FP8_QAT rule of the model itself (``quant.fp8_qat``: power-of-two
  ``2^ceil(log2(max(amax, 1e-4) / 448))`` per 64 values), so writing a row and reading it back
  gives exactly ``fp8_qat`` on the nope part; the rope part is rounded to bf16 (the reference
  model keeps its KV in bf16).
- ``IndexFp8Rows``: indexer keys as e4m3 + one fp32 scale per row (132 B for 128 dims; page
  ``[P x 128][P x 4]``), the layout DeepGEMM's ``fp8_paged_mqa_logits`` reads. The scale is a
  power of two, so the model's FP4-QAT'ed keys (e2m1 values times power-of-two block scales) are
  stored exactly unless the four 32-value block scales of a row span more than 2^14.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from ..core.compiled import on_gpu
from ..quant import FP8_MAX, pow2_exponent, pow2_scale
from . import kv_store

Tensor = torch.Tensor

FP8_TILE = 64            # nope values per ue8m0 scale
FP8_AMAX_FLOOR = 1e-4    # the model's FP8_QAT floor (quant.fp8_qat)
V4_NOPE, V4_ROPE = 448, 64
V4_TOKEN_BYTES = 584     # what FlashMLA reads per token: 576 data + 8 scale bytes


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# The quantising halves of the fp8 layouts' ``pack``, fused on the GPU (``core.compiled``): as
# torch ops they are ~15 kernels per write, and a decode step writes each layer's window, C4, C128
# and indexer rows. The byte views and the concatenation stay outside (no dtype-size bitcasts in
# the compiled graph). The arithmetic is quant.fp8_qat's (``pow2_scale`` per 64-value tile).
@on_gpu(rows={"x": (0,)})
def _v4_fp8_quantise(x: Tensor, nope: int, rope_dtype: torch.dtype, scale_bytes: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """x [n, nope + rope] -> (e4m3 nope [n, nope], rope part [n, rope] in ``rope_dtype``,
    ue8m0 scale bytes [n, scale_bytes], zero-padded after the nope // 64 tiles)."""
    tiles = x[:, :nope].float().unflatten(-1, (nope // FP8_TILE, FP8_TILE))
    log2_scale = pow2_exponent(tiles.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR), FP8_MAX)
    q = (tiles / torch.exp2(log2_scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    ue8m0 = (log2_scale.squeeze(-1) + 127).to(torch.uint8)  # biased by 127
    scales = F.pad(ue8m0, (0, scale_bytes - ue8m0.shape[-1]))
    return q.flatten(1), x[:, nope:].to(rope_dtype), scales


@on_gpu(rows={"x": (0,)})
def _v4_fp8_round(x: Tensor, nope: int, rope_dtype: torch.dtype) -> Tensor:
    """x [n, nope + rope] -> float32 [n, nope + rope]: ``unpack(pack(x))`` without the bytes, one
    fused region on the GPU instead of a pack and an unpack (~15 kernels) in every layer of every
    prefill. The quantiser and dequantiser themselves, traced inline (``on_gpu`` calls them eagerly
    inside a compiled region), so the bits are theirs."""
    tiles = nope // FP8_TILE
    q, rope, scales = _v4_fp8_quantise(x, nope, rope_dtype, tiles)
    return _v4_fp8_dequantise(q, rope, scales, tiles)


@on_gpu(rows={"q": (0,)})
def _v4_fp8_dequantise(q: Tensor, rope: Tensor, scales: Tensor, num_tiles: int) -> Tensor:
    """(e4m3 nope [n, nope], rope part [n, rope], ue8m0 scale bytes [n, >= num_tiles]) ->
    float32 [n, nope + rope]: ``V4Fp8Rows.unpack``'s arithmetic in one region on the GPU (the
    byte views stay outside: no dtype-size bitcasts in the compiled graph)."""
    scale = torch.exp2(scales[:, :num_tiles].float() - 127)
    nope = (q.float().unflatten(-1, (num_tiles, FP8_TILE)) * scale[..., None]).flatten(1)
    return torch.cat((nope, rope.float()), dim=1)


@on_gpu(rows={"x": (0,)})
def _index_fp8_quantise(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [n, dim] -> (e4m3 [n, dim], fp32 power-of-two scale [n, 1])."""
    x = x.float()
    # floor far below any real key; an all-zero row stores zeros
    scale = pow2_scale(x.abs().amax(-1, keepdim=True).clamp_min(1e-30), FP8_MAX)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class RowLayout(ABC):
    """How rows of width ``dim`` are stored in pages of ``page_size`` rows."""

    page_size: int
    dim: int

    @abstractmethod
    def alloc(self, *lead: int, device: torch.device | str = "cpu") -> Tensor:
        """Zeroed storage of shape [*lead, <one page>]: e.g. rings [slots, layers, <page>]."""

    def alloc_pool(self, num_pages: int, device: torch.device | str = "cpu") -> Tensor:
        """A page buffer of ``num_pages`` pages."""
        return self.alloc(num_pages, device=device)

    @abstractmethod
    def write(self, buf: Tensor, rows: Tensor, x: Tensor) -> None:
        """Store x [n, dim] at storage rows ``rows`` [n] of the page buffer ``buf`` (or at a
        (page, offset) pair of [n] tensors, see ``locate``)."""

    @abstractmethod
    def read(self, buf: Tensor, rows: Tensor) -> Tensor:
        """The rows ``rows`` [n] of ``buf`` as floats [n, dim]."""

    @abstractmethod
    def round(self, x: Tensor) -> Tensor:
        """What reading back ``x`` after writing it gives (float, same shape)."""

    @abstractmethod
    def copy_head(self, buf: Tensor, src_page: int, dst_page: int, n: int) -> None:
        """Copy rows 0..n-1 of page ``src_page`` to page ``dst_page`` (copy-on-write)."""

    @property
    @abstractmethod
    def page_bytes(self) -> int:
        """Bytes of one page, padding included."""

    @property
    def row_bytes(self) -> float:
        """Bytes per row, page padding amortised."""
        return self.page_bytes / self.page_size

    def locate(self, rows: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Storage rows [n] -> (page, offset in page); a (page, offset) pair passes through: a
        caller that addresses the same rows in every layer (a ring's slot and p % W) computes
        them once."""
        if isinstance(rows, tuple):
            return rows
        rows = rows.long()
        return rows // self.page_size, rows % self.page_size


class FloatRows(RowLayout):
    """Plain rows of ``dtype``. A page buffer is [pages, P, dim] or flat [pages * P, dim]."""

    def __init__(self, page_size: int, dim: int, dtype: torch.dtype = torch.float32):
        self.page_size, self.dim, self.dtype = page_size, dim, dtype

    def alloc(self, *lead: int, device: torch.device | str = "cpu") -> Tensor:
        return torch.zeros(*lead, self.page_size, self.dim, dtype=self.dtype, device=device)

    def alloc_pool(self, num_pages: int, device: torch.device | str = "cpu") -> Tensor:
        # flat rows: a row is one tensor row, which keeps pool accounting per row simple
        return torch.zeros(num_pages * self.page_size, self.dim, dtype=self.dtype, device=device)

    def _index(self, buf: Tensor, rows: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        if buf.dim() == 2:  # flat rows
            return (rows[0] * self.page_size + rows[1],) if isinstance(rows, tuple) else (rows,)
        return self.locate(rows)

    def write(self, buf: Tensor, rows: Tensor, x: Tensor) -> None:
        buf[self._index(buf, rows)] = x.to(buf.dtype)

    def read(self, buf: Tensor, rows: Tensor) -> Tensor:
        return buf[self._index(buf, rows)]

    def round(self, x: Tensor) -> Tensor:
        return x if x.dtype == self.dtype else x.to(self.dtype).to(x.dtype)

    def copy_head(self, buf: Tensor, src_page: int, dst_page: int, n: int) -> None:
        if buf.dim() == 2:
            ps = self.page_size
            buf[dst_page * ps:dst_page * ps + n] = buf[src_page * ps:src_page * ps + n]
        else:
            buf[dst_page, :n] = buf[src_page, :n]

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.dim * self.dtype.itemsize


class V4Fp8Rows(RowLayout):
    """FlashMLA's V4 layout (module docstring). Widths other than 448/64, and an fp32 rope part
    (which makes a stored QAT'ed row exact), serve CPU tests of the addressing; FlashMLA reads
    only the defaults."""

    def __init__(self, page_size: int, nope: int = V4_NOPE, rope: int = V4_ROPE,
                 rope_dtype: torch.dtype = torch.bfloat16):
        if nope % FP8_TILE:
            raise ValueError(f"nope width {nope} is not a multiple of {FP8_TILE}")
        self.page_size, self.nope, self.rope, self.dim = page_size, nope, rope, nope + rope
        self.rope_dtype = rope_dtype
        self.num_tiles = nope // FP8_TILE
        self.data_bytes = nope + rope * rope_dtype.itemsize  # e4m3 nope + bf16 rope (576 for V4)
        self.scale_bytes = _round_up(self.num_tiles, 8)   # ue8m0 per tile, padded (7 + 1 for V4)
        self.token_bytes = self.data_bytes + self.scale_bytes

    @property
    def page_bytes(self) -> int:
        # The kernel requires the page stride to be a multiple of its TMA row stride (576).
        return _round_up(self.page_size * self.token_bytes, self.data_bytes)

    def alloc(self, *lead: int, device: torch.device | str = "cpu") -> Tensor:
        return torch.zeros(*lead, self.page_bytes, dtype=torch.uint8, device=device)

    # ---- one row <-> bytes -------------------------------------------------------------------
    def pack(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [n, dim] -> (data [n, data_bytes], scales [n, scale_bytes]) as uint8."""
        # the same arithmetic as quant.fp8_qat, so the stored values equal its output bit for bit
        q, rope, scales = _v4_fp8_quantise(x, self.nope, self.rope_dtype, self.scale_bytes)
        data = torch.cat((q.view(torch.uint8), rope.contiguous().view(torch.uint8)), dim=1)
        return data, scales

    def unpack(self, data: Tensor, scales: Tensor) -> Tensor:
        """Inverse of ``pack``: -> float32 [n, dim]."""
        q = data[:, :self.nope].contiguous().view(torch.float8_e4m3fn)
        rope = data[:, self.nope:].contiguous().view(self.rope_dtype)
        return _v4_fp8_dequantise(q, rope, scales, self.num_tiles)

    def round(self, x: Tensor) -> Tensor:
        """``unpack(pack(x))`` without the bytes (``_v4_fp8_round``)."""
        return _v4_fp8_round(x.reshape(-1, self.dim), self.nope, self.rope_dtype).view(x.shape).to(x.dtype)

    # ---- page buffers ---------------------------------------------------------------------------
    def _data(self, buf: Tensor) -> Tensor:
        P = self.page_size
        return buf[..., :P * self.data_bytes].unflatten(-1, (P, self.data_bytes))

    def _scales(self, buf: Tensor) -> Tensor:
        P, base = self.page_size, self.page_size * self.data_bytes
        return buf[..., base:base + P * self.scale_bytes].unflatten(-1, (P, self.scale_bytes))

    def fused_write(self) -> bool:
        """Whether ``write`` quantises inside its store's launch (``kv_store.FUSED_WRITE``): the
        kernel's layout, FlashMLA's (a bf16 rope part, power-of-two widths)."""
        return (kv_store.FUSED_WRITE and self.rope_dtype == torch.bfloat16 and self.rope & (self.rope - 1) == 0
                and self.scale_bytes & (self.scale_bytes - 1) == 0)

    def write(self, buf: Tensor, rows: Tensor, x: Tensor) -> None:
        page, off = self.locate(rows)
        if kv_store.supported(buf):  # the GPU: one launch, quantised in it or by the fused region before
            if self.fused_write():
                kv_store.quantise_store_v4(buf, page, off, x.reshape(-1, self.dim), self.nope, self.rope,
                                           self.page_size, self.data_bytes, self.scale_bytes)
                return
            q, rope, scales = _v4_fp8_quantise(x, self.nope, self.rope_dtype, self.scale_bytes)
            kv_store.store_row_bytes(buf, page, off, [
                (q.view(torch.uint8), 0, self.data_bytes),
                (rope.contiguous().view(torch.uint8), self.nope, self.data_bytes),
                (scales, self.page_size * self.data_bytes, self.scale_bytes)])
            return
        data, scales = self.pack(x)
        self._data(buf)[page, off] = data       # views of buf: the writes land in buf
        self._scales(buf)[page, off] = scales

    def read(self, buf: Tensor, rows: Tensor) -> Tensor:
        page, off = self.locate(rows)
        return self.unpack(self._data(buf)[page, off], self._scales(buf)[page, off])

    def pack_pages(self, x: Tensor) -> Tensor:
        """Whole pages at once: x [pages, P, dim] -> page buffer [pages, page_bytes]."""
        pages, P = x.shape[:2]
        data, scales = self.pack(x.reshape(pages * P, self.dim))
        buf = self.alloc(pages, device=x.device)
        self._data(buf).copy_(data.view(pages, P, -1))
        self._scales(buf).copy_(scales.view(pages, P, -1))
        return buf

    def copy_head(self, buf: Tensor, src_page: int, dst_page: int, n: int) -> None:
        self._data(buf)[dst_page, :n] = self._data(buf)[src_page, :n]
        self._scales(buf)[dst_page, :n] = self._scales(buf)[src_page, :n]

    def flashmla_view(self, buf: Tensor) -> Tensor:
        """The page buffer [pages, page_bytes] as the kernel takes it: [pages, P, 1, token_bytes].

        The page stride stays ``buf.stride(0)`` (the kernel reads it), so a ring page buffer that
        is a strided slice of [slots, layers, page_bytes] works without a copy.
        """
        P = self.page_size
        return buf[:, :P * self.token_bytes].unflatten(-1, (P, 1, self.token_bytes))


class IndexFp8Rows(RowLayout):
    """Indexer keys: e4m3 values + one fp32 power-of-two scale per row (module docstring)."""

    def __init__(self, page_size: int, dim: int = 128):
        self.page_size, self.dim = page_size, dim

    @property
    def page_bytes(self) -> int:
        return self.page_size * (self.dim + 4)

    def alloc(self, *lead: int, device: torch.device | str = "cpu") -> Tensor:
        return torch.zeros(*lead, self.page_bytes, dtype=torch.uint8, device=device)

    def pack(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q, scale = _index_fp8_quantise(x)
        return q.view(torch.uint8), scale.contiguous().view(torch.uint8)

    def unpack(self, data: Tensor, scales: Tensor) -> Tensor:
        return data.contiguous().view(torch.float8_e4m3fn).float() * scales.contiguous().view(torch.float32)

    def round(self, x: Tensor) -> Tensor:
        return self.unpack(*self.pack(x.reshape(-1, self.dim))).view(x.shape).to(x.dtype)

    def _data(self, buf: Tensor) -> Tensor:
        return buf[..., :self.page_size * self.dim].unflatten(-1, (self.page_size, self.dim))

    def _scales(self, buf: Tensor) -> Tensor:
        base = self.page_size * self.dim
        return buf[..., base:base + 4 * self.page_size].unflatten(-1, (self.page_size, 4))

    def fused_write(self) -> bool:
        """Whether ``write`` quantises inside its store's launch (``kv_store.FUSED_WRITE``; the
        kernel takes power-of-two widths)."""
        return kv_store.FUSED_WRITE and self.dim & (self.dim - 1) == 0

    def write(self, buf: Tensor, rows: Tensor, x: Tensor) -> None:
        page, off = self.locate(rows)
        if kv_store.supported(buf) and self.fused_write():  # the GPU: quantised in the store's launch
            kv_store.quantise_store_index(buf, page, off, x.reshape(-1, self.dim), self.dim, self.page_size)
            return
        data, scales = self.pack(x)
        if kv_store.supported(buf):  # the GPU: one launch
            kv_store.store_row_bytes(buf, page, off, [(data, 0, self.dim), (scales, self.page_size * self.dim, 4)])
            return
        self._data(buf)[page, off] = data
        self._scales(buf)[page, off] = scales

    def read(self, buf: Tensor, rows: Tensor) -> Tensor:
        page, off = self.locate(rows)
        return self.unpack(self._data(buf)[page, off], self._scales(buf)[page, off])

    def copy_head(self, buf: Tensor, src_page: int, dst_page: int, n: int) -> None:
        self._data(buf)[dst_page, :n] = self._data(buf)[src_page, :n]
        self._scales(buf)[dst_page, :n] = self._scales(buf)[src_page, :n]
