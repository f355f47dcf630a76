"""SGLang plugin entry point (group ``sglang.srt.plugins``): serve V4 with our model and cache.

SGLang keys its own V4 machinery (paged SWA pool, page size 256, SWA allocator, the ``dsv4``
attention backend, the V4 radix-tree components) on the architecture string. We keep the string
(real checkpoints resolve to our class) and steer each of those switches through SGLang's
extension points; ``patches/`` lists every one with the upstream function it changes.
"""

from __future__ import annotations

import logging
import os
from functools import partial

logger = logging.getLogger(__name__)

ARCH = "DeepseekV4ForCausalLM"
RADIX_BACKEND = "dsv4"


def _is_ours(architecture: str | None) -> bool:
    return architecture == ARCH


def register() -> None:
    """Called by SGLang's plugin loader in the launcher, scheduler and detokenizer processes."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _register_model_override()
    HookRegistry.register("sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults",
                          _skip_v4_defaults, HookType.AROUND)
    HookRegistry.register("sglang.srt.configs.model_config.is_deepseek_v4",
                          _not_upstream_v4, HookType.AROUND)
    HookRegistry.register("sglang.srt.utils.hf_transformers.config.get_config",
                          _hide_quantization_config, HookType.AFTER)
    HookRegistry.register("sglang.srt.configs.update_config.adjust_config_with_unaligned_cpu_tp",
                          _keep_config_under_cpu_tp, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
                          _pool_configurator, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
                          _placeholder_kv_pool, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.registry.default_radix_cache_factory",
                          _radix_cache_factory, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free_rows",
                          _after_request_rows_freed, HookType.AFTER)
    for allocator in ("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free",
                      "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free"):
        HookRegistry.register(allocator, _after_token_slots_freed, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components",
        _after_memory_pools, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
                          _after_prepare_for_extend, HookType.AFTER)
    HookRegistry.register("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
                          _decode_rows_on_the_host, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_req_pool",
        _after_idle_pool_check, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker.self_check_during_busy",
        _after_busy_pool_check, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        _with_cache_state, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.abort_request", _count_abort, HookType.AROUND)
    from . import thinking_hooks

    thinking_hooks.register(HookRegistry, HookType)  # the think budget (patches/thinking-budget.md)
    from . import request_validation

    request_validation.register(HookRegistry, HookType)  # bad prompts -> 400 (patches/request-validation.md)
    _register_model_class()
    _register_radix_backend()
    _dp_padding_fill_value()


def _dp_padding_fill_value() -> None:
    """Data-parallel attention on the CPU: SGLang pads a rank's decode batch up to the largest
    rank's with dummy rows whose seq_lens come from the attention backend's
    ``get_cpu_graph_seq_len_fill_value`` (``ForwardBatch._pad_inputs_to_size``), which
    torch_native, the SGLang-side backend of our model, lacks. Our model never reads the dummy
    rows (it runs the real rows only), so any length does: 1, as SGLang's CUDA backends give."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1


# ---- what each hook does --------------------------------------------------------------------

def _register_model_override() -> None:
    """Replace upstream's V4 server-arg overrides (dsv4 backend, page 256, SWA ratio) with ours:
    an ordinary full-attention pool of page size 1 (token-granular prefix matches), and SGLang's
    attention backend set to torch_native: our model runs its own attention (FlashMLA or torch,
    ``kernels/``), so SGLang's backend is never called, and torch_native allocates no workspace
    and turns SGLang's CUDA graph capture off (our model captures its own decode graphs,
    ``core/graphs.py``). SGLang's overlap scheduler is left as its flags set it (on unless
    ``--disable-overlap-schedule``): exact with our cache (patches/server-arg-overrides.md)."""
    import sglang.srt.arg_groups.overrides  # noqa: F401  (registers upstream's overrides first)
    from sglang.srt.arg_groups.model_override_base import _MODEL_OVERRIDE_FNS, register_model_override

    _MODEL_OVERRIDE_FNS.pop(ARCH, None)

    @register_model_override(ARCH)
    def _dsv4_overrides(server_args, hf_config) -> dict:
        return {"disable_hybrid_swa_memory": True, "page_size": 1, "attention_backend": "torch_native"}


def _skip_v4_defaults(original, server_args, model_arch, *args, **kwargs):
    """Upstream's V4 defaults (fp8 KV, flashmla backend, 256 running requests) target its pool."""
    if _is_ours(model_arch):
        return None
    return original(server_args, model_arch, *args, **kwargs)


def _not_upstream_v4(original, config, *args, **kwargs):
    """Keep upstream's V4 KV pool, loader and scheduler special cases away from our model."""
    architectures = getattr(config, "architectures", None) or []
    if ARCH in architectures:
        return False
    return original(config, *args, **kwargs)


def _hide_quantization_config(config, *args, **kwargs):
    """Our model reads the fp8/fp4 checkpoint formats itself (``checkpoint.schema``): SGLang must
    not build its Fp8 linear methods, MoE block checks or dtype rules around it."""
    if ARCH in (getattr(config, "architectures", None) or []):
        config.quantization_config = None
    return config


def _keep_config_under_cpu_tp(original, model_config, *args, **kwargs):
    """On CPU with TP, SGLang pads head counts (and makes the one KV head two) when they do not
    divide the TP size; our model splits its heads itself (``core.parallel``, checked by
    ``V4Config.validate_parallel``), so its config stays as the checkpoint says."""
    if ARCH in (getattr(model_config.hf_config, "architectures", None) or []):
        return model_config
    return original(model_config, *args, **kwargs)


def _pool_configurator(original, kvc, *args, **kwargs):
    """Size the token pool by our cache's bytes per token, after reserving rings and snapshots."""
    if ARCH in (getattr(kvc.model_config.hf_config, "architectures", None) or []):
        from .pool_sizing import make_pool_configurator

        return make_pool_configurator(kvc)
    return original(kvc, *args, **kwargs)


def _placeholder_kv_pool(original, kvc, *args, **kwargs):
    """Our model keeps its KV in ``state.SglangV4Cache``: SGLang's generic pool only needs to keep
    its capacity accounting, which its ``NoOpMHATokenToKVPool`` does without storage."""
    if ARCH in (getattr(kvc.model_config.hf_config, "architectures", None) or []):
        from sglang.srt.mem_cache.memory_pool import NoOpMHATokenToKVPool

        kwargs["mha_pool_class"] = NoOpMHATokenToKVPool
    return original(kvc, *args, **kwargs)


def _radix_cache_factory(original, ctx):
    """Our snapshot-aware radix cache for our model; upstream's choice for every other model."""
    architectures = getattr(ctx.model_config.hf_config, "architectures", None) or []
    if ARCH in architectures and not ctx.disable_radix_cache:
        from .radix_cache import SnapshotRadixCache

        return SnapshotRadixCache(ctx.params)
    return original(ctx)


def _after_token_slots_freed(result, allocator, free_index, *args, **kwargs):
    """Token slots went back to the allocator: drop the compressed entries and snapshots they own.

    A free inside a free group is deferred by the allocator; it is seen again at the group's end.
    """
    if getattr(allocator, "free_group", None) is None:
        from .state import on_token_slots_freed

        on_token_slots_freed(free_index)
    return result


def read_done_enabled() -> bool:
    """``SGLANG_DSV4_READ_DONE=1``: each forward hands SGLang's overlap scheduler the event after
    its last read of ``req_to_token`` (patches/read-done-event.md). Opt-in until the GPU server
    has run with it (on the CPU SGLang has no such fence: nothing to publish)."""
    return os.environ.get("SGLANG_DSV4_READ_DONE", "0") == "1"


def _after_memory_pools(result, runner, *args, **kwargs):
    """SGLang's pools exist now: size our V4 cache from them (the model holds no reference), and
    with ``read_done_enabled`` let the model publish its forwards' read-done events on the runner."""
    attach = getattr(getattr(runner, "model", None), "attach_sglang_pools", None)
    if attach is not None:
        from .state import register_serving_cache

        enable_metrics = bool(getattr(runner.server_args, "enable_metrics", False))
        attach(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, enable_metrics)
        register_serving_cache(runner.model.cache)  # the one way our hooks reach it (state.py)
        runner.model.enable_decode_graphs(runner.server_args)
        if read_done_enabled():
            runner.model.publish_read_done = partial(setattr, runner, "shared_read_done_event")
    return result


def _after_prepare_for_extend(result, batch, *args, **kwargs):
    """Rows are known now: pass each request's wanted snapshot positions to the model's cache,
    and the snapshot a resuming request's match found (so its bind reads no slot back)."""
    from .radix_cache import FORK_ATTR, RESUME_ATTR
    from .state import serving_cache

    cache = serving_cache()
    if cache is not None:
        generations = batch.req_to_token_pool.req_generation
        for req in batch.reqs:
            row = req.kv.req_pool_idx
            if row is None:
                continue
            generation = int(generations[row])
            for position in getattr(req, FORK_ATTR, None) or []:
                cache.want_snapshot(row, generation, position)
            resume, snap = getattr(req, RESUME_ATTR, None) or (0, None)
            # a request continuing its chunked prefill is bound already; only its first chunk
            # resumes, from the prefix its match gave it (what prepare_for_extend just wrote)
            if resume and req.prefix_len == resume:
                cache.expect_resume(row, generation, resume, snap)
    return result


def _decode_rows_on_the_host(forward_batch, cls, batch, *args, **kwargs):
    """SGLang gives a forward its request rows on the host for extends only; our model binds each
    request's state by row before the step, so without them a decode step reads the device tensor
    back: a host sync, which under the overlap scheduler waits for the step still running. The
    rows are the batch's requests' own, in its order (``req_pool_indices`` is made from them)."""
    import torch

    from .state import serving_cache

    if (serving_cache() is not None and getattr(forward_batch, "req_pool_indices_cpu", None) is None
            and forward_batch.forward_mode.is_decode() and getattr(batch, "reqs", None)):
        forward_batch.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx for r in batch.reqs],
                                                          dtype=torch.int64)
    return forward_batch


def _after_idle_pool_check(result, checker, *args, **kwargs):
    """SGLang's idle self-check ran its pool checks: check our cache against what SGLang holds
    (the radix tree's token slots, the request rows in use), with the tree still populated."""
    from .state import serving_cache

    cache = serving_cache()
    if cache is not None:
        import torch
        from sglang.srt.environ import envs

        from .radix_cache import SnapshotRadixCache

        # SGLang calls this on every pass of its idle loop: the audit, and the tree walk for it,
        # only when due (a quiet spell after a change; after every change under SGLang's per-step
        # check, a debugging mode the fuzz tests run: its strict idle check is on by default)
        if not cache.idle_audit_due(immediate=envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY.get() > 0):
            cache.refresh_metrics()
            return result
        tree = getattr(checker, "tree_cache", None)
        live = None  # another tree (radix cache off): no liveness check, the rest still runs
        if isinstance(tree, SnapshotRadixCache) and not tree.disable:
            # (upstream's all_values_flatten fails on an empty tree)
            live = tree.all_values_flatten() if tree.evictable_size() + tree.protected_size() > 0 \
                else torch.empty(0, dtype=torch.long)
        cache.run_integrity_check(live_slots=live, live_rows=_rows_in_use(checker.req_to_token_pool))
    return result


def _rows_in_use(pool) -> list[int]:
    """SGLang's request rows in use: the complement of ``ReqToTokenPool.free_slots``."""
    free = set(int(r) for r in pool.free_slots)
    return [r for r in range(pool.req_to_token.shape[0]) if r not in free]


def _after_busy_pool_check(result, checker, *args, **kwargs):
    """SGLang's per-step self-check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``, after every
    forward step) ran its pool checks: check our cache too, with requests mid-flight, and make a
    failure fatal as SGLang's own busy check does (the scheduler stops with the message).

    Live token slots are those SGLang's allocator has not got back (tree, running and chunked
    requests alike): an entry or snapshot on a slot the allocator holds as free was missed by the
    free hooks."""
    from .state import serving_cache

    cache = serving_cache()
    if cache is None or checker.get_last_batch() is None:
        return result  # no step ran this iteration (SGLang's check returned early too)
    import torch

    alloc = checker.token_to_kv_pool_allocator
    free_pages = alloc.get_all_free_pages()
    live = None
    if free_pages is not None:
        page = int(alloc.page_size)
        held = torch.ones(int(alloc.size) + page, dtype=torch.bool)
        held[:page] = False  # page 0: SGLang's padding page, never handed out
        held[(free_pages.long().cpu()[:, None] * page + torch.arange(page)).flatten()] = False
        live = torch.nonzero(held).flatten()
    cache.run_integrity_check(live_slots=live, live_rows=_rows_in_use(checker.req_to_token_pool), strict=True)
    return result


def _with_cache_state(result, controller, *args, **kwargs):
    """``/server_info``'s ``internal_states`` (``Engine.get_server_info``) carry our cache's event
    counts and current usage as ``dsv4_cache``, with SGLang's forward step count: how tests and
    operators read them without ``--enable-metrics``."""
    from .state import serving_cache

    cache = serving_cache()
    state = getattr(result, "internal_state", None)
    if cache is not None and isinstance(state, dict):
        state["dsv4_cache"] = {**cache.stats, **cache.usage(),
                               "forward_steps": int(getattr(controller.scheduler, "forward_ct", 0))}
    return result


def _count_abort(original, scheduler, recv_req, *args, **kwargs):
    """Count a client abort by where SGLang finds the request (``aborts_queued``, ``_mid_prefill``:
    the chunked-prefill request, ``_running``: decoding), then abort it unchanged."""
    from .state import serving_cache

    cache, rid = serving_cache(), getattr(recv_req, "rid", None)
    if cache is not None and rid and not getattr(recv_req, "abort_all", False):
        chunked = scheduler.chunked_req
        if chunked is not None and chunked.rid.startswith(rid):
            cache.stats["aborts_mid_prefill"] += 1
        elif any(r.rid.startswith(rid) for r in scheduler.waiting_queue):
            cache.stats["aborts_queued"] += 1
        elif any(r.rid.startswith(rid) and not r.finished() for r in scheduler.collect_inflight_reqs()):
            cache.stats["aborts_running"] += 1
    return original(scheduler, recv_req, *args, **kwargs)


def _after_request_rows_freed(result, pool, indices, *args, **kwargs):
    """A request row went back to SGLang: its ring and compressor state are free."""
    from .state import on_request_rows_freed

    on_request_rows_freed(list(indices))
    return result


def _register_model_class() -> None:
    from sglang.srt.models.registry import ModelRegistry

    from .model import DeepseekV4ForCausalLM

    ModelRegistry.models[ARCH] = DeepseekV4ForCausalLM


def _register_radix_backend() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(RADIX_BACKEND) is None:
        def factory(ctx):
            from .radix_cache import SnapshotRadixCache

            return SnapshotRadixCache(ctx.params)

        register_radix_cache_backend(RADIX_BACKEND, factory)
