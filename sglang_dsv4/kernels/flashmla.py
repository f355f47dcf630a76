"""FlashMLA's sparse kernels (``sgl-flash-mla``) behind the ``SparseKernels`` interface.

Decode runs ``flash_mla_with_kvcache`` on the legacy kernel set: only that set reads the V4
(584-byte) cache format, on SM90 and SM100 alike. Prefill runs ``flash_mla_sparse_fwd``: the
legacy set on SM90, the current one (SM100-only) on SM100; the SM90 prefill kernel takes index
lists in multiples of 128 (``topk % (2 * B_TOPK)``, seen on the H200), so they are padded with -1
here. The kernels take 64 or 128 query heads; fewer (a tensor-parallel rank's share, e.g. 32 of
V4-Flash's 64 at TP=2) are padded with zero queries up to 64 and the padded heads' outputs dropped
(per head the result is bit-identical to an unpadded call). Importing this module imports
``flash_mla``, which needs a CUDA driver; ``dispatch`` decides whether to.
"""

from __future__ import annotations

from typing import Any

import flash_mla
import torch

from .kv_layout import V4Fp8Rows

Tensor = torch.Tensor
PREFILL_INDEX_BLOCK = 128
KERNEL_HEADS = (64, 128)


def _pad_heads(q: Tensor, sink: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """q with its head dimension ``dim`` zero-padded to a head count the kernels take, and
    the sink to match (padded heads' outputs are discarded, so their values do not matter)."""
    h = q.shape[dim]
    padded = next((n for n in KERNEL_HEADS if h <= n), None)
    if padded is None:
        raise ValueError(f"FlashMLA takes at most {KERNEL_HEADS[-1]} query heads, got {h}")
    if padded == h:
        return q, sink
    shape = list(q.shape)
    shape[dim] = padded - h
    return torch.cat((q, q.new_zeros(shape)), dim=dim), torch.cat((sink, sink.new_zeros(padded - h)))


class FlashMLAKernels:
    """``SparseKernels`` on FlashMLA; ``sched`` lets a caller reuse decode scheduling metadata
    across calls with identical shapes and lengths (e.g. all layers of one ratio in a step)."""

    name = "flashmla"

    def __init__(self, device: torch.device | str):
        major, _ = torch.cuda.get_device_capability(torch.device(device))
        if not flash_mla.has_legacy():
            raise RuntimeError("this flash_mla build has no legacy kernels, which hold the V4 cache format")
        self._legacy_prefill = major == 9

    def new_sched(self) -> Any:
        return flash_mla.get_mla_metadata()[0]

    def decode(self, q: Tensor, cache: Tensor, layout: V4Fp8Rows, indices: Tensor, lengths: Tensor | None,
               sink: Tensor, scale: float, extra_cache: Tensor | None = None,
               extra_layout: V4Fp8Rows | None = None, extra_indices: Tensor | None = None,
               extra_lengths: Tensor | None = None, sched: Any = None) -> Tensor:
        heads = q.shape[2]
        q, sink = _pad_heads(q, sink, 2)
        out, _ = flash_mla.flash_mla_with_kvcache(
            q, layout.flashmla_view(cache), None, None, layout.dim,
            sched if sched is not None else self.new_sched(),
            softmax_scale=scale, is_fp8_kvcache=True, indices=indices, attn_sink=sink,
            topk_length=lengths,
            extra_k_cache=None if extra_cache is None else extra_layout.flashmla_view(extra_cache),
            extra_indices_in_kvcache=extra_indices, extra_topk_length=extra_lengths,
            use_legacy=True)
        return out[:, :, :heads]

    def prefill(self, q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
        heads = q.shape[1]
        q, sink = _pad_heads(q, sink, 1)
        if indices.shape[-1] % PREFILL_INDEX_BLOCK:
            pad = -indices.shape[-1] % PREFILL_INDEX_BLOCK
            indices = torch.nn.functional.pad(indices, (0, pad), value=-1)
        out, _, _ = flash_mla.flash_mla_sparse_fwd(q, kv, indices, scale, d_v=kv.shape[-1], attn_sink=sink,
                                                   use_legacy=self._legacy_prefill, return_log2_lse=False)
        return out[:, :heads]
