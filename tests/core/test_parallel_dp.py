"""Data-parallel attention x expert parallelism in the core (``parallel.DataParallelTokens``): two
gloo ranks on the CPU, each with its own requests and cache, the MoE over both ranks' tokens.
The ranks take different steps (prefill on one while the other decodes, one idle, one with two
passes in a step) and every request's logits equal the single-process model's. Tolerance as in
``test_parallel.py`` (QAT simulation off, torch backend: only the order of float32 sums over the
experts differs), 1e-5 relative per position."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.parallel import DataParallelTokens, ModelParallel, shard_weights

# per scheduler step, per rank: the forwards it runs, each [(request name, tokens)]; [] = idle
LENS = {"a": 37, "b": 150, "c": 300, "d": 9}
SCHEDULE = [
    {0: [[("a", 37), ("b", 150)]], 1: [[("c", 300)]]},    # both prefill
    {0: [[("a", 1), ("b", 1)]], 1: []},                     # rank 1 idle
    {0: [], 1: [[("c", 1)]]},                               # rank 0 idle
    {0: [[("a", 1)]], 1: [[("d", 9)], [("c", 1), ("d", 1)]]},  # rank 1: two passes
]


def _ids(name: str) -> torch.Tensor:
    n = LENS[name] + 8
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(ord(name)))


def _run(model: V4Model, forwards_per_step, after_step=None) -> dict[str, list[torch.Tensor]]:
    """Run the forwards, feeding each request its next tokens -> logits per request."""
    cache = V4Cache(model.cfg, max_requests=4, max_total_tokens=4096, max_seq_len=1024, backend="torch")
    reqs, done, out = {}, {}, {}
    for forwards in forwards_per_step:
        for fw in forwards:
            batch = []
            for name, n in fw:
                if name not in reqs:
                    reqs[name], done[name], out[name] = cache.new_request(), 0, []
                batch.append((name, _ids(name)[done[name]:done[name] + n]))
                done[name] += n
            logits = model.forward(cache, [reqs[n] for n, _ in batch], [t for _, t in batch])
            for (name, _), l in zip(batch, logits):
                out[name].append(l)
        if after_step is not None:
            after_step()
    return {k: torch.cat(v) for k, v in out.items()}


def _worker(rank: int, init: str, ckpt: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        loaded = load_checkpoint(ckpt)
        cfg, w = loaded.config, loaded.tensors
        group = dist.group.WORLD
        par = ModelParallel(None, group, DataParallelTokens(group, group))
        model = V4Model(cfg, shard_weights(cfg, w, 0, 1, rank, 2), quant_sim=False, parallel=par)
        got = _run(model, [step[rank] for step in SCHEDULE], after_step=model.serve_other_ranks)
        torch.save(got, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_dp_attention_ranks_with_different_steps_match_one_process(micro_dir, tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_worker, args=(init, str(micro_dir), str(tmp_path)), nprocs=2, start_method="spawn")
    loaded = load_checkpoint(micro_dir)
    single = V4Model(loaded.config, loaded.tensors, quant_sim=False)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        ref = _run(single, [step[rank] for step in SCHEDULE])
        assert got.keys() == ref.keys() and got
        for name in got:
            err = (got[name] - ref[name]).norm(dim=-1) / ref[name].norm(dim=-1)
            assert err.max() < 1e-5, (rank, name, err.max().item())
