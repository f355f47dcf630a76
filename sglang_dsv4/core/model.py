"""The incremental V4 model: prefill chunks of any size and single-token decode over ``V4Cache``.

A forward takes a batch of (request, new token ids). Per-token work (projections, hyper-
connections, MoE) runs once over all tokens of the batch; the cache work (compressor state,
compressed entries, indexer top-k) runs per request, vectorised over that request's tokens. The
attention itself (window ring + selected entries + sink) goes to the cache's attention backend
(``kernels.backend``) in one call per layer, which also owns the storage format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import V4Config
from ..kernels.backend import TORCH_BACKEND, AttentionBackend, AttnBatch, AttnSegment
from . import ops
from .cache import C4_STATE_ROWS, RequestState, V4Cache

if TYPE_CHECKING:
    from .parallel import ModelParallel

Tensor = torch.Tensor


@dataclass
class _Segment:
    """One request's tokens inside the batch: rows [row0, row1), positions [start, start + n)."""

    req: RequestState
    row0: int
    row1: int
    start: int
    write_rows: dict[int, Tensor]  # ratio -> storage rows of the entries this chunk completes
    read_rows: dict[int, Tensor]   # ratio -> storage rows of entries 0 .. end//ratio - 1

    @property
    def end(self) -> int:
        return self.start + self.row1 - self.row0


def weight_dtypes(matmul_dtype: torch.dtype, dtype: torch.dtype = torch.float32):
    """Per-tensor dtypes for a model whose GEMMs run in ``matmul_dtype`` (e.g. bf16 on a GPU):
    the projection and expert matrices and the embedding/head take it; norms, the router, hyper-
    connection mixers, biases and the sink stay ``dtype`` (the activations' dtype). Dequantised
    fp8/fp4 weights are exact in bf16 (3 and 1 mantissa bits times a power-of-two scale), so a
    bf16 model has the checkpoint's weights; only activations are rounded at each GEMM."""
    def dtype_of(name: str) -> torch.dtype:
        parts = name.split(".")
        matmul = parts[-1] == "weight" and "norm" not in parts[-2] and parts[-2] != "gate"
        return matmul_dtype if matmul else dtype
    return dtype_of


class V4Model:
    """Incremental V4 forward (float32 on CPU; any device the weights live on).

    Activations (residual streams, norms, compressor pooling, softmaxes) take the dtype of the
    non-matrix weights; matrices may be narrower (``weight_dtypes``): ``ops.linear`` runs each GEMM
    in the matrix's dtype.

    With ``parallel`` (a ``parallel.ModelParallel``), ``weights`` are one rank's shards
    (``parallel.shard_model`` makes them) and the attention output and MoE are reduced over its
    process groups; None is the single-process model.
    """

    def __init__(self, cfg: V4Config, weights: dict[str, Tensor], quant_sim: bool = True,
                 parallel: ModelParallel | None = None):
        self.cfg, self.w, self.quant_sim, self.parallel = cfg, weights, quant_sim, parallel
        self.layers = [ops.layer_view(weights, f"layers.{i}") for i in range(cfg.num_hidden_layers)]
        self.mtp = [ops.layer_view(weights, f"mtp.{m}") for m in range(cfg.num_mtp_layers)]

    # ---- main model ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, cache: V4Cache, reqs: list[RequestState], ids: list[Tensor],
                return_streams: bool = False, return_hidden: bool = False):
        """Process ``ids[i]`` as the next tokens of ``reqs[i]``.

        -> logits per request ([n_i, V]) or, with return_hidden, the normed final hidden states the
        head is applied to ([n_i, D]); with return_streams also the final residual streams per
        request ([n_i, hc, D], the MTP block's input). Advances each request's ``num_tokens``.
        Raises ValueError (too long) or CacheCapacityError before touching any state.
        """
        cfg = self.cfg
        self._check_backend(cache)
        for req, t in zip(reqs, ids):
            if t.dim() != 1 or t.numel() == 0:
                raise ValueError(f"token ids must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
            cache.check_length(req, t.numel())
        write_rows = cache.reserve_entries(reqs, [t.numel() for t in ids])
        segments, row = [], 0
        for i, (req, t) in enumerate(zip(reqs, ids)):
            end = req.num_tokens + t.numel()
            # storage rows on the model's device, whichever cache produced them
            segments.append(_Segment(req, row, row + t.numel(), req.num_tokens,
                                     {r: rows[i].to(self.device) for r, rows in write_rows.items()},
                                     {r: cache.entry_rows(req, r, end // r).to(self.device) for r in write_rows}))
            row += t.numel()
        flat_ids = torch.cat(ids).to(self.device)
        positions = self._positions(segments)
        h = self.w["embed.weight"][flat_ids].to(self.dtype).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        for i, lw in enumerate(self.layers):
            h = self._block(h, lw, i, cfg.layer_ratios[i], flat_ids, positions, segments, cache,
                            hash_routed=i < cfg.num_hash_layers, mtp=False)
        for s in segments:
            s.req.num_tokens = s.end
        y = ops.hc_head(h, self.w["hc_head_fn"], self.w["hc_head_base"], self.w["hc_head_scale"], cfg)
        out = ops.rms_norm(y, self.w["norm.weight"], cfg.rms_norm_eps)
        if not return_hidden:
            out = self.logits(out)
        per_req = [out[s.row0:s.row1] for s in segments]
        if return_streams:
            return per_req, [h[s.row0:s.row1] for s in segments]
        return per_req

    def logits(self, hidden: Tensor) -> Tensor:
        return ops.linear(hidden, self.w["head.weight"])

    # ---- MTP ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_mtp(self, cache: V4Cache, reqs: list[RequestState], streams: list[Tensor],
                    next_ids: list[Tensor]) -> list[Tensor]:
        """MTP positions mtp_num_tokens.. of each request: row t pairs the main streams at t with
        token t+1 and predicts token t+2. -> logits per request."""
        cfg, w = self.cfg, self.mtp[0]
        for req, t in zip(reqs, next_ids):
            if req.mtp_num_tokens + t.numel() > req.num_tokens:
                raise ValueError("MTP cannot run ahead of the main model")
        self._check_backend(cache)
        segments, row = [], 0
        for req, t in zip(reqs, next_ids):
            segments.append(_Segment(req, row, row + t.numel(), req.mtp_num_tokens, {}, {}))
            row += t.numel()
        flat_ids = torch.cat(next_ids).to(self.device)
        positions = self._positions(segments)
        h = ops.mtp_input(torch.cat(streams), flat_ids, self.w["embed.weight"], w, cfg)
        h = self._block(h, w, cfg.num_hidden_layers, cfg.compress_ratios[cfg.num_hidden_layers],
                        flat_ids, positions, segments, cache, hash_routed=False, mtp=True)
        for s in segments:
            s.req.mtp_num_tokens = s.end
        y = ops.hc_head(h, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], cfg)
        logits = self.logits(ops.rms_norm(y, w["norm.weight"], cfg.rms_norm_eps))
        return [logits[s.row0:s.row1] for s in segments]

    # ---- blocks ----------------------------------------------------------------------------
    def _block(self, h: Tensor, w: dict[str, Tensor], layer: int, ratio: int, ids: Tensor,
               positions: Tensor, segments: list[_Segment], cache: V4Cache, hash_routed: bool,
               mtp: bool) -> Tensor:
        cfg = self.cfg
        y, post, comb = ops.hc_pre(h, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], cfg)
        x = ops.rms_norm(y, w["attn_norm.weight"], cfg.rms_norm_eps)
        h = ops.hc_post(self._attention(x, w, layer, ratio, positions, segments, cache), h, post, comb)
        y, post, comb = ops.hc_pre(h, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"], cfg)
        x = ops.rms_norm(y, w["ffn_norm.weight"], cfg.rms_norm_eps)
        par = self.parallel
        f = par.moe(x, ids, w, cfg, hash_routed) if par else ops.moe(x, ids, w, cfg, hash_routed)
        return ops.hc_post(f, h, post, comb)

    def _attention(self, x: Tensor, w: dict[str, Tensor], layer: int, ratio: int, positions: Tensor,
                   segments: list[_Segment], cache: V4Cache) -> Tensor:
        cfg, qs = self.cfg, self.quant_sim
        freqs = ops.layer_inv_freqs(cfg, ratio)
        q, qr = ops.project_q(x, w, positions, freqs, cfg)
        kv = ops.project_kv(x, w, positions, freqs, cfg, qs)
        if ratio:
            a, s = ops.compressor_projections(x, w, "attn.compressor", positions, ratio)
            pool = cache.pools[ratio]
        if ratio == 4:
            ia, is_ = ops.compressor_projections(x, w, "attn.indexer.compressor", positions, 4)
            qi, hw = ops.indexer_queries(x, qr, w, positions, freqs, cfg, qs)
        attn_segments = []
        for seg in segments:  # cache work per request, vectorised over its tokens
            rows = slice(seg.row0, seg.row1)
            pos = positions[rows]
            aseg = AttnSegment(seg.req.slot, seg.start, seg.row0, seg.row1)
            if ratio:
                new = self._compress(cache, seg, layer, ratio, a[rows], s[rows], w, "attn.compressor",
                                     freqs, is_indexer=False)
                pool.write(f"main{layer}", seg.write_rows[ratio], new)
                visible = (pos + 1) // ratio
                if ratio == 128:
                    j = torch.arange(seg.end // ratio, device=pos.device)
                    aseg.comp_idx = torch.where(j[None, :] < visible[:, None], j[None, :], -1)
                else:
                    new_keys = self._compress(cache, seg, layer, 4, ia[rows], is_[rows], w,
                                              "attn.indexer.compressor", freqs, is_indexer=True)
                    pool.write(f"index{layer}", seg.write_rows[4], new_keys)
                    index_keys = pool.read(f"index{layer}", seg.read_rows[4])
                    scores = ops.indexer_scores(qi[rows], hw[rows], index_keys.to(qi.dtype))
                    aseg.comp_idx = ops.select_topk(scores, visible, cfg.index_topk)
                aseg.entry_rows = seg.read_rows[ratio]
            attn_segments.append(aseg)
        backend = self._backend(cache)
        o = backend.attend(AttnBatch(
            q, kv, positions, attn_segments,
            ring=cache.slot_state["ring"][:, layer],
            ring_layout=backend.window_layout(cfg, cache.slot_state["ring"].dtype),
            entries=pool.tensors[f"main{layer}"] if ratio else None,
            entry_layout=pool.layouts[f"main{layer}"] if ratio else None,
            sink=w["attn.attn_sink"], scale=cfg.softmax_scale))
        out = ops.attention_output(o, w, positions, freqs, cfg)
        return self.parallel.reduce_attention(out) if self.parallel else out

    # ---- backend and devices ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.w["embed.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (that of the non-matrix weights)."""
        return self.w["hc_head_fn"].dtype

    def _positions(self, segments: list[_Segment]) -> Tensor:
        return torch.cat([torch.arange(s.start, s.end, device=self.device) for s in segments])

    @staticmethod
    def _backend(cache: V4Cache) -> AttentionBackend:
        # a cache that names no backend (e.g. one duck-typing V4Cache) stores float rows
        return getattr(cache, "backend", None) or TORCH_BACKEND

    def _check_backend(self, cache: V4Cache) -> None:
        backend = self._backend(cache)
        if backend.needs_quant_sim and not self.quant_sim:
            raise ValueError(f"attention backend {backend.name} stores KV in fp8, which is exact only for the "
                             "FP8/FP4-QAT'ed vectors: run the model with quant_sim=True")

    # ---- compressors -------------------------------------------------------------------------
    def _compress(self, cache: V4Cache, seg: _Segment, layer: int, ratio: int, a: Tensor, s: Tensor,
                  w: dict[str, Tensor], prefix: str, freqs: Tensor, is_indexer: bool) -> Tensor:
        """Advance one compressor over the chunk; -> the entries the chunk completes, [m, d]."""
        if ratio == 4:
            kind = "index" if is_indexer else "main"
            pooled = self._c4_step(cache, seg.req.slot, cache.c4_index[layer], kind, a, s, seg.start, seg.end)
        else:
            pooled = self._c128_step(cache, seg.req.slot, cache.c128_index[layer], a, s, seg.start, seg.end)
        first = torch.arange(seg.start // ratio, seg.end // ratio, device=a.device) * ratio
        return ops.finish_entries(pooled, w, prefix, first, freqs, self.cfg, is_indexer, self.quant_sim)

    @staticmethod
    def _c4_step(cache: V4Cache, slot: int, c4: int, kind: str, a: Tensor, s: Tensor, start: int,
                 end: int) -> Tensor:
        """Ratio-4 state: raw rows of positions 4*floor(P/4)-4 .. P-1 at row p % 8."""
        state_a = cache.slot_state[f"c4_{kind}_a"][slot, c4]
        state_s = cache.slot_state[f"c4_{kind}_s"][slot, c4]
        done_before, done_after = start // 4, end // 4
        first = 4 * done_before - 4  # first row the new entries need (group done_before - 1)
        held = torch.arange(max(first, 0), start, device=a.device) % C4_STATE_ROWS
        rows_a, rows_s = torch.cat((state_a[held], a)), torch.cat((state_s[held], s))
        if first < 0:  # group -1 does not exist
            rows_a = torch.cat((a.new_zeros(4, a.shape[1]), rows_a))
            rows_s = torch.cat((s.new_full((4, s.shape[1]), float("-inf")), rows_s))
        m = done_after - done_before
        pooled = ops.pool_c4(rows_a[: 4 * (m + 1)], rows_s[: 4 * (m + 1)])
        pos = torch.arange(start, end, device=a.device)
        keep = pos >= 4 * done_after - 4
        state_a[pos[keep] % C4_STATE_ROWS] = a[keep]
        state_s[pos[keep] % C4_STATE_ROWS] = s[keep]
        return pooled

    @staticmethod
    def _c128_step(cache: V4Cache, slot: int, c128: int, a: Tensor, s: Tensor, start: int,
                   end: int) -> Tensor:
        """Ratio-128 state: online softmax (max, sum, weighted sum) over the open group."""
        state = cache.slot_state["c128"][slot, c128]
        g0, n_groups = start // 128, (end - 1) // 128 - start // 128 + 1
        d = a.shape[1]
        grid_a = a.new_zeros(n_groups * 128, d)
        grid_s = s.new_full((n_groups * 128, d), float("-inf"))
        grid_a[start - 128 * g0:end - 128 * g0] = a
        grid_s[start - 128 * g0:end - 128 * g0] = s
        grid_a, grid_s = grid_a.view(n_groups, 128, d), grid_s.view(n_groups, 128, d)
        mx = grid_s.amax(1)
        e = torch.exp(grid_s - mx[:, None])
        total, acc = e.sum(1), (e * grid_a).sum(1)
        # merge the open group carried in from earlier chunks into the first group
        m0 = torch.maximum(state[0], mx[0])
        c_old, c_new = torch.exp(state[0] - m0), torch.exp(mx[0] - m0)
        total[0] = state[1] * c_old + total[0] * c_new
        acc[0] = state[2] * c_old + acc[0] * c_new
        mx[0] = m0
        n_done = end // 128 - g0
        if end % 128:
            state.copy_(torch.stack((mx[-1], total[-1], acc[-1])))
        else:
            state[0].fill_(float("-inf"))
            state[1:].zero_()
        return acc[:n_done] / total[:n_done]
