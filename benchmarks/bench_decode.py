"""Decode-step speed on the GPU, in-process: this tree's batched step vs an older code path.

    python -m benchmarks.bench_decode [--old-root DIR] [--configs tiny,flash8] [--batches 1,8,64]
        [--contexts 1024,16384] [--steps 20] [--rounds 1] [--weights bf16,fp8] [--out FILE.md]

For each config x batch x context: one request is prefilled to the context, B requests resume
from its snapshot (sharing its compressed entries), and decode steps are timed. The new path runs
over the serving cache (``srt.state.SglangV4Cache``, device-resident tables) driven as SGLang
drives it; the old path (``--old-root``: a ``sglang_dsv4`` package of an earlier commit, imported
as ``sglang_dsv4_old``, e.g. ``git archive 521fd56 sglang_dsv4``) over its reference cache. Both
share one set of random bf16 weights and run in this one process, side by side.

Paths: ``before`` (the old package), ``batched`` (this tree, eager), ``graphs`` (this tree, decode
replayed from CUDA graphs, ``V4Model.enable_cuda_graphs``), and ``batched-det`` / ``graphs-det``
(the same in the deterministic mode, ``V4Model(deterministic=True)``: its cost). Columns: step ms (median over ``--steps`` after warm-up, the GPU drained around each step), tok/s
(B / step), pipelined ms (steps issued back to back: host work overlaps the GPU), kernel launches and
host syncs per step (inside the steps; a graph replay counts no launch), GPU busy % (the GPU's
kernel time per step, the union of its kernels' intervals in the torch profiler over 3 back-to-back
steps, over the pipelined step time measured without the profiler: the share of a pipelined step
the GPU computes) and GPU busy % under the profiler (the same kernel time over the profiled
steps' own wall time, the figure of sessions 1-27: the profiler's host cost per op and the first
step's host work, when the GPU waits, count against it),
the step's roofline (bytes it must read: the matrices it touches, the experts its tokens route to,
the window and the compressed entries it attends to, the indexer keys it scores; over the
device-to-device copy bandwidth measured in the same run), step / roofline and pipelined / roofline
(the step as an overlap scheduler sees it, its host work hidden behind the GPU's), floor ms and
step / floor (``step_floor``: each GEMM and attention read bound by its bytes or by its FLOPs over
the matmul peak measured in the same run, ``matmul_peaks``, whichever is larger: the limit where
a large batch's GEMMs turn compute-bound, which the bytes-only roofline would understate); prefill s: the
context's prefill in chunks of 2048 (the first path of each config also compiles the fused ops);
spread %: with ``--rounds R`` (R > 1) a case's paths are all built, then timed in turns R times
(``time_in_turns``: a drift of clocks or host load falls on every path alike; the step columns
are medians over the rounds), and this is the pipelined time's (max - min) / median over them.
A single pass measured the same kernels 3.60 and 4.03 ms apart at batch 1 (session 31).

``--switches default,none,hc_fused_pre,fp8_cublas``: each new path once per set of the switched GPU
kernels (``+``-joined names, exactly those on; ``none``: all off; ``default``: as the process
started, the shipped defaults under the environment's overrides), side by side in this process,
the path column naming the set (``graphs+fp8_cublas``, ``graphs+none``): ``hc_fused_pre`` =
``SGLANG_DSV4_HC_FUSED_PRE`` (``kernels.hc_split``), ``fp8_cublas`` = ``SGLANG_DSV4_FP8_GEMM=cublas``
(``kernels.fp8_cublas``), ``fold_shared`` = ``SGLANG_DSV4_FOLD_SHARED=1`` (the shared expert in
the fp8 expert stacks, ``kernels.fp8_moe``; read when a path's model is built), ``kv_fused_write``
= ``SGLANG_DSV4_KV_FUSED_WRITE=1`` (the KV rows quantised inside their store's launch,
``kernels.kv_store``), ``branch_streams`` = ``SGLANG_DSV4_BRANCH_STREAMS=1`` (a layer's
independent chains on side streams, ``core.branches``), ``moe_fused_swiglu`` =
``SGLANG_DSV4_MOE_FUSED_SWIGLU=1`` (the routed experts' SwiGLU as GEMM 1's epilogue,
``kernels.fp8_moe``), ``stack_x`` = ``SGLANG_DSV4_STACK_X=1`` (an attention sublayer's input
matrices stacked by storage kind, one GEMM each, ``core.ops``; read when a path's model is
built), ``stack_compressor`` = ``SGLANG_DSV4_STACK_COMPRESSOR=1`` (each compressor's wkv and
wgate stacked, one GEMM a compressor; read when a path's model is built), ``pdl`` =
``SGLANG_DSV4_PDL=1`` (this package's Triton kernels launched with
programmatic dependent launch, ``kernels.pdl_triton``). The switches are read per call; a path's
graphs keep what was on while they were captured.

``--weights bf16,fp8``: each case in each weight mode (the ``weights`` column): ``bf16`` the
dequantised matrices above, ``fp8`` random checkpoint-format tensors loaded in the fp8 weight
mode (fp8 block-128 matrices, fp4 experts converted to fp8; ``kernels.weight_mode``), ``fp8+wo_a``
the same with ``attn.wo_a`` kept fp8 (``SGLANG_DSV4_WO_A_FP8``, read at load); the roofline counts the bytes each mode's weights hold (fp8: 1 B per value plus scales). The old
path runs in bf16 only.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from sglang_dsv4.checkpoint.loader import logical_from_stored
from sglang_dsv4.checkpoint.schema import Storage, checkpoint_tensors
from sglang_dsv4.checkpoint.writer import random_stored
from sglang_dsv4.config import V4Config
from sglang_dsv4.core.model import V4Model, weight_dtypes
from sglang_dsv4.kernels import fp8_linear
from sglang_dsv4.kernels.fp8_linear import Fp8Weight, weight_nbytes
from sglang_dsv4.kernels.kv_layout import V4_TOKEN_BYTES
from sglang_dsv4.srt.state import SglangV4Cache
from sglang_dsv4 import tiny
from sglang_dsv4.tiny import PRESETS


def make_config(name: str, max_len: int) -> V4Config:
    if name not in PRESETS:  # e.g. a .bench-prev package from before tiny.FLASH_PRESETS (16a5e12)
        raise SystemExit(f"unknown config {name!r}: the package at {Path(tiny.__file__).parent} has "
                         f"{', '.join(PRESETS)}")
    d = dict(PRESETS[name])  # micro / tiny, or V4-Flash dimensions cut in depth (tiny.FLASH_PRESETS)
    d["max_position_embeddings"] = max(max_len, d.get("max_position_embeddings", 0))
    d.pop("quantization_config", None)
    return V4Config.from_dict(d)


def random_weights(cfg: V4Config, device: str, matmul_dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random logical weights made on the device (the rules of ``tiny``'s init, scaled alike)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype_of = weight_dtypes(matmul_dtype)
    out = {}
    for spec in checkpoint_tensors(cfg):
        name, shape, leaf = spec.name, spec.shape, spec.name.rsplit(".", 1)[-1]
        if spec.storage is Storage.INT64:
            vocab, k = shape
            out[name] = torch.rand(vocab, cfg.n_routed_experts, generator=g, device=device).argsort(1)[:, :k].contiguous()
            continue
        t = torch.randn(shape, generator=g, device=device)
        if name == "embed.weight" or leaf == "attn_sink":
            pass
        elif name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            t = 0.5 * t
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            t = 0.5 + torch.rand(shape, generator=g, device=device)
        elif leaf == "ape":
            t = 0.5 * t
        elif name.endswith("gate.bias"):
            t = 0.1 * t
        else:
            t = t * shape[1] ** -0.5
        out[name] = t.to(dtype_of(name))
    return out


def fp8_random_weights(cfg: V4Config, device: str, seed: int = 0) -> dict:
    """Random weights in the fp8 weight mode: random checkpoint-format tensors made on the device
    (``checkpoint.writer.random_stored``) loaded as the server loads them (fp8 matrices kept, fp4
    experts converted to fp8 block-128)."""
    return logical_from_stored(cfg, random_stored(cfg, device, seed), weight_dtypes(torch.bfloat16), device=device,
                               weight_mode="fp8")


def bench_weights(cfg: V4Config, device: str, mode: str) -> dict:
    """The weights of one ``--weights`` mode: bf16 (dequantised), fp8, fp8+wo_a (fp8 with
    ``attn.wo_a`` kept fp8 too, ``SGLANG_DSV4_WO_A_FP8``: a load-time choice, so a weight mode
    here rather than a switch), or fp32 (dequantised in float32, as the CPU server runs: for
    CPU-side comparisons)."""
    if mode in ("bf16", "fp32"):
        return random_weights(cfg, device, torch.bfloat16 if mode == "bf16" else torch.float32)
    if mode in ("fp8", "fp8+wo_a"):
        held = fp8_linear.GROUPED_WO_A
        fp8_linear.GROUPED_WO_A = mode == "fp8+wo_a"
        try:
            return fp8_random_weights(cfg, device)
        finally:
            fp8_linear.GROUPED_WO_A = held
    raise SystemExit(f"--weights: expected bf16, fp8, fp8+wo_a or fp32, got {mode!r}")


_STACKED = (".ffn.experts.w13", ".ffn.experts.w2", ".ffn.experts.fp8")


# ---- the roofline --------------------------------------------------------------------------

def step_reads(cfg: V4Config, w: dict, batch: int, ctx: int) -> Iterator[tuple[float, float, torch.dtype | None]]:
    """What a decode step of ``batch`` requests at context ``ctx`` must read and multiply, one
    item per weight, grouped GEMM or attention read: (bytes, FLOPs, the operands' dtype; None
    where nothing is multiplied). fp8 weights count their e4m3 values and scales; the routed
    experts of a layer are one grouped GEMM over the experts the batch touches (random routing),
    B * k expert rows of FLOPs."""
    expert_bytes, expert_numel, expert_dtype = {}, {}, {}
    for name, t in w.items():
        if name.endswith(_STACKED) or name.startswith("mtp."):
            continue  # the stacked experts (V4Model._stack_experts): their views count them; decode runs no MTP
        fp8 = isinstance(t, Fp8Weight)
        numel, dtype = (t.q.numel(), torch.float8_e4m3fn) if fp8 else (t.numel(), t.dtype)
        if ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():
            layer = name.split(".ffn.")[0]
            expert_bytes[layer] = expert_bytes.get(layer, 0) + weight_nbytes(t)  # all experts of the layer
            expert_numel[layer] = expert_numel.get(layer, 0) + numel
            expert_dtype[layer] = dtype
        elif name == "embed.weight":
            yield batch * t.shape[1] * t.element_size(), 0, None  # the batch's rows
        elif fp8 or (t.dim() == 2 and t.is_floating_point() and not name.endswith(".ape")):
            yield weight_nbytes(t), 2 * batch * numel, dtype  # a matrix every token goes through
        else:
            yield weight_nbytes(t), 0, None  # norms, biases, tables: read, not multiplied
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** batch)  # expected distinct experts per layer (random routing)
    for layer, b in expert_bytes.items():
        yield b / E * touched, 2 * batch * k * expert_numel[layer] / E, expert_dtype[layer]
    H, Dh, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    for r in cfg.layer_ratios:
        keys, kv = W, W * V4_TOKEN_BYTES
        if r == 4:
            n = ctx // 4
            keys += min(n, cfg.index_topk)
            kv += min(n, cfg.index_topk) * V4_TOKEN_BYTES
            # the indexer scores every visible entry: its fp8 keys (+ scale) against Hi heads
            yield (batch * n * (cfg.index_head_dim + 4), 2 * batch * cfg.index_n_heads * cfg.index_head_dim * n,
                   torch.float8_e4m3fn)
        elif r == 128:
            keys += ctx // 128
            kv += ctx // 128 * V4_TOKEN_BYTES
        yield batch * kv, 4 * batch * H * Dh * keys, torch.bfloat16  # the window and entries: QK and PV


def step_bytes(cfg: V4Config, w: dict, batch: int, ctx: int) -> float:
    """Bytes a decode step of ``batch`` requests at context ``ctx`` must read (``step_reads``)."""
    return sum(nbytes for nbytes, _, _ in step_reads(cfg, w, batch, ctx))


def step_floor(cfg: V4Config, w: dict, batch: int, ctx: int, bw: float, peaks: dict[torch.dtype, float]) -> float:
    """The step's floor in seconds when every GEMM and attention read may be bound by its FLOPs as
    well as its bytes: per item of ``step_reads`` the larger of its bytes over the copy bandwidth
    ``bw`` and its FLOPs over the matmul peak of its dtype (fp32 matrices, the hyper-connection
    mixes, at bf16's), summed. Where no item is FLOP-bound it is ``step_bytes / bw``; with an
    H100's measured peaks it exceeds that by 0.4% at flash8's batch 256 (session 30)."""
    return sum(max(nbytes / bw, flops / peaks.get(dtype, peaks[torch.bfloat16]))
               for nbytes, flops, dtype in step_reads(cfg, w, batch, ctx))


def matmul_peaks(device: str) -> dict[torch.dtype, float]:
    """Dense matmul FLOP/s measured here: bf16 (an 8192^3 matmul) and fp8 (an 8192^3
    ``torch._scaled_mm``, e4m3 with per-tensor scales; the block-scaled kernels this model runs
    cannot beat it). fp8 falls back to bf16's rate where ``_scaled_mm`` does not run."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def rate(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        return 10 * 2 * n**3 / (time.perf_counter() - t)

    peaks = {torch.bfloat16: rate(lambda: a @ b)}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device)
        peaks[torch.float8_e4m3fn] = rate(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
    except (RuntimeError, AttributeError) as e:  # no fp8 tensor cores (pre-Hopper) or no _scaled_mm
        print(f"fp8 matmul peak not measured ({type(e).__name__}): fp8 GEMMs counted at bf16's rate", flush=True)
        peaks[torch.float8_e4m3fn] = peaks[torch.bfloat16]
    return peaks


def kernel_note() -> str:
    """Which optional kernels this tree runs (so a table says what it measured)."""
    try:
        from sglang_dsv4.kernels import hc_split
    except ImportError:
        return "hyper-connection split: torch ops (a tree without kernels.hc_split)"
    return "hyper-connection split: " + ("SGLang's Triton kernel" if hc_split.sglang_kernel() else "torch ops")


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of 2 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (time.perf_counter() - t)


# ---- the opt-in GPU kernels, switched per path ---------------------------------------------------

def _switch_modules() -> dict[str, tuple[object, str]]:
    from sglang_dsv4.core import branches, ops
    from sglang_dsv4.kernels import (c4_entries, c128_pool, entry_rows, fp8_cublas, fp8_linear, fp8_moe, hc_boundary,
                                     hc_split, kv_store, route, topk, triton_support)

    known = {"hc_fused_pre": (hc_split, "FUSED_PRE"), "fp8_cublas": (fp8_cublas, "REQUESTED"),
            "fold_shared": (fp8_moe, "FOLD_SHARED"), "kv_fused_write": (kv_store, "FUSED_WRITE"),
            "branch_streams": (branches, "ENABLED"), "moe_fused_swiglu": (fp8_moe, "FUSED_SWIGLU"),
            "stack_x": (ops, "STACK_X"), "pdl": (triton_support, "PDL"),
            "expert_blocks": (fp8_moe, "EXPERT_BLOCKS"), "route_kernel": (route, "ENABLED"),
            "entry_rows_kernel": (entry_rows, "ENABLED"), "topk_split": (topk, "SPLIT"),
            "c4_entries_kernel": (c4_entries, "ENABLED"), "hc_boundary_kernel": (hc_boundary, "ENABLED"),
            "c128_entries_kernel": (c128_pool, "ENTRIES"), "swiglu_one_wave": (fp8_moe, "SWIGLU_ONE_WAVE"),
            "fp8_operands": (fp8_linear, "SHARED_OPERANDS"), "stack_compressor": (ops, "STACK_COMPRESSOR"),
            "hc_fma_mix": (hc_boundary, "FMA_MIX")}
    # those the imported package has: an earlier commit's (the "before" run, .bench-prev) may
    # predate some, and --switches then names only what it can switch
    return {name: (mod, attr) for name, (mod, attr) in known.items() if hasattr(mod, attr)}


SWITCHES = tuple(_switch_modules())  # their names, for --switches


_AS_STARTED: dict[str, bool] = {}  # each switch as the process started, before any path set it


def switched(variant: str | None, make):
    """``make()`` (a path) with the kernels of ``variant`` on and the others off (``none``: all
    off; ``default``: each as the process started, ``default+X``: those and X; None: left as they
    are), its name suffixed with
    the variant (but ``default``'s). The switches stay as set until
    the next path is made: read per call, guarded by Dynamo (the cuBLAS GEMM) or read when the
    model is built (the folded shared expert), so a path runs what was switched on while it was
    made; each path builds its own model and graphs."""
    modules = _switch_modules()
    if not _AS_STARTED:
        _AS_STARTED.update({name: bool(getattr(mod, attr)) for name, (mod, attr) in modules.items()})
    if variant is None:
        return make()
    names = variant.split("+")
    if names[0] == "default":  # default+X: the defaults and X besides
        on = {name for name, value in _AS_STARTED.items() if value} | set(names[1:])
    else:
        on = set() if variant == "none" else set(names)
    _set_switches(on)
    path = make()
    path.switch_set = frozenset(on)  # for apply_switches: paths timed in turns (--rounds)
    if variant != "default":
        path.name += "+" + variant
    return path


def _set_switches(on: set[str] | frozenset[str]) -> None:
    for name, (mod, attr) in _switch_modules().items():
        setattr(mod, attr, name in on)


def apply_switches(path) -> None:
    """Before timing a path made by ``switched``: its switches again (another path, made or timed
    since, may have set others; the switches read per call must be this path's)."""
    on = getattr(path, "switch_set", None)
    if on is not None:
        _set_switches(on)


# ---- driving the two code paths ----------------------------------------------------------------

class NewPath:
    """This tree: the batched step over the serving cache, slots handed out as SGLang does."""

    def __init__(self, cfg, w, batch: int, ctx: int, steps: int, device: str, graphs: bool = False,
                 deterministic: bool = False):
        self.model = V4Model(cfg, w, deterministic=deterministic)
        self.name = ("graphs" if graphs else "batched") + ("-det" if deterministic else "")
        if graphs:
            self.model.enable_cuda_graphs()
        max_len = ctx + steps + 8
        self.cache = SglangV4Cache.with_own_table(cfg, batch + 1, (batch + 1) * (steps + 8) + ctx + 64,
                                                  max_seq_len=max_len, device=device)
        self.next_slot, self.batch, self.ctx, self.device = 1, batch, ctx, device
        self.gen = torch.Generator(device="cpu").manual_seed(1)

    def _slots(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int32)
        self.next_slot += n
        return out.pin_memory().to(self.device, non_blocking=True)  # no host sync

    def prefill(self, chunk: int) -> None:
        c = self.cache
        c.req_to_token[0, :self.ctx] = self._slots(self.ctx)
        st = c.bind(0, 1, 0)
        ids = torch.randint(0, self.model.cfg.vocab_size, (self.ctx,), generator=self.gen)
        for p in range(0, self.ctx, chunk):
            self.model.forward(c, [st], [ids[p:p + chunk].to(self.device)])
        c.take_snapshot(st)
        self.states = []
        for b in range(1, self.batch + 1):
            c.req_to_token[b, :self.ctx] = c.req_to_token[0, :self.ctx]
            self.states.append(c.bind(b, 1, self.ctx))
        self.ids = torch.randint(0, self.model.cfg.vocab_size, (self.batch, 1), generator=self.gen).to(self.device)

    def step(self) -> None:
        c = self.cache
        pos = self.states[0].num_tokens
        rows = torch.arange(1, self.batch + 1, device=self.device)
        c.req_to_token[rows, pos] = self._slots(self.batch)
        # the batch's tokens as one [B, 1] tensor, as the server passes them (an older tree
        # iterates it as B rows: the same step)
        logits = self.model.forward(c, self.states, self.ids, flat=True)
        self.ids = logits.argmax(-1, keepdim=True)  # batched greedy sampling, as SGLang samples


class OldPath:
    """An earlier tree (per-request loops) over its reference cache, for the before column."""

    name = "before"

    def __init__(self, pkg, cfg, w, batch: int, ctx: int, steps: int, device: str):
        self.pkg = pkg
        cfg = pkg.config.V4Config.from_dict(cfg.to_dict())  # its own config class (its own errors)
        self.model = pkg.core.model.V4Model(cfg, w)
        self.cache = pkg.core.cache.V4Cache(cfg, max_requests=batch + 1, max_total_tokens=ctx + (batch + 1) * (steps + 8),
                                            max_seq_len=ctx + steps + 8, device=device)
        self.batch, self.ctx, self.device = batch, ctx, device
        self.gen = torch.Generator(device="cpu").manual_seed(1)

    def prefill(self, chunk: int) -> None:
        c = self.cache
        origin = c.new_request()
        ids = torch.randint(0, self.model.cfg.vocab_size, (self.ctx,), generator=self.gen)
        for p in range(0, self.ctx, chunk):
            self.model.forward(c, [origin], [ids[p:p + chunk].to(self.device)])
        snap = c.snapshot(origin)
        self.states = [c.restore(snap) for _ in range(self.batch)]
        self.ids = torch.randint(0, self.model.cfg.vocab_size, (self.batch, 1), generator=self.gen).to(self.device)

    def step(self) -> None:
        out = self.model.forward(self.cache, self.states, list(self.ids))
        self.ids = torch.stack([o[-1:].argmax(-1) for o in out])


def compile_summary() -> str:
    """How many graphs Dynamo compiled in this process so far, and the seconds spent compiling
    them (Dynamo + Inductor): a cold process's cost of the fused regions (``core.compiled``)."""
    from torch._dynamo import utils

    secs = sum(utils.compilation_time_metrics.get("_compile.compile_inner", []))
    return f"compiled graphs {utils.counters['stats']['unique_graphs']}, {secs:.1f} s compiling (this process)"


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")  # runtime / driver


def _drain() -> None:
    """Wait for the GPU where there is one (``profile_step`` also runs on a CPU path's steps)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class StepProfile:
    """Per step, from the torch profiler over ``n`` back-to-back steps."""

    launches: float   # kernel launch calls inside the steps (a graph replay: none)
    syncs: float      # host syncs inside the steps
    kernel_ms: float  # the union of the GPU's kernel intervals, per step
    wall_ms: float    # the profiled steps' wall time, per step (the profiler's host cost included)

    @property
    def busy_profiled(self) -> float:
        """GPU busy % over the profiled wall time (sessions 1-27's column)."""
        return 100 * self.kernel_ms / self.wall_ms

    def busy_of(self, step_ms: float) -> float:
        """GPU busy % of a step of ``step_ms`` (measured without the profiler)."""
        return 100 * self.kernel_ms / step_ms


def profile_step(path, n: int = 3) -> StepProfile:
    """Kernel launches, host syncs, GPU kernel time and wall time per step, from the torch
    profiler. Launches and syncs are counted inside the steps only (each step a
    ``record_function`` range), so the profiler's and the harness's own synchronisations do not
    count."""
    from torch.profiler import ProfilerActivity, profile, record_function

    _drain()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(n):
            with record_function("bench_step"):
                path.step()
        _drain()
        wall = time.perf_counter() - t
    events = prof.events()
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == "bench_step"]

    def in_step(e) -> bool:
        return any(a <= e.time_range.start and e.time_range.end <= b for a, b in steps)

    launches = syncs = 0
    kernels = []
    for e in events:
        name = e.name
        if name in LAUNCH_CALLS:
            launches += in_step(e)
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"):
            syncs += in_step(e)
        # the step's own range also appears on the GPU's timeline (a user annotation spanning
        # its first to its last kernel): counted, it reads ~99% busy whatever the gaps between
        if e.device_type.name == "CUDA" and name != "bench_step":
            kernels.append((e.time_range.start, e.time_range.end))
    # the union of the GPU's busy intervals: an event listed twice (or overlapping another on
    # a second stream) counts once; summing durations read over 100% with the CPU activity on
    busy, reach = 0.0, float("-inf")
    for a, b in sorted(kernels):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return StepProfile(launches / n, syncs / n, busy / 1e3 / n, 1e3 * wall / n)


def time_steps(path, steps: int) -> float:
    """Median step time, the GPU drained around each step (host and GPU work in series, as a
    scheduler that reads each step's tokens back runs them)."""
    for _ in range(3):
        path.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        path.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_pipelined(path, steps: int) -> float:
    """Mean step time of ``steps`` steps issued back to back (the next step's host work overlaps
    the GPU's work on this one, as with an overlap scheduler; the tokens stay on the device)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        path.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def steps_needed(steps: int, rounds: int) -> int:
    """Decode steps a path takes in ``rounds`` rounds of ``time_steps`` (3 warm-up + ``steps``) and
    ``time_pipelined`` (``steps``), and ``profile_step``'s 3: what its cache must hold."""
    return rounds * (2 * steps + 3) + 3


def time_in_turns(paths: list, steps: int, rounds: int, failed=None) -> list[tuple[float, float, float] | None]:
    """(step ms, pipelined ms, spread %) of each path: ``rounds`` rounds, each timing every path
    once in turn (``time_steps`` then ``time_pipelined``), so a drift of the GPU's clocks or of the
    host spreads over all of them alike; the medians over the rounds, and the pipelined time's
    spread (max - min over its median, %). A path whose step raises is reported to ``failed``
    (None: the error propagates) and left out of later rounds: None in its place."""
    drained: list[list[float]] = [[] for _ in paths]
    piped: list[list[float]] = [[] for _ in paths]
    dead: set[int] = set()
    for _ in range(rounds):
        for i, path in enumerate(paths):
            if i in dead:
                continue
            try:
                apply_switches(path)
                drained[i].append(time_steps(path, steps) * 1e3)
                piped[i].append(time_pipelined(path, steps) * 1e3)
            except Exception as e:
                if failed is None:
                    raise
                failed(e)
                dead.add(i)
    out: list[tuple[float, float, float] | None] = []
    for i, (d, p) in enumerate(zip(drained, piped)):
        if i in dead:
            out.append(None)
            continue
        mid = statistics.median(p)
        out.append((statistics.median(d), mid, 100 * (max(p) - min(p)) / mid))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-root", type=Path, default=None,
                    help="folder holding sglang_dsv4_old/ (an earlier commit's package)")
    ap.add_argument("--configs", default="tiny,flash8")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time a case's paths in this many rounds, in turns, all of them alive at once "
                         "(medians over the rounds; the spread column): differences of a few percent "
                         "between switch sets need more than one (1: one path at a time, as before); "
                         "each path holds its own model: flash8 at batch 256 fits about three on an H100")
    ap.add_argument("--old-max-batch", type=int, default=64, help="skip the old path above this batch")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting new cases after this")
    ap.add_argument("--paths", default="batched,graphs",
                    help="new code paths to time: batched (eager), graphs (CUDA-graph replay), and the "
                         "same in the deterministic mode (batched-det, graphs-det); the before path runs "
                         "whenever --old-root is given")
    ap.add_argument("--weights", default="bf16",
                    help="weight modes, side by side: bf16 (dequantised), fp8 (fp8 block-128, experts converted) "
                         "and/or fp8+wo_a (fp8 with attn.wo_a fp8 too, SGLANG_DSV4_WO_A_FP8)")
    ap.add_argument("--switches", default="",
                    help="sets of switched GPU kernels to run each new path with, side by side: default (as the "
                         "process started), default+NAME (those and NAME), none (all off), or +-joined names of "
                         f"{', '.join(SWITCHES)} (exactly those on; unset: as the environment sets them)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = args.switches.split(",") if args.switches else [None]
    for v in variants:
        if v not in (None, "default", "none") and not set(v.split("+")) - {"default"} <= set(SWITCHES):
            ap.error(f"--switches: unknown {v!r} (known: default, none, {', '.join(SWITCHES)})")
    known = ("batched", "graphs", "batched-det", "graphs-det")
    new_paths = args.paths.split(",")
    if not set(new_paths) <= set(known):
        ap.error(f"--paths: unknown path(s) {sorted(set(new_paths) - set(known))} (known: {', '.join(known)})")
    device = "cuda"
    t_start = time.perf_counter()
    old = None
    if args.old_root is not None:
        sys.path.insert(0, str(args.old_root))
        old = importlib.import_module("sglang_dsv4_old")
        for sub in ("config", "core.model", "core.cache"):
            importlib.import_module(f"sglang_dsv4_old.{sub}")
    bw = copy_bandwidth(device)
    peaks = matmul_peaks(device)
    rows = []
    header = ("| config | batch | context | path | weights | step ms | tok/s | pipelined ms | launches/step | syncs/step "
              "| GPU busy % | busy % profiled | roofline ms | step / roofline | pipelined / roofline | floor ms | step / floor "
              "| vs before | prefill s | spread % |")
    import sglang_dsv4  # which tree this process measures (a "before" run must not be this one)
    print(f"package {Path(sglang_dsv4.__file__).parent}", flush=True)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, matmul peaks bf16 {peaks[torch.bfloat16] / 1e12:.0f} / fp8 "
          f"{peaks[torch.float8_e4m3fn] / 1e12:.0f} TFLOP/s ({torch.cuda.get_device_name()}); {kernel_note()}", flush=True)
    separator = "|---" * (header.count("|") - 1) + "|"
    print(header + "\n" + separator, flush=True)
    for cname in args.configs.split(","):
        contexts = [int(c) for c in args.contexts.split(",")]
        capacity = steps_needed(args.steps, args.rounds)
        cfg = make_config(cname, max(contexts) + capacity + 64)
        ws = {mode: bench_weights(cfg, device, mode) for mode in args.weights.split(",")}
        for ctx, mode in [(c, m) for c in contexts for m in ws]:
            w = ws[mode]
            for batch in [int(b) for b in args.batches.split(",")]:
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"(budget reached: {cname} B={batch} ctx={ctx} and later cases not run)", flush=True)
                    break
                roof = step_bytes(cfg, w, batch, ctx) / bw
                floor = step_floor(cfg, w, batch, ctx, bw, peaks)
                before = None
                paths = []
                if old is not None and batch <= args.old_max_batch and mode == "bf16":
                    paths.append(lambda: OldPath(old, cfg, w, batch, ctx, capacity, device))
                for p in new_paths:
                    for v in variants:
                        paths.append(lambda p=p, v=v: switched(v, lambda: NewPath(
                            cfg, w, batch, ctx, capacity, device, graphs=p.startswith("graphs"),
                            deterministic=p.endswith("-det"))))

                def failed(e: Exception) -> None:  # one path's failure (a switch's capture, say) ends only its row
                    print(f"| {cname} | {batch} | {ctx} | (failed) | {mode} | {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else ''} |", flush=True)
                    traceback.print_exc()
                    torch.cuda.empty_cache()

                def ready(make):
                    """A made and prefilled path with its prefill seconds, or None where it failed."""
                    try:
                        path = make()
                        torch.cuda.synchronize()
                        t_pre = time.perf_counter()
                        path.prefill(2048)
                        torch.cuda.synchronize()
                        return path, time.perf_counter() - t_pre  # the first path of a config includes compilation
                    except Exception as e:
                        failed(e)
                        return None

                def profiled(path):
                    try:
                        apply_switches(path)
                        return profile_step(path)
                    except Exception as e:
                        failed(e)
                        return None

                # one at a time (rounds 1), or all alive and timed in turns; a path that fails ends
                # only its own row
                for group in ([[m] for m in paths] if args.rounds == 1 else [paths]):
                    alive = [r for r in map(ready, group) if r is not None]
                    timed = time_in_turns([p for p, _ in alive], args.steps, args.rounds, failed)
                    for (path, prefill_s), t in zip(alive, timed):
                        prof = None if t is None else profiled(path)
                        if prof is None:
                            continue
                        ms, piped, spread = t
                        ratio = "" if before is None else f"{before / ms:.1f}x"
                        if path.name == "before":
                            before = ms
                        line = (f"| {cname} | {batch} | {ctx} | {path.name} | {mode} | {ms:.2f} | {batch / ms * 1e3:.0f} | "
                                f"{piped:.2f} | {prof.launches:.0f} | {prof.syncs:.1f} | {prof.busy_of(piped):.0f} | "
                                f"{prof.busy_profiled:.0f} | {roof * 1e3:.3f} | {ms / (roof * 1e3):.1f} | "
                                f"{piped / (roof * 1e3):.1f} | {floor * 1e3:.3f} | {ms / (floor * 1e3):.1f} | {ratio} | "
                                f"{prefill_s:.2f} | {f'{spread:.1f}' if args.rounds > 1 else ''} |")
                        rows.append(line)
                        print(line, flush=True)
                    del alive, timed
                    torch.cuda.empty_cache()
        del w, ws
        torch.cuda.empty_cache()
    compiled = compile_summary()
    print(compiled, flush=True)
    if args.out:
        args.out.write_text(f"copy bandwidth {bw / 1e9:.0f} GB/s, matmul peaks bf16 {peaks[torch.bfloat16] / 1e12:.0f} "
                            f"/ fp8 {peaks[torch.float8_e4m3fn] / 1e12:.0f} TFLOP/s\n\n{header}\n{separator}\n" + "\n".join(rows)
                            + f"\n\n{compiled}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
