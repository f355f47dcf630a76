"""Byte accounting of the V4 caches (v4_architecture.md §8-§9), and a CLI that prints it.

Three storage layouts:

- ``bf16``: the reference layout; a window / compressed row is ``head_dim`` bf16 values, an indexer
  row ``index_head_dim`` bf16 values;
- ``fp8``: FlashMLA's V4 layout (``KVLayout.V4``); a window / compressed row is the nope part in e4m3,
  the rope part in bf16 and one ue8m0 scale byte per 64 nope values, padded to 8 scale bytes
  (448 + 128 + 8 = 584 B for V4); an indexer row is ``index_head_dim`` e4m3 + one fp32 scale (132 B);
- ``fp32``: what the CPU torch path itself stores.

What the design shares and what it keeps per request:

- ``compressed_bytes_per_token``: the append-only compressed segment (shared through the radix
  tree), amortised per original token over all main layers: per ratio-4 layer
  (main row + indexer row) / 4, per ratio-128 layer row / 128;
- ``window_bytes_per_request``: the per-request ring, ``sliding_window`` rows in every main layer and
  in the MTP layer(s);
- ``compressor_state_bytes_per_request``: the compressors' partial-group state, fp32 in every layout:
  per ratio-4 layer 8 rows of ``2 * 2 * head_dim`` floats (main, overlapping halves A and B, kv and
  score) + 8 rows of ``2 * 2 * index_head_dim`` floats (indexer); per ratio-128 layer the online-softmax
  accumulator (running max, running sum, running weighted sum: ``3 * head_dim`` floats);
- ``snapshot_bytes``: window + compressor state, i.e. what a fork-point snapshot holds.

Run ``python -m sglang_dsv4.memory --config PATH`` (a ``config.json`` or a checkpoint directory).
Besides one object per cache layout, the output has ``"weights"`` (``weight_bytes``: one rank's
weight bytes per weight mode at ``--tp-size`` / ``--ep-size``) and ``"pool_plan"``: per weight mode,
what is left of a ``--gpu-gb`` GPU after the weights and a fixed ``--reserve-gb`` for activations
and workspace, split by ``srt.pool_sizing.plan_pools`` into request rows (rings), snapshots and
token slots in FlashMLA's fp8 cache layout (default rows and snapshot budget, as served).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from .config import FP8_QAT_BLOCK, ConfigError, V4Config
from .core.slot_state import SlotStateLayout
from .weight_bytes import MODES, weight_bytes

LAYOUTS = ("bf16", "fp8", "fp32")
FP32_BYTES = 4
GIB = 2**30
DEFAULT_GPU_GB = 140.0
# Per-GPU room kept outside weights and cache: activations of a prefill chunk, CUDA-graph pools,
# NCCL buffers, the allocator's fragmentation. A fixed, deliberately round figure (SGLang's
# default --mem-fraction-static leaves ~10-15% of a 141 GB H200 for the same things).
DEFAULT_RESERVE_GB = 12.0
POOL_PLAN_BACKEND = "torch-fp8"  # FlashMLA's fp8 storage layout, selectable on a CPU


@dataclass(frozen=True)
class CacheBytes:
    """Cache sizes of one V4 config in one storage layout. Bytes unless the name says otherwise."""

    layout: str
    # --- row sizes ---
    window_row_bytes: int          # one window (ring) row; also one main compressed entry
    compressed_row_bytes: int      # one main C4 / C128 compressed entry (same format as the window)
    indexer_row_bytes: int         # one indexer C4 compressed key
    # --- layer census ---
    num_c4_layers: int
    num_c128_layers: int
    num_window_layers: int         # main layers + MTP layers (every one has a window)
    # --- shared, append-only compressed segment, amortised per original token (all main layers) ---
    c4_main_bytes_per_token: float
    c4_indexer_bytes_per_token: float
    c128_main_bytes_per_token: float
    compressed_bytes_per_token: float
    # --- per request ---
    window_bytes_per_layer: int
    window_bytes_per_request: int
    c4_main_state_bytes_per_layer: int
    c4_indexer_state_bytes_per_layer: int
    c128_state_bytes_per_layer: int
    compressor_state_bytes_per_request: int
    snapshot_bytes: int            # window + compressor state: a fork-point snapshot

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def row_bytes(cfg: V4Config, layout: str) -> tuple[int, int]:
    """(window / compressed row bytes, indexer row bytes) of ``layout``."""
    if layout == "bf16":
        return cfg.head_dim * 2, cfg.index_head_dim * 2
    if layout == "fp8":
        nope, rope = cfg.nope_head_dim, cfg.qk_rope_head_dim
        scales = _ceil_to(math.ceil(nope / FP8_QAT_BLOCK), 8)  # ue8m0 per 64 nope values, padded to 8
        return nope + 2 * rope + scales, cfg.index_head_dim + FP32_BYTES
    if layout == "fp32":
        return cfg.head_dim * FP32_BYTES, cfg.index_head_dim * FP32_BYTES
    raise ValueError(f"layout: unknown cache layout {layout!r} (known: {', '.join(LAYOUTS)})")


def cache_bytes(cfg: V4Config, layout: str) -> CacheBytes:
    """Byte accounting of ``cfg``'s caches in ``layout`` (one of ``LAYOUTS``)."""
    row, idx_row = row_bytes(cfg, layout)
    n4, n128 = len(cfg.c4_layers), len(cfg.c128_layers)
    n_window = cfg.num_hidden_layers + cfg.num_nextn_predict_layers

    c4_main = n4 * row / 4
    c4_idx = n4 * idx_row / 4
    c128_main = n128 * row / 128

    window_layer = cfg.sliding_window * row
    # the compressor state is what the cache allocates (core.slot_state), fp32 in every layout
    shapes = SlotStateLayout.of(cfg).shapes()

    def layer_bytes(*names: str) -> int:
        return sum(math.prod(shapes[n][1:]) for n in names) * FP32_BYTES

    c4_main_state = layer_bytes("c4_main_a", "c4_main_s")
    c4_idx_state = layer_bytes("c4_index_a", "c4_index_s")
    c128_state = layer_bytes("c128")
    state = n4 * (c4_main_state + c4_idx_state) + n128 * c128_state
    window = n_window * window_layer

    return CacheBytes(
        layout=layout,
        window_row_bytes=row,
        compressed_row_bytes=row,
        indexer_row_bytes=idx_row,
        num_c4_layers=n4,
        num_c128_layers=n128,
        num_window_layers=n_window,
        c4_main_bytes_per_token=c4_main,
        c4_indexer_bytes_per_token=c4_idx,
        c128_main_bytes_per_token=c128_main,
        compressed_bytes_per_token=c4_main + c4_idx + c128_main,
        window_bytes_per_layer=window_layer,
        window_bytes_per_request=window,
        c4_main_state_bytes_per_layer=c4_main_state,
        c4_indexer_state_bytes_per_layer=c4_idx_state,
        c128_state_bytes_per_layer=c128_state,
        compressor_state_bytes_per_request=state,
        snapshot_bytes=window + state,
    )


def all_layouts(cfg: V4Config) -> dict[str, dict[str, Any]]:
    """``{layout: cache_bytes(cfg, layout).to_dict()}`` for every layout."""
    return {layout: cache_bytes(cfg, layout).to_dict() for layout in LAYOUTS}


def pool_plans(cfg: V4Config, tp_size: int = 1, ep_size: int = 1, gpu_gb: float = DEFAULT_GPU_GB,
               reserve_gb: float = DEFAULT_RESERVE_GB) -> dict[str, dict[str, Any]]:
    """Per weight mode: the KV bytes a ``gpu_gb`` GiB GPU keeps after one rank's weights and
    ``reserve_gb`` GiB, and ``plan_pools``' split of them (FlashMLA fp8 layouts, default rows and
    snapshot budget); ``"fits": False`` with the reason where nothing is left for the cache."""
    # imported here: the cache-only accounting above needs neither the kernels nor the srt package
    from .kernels.dispatch import select_backend
    from .srt.pool_sizing import plan_pools

    backend = select_backend(POOL_PLAN_BACKEND, cfg, "cpu")
    gpu, reserve = int(gpu_gb * GIB), int(reserve_gb * GIB)
    plans: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        weights = weight_bytes(cfg, mode, tp_size, ep_size).total
        kv = gpu - weights - reserve
        entry: dict[str, Any] = {"gpu_bytes": gpu, "weight_bytes": weights, "reserve_bytes": reserve,
                                 "kv_bytes": kv, "kv_gib": round(kv / GIB, 2)}
        if kv <= 0:
            plans[mode] = {**entry, "fits": False,
                           "reason": f"does not fit: {weights / GIB:.2f} GiB of weights + {reserve_gb:g} GiB "
                                     f"reserve exceed the {gpu_gb:g} GiB GPU"}
            continue
        try:
            plan = plan_pools(cfg, kv, backend=backend)
        except ValueError as e:  # rows and snapshots alone exceed what is left
            plans[mode] = {**entry, "fits": False, "reason": f"does not fit: {e}"}
            continue
        plans[mode] = {**entry, "fits": True, "rows": plan.rows, "rings": plan.rows + 1,
                       "row_bytes": plan.row_bytes, "snapshot_budget_bytes": plan.snapshot_budget_bytes,
                       "snapshots": plan.snapshot_budget_bytes // plan.snapshot_bytes,
                       "token_bytes": plan.token_bytes, "token_slots": plan.tokens}
    return plans


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_dsv4.memory",
        description="Print the V4 cache byte accounting of a config as JSON (one object per cache "
                    "layout), one rank's weight bytes per weight mode and the pool plan per mode.")
    parser.add_argument("--config", required=True, metavar="PATH",
                        help="a config.json, or a checkpoint directory containing one")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (splits query heads)")
    parser.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (splits routed experts)")
    parser.add_argument("--gpu-gb", type=float, default=DEFAULT_GPU_GB,
                        help=f"memory per GPU in GiB (2**30 B) for the pool plan (default {DEFAULT_GPU_GB:g})")
    parser.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                        help="GiB per GPU kept for activations and workspace, outside weights and cache "
                             f"(default {DEFAULT_RESERVE_GB:g})")
    args = parser.parse_args(argv)
    for flag, value in (("--gpu-gb", args.gpu_gb), ("--reserve-gb", args.reserve_gb)):
        if not (math.isfinite(value) and value >= 0):
            parser.error(f"{flag}: must be a finite non-negative number, got {value}")
    try:
        cfg = V4Config.from_json(args.config)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError, TypeError) as e:
        # TypeError: a field of the wrong JSON type that the dataclass rejects.
        print(f"{parser.prog}: error: cannot read config {args.config}: {e}", file=sys.stderr)
        return 2
    # checked one flag at a time so that the message names the flag at fault
    for flag, tp, ep in (("--tp-size", args.tp_size, 1), ("--ep-size", 1, args.ep_size)):
        try:
            cfg.validate_parallel(tp, ep)
        except ConfigError as e:
            print(f"{parser.prog}: error: {flag} {tp if flag == '--tp-size' else ep}: {e}", file=sys.stderr)
            return 2
    out: dict[str, Any] = all_layouts(cfg)
    out["weights"] = {mode: weight_bytes(cfg, mode, args.tp_size, args.ep_size).to_dict() for mode in MODES}
    out["pool_plan"] = pool_plans(cfg, args.tp_size, args.ep_size, args.gpu_gb, args.reserve_gb)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
