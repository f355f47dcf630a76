"""Upstream SGLang 0.5.23's V4 prefix-cache policy, driven through its real classes on CPU.

Real: ``UnifiedRadixCache`` with the (FULL, SWA) components (tree core as selected by SGLang),
``SWATokenToKVPoolAllocator`` (page 256, SWA pool = 0.1 x full pool), ``ReqToTokenPool``, ``Req``,
``alloc_paged_token_slots_extend`` / ``_decode`` (which evict from the tree), ``checkpoint_kv_cache``,
``release_kv_cache`` and ``evict_sliding_windows``; retain window 128 as V4 configures it.

Stand-ins (see benchmarks/README.md): the KV storage is an ``SWAKVPool`` of MHA pools with one
layer, one head and head dim 1 (the tree and allocators only move indices; V4's own pool class
adds the compressed/indexer/state pools addressed by the same indices); the scheduler is this
module's loop: one request at a time, prefill in chunks of SGLang's H200 chunk size, then decode
one token per step with the scheduler's SWA-eviction cadence.
"""

from __future__ import annotations

import logging
from array import array

import torch

from .common import H200_CHUNK, V4Costs
from .traces import Request

PAGE = 256
SWA_RATIO = 0.1
WINDOW = 128
EVICTION_INTERVAL = 128  # SGLANG_SWA_EVICTION_INTERVAL


def _install_server_args() -> None:
    """``Req`` reads process-wide serving config; install SGLang's defaults once (no server runs)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    logging.getLogger("sglang").setLevel(logging.ERROR)
    try:
        runtime_context.get_serving()
    except ValueError:
        runtime_context._CONTEXT.set_server_args(ServerArgs(model_path="unused"))


def pool_pages(budget_bytes: float, costs: V4Costs) -> tuple[int, int]:
    """(full pages, SWA pages) that ``budget_bytes`` buys at upstream's V4 sizing: the SWA pool holds
    ``SWA_RATIO`` x the full pool's tokens, each full token costs ``up_full_token`` and each SWA
    token ``up_swa_token``."""
    full_tokens = budget_bytes / (costs.up_full_token + SWA_RATIO * costs.up_swa_token)
    full_pages = max(4, int(full_tokens // PAGE))
    return full_pages, max(2, int(full_pages * SWA_RATIO))


class UpstreamSim:
    """Upstream's V4 policy at a total byte budget; ``serve`` requests one at a time."""

    name = "upstream"

    def __init__(self, budget_bytes: float, costs: V4Costs | None = None, chunk: int = H200_CHUNK,
                 max_context: int = 1 << 17, pages: tuple[int, int] | None = None):
        _install_server_args()
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.costs = costs or V4Costs.flash()
        self.chunk = chunk
        full_pages, swa_pages = pages or pool_pages(budget_bytes, self.costs)
        self.full_size, self.swa_size = full_pages * PAGE, swa_pages * PAGE
        kv = SWAKVPool(size=self.full_size, size_swa=self.swa_size, page_size=PAGE, dtype=torch.bfloat16,
                       head_num=1, head_dim=1, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                       device="cpu", enable_memory_saver=False)
        self.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=max_context, device="cpu",
                                                enable_memory_saver=False)
        self.allocator = SWATokenToKVPoolAllocator(self.full_size, self.swa_size, page_size=PAGE,
                                                   dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                                   need_sort=False, req_to_token_pool=self.req_to_token_pool)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=PAGE,
                                 chunked_prefill_size=chunk, sliding_window_size=WINDOW,
                                 tree_components=(ComponentType.FULL, ComponentType.SWA))
        self.tree = UnifiedRadixCache(params)
        self._n = 0

    # ---- one request through the scheduler's call sequence (integration_facts.md §2) ----------
    def serve(self, req: Request) -> int:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode, alloc_paged_token_slots_extend
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.sampling.sampling_params import SamplingParams

        tree, r2t = self.tree, self.req_to_token_pool.req_to_token
        L, outputs = len(req.prompt), list(req.output) or [0]  # max_new_tokens=0 still samples once
        sp = SamplingParams(max_new_tokens=len(req.output), ignore_eos=True)
        sp.normalize(None)
        self._n += 1
        r = Req(f"r{self._n}", "", array("q", req.prompt), sp, vocab_size=1 << 20)
        # arrival: match, take a row, lock the matched node
        r.init_next_round_input(tree)
        cached = pos = r.prefix_len
        prefix = tree.prefix_device_indices(r) if pos else None
        (row,) = self.req_to_token_pool.alloc([r])
        if pos:
            r2t[row, :pos] = prefix.to(r2t.dtype)
        r.kv.kv_allocated_len = r.kv.kv_committed_len = pos
        r.lock = tree.lock(r.last_node)
        # prefill in chunks, each published by a checkpoint (the last one too, unless finished)
        while pos < L:
            end = min(pos + self.chunk, L)
            r.extend_end = end
            last_loc = r2t[row, pos - 1:pos].long() if pos else torch.tensor([-1])
            out = alloc_paged_token_slots_extend(
                tree, prefix_lens=torch.tensor([pos]), prefix_lens_cpu=torch.tensor([pos]),
                seq_lens=torch.tensor([end]), seq_lens_cpu=torch.tensor([end]), last_loc=last_loc,
                extend_num_tokens=end - pos)
            r2t[row, pos:end] = out.to(r2t.dtype)
            r.kv.kv_allocated_len = r.kv.kv_committed_len = end
            if end == L:
                r.output_ids.append(outputs[0])
                r.update_finish_state()
                if r.finished():
                    release_kv_cache(r, tree, checkpoint=True)
                    return cached
            checkpoint_kv_cache(r, tree)
            pos = end
        # decode, one token per step, sliding the request's window on the scheduler's cadence
        for step, tok in enumerate(outputs[1:]):
            seqlen = r.seqlen
            if step >= 1 and seqlen - 1 - WINDOW >= r.kv.get_evicted_seqlen(ComponentType.SWA) + EVICTION_INTERVAL:
                tree.evict_sliding_windows(r, seqlen - 1)
            kv = r.kv.kv_committed_len
            out = alloc_paged_token_slots_decode(
                tree, seq_lens=torch.tensor([kv + 1]), seq_lens_cpu=torch.tensor([kv + 1]),
                last_loc=r2t[row, kv - 1:kv].long())
            r2t[row, kv] = int(out[0])
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
            r.output_ids.append(tok)
            r.update_finish_state()
        assert r.finished(), "request did not finish"
        release_kv_cache(r, tree, checkpoint=True)
        return cached

    # ---- end-of-trace probes ------------------------------------------------------------------
    def resumable(self, history: tuple[int, ...]) -> int:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(max_new_tokens=1)
        sp.normalize(None)
        self._n += 1
        r = Req(f"probe{self._n}", "", array("q", history + (1,)), sp, vocab_size=1 << 20)
        r.init_next_round_input(self.tree)
        return r.prefix_len

    def resume_points(self) -> None:
        return None
