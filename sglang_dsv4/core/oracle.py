"""Reference oracle: the V4 forward over a whole sequence, with no cache of any kind.

Every quantity is defined by absolute token position, straight from v4_architecture.md §11.1:
the window is positions max(0, p-W+1)..p, compressed entry j pools the complete group ending at
r*j + r - 1 and is visible to p iff j < (p+1)//r, the indexer picks among those. It shares only
per-token math (``ops``) with the incremental model; group pooling and key selection are written
independently here so the two check each other.
"""

from __future__ import annotations

import torch

from ..config import V4Config
from . import ops

Tensor = torch.Tensor


class OracleModel:
    """Cache-free V4 forward. ``forward(ids)`` -> logits [T, V] (float32)."""

    def __init__(self, cfg: V4Config, weights: dict[str, Tensor], quant_sim: bool = True):
        self.cfg, self.w, self.quant_sim = cfg, weights, quant_sim
        self.layers = [ops.layer_view(weights, f"layers.{i}") for i in range(cfg.num_hidden_layers)]
        self.mtp = [ops.layer_view(weights, f"mtp.{m}") for m in range(cfg.num_mtp_layers)]

    @torch.no_grad()
    def forward(self, ids: Tensor, return_streams: bool = False):
        """ids: [T] -> logits [T, V]; with return_streams also the final residual streams [T, hc, D]."""
        cfg = self.cfg
        ids = ids.to(self.w["embed.weight"].device)
        positions = torch.arange(ids.numel(), device=ids.device)
        h = self.w["embed.weight"][ids].to(self.w["hc_head_fn"].dtype).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        for i, lw in enumerate(self.layers):
            h = self._block(h, lw, ids, positions, cfg.layer_ratios[i], hash_routed=i < cfg.num_hash_layers)
        y = ops.hc_head(h, self.w["hc_head_fn"], self.w["hc_head_base"], self.w["hc_head_scale"], cfg)
        logits = ops.linear(ops.rms_norm(y, self.w["norm.weight"], cfg.rms_norm_eps), self.w["head.weight"])
        return (logits, h) if return_streams else logits

    @torch.no_grad()
    def forward_mtp(self, ids: Tensor, streams: Tensor) -> Tensor:
        """MTP logits [T-1, V]: row t uses (streams[t], ids[t+1]) at position t and predicts ids[t+2]."""
        cfg, w = self.cfg, self.mtp[0]
        T = ids.numel() - 1
        ids = ids.to(self.w["embed.weight"].device)
        positions = torch.arange(T, device=ids.device)
        h = ops.mtp_input(streams[:T], ids[1:], self.w["embed.weight"], w, cfg)
        h = self._block(h, w, ids[1:], positions, cfg.compress_ratios[cfg.num_hidden_layers], hash_routed=False)
        y = ops.hc_head(h, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], cfg)
        return ops.linear(ops.rms_norm(y, w["norm.weight"], cfg.rms_norm_eps), self.w["head.weight"])

    def _block(self, h: Tensor, w: dict[str, Tensor], ids: Tensor, positions: Tensor, ratio: int,
               hash_routed: bool) -> Tensor:
        cfg = self.cfg
        y, post, comb = ops.hc_pre(h, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], cfg)
        x = ops.rms_norm(y, w["attn_norm.weight"], cfg.rms_norm_eps)
        h = ops.hc_post(self._attention(x, w, positions, ratio), h, post, comb)
        y, post, comb = ops.hc_pre(h, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"], cfg)
        x = ops.rms_norm(y, w["ffn_norm.weight"], cfg.rms_norm_eps)
        return ops.hc_post(ops.moe(x, ids, w, cfg, hash_routed), h, post, comb)

    def _attention(self, x: Tensor, w: dict[str, Tensor], positions: Tensor, ratio: int) -> Tensor:
        cfg, qs = self.cfg, self.quant_sim
        T = x.shape[0]
        freqs = ops.layer_inv_freqs(cfg, ratio)
        rope = ops.rope_at(positions, freqs)
        q, qr = ops.project_q(x, w, rope, cfg)
        kv = ops.project_kv(x, w, rope, cfg, qs)
        idx = ops.window_indices(positions, cfg.sliding_window, 0)
        keys = kv
        if ratio:
            entries = self._compress(x, w, "attn.compressor", ratio, freqs, is_indexer=False)
            n = entries.shape[0]
            visible = (positions + 1) // ratio
            if ratio == 128:
                j = torch.arange(n, device=x.device)
                comp_idx = torch.where(j[None, :] < visible[:, None], j[None, :], -1)
            else:
                index_keys = self._compress(x, w, "attn.indexer.compressor", 4, freqs, is_indexer=True)
                qi, hw = ops.indexer_queries(x, qr, w, rope, cfg, qs)
                scores = ops.indexer_scores(qi, hw, index_keys)
                comp_idx = ops.select_topk(scores, visible, cfg.index_topk)
            idx = torch.cat((idx, torch.where(comp_idx >= 0, comp_idx + T, -1)), dim=1)
            keys = torch.cat((kv, entries), dim=0)
        o = ops.sparse_attention(q, keys, idx, w["attn.attn_sink"], cfg.softmax_scale)
        return ops.attention_output(o, w, rope, cfg)

    def _compress(self, x: Tensor, w: dict[str, Tensor], prefix: str, ratio: int, freqs: Tensor,
                  is_indexer: bool) -> Tensor:
        """All complete groups of the sequence -> entries [T//ratio, d] (§3.3)."""
        T = x.shape[0]
        n = T // ratio
        a, s = ops.compressor_projections(x[: n * ratio], w, prefix, torch.arange(n * ratio, device=x.device))
        if ratio == 128:
            pooled = (torch.softmax(s.view(n, ratio, s.shape[1]), dim=1) * a.view(n, ratio, a.shape[1])).sum(1)
        else:  # group -1 does not exist: pad it with zero values and -inf scores
            pad_a, pad_s = a.new_zeros(4, a.shape[1]), s.new_full((4, s.shape[1]), float("-inf"))
            pooled = ops.pool_c4(torch.cat((pad_a, a)), torch.cat((pad_s, s)))
        first = torch.arange(n, device=x.device) * ratio
        return ops.finish_entries(pooled, w, prefix, ops.rope_at(first, freqs), self.cfg, is_indexer, self.quant_sim)
