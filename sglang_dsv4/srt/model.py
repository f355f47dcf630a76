"""``DeepseekV4ForCausalLM`` as SGLang instantiates it: a thin adapter around ``core.V4Model``.

SGLang gives each forward a batch of requests (rows of ``req_to_token``) with their cached prefix
and new tokens; we bind each row to its V4 request state (``state.SglangV4Cache``), run the core
model, take the snapshots the radix cache asked for at divergence points, and hand the final
hidden states to SGLang's LogitsProcessor (sampling, logprobs, grammar masks stay SGLang's).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterable

import torch
from torch import nn

from ..checkpoint.loader import logical_from_stored
from ..config import V4Config
from ..core.model import V4Model, weight_dtypes
from ..core.parallel import DataParallelTokens, ModelParallel, TensorSharder
from ..core.step import DETERMINISTIC_TILE
from ..kernels.weight_mode import WEIGHTS_KEY, select_weight_mode
from .pool_sizing import (CUDA_GRAPH_MAX_BS_KEY, CUDA_GRAPH_PRECAPTURE_KEY, DETERMINISTIC_KEY, SNAPSHOT_BUDGET_KEY,
                          cache_backend)
from .state import SglangV4Cache

logger = logging.getLogger(__name__)


def override_count(config, key: str, unset: int | None = 0) -> int | None:
    """The model override ``key`` of ``config`` as a count >= 0 (``unset`` when absent); a ValueError
    naming the key and the value otherwise (raised while the server loads, before any request)."""
    value = getattr(config, key, None)
    if value is None:
        return unset
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"--json-model-override-args {key}: expected a whole number >= 0, got {value!r}")
    return value


class CoreHeadMethod:
    """The head GEMM of SGLang's LogitsProcessor, as the core computes it.

    SGLang calls ``lm_head.quant_method.apply(lm_head, hidden, bias)`` for the logits when the
    method is not one of its plain ones (``logits_processor.should_apply_lm_head_quant_method``),
    which it otherwise computes with one matmul over the batch's rows: a row's logits then
    depend on how many rows the batch has. This runs ``V4Model.head_logits`` on the rank's head
    rows instead, so the server's logits are the core's (patches/core-head.md)."""

    def __init__(self, core: V4Model):
        self.core = core

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """SGLang's loader calls this on every module's method: the head is loaded as it is."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.core.head_logits(x, layer.weight)
        return y if bias is None else y + bias


class DeepseekV4ForCausalLM(nn.Module):
    """SGLang model class for V4 checkpoints, backed by the two-segment cache."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

        self.config = config
        self.v4 = V4Config.from_dict(config.to_dict())
        self.lm_head = ParallelLMHead(self.v4.vocab_size, self.v4.hidden_size)
        self.logits_processor = LogitsProcessor(config)
        self.core: V4Model | None = None
        self.cache: SglangV4Cache | None = None
        self.metrics = None
        # SGLANG_DSV4_SYNC_DEBUG=warn|error: torch's CUDA sync debug mode around each forward of
        # ours (the host syncs in our part of a step, where the overlap scheduler would lose them)
        self.sync_debug = os.environ.get("SGLANG_DSV4_SYNC_DEBUG") or None
        # where each forward hands SGLang's overlap scheduler the event after its last read of
        # req_to_token (``SglangV4Cache.end_forward``): set by the plugin from the model runner
        # (patches/read-done-event.md); None: SGLang fences on the whole forward
        self.publish_read_done: Callable[[torch.cuda.Event | None], None] | None = None

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors as stored (fp8 + scales, packed fp4, ...) -> this rank's core weights."""
        # GEMMs in SGLang's --dtype (bf16 on GPU; the CPU launcher picks float32), activations fp32
        matmul_dtype, device = self.lm_head.weight.dtype, self.lm_head.weight.device
        par = self._model_parallel()
        shard = None if par is None else TensorSharder(self.v4, par.tp_rank, par.tp_size, par.ep_rank, par.ep_size)
        # --dsv4-weights (model override dsv4_weights): auto | bf16 | fp8; a forced mode that cannot
        # run here (fp8 without CUDA SM90+ / Triton, or on a bf16-expert checkpoint) fails here
        mode, why = select_weight_mode(getattr(self.config, WEIGHTS_KEY, None), device, self.v4,
                                       tp_size=1 if par is None else par.tp_size)
        logger.info("sglang_dsv4 weights: %s", why)
        # streamed: each tensor is dequantised (or kept fp8), sharded and moved as soon as its parts arrived
        tensors = logical_from_stored(self.v4, weights, weight_dtypes(matmul_dtype), device=device, shard=shard,
                                      weight_mode=mode)
        # SGLang's vocab-parallel head takes this rank's rows; its logits processor gathers them
        self.lm_head.weight_loader(self.lm_head.weight, tensors["head.weight"])
        if par is None:
            tensors["head.weight"] = self.lm_head.weight.data  # one copy of the head
        else:
            # the server's logits come from SGLang's lm_head (this rank's rows, gathered by its
            # logits processor) applied to the core's hidden states: a full copy would be dead
            # weight (~1 GB for V4) on every rank
            del tensors["head.weight"]
        # --dsv4-deterministic: every position's result independent of chunking and batch, on
        # the GPU too (core.model); its cost: benchmarks/bench_decode.py --paths graphs,graphs-det
        deterministic = _flag(getattr(self.config, DETERMINISTIC_KEY, False), DETERMINISTIC_KEY)
        self.core = V4Model(self.v4, tensors, parallel=par, deterministic=deterministic)
        if deterministic:
            logger.info("sglang_dsv4: deterministic mode: forwards in pieces of %d rows, decode through the "
                        "prefill kernel, exact indexer dots, head GEMMs over %d-row tiles",
                        DETERMINISTIC_TILE, DETERMINISTIC_TILE)
        if deterministic or device.type == "cpu":
            # the core's head GEMM where it differs from SGLang's plain matmul over the batch's
            # rows: row tiles on the CPU (ops.CPU_ROW_TILE), fixed-size tiles in the deterministic mode
            self.lm_head.quant_method = CoreHeadMethod(self.core)
        logger.info("sglang_dsv4: loaded %d V4 tensors (%s layers, ratios %s; matrices %s, activations "
                    "float32) on %s%s", len(tensors), self.v4.num_hidden_layers, list(self.v4.layer_ratios),
                    "fp8 block-128 (wo_a, embedding, head and bf16-stored ones %s)" % matmul_dtype
                    if mode == "fp8" else matmul_dtype, device, "" if par is None else
                    f"; rank tp {par.tp_rank}/{par.tp_size} ep {par.ep_rank}/{par.ep_size}"
                    + ("" if par is None or par.dp is None else f" (data-parallel attention over {par.dp.size} ranks)"))

    def _model_parallel(self) -> ModelParallel | None:
        """Our TP / EP groups from SGLang's (--tp-size, --ep-size); None on one rank. Attention
        splits heads over the TP group, routed experts split over the MoE-EP group. With
        data-parallel attention (--attn-dp-size = --tp-size = --ep-size) attention is not split
        and the MoE-EP group carries every rank's tokens (``core.parallel.DataParallelTokens``)."""
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.runtime_context import get_parallel

        tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_moe_expert_parallel_world_size()
        if tp == 1 and ep == 1:
            return None
        dp = int(getattr(get_parallel(), "attn_dp_size", 1) or 1)
        if dp > 1:
            # data-parallel attention: every rank runs all heads over its own requests, the
            # routed experts split over the EP group, which carries every rank's tokens
            if not dp == tp == ep:
                raise ValueError(f"sglang_dsv4: data-parallel attention needs --attn-dp-size = --tp-size = "
                                 f"--ep-size (got attn-dp {dp}, tp {tp}, ep {ep})")
            self.v4.validate_parallel(1, ep)
            group = ps.get_moe_ep_group()
            return ModelParallel(None, group.device_group, DataParallelTokens(group.device_group, group.cpu_group))
        self.v4.validate_parallel(tp, ep)
        return ModelParallel(ps.get_tp_group().device_group if tp > 1 else None,
                             ps.get_moe_ep_group().device_group if ep > 1 else None)

    # ---- forward ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, *args, **kwargs):
        if self.sync_debug is None or not torch.cuda.is_available():
            return self._forward(input_ids, forward_batch)
        torch.cuda.set_sync_debug_mode(self.sync_debug)
        try:
            return self._forward(input_ids, forward_batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def _forward(self, input_ids: torch.Tensor, forward_batch):
        fb = forward_batch
        cache = self.cache
        if cache is None:
            raise RuntimeError("sglang_dsv4: the V4 cache was not attached to SGLang's memory pools "
                               "(is the sglang_dsv4 plugin loaded?)")
        mode = fb.forward_mode
        dp = self.core.data_parallel is not None
        if dp:
            # data-parallel attention: SGLang runs an IDLE step on a rank without requests and
            # pads a decode batch with dummy rows (request row 0) up to the largest rank's; our
            # model runs the real rows only and joins the other ranks' MoE passes after them
            real = int(getattr(fb, "_original_batch_size", fb.batch_size))
            if mode.is_idle() or real == 0:
                self.core.serve_other_ranks()
                self._read_done(None)
                hidden = input_ids.new_zeros((input_ids.shape[0], self.v4.hidden_size), dtype=self.lm_head.weight.dtype)
                return self.logits_processor(input_ids, hidden, self.lm_head, fb)
        # the scheduler's host copy of the rows (SGLang's for extends, plugin._decode_rows_on_the_host's
        # for decodes): no device-to-host sync per step; the host work below is whole-list
        # operations: a decode step's host cost is on the critical path unless SGLang's overlap
        # scheduler runs (patches/server-arg-overrides.md)
        rows_t = getattr(fb, "req_pool_indices_cpu", None)
        if rows_t is None:
            rows_t = fb.req_pool_indices.cpu()  # waits for the device (the step before, under overlap)
            cache.stats["rows_read_back"] += 1
        rows = rows_t.tolist()
        generations = self.req_generation[rows_t.long()].tolist()  # a host tensor: one gather
        if mode.is_extend():
            prefix_lens, new_lens = list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)
        else:
            new_lens = None  # one token each
            prefix_lens = (fb.seq_lens_cpu - 1).tolist()
        all_ids, padded_tokens = input_ids, input_ids.shape[0]
        if dp:  # dummy rows of a padded batch (decode: dummy requests; extend: trailing tokens)
            rows, generations, prefix_lens = rows[:real], generations[:real], prefix_lens[:real]
            new_lens = None if new_lens is None else new_lens[:real]
            input_ids = input_ids[:real if new_lens is None else sum(new_lens)]
        states = [cache.bind(r, g, p) for r, g, p in zip(rows, generations, prefix_lens)]
        # a decode batch stays one [B, 1] tensor (core.step.TokenIds)
        pieces = input_ids.view(-1, 1) if new_lens is None else list(torch.split(input_ids, new_lens))
        hidden = self._run(cache, rows, generations, states, pieces)
        read_done = cache.end_forward()
        # data-parallel attention: the other ranks' MoE passes below read no table of ours, but
        # a rank's forward is one collective; the scheduler fences on all of it
        self._read_done(None if dp else read_done)
        if dp:
            self.core.serve_other_ranks()
            if hidden.shape[0] < padded_tokens:
                hidden = torch.cat((hidden, hidden.new_zeros(padded_tokens - hidden.shape[0], hidden.shape[1])))
        input_ids = all_ids
        if new_lens is not None:
            cache.stats["prompt_tokens_computed"] += sum(new_lens)
        if self.metrics is not None:
            self.metrics.update()
        return self.logits_processor(input_ids, hidden, self.lm_head, fb)

    def _read_done(self, event: torch.cuda.Event | None) -> None:
        if self.publish_read_done is not None:
            self.publish_read_done(event)  # every forward: never an earlier forward's event

    def _run(self, cache: SglangV4Cache, rows: list[int], generations: list[int], states, pieces):
        """Core forward; a request with a wanted snapshot inside its chunk is cut there, run in
        passes, and snapshotted between them."""
        points, cuts = [], []
        if not cache.pending_forks.keys().isdisjoint(rows):  # some row wants a snapshot (most steps: none)
            for row, gen, st, ids in zip(rows, generations, states, pieces):
                end = st.num_tokens + ids.numel()
                points.append(cache.fork_points(row, gen, st.num_tokens, end))
                cuts.append([0] + [p - st.num_tokens for p in points[-1] if p < end] + [ids.numel()])
        if all(len(c) == 2 for c in cuts):  # no cut: one pass, the core's rows already in batch order
            hidden = self.core.forward(cache, states, pieces, return_hidden=True, flat=True)
            for st, pts in zip(states, points):
                if st.num_tokens in pts:  # a fork point at the chunk's end
                    cache.take_snapshot(st)
            return hidden.to(self.lm_head.weight.dtype)
        outputs: list[list[torch.Tensor]] = [[] for _ in rows]
        for step in range(max(len(c) for c in cuts) - 1):
            todo = [i for i, c in enumerate(cuts) if step < len(c) - 1]
            hidden = self.core.forward(cache, [states[i] for i in todo],
                                       [pieces[i][cuts[i][step]:cuts[i][step + 1]] for i in todo],
                                       return_hidden=True)
            for i, h in zip(todo, hidden):
                outputs[i].append(h)
                if states[i].num_tokens in points[i]:
                    cache.take_snapshot(states[i])
        return torch.cat([torch.cat(o) for o in outputs]).to(self.lm_head.weight.dtype)

    def enable_decode_graphs(self, server_args) -> None:
        """CUDA graphs of our decode step (``core.graphs``), on a GPU unless turned off.

        SGLang's own graph runner is off for us (torch_native attention, patches/server-arg-
        overrides.md), so its flags are read here: ``--disable-cuda-graph`` turns ours off,
        ``--cuda-graph-max-bs`` bounds the batch; our model override key ``dsv4_cuda_graph_max_bs``
        (``--dsv4-cuda-graph-max-bs``) wins over both. Default: up to the max running requests.
        ``dsv4_cuda_graph_precapture_len`` N > 0 (``--dsv4-cuda-graph-precapture-len``): the
        graphs of requests up to N tokens are captured here, at start-up (``V4Model.precapture_graphs``),
        and the log lists them; otherwise each shape is captured on its first use."""
        upto = override_count(self.config, CUDA_GRAPH_PRECAPTURE_KEY)  # bad values fail on any device
        max_bs = override_count(self.config, CUDA_GRAPH_MAX_BS_KEY, unset=None)
        if self.core is None or self.core.device.type != "cuda":
            return
        if self.core.data_parallel is not None:
            logger.info("sglang_dsv4: CUDA graphs of the decode step are off under data-parallel attention")
            return
        if max_bs is None:
            if getattr(server_args, "disable_cuda_graph", False):
                max_bs = 0
            else:
                max_bs = (getattr(server_args, "cuda_graph_max_bs_decode", None)
                          or getattr(server_args, "cuda_graph_max_bs", None)
                          or self.cache.num_req_rows)
        if int(max_bs) <= 0:
            logger.info("sglang_dsv4: CUDA graphs of the decode step are off")
            return
        # short extends too (up to 8 requests, < 1024 tokens; core/extend_graphs.py): the flash8
        # server's 512-token TTFT 30 ms with them (221.7 ms eager, session 19); SGLANG_DSV4_EXTEND_GRAPHS=0
        # keeps extends eager
        extend = os.environ.get("SGLANG_DSV4_EXTEND_GRAPHS", "1") == "1"
        self.core.enable_cuda_graphs(int(max_bs), extend=extend)
        logger.info("sglang_dsv4: CUDA graphs of the decode step on, batch buckets %s (%s)",
                    list(self.core.graphs.buckets),
                    f"captured now for requests of up to {upto} tokens" if upto > 0 else "captured on first use")
        if self.core.extend_graphs is not None:
            logger.info("sglang_dsv4: CUDA graphs of extends on: up to %d requests, token buckets %s",
                        self.core.extend_graphs.max_requests, list(self.core.extend_graphs.buckets))
        if upto > 0:
            t0 = time.perf_counter()
            decode, extend_shapes = self.core.precapture_graphs(self.cache, min(upto, self.cache.max_seq_len))
            widths = sorted({w for _, w in decode})
            logger.info("sglang_dsv4: captured %d decode graphs (batch buckets %s x entry widths %s) and %d extend "
                        "graphs (1 request, token buckets %s) in %.1f s; %.2f GiB of device memory in use",
                        len(decode), sorted({b for b, _ in decode}), widths, len(extend_shapes),
                        sorted({s.tokens for s in extend_shapes}), time.perf_counter() - t0,
                        torch.cuda.memory_allocated() / 2**30)

    def attach_sglang_pools(self, req_to_token_pool, token_allocator, enable_metrics: bool = False) -> None:
        """Build the V4 cache beside SGLang's pools: one slot state per request row, one entry
        side-table position per token slot."""
        rows, max_len = req_to_token_pool.req_to_token.shape
        num_slots = int(token_allocator.size) + int(token_allocator.page_size) + 1
        budget_mb = getattr(self.config, SNAPSHOT_BUDGET_KEY, None)
        device = self.lm_head.weight.device
        self.cache = SglangV4Cache(self.v4, rows, num_slots, max_seq_len=max_len,
                                   snapshot_budget_bytes=None if budget_mb is None else int(budget_mb * 2**20),
                                   device=device, backend=cache_backend(self.v4, self.config, device))
        self.cache.req_to_token = req_to_token_pool.req_to_token
        self.req_generation = req_to_token_pool.req_generation  # bumped when a row changes hands
        per_req = self.cache.snapshot_bytes_each  # a request row's state = what a snapshot copies
        entry_bytes = {r: int(p.capacity * p.row_bytes) for r, p in self.cache.pools.items()}
        if enable_metrics:
            from .metrics import V4CacheMetrics

            self.metrics = V4CacheMetrics(self.cache)
            self.cache.metrics = self.metrics
        budget = self.cache.snapshot_budget_bytes
        logger.info("sglang_dsv4 memory: attention %s; rings + compressor state %d B (%d request rows x %d B, a "
                    "%d-token window each); compressed entries %d B (C4 %d B + C128 %d B, for %d "
                    "token slots, grown on demand); snapshots budget %d B (%d snapshots of %d B = "
                    "%d window tokens, LRU; set %s in --json-model-override-args)",
                    self.cache.backend.name, rows * per_req, rows, per_req, self.v4.sliding_window,
                    entry_bytes[4] + entry_bytes[128], entry_bytes[4], entry_bytes[128], num_slots,
                    budget, budget // per_req, per_req, budget // per_req * self.v4.sliding_window,
                    SNAPSHOT_BUDGET_KEY)


def _flag(value, key: str) -> bool:
    """A boolean model override (JSON true/false, or the strings "true"/"false"/"1"/"0")."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and str(value).strip().lower() in ("1", "true", "0", "false", ""):
        return str(value).strip().lower() in ("1", "true")
    raise ValueError(f"sglang_dsv4: model override {key} must be true or false, got {value!r}")
