"""bench_prefill's hit case is a real cache hit: resumed from the prompt's snapshot, its last
position equals the same sequence prefilled cold, bit for bit (the CPU path is chunk-invariant)."""

from __future__ import annotations

import torch

from benchmarks.bench_decode import bench_weights, make_config
from benchmarks.bench_prefill import PrefillCase, prompt_cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.srt.state import SglangV4Cache


def test_a_hit_resumes_from_the_snapshot_and_equals_the_sequence_cold():
    length, new = 150, 7  # a C4 and a C128 group boundary inside, the window wrapped
    cfg = make_config("micro", length + new + 8)
    model = V4Model(cfg, bench_weights(cfg, "cpu", "bf16"))
    gen = torch.Generator().manual_seed(0)
    cache, base, prompt = prompt_cache(model, length, new, 64, "cpu", gen)
    hit = PrefillCase(model, cache, "hit", length, new, 64, base, gen)
    restored = cache.stats["snapshots_restored"]
    hit.step()
    hit.step()  # a second request in the row: resumed again, the same result
    assert cache.stats["snapshots_restored"] == restored + 2

    cold_cache = SglangV4Cache.with_own_table(cfg, 2, length + new + 8, max_seq_len=length + new + 8)
    cold_cache.req_to_token[1, :length + new] = torch.arange(1, 1 + length + new, dtype=torch.int32)
    st = cold_cache.bind(1, 1, 0)
    hidden = model.forward(cold_cache, [st], [torch.cat([prompt, hit.ids])], return_hidden=True)[0]
    assert torch.equal(hit.last_hidden, hidden[-1:])


def test_the_census_traces_a_run_and_names_the_model_functions_it_spent_time_in():
    """``--census`` on the CPU: the run's host time by function, from the harness's own thread."""
    from benchmarks.bench_prefill import census_lines

    length, new = 40, 5
    cfg = make_config("micro", length + new + 8)
    model = V4Model(cfg, bench_weights(cfg, "cpu", "bf16"))
    gen = torch.Generator().manual_seed(0)
    cache, base, _ = prompt_cache(model, length, new, 64, "cpu", gen)
    hit = PrefillCase(model, cache, "hit", length, new, 64, base, gen)
    lines = census_lines(hit, top=40)
    inclusive = {row.split(" | ")[0].lstrip("| "): row for row in lines if row.startswith("| sglang_dsv4/")}
    assert any(name.endswith(": forward_step") for name in inclusive), lines
    assert any(row.startswith("| aten::") for row in lines)  # the flat self-time table holds torch ops


def test_released_runs_keep_the_pools_as_they_were():
    """Each timed run is released as SGLang ends a request (``PrefillCase.release``): repeated
    cold runs and hits hand their entry rows back, so the pools neither fill nor grow (a growth
    drops the graphs that read them, and a run would recapture: the profiled cold run's ~1000
    launches on the H100, 2026-12-05)."""
    length, new = 150, 7
    cfg = make_config("micro", length + new + 8)
    model = V4Model(cfg, bench_weights(cfg, "cpu", "bf16"))
    gen = torch.Generator().manual_seed(0)
    cache, base, _ = prompt_cache(model, length, new, 64, "cpu", gen)
    held = {r: (p.capacity, p.num_used) for r, p in cache.pools.items()}
    for kind in ("cold", "hit"):
        case = PrefillCase(model, cache, kind, length, new, 64, base, gen)
        for _ in range(6):
            case.step()
            case.release()
            assert {r: (p.capacity, p.num_used) for r, p in cache.pools.items()} == held
    cache.check_integrity()
