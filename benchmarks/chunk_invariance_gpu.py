"""How far the GPU step is from chunk invariance today (issue 15's GPU deterministic mode).

    python -m benchmarks.chunk_invariance_gpu [--configs tiny,flash8] [--modes default,deterministic,graphs-det]
        [--prompt 600] [--steps 32]

On the CPU every position's result is independent of how its sequence was chunked
(``tests/core/test_chunk_invariance.py``). On the GPU it is not (cuBLAS picks its GEMM by row
count, FlashMLA's decode splits its work by batch size, Inductor kernels are specialised on
shapes). This prints, per config and compile setting, how much the logits move when a prompt is
prefilled uncut vs cut as [1, rest] (the cut a server makes after a cached BOS token) or at the
middle, and when a request decodes alone vs inside a batch of 8: whether they are equal, the
largest and median relative logit difference, the first decode step whose greedy token differs.
``--modes``: ``default`` (the GPU step as it serves), ``deterministic`` (``V4Model(deterministic=True)``,
eager), ``graphs-det`` (the deterministic mode with decode replayed from CUDA graphs), ``graphs``.
A measurement; ``tests/core/test_deterministic_gpu.py`` asserts the deterministic rows.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.bench_decode import make_config, random_weights
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.srt.state import SglangV4Cache

DEV = "cuda"


class Rows:
    """The serving cache driven as SGLang drives it (rows of req_to_token, fresh slots)."""

    def __init__(self, cfg, rows: int, max_len: int):
        self.cache = SglangV4Cache.with_own_table(cfg, rows, rows * max_len, max_seq_len=max_len, device=DEV,
                                                  backend="flashmla")
        self.next = 1

    def slots(self, row: int, start: int, n: int) -> None:
        self.cache.req_to_token[row, start:start + n] = torch.arange(self.next, self.next + n, dtype=torch.int32,
                                                                     device=DEV)
        self.next += n


def run(model, cfg, prompt: torch.Tensor, cuts: list[int], steps: int, batch_with: list[torch.Tensor]):
    """Prefill ``prompt`` in pieces ending at ``cuts`` (row 0), the ``batch_with`` prompts in
    rows 1.., then ``steps`` greedy decode steps of all rows together -> (prefill logits of row 0,
    decode logits of row 0 [steps, V], its greedy tokens)."""
    rows = Rows(cfg, 1 + len(batch_with), prompt.numel() + steps + 8)
    states, pre = [], []
    for r, p in enumerate([prompt] + batch_with):
        st = rows.cache.bind(r, 1, 0)
        pos = 0
        for c in (sorted(cuts) if r == 0 else []) + [p.numel()]:
            if c > pos:
                rows.slots(r, pos, c - pos)
                out = model.forward(rows.cache, [st], [p[pos:c].to(DEV)])[0]
                if r == 0:
                    pre.append(out)
                pos = c
        states.append(st)
    first = torch.cat(pre)
    ids = [first[-1].argmax().view(1)] + [torch.zeros(1, dtype=torch.long, device=DEV)] * len(batch_with)
    dec, toks = [], []
    for _ in range(steps):
        for r, st in enumerate(states):
            rows.slots(r, st.num_tokens, 1)
        outs = model.forward(rows.cache, states, ids)
        dec.append(outs[0][-1])
        ids = [o[-1].argmax().view(1) for o in outs]
        toks.append(ids[0])
    return first, torch.stack(dec), torch.cat(toks)


def compare(a, b) -> tuple[bool, float, float]:
    rel = (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-30)
    return torch.equal(a, b), rel.max().item(), rel.median().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,flash8")
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--modes", default="default,deterministic")
    args = ap.parse_args()
    compile_on = os.environ.get("SGLANG_DSV4_COMPILE", "1") not in ("0", "false", "False", "")
    print("| config | mode | compile | case | prefill equal | prefill max rel | prefill median rel "
          "| decode equal | decode max rel | first token differing |")
    print("|---" * 10 + "|")
    for name, mode in [(n, m) for n in args.configs.split(",") for m in args.modes.split(",")]:
        cfg = make_config(name, args.prompt + args.steps + 64)
        model = V4Model(cfg, random_weights(cfg, DEV, torch.bfloat16), deterministic=mode.endswith("det")
                        or mode == "deterministic")
        if mode.startswith("graphs"):
            model.enable_cuda_graphs(16)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g)
        others = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (37, 130, 260, 515, 70, 5, 300)]
        print(f"(running {name} / {mode} / reference: uncut, alone)", flush=True)
        ref = run(model, cfg, prompt, [], args.steps, [])
        cases = {"cut [1, rest]": ([1], []), f"cut at {args.prompt // 2}": ([args.prompt // 2], []),
                 "decode in a batch of 8": ([], others)}
        for case, (cuts, batch_with) in cases.items():
            # named first: a device-side assert ends the process before the row is printed
            print(f"(running {name} / {mode} / {case})", flush=True)
            got = run(model, cfg, prompt, cuts, args.steps, batch_with)
            p_eq, p_max, p_med = compare(got[0], ref[0])
            d_eq, d_max, _ = compare(got[1], ref[1])
            diff = (got[2] != ref[2]).nonzero()
            first = int(diff[0]) if diff.numel() else "-"
            print(f"| {name} | {mode} | {'on' if compile_on else 'off'} | {case} | {p_eq} | {p_max:.2e} | {p_med:.2e} "
                  f"| {d_eq} | {d_max:.2e} | {first} |", flush=True)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
