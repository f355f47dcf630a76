"""Torch reference of the two FlashMLA sparse entry points, with the same arguments.

``decode``: ``flash_mla_with_kvcache`` in sparse mode over V4-layout page buffers: each query
attends to the rows named by ``indices`` (storage rows page * P + offset; only -1 is invalid) and
``extra_indices``; ``lengths`` / ``extra_lengths`` keep only the leftmost entries of each row.
``prefill``: ``flash_mla_sparse_fwd`` over a bf16 kv buffer (invalid: -1 or >= len(kv)).
Both add the attention sink to the softmax denominator and compute in float32 from the stored
values, so they are what the kernels should return up to their bf16 arithmetic.
"""

from __future__ import annotations

import torch

from ..core import ops
from .kv_layout import V4Fp8Rows

Tensor = torch.Tensor


def _gather(cache: Tensor, layout: V4Fp8Rows, indices: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """-> (keys [B*S, K, D] float32, valid [B*S, K])."""
    B, S, K = indices.shape
    valid = indices != -1
    if lengths is not None:
        valid &= torch.arange(K, device=indices.device) < lengths.view(B, 1, 1)
    keys = layout.read(cache, indices.clamp_min(0).flatten()).view(B * S, K, -1)
    return keys, valid.view(B * S, K)


class TorchSparseKernels:
    """The reference implementation of the ``SparseKernels`` interface (see ``flashmla``)."""

    name = "torch-ref"

    def new_sched(self) -> None:
        return None  # nothing to schedule

    def decode(self, q: Tensor, cache: Tensor, layout: V4Fp8Rows, indices: Tensor, lengths: Tensor | None,
               sink: Tensor, scale: float, extra_cache: Tensor | None = None,
               extra_layout: V4Fp8Rows | None = None, extra_indices: Tensor | None = None,
               extra_lengths: Tensor | None = None, sched: None = None) -> Tensor:
        """q [B, S, H, D]; indices [B, S, K] int32; lengths [B] -> out [B, S, H, D] float32."""
        B, S, H, D = q.shape
        keys, valid = _gather(cache, layout, indices, lengths)
        if extra_cache is not None:
            ek, ev = _gather(extra_cache, extra_layout, extra_indices, extra_lengths)
            keys, valid = torch.cat((keys, ek), dim=1), torch.cat((valid, ev), dim=1)
        n, K = valid.shape
        idx = torch.arange(n * K, device=q.device).view(n, K)
        out = ops.sparse_attention(q.reshape(n, H, D).float(), keys.reshape(n * K, D),
                                   torch.where(valid, idx, -1), sink.float(), scale)
        return out.view(B, S, H, D)

    def prefill(self, q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor:
        """q [T, H, D]; kv [N, 1, D]; indices [T, 1, K] int32 -> out [T, H, D] float32."""
        idx = indices[:, 0].long()
        idx = torch.where((idx >= 0) & (idx < kv.shape[0]), idx, -1)
        return ops.sparse_attention(q.float(), kv[:, 0].float(), idx, sink.float(), scale)
