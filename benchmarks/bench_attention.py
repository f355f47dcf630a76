"""Sparse attention on the GPU: FlashMLA against the torch path, with this run's ceilings.

Decode: one query token per request, 64 heads (V4-Flash), head_dim 512, over the V4 fp8 cache:
the request's 128-token ring (main cache, pages of 128) plus compressed entries (extra cache,
pages of 64): a ratio-4 layer attends to top-k 512 of ctx/4 entries, a ratio-128 layer to all
ctx/128. Prefill: one fresh request of T tokens through ``flash_mla_sparse_fwd`` over a bf16
workspace (T window rows + T/ratio entries), each query its window plus top-512 (ratio 4) or all
visible (ratio 128) entries. The torch path is ``kernels.torch_ref`` (gather + dequantise +
``ops.sparse_attention`` in fp32), i.e. what the fallback runs on the same cache.

FLOPs count only valid keys: 4 * heads * 512 per (query, key) (QK^T and PV). Bytes are the
fewest a kernel must move: every selected KV row once (584 B in the fp8 cache, 1 KiB in the bf16
workspace), q and out once, the indices. Ceilings: a 2 GiB device copy (bytes read + written)
and an 8192^3 bf16 matmul, both measured here, first.

Timing: FlashMLA calls are captured in a CUDA graph and the replays timed, which is the device
time a graph-captured step pays; "eager" is one call timed alone from the host (Python wrapper
and launches included). A decode graph walks 256 / batch input sets on disjoint requests (own
ring pages, own entries), so each replay reads 256 requests' rows: 96 MB for the C4 rows, more
than the 60 MB L2; the C128 rows at 4K-16K contexts (24-38 MB) may stay in L2. The torch path
runs back to back without a graph.

    python benchmarks/bench_attention.py [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_dsv4.kernels.kv_layout import V4Fp8Rows  # noqa: E402
from sglang_dsv4.kernels.torch_ref import TorchSparseKernels  # noqa: E402

D, W, TOPK, EXTRA_PAGE = 512, 128, 512, 64
SCALE = D**-0.5


def bench_ms(fn, rep_ms: float = 150.0) -> float:
    """Median time of fn() in ms, from CUDA events around each call after warm-up."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    n = max(3, min(200, int(rep_ms / max(once, 1e-3))))
    for _ in range(min(n, 10)):  # warm-up
        fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def loop_ms(fn, calls: int) -> float:
    """Mean device time of ``calls`` back-to-back calls (events around the whole loop)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def graph_ms(fn, inner: int = 20) -> float:
    """Device time per call, from replays of a CUDA graph of ``inner`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return bench_ms(graph.replay) / inner


def device_ms(fn, inner: int) -> tuple[float, str]:
    """``graph_ms``, or back-to-back timing (marked "+") where the calls cannot be captured."""
    try:
        return graph_ms(fn, inner), ""
    except RuntimeError:
        torch.cuda.synchronize()
        return loop_ms(fn, 20), "+"


def torch_ms(fn) -> float:
    fn()
    once = bench_ms(fn, rep_ms=1)
    return loop_ms(fn, max(3, min(50, int(200 / max(once, 1e-3)))))


def ceilings() -> tuple[float, float]:
    """(device copy GB/s counting read + write, bf16 matmul TFLOP/s)."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    copy_ms = bench_ms(lambda: b.copy_(a))
    a = b = None  # free the 4 GiB before the matmul
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: x @ y)
    return 2 * (1 << 31) / copy_ms / 1e6, 2 * n**3 / mm_ms / 1e9


def stored_pages(layout: V4Fp8Rows, num_pages: int, g: torch.Generator) -> torch.Tensor:
    """A page buffer of random stored rows: a block of real pages, tiled (no NaN byte patterns)."""
    block = min(num_pages, 2048)
    real = layout.pack_pages(torch.randn(block, layout.page_size, layout.dim, generator=g, device="cuda"))
    buf = layout.alloc_pool(num_pages, device="cuda")
    for i in range(0, num_pages, block):
        buf[i:i + block] = real[:num_pages - i]
    return buf


class DecodeSetup:
    """Rings and entry pools sized for the largest batch and context, shared by all decode rows."""

    def __init__(self, max_batch: int, max_ctx: int, heads: int, g: torch.Generator):
        self.g, self.heads = g, heads
        self.ring_lay, self.ent_lay = V4Fp8Rows(W), V4Fp8Rows(EXTRA_PAGE)
        self.ring = stored_pages(self.ring_lay, max_batch, g)
        self.pages_per_req = {r: -(-(max_ctx // r) // EXTRA_PAGE) for r in (4, 128)}
        self.pools = {r: stored_pages(self.ent_lay, max_batch * p, g) for r, p in self.pages_per_req.items()}
        self.sink = torch.randn(heads, generator=g, device="cuda")

    def inputs(self, batch: int, ctx: int, ratio: int, slot0: int = 0) -> tuple[tuple, dict, int]:
        """Decode inputs for requests in slots slot0.. at position ctx - 1."""
        dev, g = "cuda", self.g
        q = torch.randn(batch, 1, self.heads, D, generator=g, device=dev).bfloat16()
        pos = ctx - 1
        slots = torch.arange(slot0, slot0 + batch, device=dev)
        kp = torch.arange(pos - W + 1, pos + 1, device=dev)
        idx = (slots[:, None] * W + kp % W).to(torch.int32).unsqueeze(1)
        lengths = torch.full((batch,), W, dtype=torch.int32, device=dev)
        n = ctx // ratio
        base = slots[:, None] * self.pages_per_req[ratio] * EXTRA_PAGE
        if ratio == 4:  # the indexer's top-k: distinct random entries of the request
            j = torch.rand(batch, n, generator=g, device=dev).topk(TOPK, dim=-1).indices
        else:
            j = torch.arange(n, device=dev).expand(batch, n)
        ext = (base + j).to(torch.int32).unsqueeze(1).contiguous()
        ext_len = torch.full((batch,), ext.shape[-1], dtype=torch.int32, device=dev)
        args = (q, self.ring, self.ring_lay, idx, lengths, self.sink, SCALE)
        kw = dict(extra_cache=self.pools[ratio], extra_layout=self.ent_lay, extra_indices=ext, extra_lengths=ext_len)
        return args, kw, W + ext.shape[-1]


def prefill_inputs(T: int, ratio: int, heads: int, g: torch.Generator) -> tuple[tuple, int, int]:
    """(args, valid (query, key) pairs, workspace rows) of a fresh T-token prefill."""
    dev = "cuda"
    n = T // ratio
    pos = torch.arange(T, device=dev)
    kp = pos[:, None] - (W - 1) + torch.arange(W, device=dev)
    widx = torch.where(kp >= 0, kp, -1)
    visible = (pos + 1) // ratio
    if ratio == 4:
        k = min(TOPK, n)
        scores = torch.rand(T, n, generator=g, device=dev).masked_fill(torch.arange(n, device=dev) >= visible[:, None], -1)
        j = scores.topk(k, dim=-1).indices
        j = torch.where(torch.arange(k, device=dev) < visible[:, None], j, -1)
    else:
        j = torch.arange(n, device=dev).expand(T, n)
        j = torch.where(j < visible[:, None], j, -1)
    cidx = torch.where(j >= 0, j + T, -1)
    idx = torch.cat((widx, cidx), dim=1)
    idx = torch.nn.functional.pad(idx, (0, -idx.shape[1] % 64), value=-1).to(torch.int32).unsqueeze(1).contiguous()
    kv = torch.randn(T + n, 1, D, generator=g, device=dev).bfloat16()
    q = torch.randn(T, heads, D, generator=g, device=dev).bfloat16()
    sink = torch.randn(heads, generator=g, device=dev)
    return (q, kv, idx, sink, SCALE), int((idx >= 0).sum()), T + n


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="a few sizes only")
    p.add_argument("--no-torch-above", type=int, default=1 << 30,
                   help="skip the torch path for decode batches x keys above this")
    args = p.parse_args(argv)
    from sglang_dsv4.kernels.flashmla import FlashMLAKernels

    batches = [1, 8, 64, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [4096, 131072] if args.quick else [4096, 16384, 65536, 131072]
    prefills = [1024, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384]
    g = torch.Generator(device="cuda").manual_seed(0)
    fm, ref = FlashMLAKernels("cuda"), TorchSparseKernels()
    copy_gbs, mm_tflops = ceilings()
    lines = [
        f"# Sparse attention on {torch.cuda.get_device_name()} ({datetime.date.today().isoformat()})",
        "",
        f"torch {torch.__version__}, flash_mla {__import__('flash_mla').__version__}, python {platform.python_version()}; "
        f"{args.heads} query heads, head_dim 512 (rope 64), V4 fp8 KV cache (584 B/row).",
        f"Ceilings measured in this run: device copy {copy_gbs / 1e3:.2f} TB/s (read + write, 2 GiB), "
        f"bf16 matmul {mm_tflops:.0f} TFLOP/s (8192^3). Times are medians of CUDA-event-timed calls.",
        "Torch path: gather + dequantise + `ops.sparse_attention` in fp32 over the same cache "
        "(`kernels.torch_ref`). rel err: FlashMLA vs that path, ||a-b||/||b||. FlashMLA times: CUDA-graph "
        "replays (\"+\": back-to-back calls where capture failed); eager: one call from the host.",
        "",
        "## Decode (one token per request; window 128 + compressed entries)",
        "",
        "| layer | batch | context | keys/query | FlashMLA us | TFLOP/s | % of matmul | GB/s | % of copy | eager us | torch us | speed-up | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)

    def emit(row: str) -> None:
        lines.append(row)
        print(row, flush=True)

    setup = DecodeSetup(max(batches), max(contexts), args.heads, g)
    for ratio in (4, 128):
        for ctx in contexts:
            for B in batches:
                label = f"C{ratio}"
                try:
                    sets = [setup.inputs(B, ctx, ratio, k * B) for k in range(max(1, max(batches) // B))]
                    a, kw, keys = sets[0]
                    sched = fm.new_sched()  # equal shapes and lengths in every set: one schedule
                    out = fm.decode(*a, **kw, sched=sched)
                    eager = bench_ms(lambda: fm.decode(*a, **kw, sched=sched))

                    def walk(sets=sets, sched=sched):
                        for a_, kw_, _ in sets:
                            fm.decode(*a_, **kw_, sched=sched)

                    t, mark = device_ms(walk, inner=1)
                    t /= len(sets)
                    flops = 4 * args.heads * D * B * keys
                    nbytes = B * keys * 584 + 2 * B * args.heads * D * 2 + B * keys * 4
                    if B * keys <= args.no_torch_above:
                        r = ref.decode(*a, **kw)
                        err = f"{rel_err(out, r):.1e}"
                        del r
                        tt = torch_ms(lambda: ref.decode(*a, **kw))
                        torch_cols = f"{tt * 1e3:.0f} | {tt / t:.1f}x"
                    else:
                        err, torch_cols = "-", "- | -"
                    tf, gbs = flops / t / 1e9, nbytes / t / 1e6
                    emit(f"| {label} | {B} | {ctx // 1024}K | {keys} | {t * 1e3:.1f}{mark} | {tf:.1f} | "
                         f"{100 * tf / mm_tflops:.1f}% | {gbs:.0f} | {100 * gbs / copy_gbs:.1f}% | {eager * 1e3:.0f} | "
                         f"{torch_cols} | {err} |")
                except Exception as e:  # keep the table going; the row says what failed
                    emit(f"| {label} | {B} | {ctx // 1024}K | error: {type(e).__name__}: {str(e)[:120]} |")
                torch.cuda.empty_cache()
    del setup
    torch.cuda.empty_cache()

    emit("")
    emit("## Prefill (one fresh request; bf16 workspace of window rows + entries)")
    emit("")
    emit("| layer | tokens | valid keys/query | FlashMLA ms | TFLOP/s | % of matmul | GB/s | % of copy | torch ms | speed-up | rel err |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    for ratio in (4, 128):
        for T in prefills:
            label = f"C{ratio}"
            try:
                a, pairs, rows = prefill_inputs(T, ratio, args.heads, g)
                out = fm.prefill(*a)
                t, mark = device_ms(lambda: fm.prefill(*a), inner=5)
                r = ref.prefill(*a)
                err = rel_err(out, r)
                del r
                tt = torch_ms(lambda: ref.prefill(*a))
                flops = 4 * args.heads * D * pairs
                nbytes = 2 * T * args.heads * D * 2 + rows * D * 2 + a[2].numel() * 4
                tf, gbs = flops / t / 1e9, nbytes / t / 1e6
                emit(f"| {label} | {T} | {pairs / T:.0f} | {t:.3f}{mark} | {tf:.0f} | {100 * tf / mm_tflops:.0f}% | "
                     f"{gbs:.0f} | {100 * gbs / copy_gbs:.1f}% | {tt:.2f} | {tt / t:.1f}x | {err:.1e} |")
            except Exception as e:
                emit(f"| {label} | {T} | error: {type(e).__name__}: {str(e)[:120]} |")
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
