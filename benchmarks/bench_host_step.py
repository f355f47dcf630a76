"""Host cost of a server decode step: the Python work around the device work, per batch size.

    python -m benchmarks.bench_host_step [--batches 1,64,256] [--context 300] [--steps 20]
        [--prev-root DIR] [--out FILE.md]

Without SGLang's overlap scheduler (``--disable-overlap-schedule``) the host work of a step
(SGLang's, then ours before the step's kernels are queued) leaves the GPU idle: it adds to every
step's time; with it (the default) it runs while the step before is on the GPU, and bounds the
step from below. This measures ours, on the CPU, with the code that serves:

- ``adapter``: ``srt.model.DeepseekV4ForCausalLM.forward`` outside ``V4Model.forward`` (rows,
  generations, binding each row's request state, the token tensors, fork points), driven with a
  decode ``ForwardBatch``'s host fields as SGLang fills them;
- ``graph inputs``: ``plan_tables`` + ``graphs.decode_inputs`` of the step, what
  ``DecodeGraphs.run`` computes before its one host-to-device copy and the replay.

On the GPU's server path the host part of a decode step is ``adapter`` + ``graph inputs`` (+ the
copy and the replay's launch). (The CPU's own eager step is not timed: its host work, padding to
32-row tiles included, is the CPU's alone.) The model is ``micro`` on the CPU (its compute is not counted); B requests
resume from one snapshot of a ``--context``-token prompt, as a shared prefix does in the server.
SGLang's logits processor is left out: it is SGLang's, the same for both trees.

``--prev-root DIR`` (a ``sglang_dsv4`` package of an earlier commit: ``git archive COMMIT
sglang_dsv4 | tar -x -C DIR``) runs the same measurement on it in a subprocess first, so the two
trees are side by side in one run (medians over ``--steps`` steps after 3 warm-up steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch


def measure(batches: list[int], context: int, steps: int) -> list[dict]:
    """Per batch: median microseconds of each host part of a decode step (module docstring)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dsv4.core import graphs as graphs_mod
    from sglang_dsv4.core import model as model_mod
    from sglang_dsv4.srt import model as srt_model
    from sglang_dsv4.srt.state import SglangV4Cache
    from sglang_dsv4.tiny import preset_config

    from .bench_decode import random_weights
    from .profile_decode import PhaseTimer

    torch.set_num_threads(1)  # no OpenMP workers spinning beside the timed host code after each compute
    cfg = preset_config("micro")
    w = random_weights(cfg, "cpu", torch.float32)
    timer = PhaseTimer()
    timer.wrap(model_mod.V4Model, "forward", "core")
    rows_out = []
    for B in batches:
        max_len = context + steps + 8
        cache = SglangV4Cache.with_own_table(cfg, B + 1, (B + 1) * (steps + 8) + context + 64, max_len,
                                             backend="torch")
        core = model_mod.V4Model(cfg, w)
        # the SGLang model class as its loader leaves it (srt.model), without SGLang's process set-up
        model = srt_model.DeepseekV4ForCausalLM.__new__(srt_model.DeepseekV4ForCausalLM)
        torch.nn.Module.__init__(model)
        model.v4, model.core, model.cache, model.metrics = cfg, core, cache, None
        model.lm_head = SimpleNamespace(weight=torch.empty(0))
        model.logits_processor = lambda ids, hidden, head, fb: hidden
        model.req_generation = torch.ones(B + 1, dtype=torch.int64)
        # row 0: the shared prompt, snapshotted at its end; rows 1..B resume there
        slots = iter(range(1, 10**9))
        cache.req_to_token[0, :context] = torch.tensor([next(slots) for _ in range(context)], dtype=torch.int32)
        prompt = cache.bind(0, 1, 0)
        core.forward(cache, [prompt], [torch.randint(0, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0))])
        cache.take_snapshot(prompt)
        rows = torch.arange(1, B + 1)
        cache.req_to_token[1:B + 1, :context] = cache.req_to_token[0, :context]
        ids = torch.randint(0, cfg.vocab_size, (B,), generator=torch.Generator().manual_seed(1))
        parts: dict[str, list[float]] = {"adapter": [], "graph inputs": []}
        for step in range(steps + 3):
            pos = context + step
            cache.req_to_token[1:B + 1, pos] = torch.tensor([next(slots) for _ in range(B)], dtype=torch.int32)
            fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices_cpu=rows,
                                 req_pool_indices=rows, seq_lens_cpu=torch.full((B,), pos + 1))
            timer.t.clear()
            t0 = time.perf_counter()
            hidden = model.forward(ids, torch.full((B,), pos), fb)
            total = time.perf_counter() - t0
            ids = hidden[:, :cfg.vocab_size].argmax(-1) % cfg.vocab_size
            if step >= 3:
                parts["adapter"].append(total - sum(timer.t["core"]))
        # the graph path's host part (DecodeGraphs.run before its copy), on a cache of its own; a
        # loop of its own, so that no CPU compute of the model precedes it (on a GPU none does)
        graph_cache = SglangV4Cache.with_own_table(cfg, B + 1, (B + 1) * (steps + 8) + 64, max_len, backend="torch")
        graph_states = [graph_cache.bind(r, 1, 0) for r in range(B)]
        for st in graph_states:
            st.num_tokens = context
        for step in range(steps + 3):
            starts = [st.num_tokens for st in graph_states]
            t1 = time.perf_counter()
            positions = torch.tensor(starts)
            plan = graph_cache.plan_tables(graph_states, starts, [1] * B, positions)
            graphs_mod.decode_inputs(graph_cache, graph_states, starts, plan, B)
            graph = time.perf_counter() - t1
            for r, wr in plan.write.items():  # the rows go back (their tokens are not kept)
                graph_cache.pools[r].free(wr[wr != graph_cache.pools[r].scratch_row])
            for st in graph_states:
                st.num_tokens += 1
            if step >= 3:
                parts["graph inputs"].append(graph)
        row = {"batch": B}
        row.update({k: 1e6 * statistics.median(v) for k, v in parts.items()})
        rows_out.append(row)
        print(f"  batch {B}: " + ", ".join(f"{k} {v:.0f} us" for k, v in row.items() if k != "batch"),
              file=sys.stderr, flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prev-root", default=None, help="an earlier commit's sglang_dsv4 package, measured first")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON (the subprocess's form)")
    ap.add_argument("--expect-root", default=None, help="fail unless sglang_dsv4 is imported from this directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    import sglang_dsv4
    where = os.path.dirname(os.path.dirname(os.path.abspath(sglang_dsv4.__file__)))
    if args.expect_root and where != args.expect_root:
        raise SystemExit(f"sglang_dsv4 imported from {where}, not {args.expect_root}")
    results: list[tuple[str, dict]] = []
    if args.prev_root:
        root = os.path.abspath(args.prev_root)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.getcwd()]))
        # -P: no current directory ahead of PYTHONPATH (``-m`` would put this tree's package
        # first, and the "before" rows would measure this tree)
        cmd = [sys.executable, "-P", "-m", "benchmarks.bench_host_step", "--batches", args.batches, "--context",
               str(args.context), "--steps", str(args.steps), "--json", "--expect-root", root]
        print(f"before: {args.prev_root}", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, env=env, capture_output=False, stdout=subprocess.PIPE, text=True, check=True)
        results += [("before", r) for r in json.loads(out.stdout)]
    print(f"{args.label}: {where}", file=sys.stderr, flush=True)
    rows = measure(batches, args.context, args.steps)
    if args.json:
        print(json.dumps(rows))
        return
    results += [(args.label, r) for r in rows]
    lines = ["| batch | tree | adapter us | graph inputs us | host part of a graphed decode step us |",
             "|---|---|---|---|---|"]
    for B in batches:
        for label, r in results:
            if r["batch"] == B:
                lines.append(f"| {B} | {label} | {r['adapter']:.0f} | {r['graph inputs']:.0f} | "
                             f"{r['adapter'] + r['graph inputs']:.0f} |")
        before = [r for label, r in results if label == "before" and r["batch"] == B]
        after = [r for label, r in results if label != "before" and r["batch"] == B]
        if before and after:
            b, a = before[0], after[0]
            lines.append(f"| {B} | before / after | {b['adapter'] / a['adapter']:.1f}x | "
                         f"{b['graph inputs'] / a['graph inputs']:.1f}x | "
                         f"{(b['adapter'] + b['graph inputs']) / (a['adapter'] + a['graph inputs']):.1f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
