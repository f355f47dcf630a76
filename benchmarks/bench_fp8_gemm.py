"""Tile configurations of the fp8 block GEMM (``kernels.fp8_linear``) at decode shapes, on the GPU.

    python -m benchmarks.bench_fp8_gemm [--tokens 1,64,256] [--experts 32,8] [--dense-tokens 1,64,256]
        [--stages 3,4] [--reps 30] [--cublas] [--swiglu [--swiglu-configs 4/3,8/4] [--swiglu-everywhere]] [--blocks] [--wo-a]

Times ``fp8_gemm`` on V4-Flash's dense projection shapes and on the routed experts' two grouped
GEMMs (k = 6 of E experts, random routing, the row layout of ``fp8_moe``), once with the
shipped choice (``fp8_linear._config``, ``fp8_moe.block_rows``) and once per candidate tile
configuration, and prints per case the time, the bytes the GEMM must read (the weights its rows
touch, once) per second, the time over those bytes / the copy bandwidth measured in the same run
(``bench_decode``'s roofline), and
the largest difference from the shipped configuration's result (0: the same bits). ``--cublas``:
instead, the dense shapes with the shipped Triton kernel against cuBLAS's block-scaled GEMM
(``kernels.fp8_cublas``, ``SGLANG_DSV4_FP8_GEMM=cublas``, the default), side by side. ``--swiglu``:
instead, the routed experts' GEMM 1 and the SwiGLU region after it against GEMM 1 with the
SwiGLU as its epilogue (``fp8_moe.swiglu_gemm``, on by default, ``SGLANG_DSV4_MOE_FUSED_SWIGLU=0`` off). ``--blocks``:
instead, the experts' whole pass with the rows per expert block by pair count (the default)
against by pairs per expert (``fp8_moe.EXPERT_BLOCKS``). ``--wo-a``: instead, V4's grouped wo_a
in bf16 (the model's einsum) against its fp8 weights through the weight-only kernel
(``fp8_weight_only``) and the latter's launches. Weights are
rotated through copies larger than the L2, as the layers of a step are. A harness: what a
configuration costs decides ``_config``; nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from benchmarks.bench_decode import copy_bandwidth
from sglang_dsv4.kernels import fp8_cublas
from sglang_dsv4.kernels import fp8_linear as fp8_mod
from sglang_dsv4.kernels import fp8_moe
from sglang_dsv4.kernels import fp8_weight_only as weight_only
from sglang_dsv4.kernels.fp8_linear import Fp8Weight, fp8_gemm, quantize_act
from sglang_dsv4.quant import FP8_WEIGHT_BLOCK

DENSE = {  # V4-Flash projections, N x K
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "idx_wq_b": (8192, 1024), "shared_w13": (4096, 4096), "shared_w2": (4096, 2048),
}
INTER, DIM, TOPK = 2048, 4096, 6
L2_BYTES = 50 * 2**20


def random_fp8(shape: tuple[int, ...], g: torch.Generator) -> Fp8Weight:
    q = (torch.randn(shape, generator=g, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    sshape = tuple(shape[:-2]) + tuple(math.ceil(d / FP8_WEIGHT_BLOCK) for d in shape[-2:])
    scale = torch.exp2(torch.randint(-12, -8, sshape, generator=g, device="cuda").float())
    return Fp8Weight(q, scale)


def time_us(fn, reps: int) -> float:
    """GPU microseconds per call of ``fn``: ``reps`` calls captured in one CUDA graph and replayed
    (the host's launch cost, larger than a decode-sized GEMM, stays out, as in a graphed step)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / (3 * reps)


class Override:
    """Replaces ``fp8_linear._config``'s tile choice (BLOCK_M stays the caller's) for one run."""

    def __init__(self, cfg: dict[str, int] | None):
        self.cfg, self.orig = cfg, fp8_mod._config

    def __enter__(self):
        if self.cfg is not None:
            orig, cfg = self.orig, self.cfg
            fp8_mod._config = lambda *a, **k: {**orig(*a, **k), **cfg}
        return self

    def __exit__(self, *exc):
        fp8_mod._config = self.orig


def dense_cases(tokens: list[int], g: torch.Generator):
    for name, (n, k) in DENSE.items():
        copies = max(2, math.ceil(2 * L2_BYTES / (n * k)))
        ws = [random_fp8((n, k), g) for _ in range(copies)]
        for t in tokens:
            xq, xs = quantize_act(torch.randn(t, k, generator=g, device="cuda", dtype=torch.bfloat16))
            it = itertools.cycle(ws)
            yield (f"{name} {n}x{k}", t, n * k, lambda bm, it=it, xq=xq, xs=xs: fp8_gemm(
                xq, xs, next(it), torch.bfloat16, block_m=bm), [None],
                lambda bm, w=ws[0], xq=xq, xs=xs: fp8_gemm(xq, xs, w, torch.bfloat16, block_m=bm), None)


def grouped_cases(tokens: list[int], experts: list[int], g: torch.Generator):
    for E in experts:
        w13 = random_fp8((E, 2 * INTER, DIM), g)
        w2 = random_fp8((E, DIM, INTER), g)
        for t in tokens:
            chosen = torch.rand(t, E, generator=g, device="cuda").topk(min(TOPK, E), -1).indices.int()
            gates = torch.rand(chosen.shape, generator=g, device="cuda")
            used = int(torch.unique(chosen).numel())
            x = torch.randn(t, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_act(x)
            yq, ys = quantize_act(torch.randn(chosen.numel() * 2 + E * 64, INTER, generator=g, device="cuda"))

            def layout(A: int, chosen=chosen, gates=gates, E=E):
                M = math.ceil((chosen.numel() + min(chosen.numel(), E) * (A - 1)) / A) * A
                tok, be, _, _ = fp8_moe._row_layout(chosen, gates, 0, E, A, M)
                return tok, be, M

            shipped = fp8_moe.block_rows(chosen.numel(), E)
            lay = {A: layout(A) for A in (16, 32, 64)}
            def w13_gemm(bm, lay=lay, xq=xq, xs=xs, shipped=shipped, w13=w13):
                A = bm or shipped
                return fp8_gemm(xq, xs, w13, torch.float32, rows=lay[A][0], block_expert=lay[A][1], block_m=A,
                                sum_splits=False)

            def w2_gemm(bm, lay=lay, yq=yq, ys=ys, shipped=shipped, w2=w2):
                A = bm or shipped
                return fp8_gemm(yq, ys, w2, torch.bfloat16, block_expert=lay[A][1], block_m=A, m=lay[A][2],
                                sum_splits=False)

            yield f"experts E={E} w13", t, used * 2 * INTER * DIM, w13_gemm, [16, 32, 64], w13_gemm, shipped
            yield f"experts E={E} w2", t, used * DIM * INTER, w2_gemm, [16, 32, 64], w2_gemm, shipped


def cublas_table(tokens: list[int], reps: int, bw: float, g: torch.Generator) -> None:
    """The dense shapes, the Triton kernel against cuBLAS (``fp8_cublas``), side by side."""
    fp8_cublas.REQUESTED = True
    fp8_mod.prepare(torch.device("cuda"))
    dev = torch.cuda.current_device()
    if not fp8_cublas._checked.get(dev):
        raise SystemExit("cuBLAS's block-scaled fp8 GEMM did not pass its check here (see the log)")
    print("| GEMM | tokens | Triton us | Triton / roofline | cuBLAS us | cuBLAS / roofline | speed-up | max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t, nbytes, fn, _, result, _ in dense_cases(tokens, g):
        fp8_cublas.REQUESTED = False
        want, tri = result(None), time_us(lambda: fn(None), reps)
        fp8_cublas.REQUESTED = True
        got, cub = result(None), time_us(lambda: fn(None), reps)
        diff = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
        roof = nbytes / bw * 1e6  # the weight bytes over the copy bandwidth, us (bench_decode's roofline)
        print(f"| {name} | {t} | {tri:.1f} | {tri / roof:.2f} | {cub:.1f} | {cub / roof:.2f} | {tri / cub:.2f}x | "
              f"{diff:.1e} |", flush=True)


def swiglu_table(tokens: list[int], experts: list[int], reps: int, bw: float, g: torch.Generator,
                 configs: list[tuple[int, int]] = (), everywhere: bool = False) -> None:
    """GEMM 1 + ``_gated_swiglu_quantised`` against ``swiglu_gemm`` (one launch, what ships), the
    shipped row layout, side by side; where the epilogue does not fit (K would be split) no row.
    ``configs``: (warps, stages) launches of ``swiglu_gemm`` timed beside the shipped one (the
    same bits: a launch shape changes no arithmetic), one column each. ``everywhere``: also where
    the epilogue does not fit (the two-step path then splits K, the epilogue does not)."""
    extra = "".join(f" w{w}/s{st} us |" for w, st in configs)
    print("| experts | tokens | block_m | GEMM 1 + SwiGLU us | epilogue us | speed-up | roofline us "
          f"| epilogue / roofline | bytes differing |{extra}")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(configs))
    for E in experts:
        w13 = [random_fp8((E, 2 * INTER, DIM), g) for _ in range(max(2, math.ceil(2 * L2_BYTES / (E * 2 * INTER * DIM))))]
        stack = [fp8_moe.Fp8Experts(w, w, INTER) for w in w13]  # GEMM 1 reads w13 alone
        for t in tokens:
            chosen = torch.rand(t, E, generator=g, device="cuda").topk(min(TOPK, E), -1).indices.int()
            gates = torch.rand(chosen.shape, generator=g, device="cuda")
            A, M = fp8_moe.grouped_rows(chosen.numel(), E)
            if not (everywhere or fp8_moe.swiglu_epilogue_fits(M, stack[0], A, chosen.device)):
                print(f"| {E} | {t} | {A} | | (K split: not fused) | | | | |")
                continue
            tok, be, _, gr = fp8_moe._row_layout(chosen, gates, 0, E, A, M)
            xq, xs = quantize_act(torch.randn(t, DIM, generator=g, device="cuda", dtype=torch.bfloat16))
            it = itertools.cycle(stack)

            def two_step(s=None):
                s = s or next(it)
                h = fp8_gemm(xq, xs, s.w13, torch.float32, rows=tok, block_expert=be, block_m=A, sum_splits=False)
                return fp8_moe._gated_swiglu_quantised(h, gr, INTER, INTER, 10.0)

            def fused(s=None):
                return fp8_moe.swiglu_gemm(xq, xs, s or next(it), tok, be, gr, A, 10.0)

            differ = (two_step(stack[0])[0].view(torch.uint8) != fused(stack[0])[0].view(torch.uint8)).float().mean()
            base, us = time_us(two_step, reps), time_us(fused, reps)
            used = int(torch.unique(chosen).numel())
            roof = used * 2 * INTER * DIM / bw * 1e6
            shapes, shipped = [], (fp8_moe.SWIGLU_WARPS, fp8_moe.SWIGLU_STAGES)
            for w, st in configs:
                fp8_moe.SWIGLU_WARPS, fp8_moe.SWIGLU_STAGES = w, st
                try:
                    shapes.append(f"{time_us(fused, reps):.1f}")
                except Exception as e:  # out of shared memory / registers: not a candidate
                    shapes.append(type(e).__name__)
                finally:
                    fp8_moe.SWIGLU_WARPS, fp8_moe.SWIGLU_STAGES = shipped
            print(f"| {E} | {t} | {A} | {base:.1f} | {us:.1f} | {base / us:.2f}x | {roof:.1f} | {us / roof:.2f} | "
                  f"{differ.item():.1e} |" + "".join(f" {c} |" for c in shapes), flush=True)


WO_A = (8, 1024, 4096)  # V4-Flash's wo_a: o_groups x o_lora_rank x (heads x head_dim / o_groups)


def wo_a_table(tokens: list[int], reps: int, bw: float, g: torch.Generator, stages: list[int]) -> None:
    """V4-Flash's grouped wo_a (``ops.attention_output``): bf16 weights through the model's einsum
    against fp8 weights through the weight-only kernel (``fp8_weight_only``, ``SGLANG_DSV4_WO_A_FP8=1``),
    side by side, then the kernel's launches (BLOCK_M, BLOCK_N, K splits, stages), each against
    its own bytes (the weight read once, over the copy bandwidth), with the
    largest difference from the einsum's bf16 result. The shipped launch includes its split-K sum
    (in the model a compiled neighbour adds the partials)."""
    G, R, K = WO_A
    copies = max(2, math.ceil(2 * L2_BYTES / (G * R * K)))
    w8 = [random_fp8((G * R, K), g) for _ in range(copies)]
    w16 = [w.dequantize(torch.bfloat16).view(G, R, K) for w in w8]  # the same matrices, as the loader widens them
    rows = []
    for t in tokens:
        x = torch.randn(t, G, K, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = torch.einsum("tgd,grd->tgr", x, w16[0]).float()
        i16, i8 = itertools.cycle(w16), itertools.cycle(w8)
        b16 = time_us(lambda: torch.einsum("tgd,grd->tgr", x, next(i16)), reps)
        b8 = time_us(lambda: weight_only.grouped_weight_only(x, next(i8)), reps)
        shipped = weight_only.plan(t, G, R, K, x.device)
        differ = (weight_only.grouped_weight_only(x, w8[0]).float() - ref).abs().max().item()
        best = (b8, f"shipped (n={shipped[0]['BLOCK_N']} S={shipped[3]})")
        ship = weight_only.launch_config(t)
        for bn, n_split, bm in itertools.product((64, 128), (1, 2, 4),
                                                 sorted({ship["BLOCK_M"], min(ship["BLOCK_M"], 32)})):
            for ns in stages:
                cfg = dict(ship, BLOCK_M=bm, BLOCK_N=bn, num_stages=ns)
                name = f"m={bm} n={bn} S={n_split} s={ns}"
                try:
                    us = time_us(lambda: weight_only.grouped_weight_only(x, next(i8), config=cfg, splits=n_split),
                                 reps)
                except Exception as e:  # out of shared memory / registers: not a candidate
                    print(f"  wo_a T={t} {name}: {type(e).__name__}")
                    continue
                print(f"  wo_a T={t} {name}: {us:.1f} us")
                if us < best[0]:
                    best = (us, name)
        r16, r8 = G * R * K * 2 / bw * 1e6, G * R * K / bw * 1e6
        rows.append((t, b16, b16 / r16, b8, b8 / r8, b16 / b8, differ, *best))
        print(f"  wo_a T={t}: bf16 {b16:.1f} us, fp8 weight-only {b8:.1f} us, best {best[0]:.1f} ({best[1]})",
              flush=True)
    print("\n| tokens | bf16 einsum us | bf16 / roofline | fp8 weight-only us | fp8 / fp8 roofline | speed-up "
          "| max diff from the einsum | best fp8 us | best launch | best / fp8 roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    r8 = G * R * K / bw * 1e6
    for t, b16, q16, b8, q8, up, differ, best_us, best_cfg in rows:
        print(f"| {t} | {b16:.1f} | {q16:.2f} | {b8:.1f} | {q8:.2f} | {up:.2f}x | {differ:.1e} | {best_us:.1f} | "
              f"{best_cfg} | {best_us / r8:.2f} |")


def blocks_table(tokens: list[int], experts: list[int], reps: int, bw: float, g: torch.Generator) -> None:
    """The routed experts' whole pass (``fp8_moe.fp8_grouped_experts``: layout, quantiser, both
    GEMMs, the slot sum) with the rows per block by pair count (the default) against by pairs per
    expert (``fp8_moe.EXPERT_BLOCKS``), side by side, and the largest difference between them."""
    print("| experts | tokens | pairs / expert | block rows (default -> per expert) | default us | per expert us "
          "| speed-up | roofline us | per expert / roofline | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    was = fp8_moe.EXPERT_BLOCKS
    try:
        for E in experts:
            copies = max(2, math.ceil(2 * L2_BYTES / (E * 3 * INTER * DIM)))
            stacks = [fp8_moe.Fp8Experts(random_fp8((E, 2 * INTER, DIM), g), random_fp8((E, DIM, INTER), g), INTER)
                      for _ in range(copies)]
            for t in tokens:
                chosen = torch.rand(t, E, generator=g, device="cuda").topk(min(TOPK, E), -1).indices
                gates = torch.rand(chosen.shape, generator=g, device="cuda")
                x = torch.randn(t, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
                it = itertools.cycle(stacks)

                def moe(s=None):
                    return fp8_moe.fp8_grouped_experts(x, chosen, gates, s or next(it), 0, 10.0)

                got, us, rows = {}, {}, {}
                for rule in (False, True):
                    fp8_moe.EXPERT_BLOCKS = rule
                    rows[rule] = fp8_moe.block_rows(chosen.numel(), E)
                    got[rule] = moe(stacks[0]).float()
                    us[rule] = time_us(moe, reps)
                diff = ((got[True] - got[False]).abs().max() / got[False].abs().max().clamp_min(1e-30)).item()
                used = int(torch.unique(chosen).numel())
                roof = used * 3 * INTER * DIM / bw * 1e6
                print(f"| {E} | {t} | {chosen.numel() / E:.1f} | {rows[False]} -> {rows[True]} | {us[False]:.1f} | "
                      f"{us[True]:.1f} | {us[False] / us[True]:.2f}x | {roof:.1f} | {us[True] / roof:.2f} | {diff:.1e} |",
                      flush=True)
    finally:
        fp8_moe.EXPERT_BLOCKS = was


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--experts", default="32,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dense-tokens", default="1,64,256", help="token counts of the dense cases ('' for none)")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--cublas", action="store_true", help="the dense shapes, Triton against cuBLAS, only")
    ap.add_argument("--blocks", action="store_true",
                    help="the experts' whole pass with the rows per block by pair count against by pairs per "
                         "expert (fp8_moe.EXPERT_BLOCKS), only")
    ap.add_argument("--swiglu", action="store_true",
                    help="the experts' GEMM 1 + SwiGLU region against GEMM 1 with the SwiGLU epilogue, only")
    ap.add_argument("--wo-a", action="store_true",
                    help="the grouped wo_a, bf16 einsum against the fp8 weight-only kernel and its launches, only")
    ap.add_argument("--swiglu-everywhere", action="store_true",
                    help="with --swiglu: also the cases where the epilogue does not fit (K split)")
    ap.add_argument("--swiglu-configs", default="",
                    help="with --swiglu: warps/stages launches of the epilogue GEMM also timed, e.g. 4/3,8/4")
    ap.add_argument("--all", action="store_true",
                    help="the tile sweep: print every configuration's time, not only the best")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    if args.cublas:
        return cublas_table([int(t) for t in args.dense_tokens.split(",")], args.reps, bw, g)
    if args.wo_a:
        return wo_a_table(tokens, args.reps, bw, g, [int(s) for s in args.stages.split(",")])
    if args.blocks:
        return blocks_table(tokens, [int(e) for e in args.experts.split(",")], args.reps, bw, g)
    if args.swiglu:
        configs = [tuple(int(v) for v in c.split("/")) for c in args.swiglu_configs.split(",") if c]
        return swiglu_table(tokens, [int(e) for e in args.experts.split(",")], args.reps, bw, g, configs,
                            args.swiglu_everywhere)
    tiles = [dict(BLOCK_N=bn, num_warps=nw, num_stages=int(ns)) for bn in (64, 128, 256) for nw in (4, 8)
             for ns in args.stages.split(",")]
    rows = []
    cases = list(grouped_cases(tokens, [int(e) for e in args.experts.split(",")], g))
    if args.dense_tokens:
        cases += list(dense_cases([int(t) for t in args.dense_tokens.split(",")], g))
    for name, t, nbytes, fn, block_ms, result, shipped_bm in cases:
        ref = result(None)
        ref = ref if ref.dim() == 2 else ref.sum(0)
        base = time_us(lambda: fn(None), args.reps)
        best = same = (base, "shipped", 0.0)  # the fastest of all; of those with the shipped block_m
        for bm in block_ms:
            for cfg in tiles:
                with Override(cfg):
                    try:
                        out = result(bm)
                        us = time_us(lambda: fn(bm), args.reps)
                    except Exception as e:  # out of shared memory / registers: not a candidate
                        print(f"  {name} T={t} bm={bm} {cfg}: {type(e).__name__}")
                        continue
                out = out if out.dim() == 2 else out.sum(0)
                # (grouped: another block_m is another row layout; only the same layout compares)
                diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item() \
                    if out.shape == ref.shape else float("nan")
                label = f"bm={bm} n={cfg['BLOCK_N']} w={cfg['num_warps']} s={cfg['num_stages']}"
                if args.all:
                    print(f"  {name} T={t} {label}: {us:.1f} us ({base / us:.2f}x the shipped), max rel diff {diff:.1e}")
                if us < best[0]:
                    best = (us, label, diff)
                if bm == shipped_bm and us < same[0]:
                    same = (us, label, diff)
        rows.append((name, t, base, nbytes / base / 1e3, best, same))
        print(f"  {name} T={t}: shipped {base:.1f} us, best {best[0]:.1f} us ({best[1]})", flush=True)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; bytes = weights the rows touch, read once\n")
    print("| GEMM | tokens | shipped us | shipped GB/s | shipped / roofline | best us | best config | best / roofline"
          " | speed-up | max rel diff | best at the shipped block_m | its us | its max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t, base, gbs, (us, cfg, diff), (s_us, s_cfg, s_diff) in rows:
        roof = base * gbs * 1e3 / bw * 1e6  # the bytes over the copy bandwidth, us (bench_decode's roofline)
        print(f"| {name} | {t} | {base:.1f} | {gbs:.0f} | {base / roof:.2f} | {us:.1f} | {cfg} | {us / roof:.2f} | "
              f"{base / us:.2f}x | {diff:.1e} | {s_cfg} | {s_us:.1f} | {s_diff:.1e} |")


if __name__ == "__main__":
    main()
