"""The incremental V4 model: prefill chunks of any size and single-token decode over a cache.

A forward takes a batch of (request, new token ids) and runs as one batched step (``step``):
every op runs once over all tokens of the batch, and the cache work (compressor state, entries,
indexer top-k, window rings) is vectorised over the batch's requests through index tensors built
before the step from host lengths. Nothing inside a layer loops over requests or syncs with the
host. The attention itself (window ring + selected entries + sink) goes to the cache's attention
backend (``kernels.backend``) in one call per layer, which also owns the storage format.

The cache is reached only through ``step.V4CacheView``; the same code runs over the reference
cache (``cache.V4Cache``) and the serving one (``srt.state.SglangV4Cache``), on CPU and GPU.
On the CPU every position's result is independent of how its sequence was chunked (GEMM rows
padded, fixed-width entry tables, sequential C128 pooling), so cut prefills and decode give
the logits of an uncut prefill bit for bit. On the GPU the same holds only in the opt-in
deterministic mode (``deterministic=True``): every forward runs over exactly
``step.DETERMINISTIC_TILE`` token rows, every step (decode too) through the backend's prefill
kernel, and the indexer's dot products in float64 (exact for its fp4-valued operands).
"""

from __future__ import annotations

from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Sequence

import torch

from ..config import V4Config
from ..kernels.backend import TORCH_BACKEND, AttentionBackend, AttnBatch
from ..kernels import fp8_linear, fp8_moe
from ..kernels.fp8_linear import Fp8Act, Fp8Weight, prepare as prepare_fp8
from ..kernels.kv_layout import RowLayout
from . import ops
from .branches import Branches
from .cache import RequestState
from .compiled import on_gpu
from .slot_state import C4_STATE_ROWS
from .step import (CPU_TOKEN_TILE, DETERMINISTIC_TILE, StepBatch, TokenIds, V4CacheView, build_step,
                   pad_step, step_tables, tile_pieces, token_lens)

if TYPE_CHECKING:
    from .parallel import DataParallelTokens, ModelParallel

Tensor = torch.Tensor


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


def _c4_window_rows(step: StepBatch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``V4Model._c4_compress``' addressing, the same in every C4 layer and kind: (per token the
    8 rows its window pools [T, 8], in the concatenation [slot states' rows (B * 8); the chunk's
    rows (T); a padding row], and where its row goes in a layer's state [slots, 8, 2d]: (slot,
    row) per token, the request's slot for its last 8 positions, the scratch slot's else)."""
    return _c4_window_rows_of(step.positions, step.tok_req, step.starts, step.ends, step.row0, step.slots,
                              step.scratch_slot)


@on_gpu(rows={"positions": (0,), "tok_req": (0,), "starts": (0,), "ends": (0,), "row0": (0,), "slots": (0,)})
def _c4_window_rows_of(positions: Tensor, tok_req: Tensor, starts: Tensor, ends: Tensor, row0: Tensor,
                       slots: Tensor, scratch_slot: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """``_c4_window_rows`` on the step's tensors: one fused region on the GPU."""
    R, B, T = C4_STATE_ROWS, slots.shape[0], positions.shape[0]
    pos, b = positions, tok_req
    qpos = pos[:, None] - (R - 1) + torch.arange(R, device=pos.device)
    start = starts[b][:, None]
    idx = torch.where(qpos >= start, B * R + row0[b][:, None] + qpos - start,
                      torch.where(qpos >= 0, b[:, None] * R + qpos % R, B * R + T))
    keep = pos >= ends[b] - R
    return idx, (torch.where(keep, slots[b], scratch_slot), pos % R)


def _token_columns(step: StepBatch) -> Tensor:
    """[T] each token's column in its request's row of ``StepBatch.token_grid``."""
    return torch.arange(step.num_tokens, device=step.tok_req.device) - step.row0[step.tok_req]


def _c128_rows(step: StepBatch, scratch_row: int, width: int, visible: Tensor,
               layout: RowLayout) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """The C128 layers' addressing, the same in each: (where each segment's entry goes, located
    in ``layout``'s pages: its pool row, the scratch row where it completes no group; per token
    its visible entries 0..v-1, -1 padded to the table's ``width``)."""
    seg = step.c128
    dst = torch.where(seg.completes, step.tables.write_rows[128][seg.last_tok], scratch_row)
    j = torch.arange(width, device=visible.device)
    return layout.locate(dst), torch.where(j[None, :] < visible[:, None], j[None, :], -1)


class V4Model:
    """Incremental V4 forward (float32 on CPU; any device the weights live on).

    Activations (residual streams, norms, compressor pooling, softmaxes) take the dtype of the
    non-matrix weights; matrices may be narrower (``weight_dtypes``): ``ops.linear`` runs each GEMM
    in the matrix's dtype.

    With ``parallel`` (a ``parallel.ModelParallel``), ``weights`` are one rank's shards
    (``parallel.shard_model`` makes them) and the attention output and MoE are reduced over its
    process groups; None is the single-process model.

    ``deterministic`` (opt-in; see the module docstring) makes every position's result
    independent of the chunking and of the batch on any device, at the cost of running each
    forward in pieces of ``DETERMINISTIC_TILE`` rows (``benchmarks/bench_decode.py --paths
    graphs,graphs-det`` measures it). On the CPU it changes no result: the default path is
    invariant there already.
    """

    def __init__(self, cfg: V4Config, weights: dict[str, Tensor], quant_sim: bool = True,
                 parallel: ModelParallel | None = None, deterministic: bool = False):
        self.cfg, self.w, self.quant_sim, self.parallel = cfg, weights, quant_sim, parallel
        self.deterministic = deterministic
        self.layers = [ops.layer_view(weights, f"layers.{i}") for i in range(cfg.num_hidden_layers)]
        self.mtp = [ops.layer_view(weights, f"mtp.{m}") for m in range(cfg.num_mtp_layers)]
        # "fp8" when the loader kept the checkpoint's matrices quantised (``checkpoint.loader``'s
        # weight_mode; ops.linear / grouped_experts dispatch on the weights' type), else "bf16"
        self.weight_mode = "fp8" if any(isinstance(v, Fp8Weight) for v in weights.values()) else "bf16"
        if self.weight_mode == "fp8":
            prepare_fp8(self.device)  # the dense GEMMs' backend, fixed before anything is traced
        if (self.weight_mode == "fp8" and self.device.type == "cuda") or ops.grouped_mm_available(
                self.device, weights["embed.weight"].dtype):
            self._stack_experts()
        if ops.STACK_X and self.device.type == "cuda":
            self._stack_x_matrices()
        elif ops.STACK_COMPRESSOR and self.device.type == "cuda":
            self._stack_compressor_matrices()
        self.branches = Branches(self.device)  # a layer's independent chains (side streams where on)
        self.graphs = None  # DecodeGraphs once enable_cuda_graphs() is called
        self.extend_graphs = None  # ExtendGraphs once enable_cuda_graphs(extend=True) is called

    def enable_cuda_graphs(self, max_batch: int = 256, extend: bool = False) -> None:
        """Replay decode steps of up to ``max_batch`` requests from CUDA graphs (captured per batch
        bucket and entry-table widths on first use; ``core.graphs``). In the deterministic mode
        there is one bucket, ``DETERMINISTIC_TILE``, whatever ``max_batch`` (every decode piece is
        padded to it). ``extend``: also short extends of a few requests (``core.extend_graphs``;
        not in the deterministic mode, whose pieces have one shape already)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {self.device}")
        if self.data_parallel is not None:
            raise ValueError("CUDA graphs of the decode step are not built under data-parallel attention "
                             "(each step starts with a host exchange of the ranks' row counts)")
        from .graphs import DecodeGraphs

        if self.deterministic:  # one graph shape: every decode piece is padded to the tile
            self.graphs = DecodeGraphs(self, DETERMINISTIC_TILE, buckets=(DETERMINISTIC_TILE,))
        else:
            self.graphs = DecodeGraphs(self, max_batch)
            if extend:
                from .extend_graphs import ExtendGraphs

                self.extend_graphs = ExtendGraphs(self)

    def precapture_graphs(self, cache: V4CacheView, max_end: int) -> tuple[list, list]:
        """Capture the graphs ``enable_cuda_graphs`` turned on for steps whose longest request
        ends at up to ``max_end`` tokens now, instead of on their first use: the decode step of
        every batch bucket, and with extend graphs the extends of one request in every token
        bucket, at each entry-table width up to that length (``graphs.width_classes``). A
        server does this at start-up so no request waits for a compile or a capture of a shape
        it is the first to need. -> (decode keys, extend shapes) captured now."""
        if self.graphs is None:
            raise ValueError("precapture_graphs needs enable_cuda_graphs first")
        decode = self.graphs.precapture(cache, max_end)
        extend = self.extend_graphs.precapture(cache, max_end) if self.extend_graphs is not None else []
        return decode, extend

    def _stack_experts(self) -> None:
        """Stacked expert matrices for the GPU's grouped GEMM (bf16: ``torch._grouped_mm``; fp8:
        ``kernels.fp8_moe``); per-expert entries become views. With ``fp8_moe.FOLD_SHARED`` the
        fp8 stacks take the shared expert too, where every expert is held here and the MoE is
        ``ops.moe`` (one process, or tensor parallelism alone)."""
        par = self.parallel
        experts = par.local_experts(self.cfg) if par else range(self.cfg.n_routed_experts)
        fold = fp8_moe.FOLD_SHARED and (par is None or (par.ep_size == 1 and par.dp is None))
        for prefix, lw in self._layer_views():
            if f"ffn.experts.{experts.start}.w1.weight" in lw:
                ops.stack_experts(lw, experts, fold_shared=fold)
                self.w.update({f"{prefix}.{k}": v for k, v in lw.items()
                               if k.startswith(("ffn.experts.", ops.SHARED_EXPERT + "."))})

    def _layer_views(self) -> list[tuple[str, dict[str, Tensor]]]:
        """(name prefix in ``self.w``, layer view) of every main and MTP layer."""
        return [(f"layers.{i}", lw) for i, lw in enumerate(self.layers)] + [(f"mtp.{m}", lw) for m, lw in enumerate(self.mtp)]

    def _stack_x_matrices(self) -> None:
        """Each attention sublayer's input matrices stacked by storage kind (``ops.stack_x_matrices``:
        wq_a + wkv, the compressors' + the indexer's), one GEMM each instead of up to seven; the
        model's per-matrix entries become views of the stacks."""
        for prefix, lw in self._layer_views():
            if ops.stack_x_matrices(lw):
                self.w.update({f"{prefix}.{n}": lw[n] for n in ops.X_MATRICES if n in lw})

    def _stack_compressor_matrices(self) -> None:
        """Each compressor's wkv and wgate stacked (``ops.stack_compressor_matrices``), one GEMM a
        compressor; the model's per-matrix entries become views of the stacks."""
        for prefix, lw in self._layer_views():
            for stack in ops.stack_compressor_matrices(lw):
                name = stack.removesuffix(ops.KV_GATE)
                self.w.update({f"{prefix}.{name}.{m}.weight": lw[f"{name}.{m}.weight"] for m in ("wkv", "wgate")})

    # ---- main model ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds,
                return_streams: bool = False, return_hidden: bool = False, flat: bool = False):
        """Process ``ids[i]`` as the next tokens of ``reqs[i]`` (``ids``: a 1-D tensor per request,
        or one [B, L] tensor when each request brings L tokens, e.g. a decode step's [B, 1]).

        -> logits per request ([n_i, V]) or, with return_hidden, the normed final hidden states the
        head is applied to ([n_i, D]); with return_streams also the final residual streams per
        request ([n_i, hc, D], the MTP block's input); with ``flat`` one tensor of all requests'
        rows in order instead of a list. Advances each request's ``num_tokens``.
        Raises ValueError (too long) or CacheCapacityError before touching any state; in the
        deterministic mode a step cut into pieces commits piece by piece, so a capacity error in
        a later piece leaves the earlier pieces done (the serving cache's pools grow on demand).
        """
        self._check_inputs(cache, reqs, ids)
        if self.deterministic:
            pieces = tile_pieces(token_lens(ids), DETERMINISTIC_TILE)
            if len(pieces) > 1:
                return self._forward_pieces(cache, reqs, ids, pieces, return_streams, return_hidden, flat)
        return self._forward_once(cache, reqs, ids, return_streams, return_hidden, flat)

    def _forward_pieces(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds,
                        pieces: list[list[tuple[int, int, int]]], return_streams: bool, return_hidden: bool,
                        flat: bool):
        """``forward`` as consecutive steps over ``pieces`` (``step.tile_pieces``): a request cut
        between pieces continues in the next one, as in a chunked prefill."""
        outs, streams = [], []
        for piece in pieces:  # in request order, each request's tokens in order: flat rows concatenate
            got = self._forward_once(cache, [reqs[i] for i, _, _ in piece], [ids[i][lo:hi] for i, lo, hi in piece],
                                     return_streams, return_hidden, True)
            out, h = got if return_streams else (got, None)
            # copies: a graph replay returns views of its output buffers, which the next
            # piece's replay of the same graph overwrites
            outs.append(out.clone())
            if h is not None:
                streams.append(h.clone())
        out = torch.cat(outs)
        h = torch.cat(streams) if return_streams else None
        if not flat:
            lens = token_lens(ids)
            out = list(torch.split(out, lens))
            h = list(torch.split(h, lens)) if h is not None else None
        return (out, h) if return_streams else out

    def _forward_once(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds,
                      return_streams: bool, return_hidden: bool, flat: bool):
        """``forward`` as one step (inputs checked)."""
        if self.graphs is not None:
            replayed = self.graphs.run(cache, reqs, ids)  # None: not a decode step, or too large
            if replayed is not None:
                h, out = replayed
                for req in reqs:
                    req.num_tokens += 1
                return self._per_request(h, out, [1] * len(reqs), return_streams, return_hidden, flat)
        if self.extend_graphs is not None:
            replayed = self.extend_graphs.run(cache, reqs, ids)  # None: not a short extend
            if replayed is not None:
                lens = token_lens(ids)
                # copies: the replay's outputs are views of its graph's buffers, which the next
                # replay of that graph overwrites (a chunk cut at a fork point replays it twice)
                h, out = (t[:sum(lens)].clone() for t in replayed)
                for req, n in zip(reqs, lens):
                    req.num_tokens += n
                return self._per_request(h, out, lens, return_streams, return_hidden, flat)
        step = build_step(reqs, ids, [r.num_tokens for r in reqs], cache.layout.scratch_slot(cache.slot_state),
                          self.device, with_c128=bool(self.cfg.c128_layers))
        step.tables = step_tables(cache, reqs, step)
        step = self._pad(cache, step)
        if self.data_parallel is not None:
            self.data_parallel.exchange(step.num_tokens)  # the MoE gathers every rank's rows
        h = self.forward_step(cache, step)
        for req, n in zip(reqs, step.real_lens):
            req.num_tokens += n
        # the head's input norm runs over the padded rows too (CPU: no row in a loop tail)
        return self._per_request(h, self.head_input(h), step.real_lens, return_streams, return_hidden, flat)

    def _pad(self, cache: V4CacheView, step: StepBatch) -> StepBatch:
        """Pad the step's tokens to a multiple of ``DETERMINISTIC_TILE`` in the deterministic mode
        (exactly one tile: ``forward`` cuts longer steps; MTP steps are not cut), to a multiple of
        ``CPU_TOKEN_TILE`` on the CPU (see there); as is elsewhere."""
        if self.deterministic:
            tile = DETERMINISTIC_TILE
        elif self.device.type == "cpu":
            tile = CPU_TOKEN_TILE
        else:
            return step
        return pad_step(step, tile, {r: p.scratch_row for r, p in cache.pools.items()})

    def forward_step(self, cache: V4CacheView, step: StepBatch) -> Tensor:
        """The batched step on device tensors only: -> final residual streams [T, hc, D]."""
        cfg = self.cfg
        h = self.w["embed.weight"][step.ids].to(self.dtype).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        done = None
        for i, lw in enumerate(self.layers):
            h, done = self._block(h, done, lw, i, cfg.layer_ratios[i], step, cache, hash_routed=i < cfg.num_hash_layers)
        return ops.hc_expand(h, done)

    def head_input(self, h: Tensor, w: dict[str, Tensor] | None = None) -> Tensor:
        """Final streams [T, hc, D] -> the normed hidden states the head is applied to [T, D]."""
        w = w or self.w
        y = ops.hc_head(h, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], self.cfg)
        return ops.rms_norm(y, w["norm.weight"], self.cfg.rms_norm_eps)

    def _per_request(self, h: Tensor, hidden: Tensor, lens: list[int], return_streams: bool,
                     return_hidden: bool, flat: bool):
        """The caller's outputs from the streams and head input of a step's rows (see ``forward``):
        the real rows first (``sum(lens)``), then any padding rows, which are dropped."""
        n = sum(lens)
        h = h[:n]
        out = hidden[:n] if return_hidden else self.logits(hidden[:n])
        if flat:
            return (out, h) if return_streams else out
        per_req = list(torch.split(out, lens))
        if return_streams:
            return per_req, list(torch.split(h, lens))
        return per_req

    def logits(self, hidden: Tensor) -> Tensor:
        head = self.w.get("head.weight")
        if head is None:  # the SGLang model class keeps the head in its vocab-parallel lm_head
            raise RuntimeError("this model holds no head.weight (the server's lm_head computes the logits): "
                               "call forward(..., return_hidden=True)")
        return self.head_logits(hidden, head)

    def head_logits(self, hidden: Tensor, head: Tensor) -> Tensor:
        """The head GEMM: hidden [n, D] @ head.T (a vocab-parallel rank passes its rows). The
        deterministic mode runs it over blocks of exactly ``DETERMINISTIC_TILE`` rows: a GPU
        GEMM's result for a row depends on the row count (cuBLAS picks its kernel by it), and
        V4-Flash's 4096-wide head takes split-K kernels at small counts. The server's head is
        this too (``srt.model.CoreHeadMethod``)."""
        if self.deterministic:
            return ops.tiled_linear(hidden, head, DETERMINISTIC_TILE)
        return ops.linear(hidden, head)

    def serve_other_ranks(self) -> None:
        """Data-parallel attention (``parallel.DataParallelTokens``): join the other ranks' passes
        with zero rows of this rank's own until no rank has one left. Every rank calls it once per
        scheduler step, after its own forward (an idle rank instead of one); a no-op otherwise."""
        dp = self.data_parallel
        if dp is None:
            return
        x = torch.zeros(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        while dp.exchange(None):
            for i, lw in enumerate(self.layers):
                self.parallel.moe(x, ids, lw, self.cfg, hash_routed=i < self.cfg.num_hash_layers)

    # ---- MTP ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_mtp(self, cache: V4CacheView, reqs: Sequence[RequestState], streams: Sequence[Tensor],
                    next_ids: Sequence[Tensor]) -> list[Tensor]:
        """MTP positions mtp_num_tokens.. of each request: row t pairs the main streams at t with
        token t+1 and predicts token t+2. -> logits per request."""
        cfg, w = self.cfg, self.mtp[0]
        layer = cfg.num_hidden_layers
        if cfg.compress_ratios[layer]:
            raise NotImplementedError(f"an MTP layer with compress ratio {cfg.compress_ratios[layer]}")
        if self.data_parallel is not None:
            raise NotImplementedError("MTP under data-parallel attention")
        for req, t in zip(reqs, next_ids):
            if req.mtp_num_tokens + t.numel() > req.num_tokens:
                raise ValueError("MTP cannot run ahead of the main model")
        self._check_backend(cache)
        step = build_step(reqs, next_ids, [r.mtp_num_tokens for r in reqs],
                          cache.layout.scratch_slot(cache.slot_state), self.device, with_c128=False)
        step = self._pad(cache, step)
        streams = torch.cat(list(streams))
        streams = torch.cat((streams, streams.new_zeros((step.num_tokens - streams.shape[0],) + streams.shape[1:])))
        h = ops.mtp_input(streams, step.ids, self.w["embed.weight"], w, cfg)
        h = ops.hc_expand(*self._block(h, None, w, layer, 0, step, cache, hash_routed=False))
        for req, n in zip(reqs, step.real_lens):
            req.mtp_num_tokens += n
        return self._per_request(h, self.head_input(h, w), step.real_lens, False, False, False)

    # ---- blocks ----------------------------------------------------------------------------
    def _block(self, h: Tensor, done: ops.SublayerOutput | None, w: dict[str, Tensor], layer: int, ratio: int,
               step: StepBatch, cache: V4CacheView, hash_routed: bool) -> tuple[Tensor, ops.SublayerOutput]:
        """One layer on the streams ``h`` and the previous layer's MoE output ``done`` (not yet in
        them: each sublayer boundary expands one output and reduces the next input at once,
        ``ops.hc_boundary``) -> (streams, this layer's MoE output, likewise not yet in them)."""
        cfg = self.cfg
        fused = self.boundary_kernel(step)
        h, x, post, comb, act = self._boundary(h, done, w, "attn", fused)
        attn = ops.SublayerOutput(self._attention(x, w, layer, ratio, step, cache, act), post, comb)
        h, x, post, comb, act = self._boundary(h, attn, w, "ffn", fused)
        par = self.parallel
        if par is None and self.branches.on and ops.separate_shared_expert(w, cfg):
            # the routed experts and the shared expert side by side; hc_post adds them (routed +
            # shared, the sum ops.moe makes)
            routed, shared = self.branches.run([lambda: ops.routed_experts(x, step.ids, w, cfg, hash_routed, act=act),
                                                lambda: ops.shared_expert(x, w, cfg, act=act)])
            return h, ops.SublayerOutput(routed, post, comb, shared)
        f = par.moe(x, step.ids, w, cfg, hash_routed) if par else ops.moe(x, step.ids, w, cfg, hash_routed, act)
        return h, ops.SublayerOutput(f, post, comb)

    def _boundary(self, h: Tensor, done: ops.SublayerOutput | None, w: dict[str, Tensor], sublayer: str,
                  fused: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Fp8Act | None]:
        """``ops.hc_boundary`` into ``sublayer`` (attn / ffn) -> (streams, its input x, post, comb,
        x's fp8 GEMM operands where the boundary kernel wrote them: the fp8 weight mode only)."""
        fp8 = self.weight_mode == "fp8"
        got = ops.hc_boundary(h, done, w[f"hc_{sublayer}_fn"], w[f"hc_{sublayer}_base"], w[f"hc_{sublayer}_scale"],
                              self.cfg, norm=w[f"{sublayer}_norm.weight"], kernel=fused, quantized=fp8)
        return got if fp8 else (*got, None)

    def boundary_kernel(self, step: StepBatch) -> bool:
        """Whether the step's sublayer boundaries may take the boundary kernel (``ops.hc_boundary``,
        which also bounds the rows): a decode step (one token a request), and every piece of the
        deterministic mode, whose decode and prefill must run the same ops. A prefill chunk keeps
        the torch ops at any length, so chunkings of a prompt give the same bits whatever their
        lengths (``tests/srt/test_state_gpu.py``): the kernel rounds otherwise, and it is there for
        the decode batch's launches. Decided once a step (every layer asks)."""
        return step.derived(("boundary_kernel",), lambda: self.deterministic or step.is_decode)

    def _attention(self, x: Tensor, w: dict[str, Tensor], layer: int, ratio: int, step: StepBatch,
                   cache: V4CacheView, act: Fp8Act | None = None) -> Tensor:
        """The attention sublayer. Its independent chains (the queries, the window KV, each
        compressor with its entry writes) are the parts of one ``branches.run``: side by side on
        CUDA streams where that is on, in this order otherwise. Every index tensor they share is
        derived here first, on the calling stream. ``act``: x's fp8 GEMM operands, if made."""
        cfg, qs, pos = self.cfg, self.quant_sim, step.positions
        freqs = ops.layer_inv_freqs(cfg, ratio, self.device)  # one set for ratio 0, one for the others
        rope = step.derived(("rope", ratio > 0), lambda: ops.rope_at(pos, freqs))
        backend = self._backend(cache)
        # x through the stacked input matrices at once, before the chains fork ({} where none)
        xp = ops.x_projections(x, w)

        # qr quantised once for both of its fp8 GEMMs (wq_b and the indexer's), on the GPU
        shared_qr = (ratio == 4 and x.is_cuda and fp8_linear.SHARED_OPERANDS
                     and isinstance(w["attn.wq_b.weight"], Fp8Weight)
                     and isinstance(w["attn.indexer.wq_b.weight"], Fp8Weight))

        def queries():
            q, qr, *qa = ops.project_q(x, w, rope, cfg, backend.query_dtype, xp.get("attn.wq_a.weight"), act,
                                       qr_act=shared_qr)
            return q, qr, (ops.indexer_queries(x, qr, w, rope, cfg, qs, xp.get("attn.indexer.weights_proj.weight"),
                                               qa[0] if qa else None) if ratio == 4 else None)

        parts = [queries, lambda: ops.project_kv(x, w, rope, cfg, qs, xp.get("attn.wkv.weight"), act)]
        comp_idx = table = entries = entry_layout = None
        if ratio:
            pool, table = cache.pools[ratio], step.tables.entry_rows[ratio]
            visible = step.derived(("visible", ratio), lambda: (pos + 1) // ratio)
            main = f"main{layer}"
            # x cast once for the compressors' GEMMs (bf16 matrices), before the chains fork
            # (stacked, their products are in xp already)
            xc = x if xp else ops.compressor_input(x, w)
        if ratio == 4:
            windows = self._c4_windows(step, freqs)
            for kind, prefix, name in (("main", "attn.compressor", main),
                                       ("index", "attn.indexer.compressor", f"index{layer}")):
                parts.append(partial(self._c4_compress, cache, step, xc, xp, w, cache.c4_index[layer], kind, prefix,
                                     pool, name, self._write_rows(step, pool, name, 4), windows))
        elif ratio == 128:
            layout = pool.layouts[main]
            dst, comp_idx = step.derived(("c128_entries", table.shape[1], layout.page_size),
                                         lambda: _c128_rows(step, pool.scratch_row, table.shape[1], visible, layout))
            parts.append(partial(self._c128_compress, step, xc, xp, w, pool, main, dst,
                                 self._c128_segments(step, cache, cache.c128_index[layer], freqs)))
        (q, qr, index_q), kv = self.branches.run(parts)[:2]
        if ratio:
            if ratio == 4:
                comp_idx = self._select(backend, pool, f"index{layer}", table, step, *index_q, visible)
            entries, entry_layout = pool.tensors[main], pool.layouts[main]
        o = backend.attend(AttnBatch(
            q, kv, step, ring=cache.slot_state["ring"][:, layer],
            ring_layout=cache.layout.ring, comp_idx=comp_idx, entry_table=table,
            entries=entries, entry_layout=entry_layout, sink=w["attn.attn_sink"], scale=cfg.softmax_scale,
            decode_kernel=not self.deterministic, ratio=ratio))
        out = ops.attention_output(o, w, rope, cfg, x.dtype)
        return self.parallel.reduce_attention(out) if self.parallel else out

    @staticmethod
    def _write_rows(step: StepBatch, pool, name: str, ratio: int):
        """The step's new ratio-``ratio`` entry rows located in ``name``'s pages, once per step
        (every C4 layer writes the same rows to each of its tensors)."""
        layout = pool.layouts[name]
        return step.derived(("write_rows", ratio, layout.page_size),
                            lambda: layout.locate(step.tables.write_rows[ratio]))

    # ---- compressors (batched over the step's requests) -------------------------------------
    @staticmethod
    def _c4_windows(step: StepBatch, freqs: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor], ops.Rope]:
        """The C4 layers' window addressing (``_c4_window_rows``) and each token's rotation at its
        group's first position, derived once per step."""
        idx, dst = step.derived(("c4_windows",), lambda: _c4_window_rows(step))
        rope = step.derived(("rope_c4_entries",), lambda: ops.rope_at(step.positions - 3, freqs))  # group starts
        return idx, dst, rope

    def _c4_compress(self, cache: V4CacheView, step: StepBatch, x: Tensor, xp: dict[str, Tensor],
                     w: dict[str, Tensor], c4: int, kind: str, prefix: str, pool, name: str, rows,
                     windows: tuple[Tensor, tuple[Tensor, Tensor], ops.Rope]) -> None:
        """One ratio-4 compressor of a layer (``kind`` main or index): per token t at position p,
        the entry its 8-row window (positions p-7..p) pools, finished and written to ``name`` at
        ``rows`` (the scratch row where p completes no group). Then the chunk's last 8 rows of
        each request become its state (rows at p % 8). x: in the compressor matrices' dtype
        (``ops.compressor_input``); ``xp``: x's stacked projections, if any."""
        a, s = ops.compressor_gemms(x, w, prefix, xp.get(f"{prefix}.wkv.weight"), xp.get(f"{prefix}.wgate.weight"))
        # this layer's states [slots, 8, 2d] (views); rows before the chunk come from them, rows
        # inside it from the chunk
        st_a, st_s = cache.slot_state[f"c4_{kind}_a"][:, c4], cache.slot_state[f"c4_{kind}_s"][:, c4]
        idx, dst, rope = windows
        pool.write(name, rows, ops.c4_entries(a, s, st_a, st_s, step.slots, idx, dst, w, prefix, rope, self.cfg,
                                              kind == "index", self.quant_sim, step.positions))

    @staticmethod
    def _c128_segments(step: StepBatch, cache: V4CacheView, c128: int, freqs: Tensor
                       ) -> tuple[Tensor, Tensor, ops.Rope]:
        """A C128 layer's segment inputs: (its states [slots, 3, d] (a view), each segment's slot,
        each segment's rotation at its group's first position), the latter two once per step."""
        seg = step.c128
        slots = step.derived(("c128_slots",), lambda: step.slots[step.tok_req[seg.last_tok]])
        rope = step.derived(("rope_c128_entries",), lambda: ops.rope_at(seg.first_pos, freqs))
        return cache.slot_state["c128"][:, c128], slots, rope

    def _c128_compress(self, step: StepBatch, x: Tensor, xp: dict[str, Tensor], w: dict[str, Tensor], pool,
                       name: str, dst, segments: tuple[Tensor, Tensor, ops.Rope]) -> None:
        """A layer's ratio-128 compressor: online-softmax pooling of every (request, group)
        segment of the step, position by position; the segments' entries written to ``name`` at
        ``dst`` (real where the segment completes its group, else to the scratch row). x: in the
        compressor matrices' dtype (``ops.compressor_input``)."""
        a, s = ops.compressor_gemms(x, w, "attn.compressor", xp.get("attn.compressor.wkv.weight"),
                                    xp.get("attn.compressor.wgate.weight"))
        seg, (state, slots, rope) = step.c128, segments
        pool.write(name, dst, ops.c128_entries(a, s, seg.tok, seg.width, seg.carry, slots, state, seg.completes,
                                               seg.store_slot, w, rope, self.cfg, self.quant_sim, step.positions))

    def _select(self, backend: AttentionBackend, pool, name: str, table: Tensor, step: StepBatch, qi: Tensor,
                hw: Tensor, visible: Tensor) -> Tensor:
        """Indexer top-k per token among its request's visible entries -> entry indices [T, k].
        The scores come from the backend's fused kernel where it has one (the GPU's fp8 keys),
        else from the keys read back (the deterministic mode: always, its dots are exact)."""
        scores = None if self.deterministic else backend.index_scores(qi, hw, pool.tensors[name], pool.layouts[name],
                                                                      table, step.tok_req)
        if scores is None:
            scores = self._index_scores(pool, name, table, step, qi, hw)
        return ops.select_topk(scores, visible, self.cfg.index_topk)

    def _index_scores(self, pool, name: str, table: Tensor, step: StepBatch, qi: Tensor, hw: Tensor) -> Tensor:
        """The indexer's scores [T, N] in torch: each request's keys read back, scored per request.
        The dots are exact (float64 over the QAT'ed operands) in the deterministic mode and on the
        CPU: there a fp32 GEMM's summation order is MKL's choice by shape and machine (the rows
        are tokens x heads, which chunking changes), and a near-tie of the top-k turns any
        difference into another selection; exact dots leave nothing for the shape to decide."""
        exact = self.deterministic or qi.device.type == "cpu"
        B, N = table.shape
        rows, grid, col = step.derived(("indexer", N, pool.layouts[name].page_size),
                                       lambda: (pool.layouts[name].locate(table.clamp_min(0).flatten()),
                                                step.token_grid().clamp_min(0), _token_columns(step)))
        keys = pool.read(name, rows).view(B, N, -1).to(qi.dtype)  # grid [B, L]: padding rows compute garbage
        L = grid.shape[1]
        scores = torch.empty(B, L, N, dtype=qi.dtype, device=qi.device)
        for l0 in range(0, L, self.SCORE_BLOCK):     # bounds the [B, block, Hi, N] products
            gb = grid[:, l0:l0 + self.SCORE_BLOCK]
            scores[:, l0:l0 + self.SCORE_BLOCK] = ops.batched_indexer_scores(qi[gb], hw[gb], keys, exact=exact)
        return scores[step.tok_req, col]

    SCORE_BLOCK = 256

    # ---- checks, backend and devices ---------------------------------------------------------
    def _check_inputs(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds) -> None:
        self._check_backend(cache)
        if len(reqs) != len(ids) or not reqs:
            raise ValueError(f"{len(reqs)} requests with {len(ids)} token tensors")
        if len({r.slot for r in reqs}) != len(reqs):
            raise ValueError("a request appears twice in one step")
        if isinstance(ids, Tensor):  # L tokens each: the longest request is the one to check
            if ids.dim() != 2 or ids.shape[1] == 0:
                raise ValueError(f"token ids of a batch must be a [requests, tokens] tensor, got shape "
                                 f"{tuple(ids.shape)}")
            cache.check_length(max(reqs, key=attrgetter("num_tokens")), ids.shape[1])
            return
        for req, t in zip(reqs, ids):
            if t.dim() != 1 or t.numel() == 0:
                raise ValueError(f"token ids must be a non-empty 1-D tensor, got shape {tuple(t.shape)}")
            cache.check_length(req, t.numel())

    @property
    def data_parallel(self) -> DataParallelTokens | None:
        """The data-parallel attention exchange (``parallel.DataParallelTokens``), if any."""
        return self.parallel.dp if self.parallel is not None else None

    @property
    def device(self) -> torch.device:
        return self.w["embed.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (that of the non-matrix weights)."""
        return self.w["hc_head_fn"].dtype

    @staticmethod
    def _backend(cache: V4CacheView) -> AttentionBackend:
        return getattr(cache, "backend", None) or TORCH_BACKEND

    def _check_backend(self, cache: V4CacheView) -> None:
        backend = self._backend(cache)
        if backend.needs_quant_sim and not self.quant_sim:
            raise ValueError(f"attention backend {backend.name} stores KV in fp8, which is exact only for the "
                             "FP8/FP4-QAT'ed vectors: run the model with quant_sim=True")
