"""Run the sharded core in N processes (gloo on CPU, NCCL on GPUs) against TP=1, and time decode.

Every process loads the same checkpoint, runs one fixed schedule once unsharded (TP=1, EP=1, no
collectives) and once per parallel case (TP=N, EP=N, TP=N+EP=N, the groups being all N ranks),
each with its own cache; it compares each case's logits with its own TP=1 logits and sends back
the errors and a digest of the logits (equal digests: the ranks agree bit for bit). The case
DP=N+EP=N is data-parallel attention (``core.parallel.DataParallelTokens``): each rank runs the
schedule over its own tokens (another seed per rank, so no digests to compare), the MoE over
all ranks' tokens; its decode timing is per rank's batch (the ranks together serve N times it). The schedule
covers a mixed-batch prefill, a chunk that completes a ratio-128 entry and wraps the window ring,
batched decode, a snapshot restore followed by a prefill chunk, and batched decode of the original
request beside the restored one.

    python -m sglang_dsv4.parallel_check --preset micro --device cpu              # gloo, 2 processes
    python -m sglang_dsv4.parallel_check --preset tiny --device cuda --time 1,8,32 --out FILE.md
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .checkpoint import load_checkpoint
from .core.cache import V4Cache
from .core.model import V4Model
from .core.parallel import DataParallelTokens, ModelParallel, shard_model, shard_weights
from .ports import free_port

Tensor = torch.Tensor


@dataclass(frozen=True)
class Run:
    """One attention backend / QAT setting, with the bounds its parallel cases must meet.

    ``max_err`` bounds every position's relative logit error (round-off only); where QAT bins or
    bf16 roundings can flip (``max_err`` None) the median, the 99th percentile and the argmax
    agreement are bounded instead.
    """

    backend: str
    quant_sim: bool
    max_err: float | None = None
    median_err: float = 1e-5
    p99_err: float = 2e-3
    argmax_agree: float = 0.97


# Bounds (tests/core/test_parallel.py explains them): float32 torch path = round-off only; the fp8
# paths can flip QAT / bf16 rounding bins, FlashMLA also computes in bf16.
CPU_RUNS = (Run("torch", False, max_err=1e-5),
            Run("torch-fp8", True, median_err=1e-4, p99_err=2e-3))
GPU_RUNS = (Run("torch", False, max_err=1e-4),
            Run("flashmla", True, median_err=5e-3, p99_err=2e-2))


@dataclass(frozen=True)
class CheckOptions:
    """What the workers run: the checkpoint, the device, the runs, the cases and the timing."""

    ckpt: str
    device: str                               # "cpu" or "cuda"
    world: int = 2
    runs: tuple[Run, ...] = ()
    cases: tuple[tuple[int, int], ...] = ((2, 1), (1, 2), (2, 2))  # (tp, ep), each 1 or world
    dp: bool = True  # also the DP=world+EP=world case
    time_batches: tuple[int, ...] = ()
    time_backend: str = "auto"
    time_prompt: int = 256
    time_steps: int = 20
    seed: int = 0


@dataclass
class CaseResult:
    run: Run
    case: str
    median: float
    p99: float
    max: float
    argmax_agree: float
    ranks_identical: bool | None  # None: the ranks ran different tokens (DP)
    ok: bool


@dataclass
class CheckReport:
    results: list[CaseResult] = field(default_factory=list)
    step_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # case -> batch -> median ms

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


def case_name(tp: int, ep: int) -> str:
    return "+".join([f"TP={tp}"] * (tp > 1) + [f"EP={ep}"] * (ep > 1)) or "TP=1"


# ---- the schedule -----------------------------------------------------------------------------

def _ids(n: int, seed: int, vocab: int, device: torch.device) -> Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def run_schedule(model: V4Model, cache: V4Cache, seed: int) -> list[Tensor]:
    """The fixed prefill / decode / snapshot-restore schedule (see module docstring) -> the logits
    of every forward, per request, in order (on the CPU, float32). Under data-parallel attention
    each forward is a scheduler step: the rank then serves the other ranks' passes."""
    V, dev = model.cfg.vocab_size, model.device
    A, B, C = _ids(180, seed + 1, V, dev), _ids(90, seed + 2, V, dev), _ids(40, seed + 3, V, dev)
    out: list[Tensor] = []

    def step(reqs, pieces) -> None:
        out.extend(x.float().cpu() for x in model.forward(cache, reqs, pieces))
        model.serve_other_ranks()

    a, b = cache.new_request(), cache.new_request()
    step([a, b], [A[:100], B[:70]])             # mixed prefill batch
    step([a], [A[100:150]])                     # completes a C128 entry, wraps the ring
    snap = cache.snapshot(a)
    for k in range(8):                          # batched decode
        step([a, b], [A[150 + k:151 + k], B[70 + k:71 + k]])
    f = cache.restore(snap)                     # resumes a at 150 with other tokens
    step([f], [C[:20]])
    for k in range(8):
        step([a, f], [A[158 + k:159 + k], C[20 + k:21 + k]])
    for r in (a, b, f):
        cache.free_request(r)
    cache.release(snap)
    return out


# ---- workers ----------------------------------------------------------------------------------

def _parallel(world: int, tp: int, ep: int) -> ModelParallel:
    # with N processes a case's groups are all of them or none (tp, ep in {1, N})
    for name, size in (("tp", tp), ("ep", ep)):
        if size not in (1, world):
            raise ValueError(f"{name}={size}: this check runs groups of 1 or all {world} processes")
    return ModelParallel(dist.group.WORLD if tp > 1 else None, dist.group.WORLD if ep > 1 else None)


DP_CASE = "DP={n}+EP={n}"


def _dp_model(base: V4Model, rank: int, world: int, cpu_group) -> V4Model:
    """This rank's model of the DP=world+EP=world case: all heads, its share of the experts."""
    par = ModelParallel(None, dist.group.WORLD, DataParallelTokens(dist.group.WORLD, cpu_group))
    w = shard_weights(base.cfg, base.w, 0, 1, rank, world)
    return V4Model(base.cfg, w, base.quant_sim, parallel=par)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_decode(model: V4Model, opts: CheckOptions, batch: int, device: torch.device) -> float:
    """Median wall time of one decode step (ms) of ``batch`` requests after a ``time_prompt`` prefill."""
    cfg, L = model.cfg, opts.time_prompt
    total = batch * (L + opts.time_steps + 8)
    cache = V4Cache(cfg, max_requests=batch, max_total_tokens=total, page_size=64, device=device,
                    backend=opts.time_backend)
    reqs = [cache.new_request() for _ in range(batch)]
    ids = _ids(batch * (L + opts.time_steps + 8), opts.seed + 7, cfg.vocab_size, device).view(batch, -1)
    for i in range(0, batch, 16):  # prefill in groups of 16 requests, bounding the workspace
        model.forward(cache, reqs[i:i + 16], list(ids[i:i + 16, :L]))
        model.serve_other_ranks()
    times = []
    for k in range(opts.time_steps + 3):
        _sync(device)
        t0 = time.perf_counter()
        model.forward(cache, reqs, list(ids[:, L + k:L + k + 1]))
        model.serve_other_ranks()  # under DP: the other ranks' passes (none are left here)
        _sync(device)
        if k >= 3:  # the first steps warm up allocator and kernels
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _worker(rank: int, opts: CheckOptions, port: int, out_dir: str) -> None:
    on_gpu = opts.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # N processes share the machine's cores
    device = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=opts.world, device_id=device if on_gpu else None)
    try:
        ckpt = load_checkpoint(opts.ckpt)
        weights = {k: v.to(device) for k, v in ckpt.tensors.items()}
        cfg = ckpt.config
        cpu_group = dist.new_group(backend="gloo") if opts.dp else None  # DP's row-count exchange
        dp_name = DP_CASE.format(n=opts.world)

        def cache_of(run: Run) -> V4Cache:
            return V4Cache(cfg, max_requests=3, max_total_tokens=1024, page_size=16, device=device,
                           backend=run.backend)

        compared = []  # the logits are [positions, vocab]: compared here, only errors go back
        for i, run in enumerate(opts.runs):
            base = V4Model(cfg, weights, quant_sim=run.quant_sim)
            ref = None
            for tp, ep in ((1, 1),) + opts.cases:
                model = base if (tp, ep) == (1, 1) else shard_model(base, _parallel(opts.world, tp, ep))
                logits = torch.cat(run_schedule(model, cache_of(run), opts.seed))
                if ref is None:
                    ref = logits
                    continue
                compared.append((i, case_name(tp, ep), *_compare(logits, ref)))
            if opts.dp:  # this rank's own tokens (its seed) against TP=1 over the same tokens
                seed = opts.seed + 1000 * (rank + 1)
                ref = torch.cat(run_schedule(base, cache_of(run), seed))
                logits = torch.cat(run_schedule(_dp_model(base, rank, opts.world, cpu_group), cache_of(run), seed))
                compared.append((i, dp_name, *_compare(logits, ref)[:2], None))
        step_ms: dict[str, dict[int, float]] = {}
        base = V4Model(cfg, weights)
        timed = ((1, 1),) + opts.cases if opts.time_batches else ()
        for tp, ep in timed:
            model = base if (tp, ep) == (1, 1) else shard_model(base, _parallel(opts.world, tp, ep))
            step_ms[case_name(tp, ep)] = {b: _time_decode(model, opts, b, device) for b in opts.time_batches}
            dist.barrier()
        if opts.time_batches and opts.dp:
            model = _dp_model(base, rank, opts.world, cpu_group)
            step_ms[dp_name] = {b: _time_decode(model, opts, b, device) for b in opts.time_batches}
            dist.barrier()
        torch.save({"compared": compared, "step_ms": step_ms}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _compare(logits: Tensor, ref: Tensor) -> tuple[Tensor, float, str]:
    """(relative error per position, argmax agreement, digest of the logits)."""
    err = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    return err, agree, hashlib.sha256(logits.numpy().tobytes()).hexdigest()


# ---- the parent -------------------------------------------------------------------------------

def run_check(opts: CheckOptions) -> CheckReport:
    """Spawn ``opts.world`` processes, run every case, compare with TP=1 and with each other."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    with tempfile.TemporaryDirectory(prefix="dsv4-parallel-") as out_dir:
        # spawned, not forked: CUDA and OpenMP thread pools do not survive a fork
        mp.spawn(_worker, args=(opts, free_port(), out_dir), nprocs=opts.world, join=True)
        per_rank = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(opts.world)]
    report = CheckReport(step_ms=per_rank[0]["step_ms"])
    for k, (i, case, err, agree, digest) in enumerate(per_rank[0]["compared"]):
        run = opts.runs[i]
        if digest is None:  # data-parallel: each rank checked its own tokens; take them all
            err = torch.cat([p["compared"][k][2] for p in per_rank])
            agree = min(p["compared"][k][3] for p in per_rank)
            same = None
        else:
            # the residual streams are replicated, so every rank must produce the same logits
            same = all(p["compared"][k][4] == digest for p in per_rank[1:])
        med, p99, mx = float(err.median()), float(err.quantile(0.99)), float(err.max())
        if run.max_err is not None:
            ok = mx < run.max_err
        else:
            ok = med < run.median_err and p99 < run.p99_err and agree >= run.argmax_agree
        report.results.append(CaseResult(run, case, med, p99, mx, agree, same, ok and same is not False))
    return report


def format_report(report: CheckReport, opts: CheckOptions) -> str:
    """Markdown: the equality checks, then the decode step times."""
    lines = ["## Sharded vs TP=1 logits (relative error per position, ||a-b|| / ||b||)", "",
             "| backend | QAT sim | case | median | p99 | max | argmax agree | ranks identical | bound | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.results:
        bound = (f"max < {r.run.max_err:g}" if r.run.max_err is not None else
                 f"median < {r.run.median_err:g}, p99 < {r.run.p99_err:g}, argmax >= {r.run.argmax_agree:g}")
        lines.append(f"| {r.run.backend} | {r.run.quant_sim} | {r.case} | {r.median:.2e} | {r.p99:.2e} | "
                     f"{r.max:.2e} | {r.argmax_agree:.3f} | {'-' if r.ranks_identical is None else r.ranks_identical} | "
                     f"{bound} | {'yes' if r.ok else 'NO'} |")
    if report.step_ms:
        cases = list(report.step_ms)
        batches = list(next(iter(report.step_ms.values())))
        lines += ["", f"## Decode step time (ms, median of {opts.time_steps} steps after a "
                      f"{opts.time_prompt}-token prefill; attention backend {opts.time_backend})", "",
                  "| batch | " + " | ".join(cases) + " | " + " | ".join(f"{c} speed-up" for c in cases[1:]) + " |",
                  "|---" * (1 + 2 * len(cases) - 1) + "|"]
        for b in batches:
            t = [report.step_ms[c][b] for c in cases]
            lines.append(f"| {b} | " + " | ".join(f"{x:.2f}" for x in t) + " | "
                         + " | ".join(f"{t[0] / x:.2f}x" for x in t[1:]) + " |")
        if any(c.startswith("DP=") for c in cases):
            lines += ["", "(DP: the batch is each rank's; the ranks together decode world x batch "
                          "requests per step, so its throughput against TP=1 is world x its speed-up.)"]
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_dsv4.parallel_check", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="micro", help="tiny preset to build (see sglang_dsv4.tiny)")
    p.add_argument("--ckpt", help="an existing checkpoint directory instead of --preset")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=2, help="processes (GPUs on cuda)")
    p.add_argument("--time", default="", help="comma-separated decode batch sizes to time (empty: none)")
    p.add_argument("--time-steps", type=int, default=20)
    p.add_argument("--out", type=Path, help="also write the markdown report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from .checkpoint.writer import write_checkpoint
    from .tiny import preset_config, random_weights

    with tempfile.TemporaryDirectory(prefix="dsv4-ckpt-") as tmp:
        ckpt = args.ckpt
        if ckpt is None:  # weights only: no tokenizer files are needed here
            cfg = preset_config(args.preset)
            ckpt = str(Path(tmp) / args.preset)
            write_checkpoint(cfg, random_weights(cfg, 0), ckpt)
        gpu = args.device == "cuda"
        opts = CheckOptions(ckpt=ckpt, device=args.device, world=args.world, runs=GPU_RUNS if gpu else CPU_RUNS,
                            time_batches=tuple(int(b) for b in args.time.split(",") if b),
                            time_steps=args.time_steps)
        t0 = time.perf_counter()
        report = run_check(opts)
    dev = torch.cuda.get_device_name(0) if gpu else platform.processor() or platform.machine()
    head = (f"# Sharded V4 core: {args.world} x {dev} ({datetime.date.today()})\n\n"
            f"torch {torch.__version__}, python {platform.python_version()}, preset {args.preset}, "
            f"{'NCCL' if gpu else 'gloo'}; check + timing took {time.perf_counter() - t0:.0f} s.\n")
    text = head + "\n" + format_report(report, opts) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
