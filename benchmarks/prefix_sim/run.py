"""Replay every workload through ours, upstream and no cache at each budget; print a markdown table.

``python -m benchmarks.prefix_sim.run [--budgets-gib 1 2 8 32] [--workloads ...] [--seed 0]``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Sequence

from . import traces
from .common import GIB, NoCache, Outcome, Policy, V4Costs, replay
from .ours import OursSim
from .upstream import UpstreamSim

POLICIES: dict[str, Callable[[float], Policy]] = {
    "ours": lambda b: OursSim(b),
    "upstream": lambda b: UpstreamSim(b),
    "none": lambda b: NoCache(),
}


def _fmt_tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def row(workload: str, budget: float, out: Outcome) -> str:
    points = "-" if out.resume_points is None else str(out.resume_points)
    return (f"| {workload} | {budget:g} | {out.policy} | {out.hit_rate:.1%} | {_fmt_tokens(out.recomputed)} "
            f"| {out.retained:.1%} | {points} |")


def describe(trace: Sequence[traces.Request]) -> str:
    prompt = sum(len(r.prompt) for r in trace)
    return (f"{len(trace)} requests, {_fmt_tokens(prompt)} prompt tokens, "
            f"longest history {max(len(r.history) for r in trace)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Prefix-sharing simulation: ours vs upstream 0.5.23 vs none")
    ap.add_argument("--budgets-gib", type=float, nargs="+", default=[1, 2, 8, 32])
    ap.add_argument("--workloads", nargs="+", default=list(traces.WORKLOADS), choices=list(traces.WORKLOADS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every trace length")
    args = ap.parse_args(argv)

    c = V4Costs.flash()
    print(f"V4-Flash fp8 bytes: ours {c.ours_token:g} B/cached token, {c.ours_snapshot:,} B/snapshot or running ring; "
          f"upstream {c.up_full_token:g} B/full token + {c.up_swa_token:g} B/SWA token (SWA pool 0.1 x full)\n")
    print("| workload | budget GiB | policy | hit rate | prompt tokens recomputed | follow-up reuse at end "
          "| snapshots held |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads:
        trace = traces.build(name, args.seed, args.scale)
        print(f"{name}: {describe(trace)}", file=sys.stderr)
        for budget in args.budgets_gib:
            for pol in args.policies:
                t0 = time.time()
                try:
                    out = replay(POLICIES[pol](budget * GIB), trace)
                except RuntimeError as e:  # upstream's allocator: the pools cannot hold one chunk
                    print(f"| {name} | {budget:g} | {pol} | out of memory: {str(e).splitlines()[0]} | | | |")
                    continue
                print(row(name, budget, out), flush=True)
                print(f"  {name} {budget:g} GiB {pol}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
