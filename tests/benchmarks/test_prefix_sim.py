"""The prefix-sharing simulators (benchmarks/prefix_sim) on hand-checked tiny traces, trace
determinism, and agreement of our simulator with the real server's ``cached_tokens``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dsv4.ports import free_port

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks.prefix_sim import traces  # noqa: E402
from benchmarks.prefix_sim.common import NoCache, V4Costs, replay  # noqa: E402
from benchmarks.prefix_sim.ours import OursSim  # noqa: E402
from benchmarks.prefix_sim.traces import Request  # noqa: E402

HUGE = 1e15  # bytes: no eviction


def _tok(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 120000) for _ in range(n))


def _chat_and_divergence() -> list[Request]:
    """A: 600-token prompt, 20 out; B: A's history + 50; C and D: A's first 300 tokens + 400 new."""
    rng = random.Random(0)
    a = Request(_tok(rng, 600), _tok(rng, 20))
    return [a, Request(a.history + _tok(rng, 50), _tok(rng, 5)),
            Request(a.prompt[:300] + _tok(rng, 400), _tok(rng, 5)),
            Request(a.prompt[:300] + _tok(rng, 400), _tok(rng, 5))]


def _shared_system() -> list[Request]:
    """A 700-token system prompt, three questions on it, then two requests leaving it at 400."""
    rng = random.Random(1)
    system = _tok(rng, 700)
    return [Request(system + _tok(rng, 50), _tok(rng, 8)), Request(system + _tok(rng, 50), _tok(rng, 8)),
            Request(system + _tok(rng, 60), _tok(rng, 8)), Request(system[:400] + _tok(rng, 50), _tok(rng, 8)),
            Request(system[:400] + _tok(rng, 70), _tok(rng, 8))]


def _fork() -> list[Request]:
    """fork(3) as the frontend sends it: a max_new_tokens=0 prefill of 900 tokens, then 3 branches."""
    rng = random.Random(2)
    root = Request(_tok(rng, 900), ())
    return [root] + [Request(root.prompt + _tok(rng, 40), _tok(rng, 6)) for _ in range(3)]


def _n_sampling() -> list[Request]:
    """n=3 as SGLang sends it: a max_new_tokens=0 warm-up of a 900-token prompt, then 3 copies."""
    rng = random.Random(3)
    prompt = _tok(rng, 900)
    return [Request(prompt, ())] + [Request(prompt, _tok(rng, 6)) for _ in range(3)]


# ---- ours ------------------------------------------------------------------------------------
@pytest.mark.parametrize("trace, expected", [
    # B resumes at A's finish snapshot (600 + 20 - 1); C matches 300 but no snapshot is there, so it
    # recomputes and leaves one at its divergence point, which D resumes from.
    (_chat_and_divergence(), [0, 619, 0, 300]),
    # the 2nd request diverges at 700 (snapshot taken as it passes), the 3rd resumes there; same at 400
    (_shared_system(), [0, 0, 700, 0, 400]),
    # the fork point's prefill snapshot (900) serves every branch
    (_fork(), [0, 900, 900, 900]),
    # copies are capped at 899: the warm-up (max_new_tokens=0) snapshots there as well as at 900
    (_n_sampling(), [0, 899, 899, 899]),
])
def test_ours_hits_exactly(trace, expected):
    sim = OursSim(HUGE)
    assert [sim.serve(r) for r in trace] == expected


@pytest.mark.parametrize("trace", [_chat_and_divergence(), _shared_system(), _fork(), _n_sampling()])
def test_ours_releases_every_lock(trace):
    sim = OursSim(HUGE, chunk=256)  # chunk checkpoints and divergences split the running path
    for r in trace:
        sim.serve(r)
        assert sim.locked_nodes() == 0 and sim.running == 0


def test_ours_unlocks_nodes_split_under_a_running_request():
    """The third request resumes at 100 on a path whose deeper snapshots were evicted; its chunk
    checkpoints (356, 612, 868) split the locked node [100, 1000): the split-off parts unlock too."""
    rng = random.Random(9)
    x = _tok(rng, 1000)
    costs = V4Costs(ours_token=1.0, ours_snapshot=1000, up_full_token=1.0, up_swa_token=1.0)
    sim = OursSim(7000, costs=costs, chunk=256)
    trace = [Request(x, _tok(rng, 5)), Request(x[:100] + _tok(rng, 20), _tok(rng, 5)),
             Request(x[:900] + _tok(rng, 20), _tok(rng, 5))]
    assert [sim.serve(r) for r in trace] == [0, 0, 100]
    assert sim.locked_nodes() == 0


def test_ours_without_the_fan_out_snapshot_first_copy_recomputes():
    # the warm-up's snapshot at 900 is past the copies' 899 cap: the first copy recomputes and
    # leaves a divergence snapshot at 899 for the others
    sim = OursSim(HUGE, fan_out_snapshot=False)
    assert [sim.serve(r) for r in _n_sampling()] == [0, 0, 899, 899]


def test_ours_chunk_ends_are_resume_points():
    rng = random.Random(4)
    a = Request(_tok(rng, 5000), _tok(rng, 3))
    b = Request(a.prompt[:4500] + _tok(rng, 10), _tok(rng, 3))
    sim = OursSim(HUGE, chunk=2048)
    assert [sim.serve(a), sim.serve(b)] == [0, 4096]  # chunk ends 2048, 4096; prompt end 5000


def _unit_costs() -> V4Costs:
    return V4Costs(ours_token=1.0, ours_snapshot=10, up_full_token=1.0, up_swa_token=1.0)


def test_ours_evicts_snapshots_alone_least_recent_first():
    rng = random.Random(5)
    a, b = Request(_tok(rng, 100), _tok(rng, 10)), Request(_tok(rng, 100), _tok(rng, 10))
    # A: 109 tokens + snapshots at 100 and 109 = 129 B; B the same: 258 B > 250, so the oldest
    # item (A's snapshot at 100) goes and nothing else.
    sim = OursSim(250, costs=_unit_costs())
    sim.serve(a)
    sim.serve(b)
    assert (sim.tokens, sim.num_snaps, sim.used()) == (218, 3, 248)
    assert sim.resumable(a.history[:-1]) == 109
    assert sim.match(a.prompt + (7,))[0] == 0  # the prompt-end snapshot is gone, the path is not
    assert sim.match(a.prompt + (7,))[1] == 100


def test_ours_evicts_least_recent_leaf_with_its_snapshots():
    rng = random.Random(6)
    a, b = Request(_tok(rng, 100), _tok(rng, 10)), Request(_tok(rng, 100), _tok(rng, 10))
    sim = OursSim(160, costs=_unit_costs())
    sim.serve(a)
    sim.serve(b)
    assert sim.match(a.history)[1] == 0  # A's tokens and snapshots are gone
    assert sim.resumable(b.history[:-1]) == 109
    assert sim.used() <= 160


def test_ours_never_evicts_the_running_request_path():
    rng = random.Random(7)
    a = Request(_tok(rng, 100), _tok(rng, 10))
    b = Request(a.history + _tok(rng, 20), _tok(rng, 5))
    sim = OursSim(140, costs=_unit_costs())
    assert [sim.serve(a), sim.serve(b)] == [0, 109]


# ---- upstream (its real classes) -------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream_cls():
    from benchmarks.prefix_sim.upstream import UpstreamSim
    return UpstreamSim


@pytest.mark.parametrize("trace, expected", [
    # integration_facts.md §2's probe: B hits A's history floored to 256; C's hit would end at 256,
    # whose SWA A's prefill freed; C's insert restores it for D.
    (_chat_and_divergence(), [0, 512, 0, 256]),
    # 757 tokens inserted -> 512 cached with live SWA on [256, 512); at 400 the hit floors to 256 (dead)
    (_shared_system(), [0, 512, 512, 0, 256]),
    # 900 floored to 768
    (_fork(), [0, 768, 768, 768]),
    (_n_sampling(), [0, 768, 768, 768]),
])
def test_upstream_hits_exactly(upstream_cls, trace, expected):
    sim = upstream_cls(0, pages=(64, 6))
    assert [sim.serve(r) for r in trace] == expected


def _round_robin(sim, seed: int) -> tuple[list[int], list[int]]:
    """Three 600-token sessions, then two more turns each, round-robin: (hits, the previous
    history's length floored to a page, per turn)."""
    rng = random.Random(seed)
    last = [Request(_tok(rng, 600), _tok(rng, 20)) for _ in range(3)]
    for r in last:
        sim.serve(r)
    hits, floors = [], []
    for _ in range(2):
        for k in range(3):
            floors.append((len(last[k].history) - 1) // 256 * 256)
            last[k] = Request(last[k].history + _tok(rng, 30), _tok(rng, 20))
            hits.append(sim.serve(last[k]))
    return hits, floors


def test_upstream_round_robin_sessions_lose_their_window(upstream_cls):
    """With a 4-page SWA pool each turn evicts the other sessions' window tails: every turn misses
    although their full KV stays; with a 30-page SWA pool every turn hits its history floored to 256."""
    hits, _ = _round_robin(upstream_cls(0, pages=(64, 4)), 8)
    assert hits == [0] * 6
    hits, floors = _round_robin(upstream_cls(0, pages=(64, 30)), 8)
    assert hits == floors and min(floors) >= 512
    ours, _ = _round_robin(OursSim(64 * 256 * 3850.25 + 4 * 256 * 31875), 8)
    assert all(h > f for h, f in zip(ours, floors))  # ours: the same budget, token-exact resumes


# ---- traces, replay ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(traces.WORKLOADS))
def test_traces_are_deterministic_by_seed(name):
    a, b, c = (traces.build(name, s, scale=0.1) for s in (3, 3, 4))
    assert a == b
    assert a != c


def test_chat_turns_extend_the_previous_history():
    specs = traces.multi_turn_chat(0, sessions=2, turns=3, scale=0.2)
    trace = traces.realize(specs, traces.seeded_outputs(0))
    assert trace[2].prompt[:len(trace[0].history)] == trace[0].history
    assert trace[3].prompt[:len(trace[1].history)] == trace[1].history


def test_replay_counts():
    trace = _chat_and_divergence()
    none, ours = replay(NoCache(), trace), replay(OursSim(HUGE), trace)
    assert none.hit_tokens == 0 and none.recomputed == none.prompt_tokens == 600 + 670 + 700 + 700
    assert ours.hit_tokens == 619 + 300 and ours.recomputed == ours.prompt_tokens - 919


# ---- agreement with the real server --------------------------------------------------------------
def test_ours_agrees_with_the_server(tmp_path):
    """Every request of agree.short_trace: simulator's cached tokens == server's cached_tokens."""
    from benchmarks.prefix_sim.agree import compare, short_trace
    from benchmarks.prefix_sim.serve import wait_healthy

    port = free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_dsv4.launch_server", "--model-path", "micro",
                             "--port", str(port), "--dsv4-snapshot-budget-mb", "64",
                             "--max-total-tokens", "16384"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, tmp_path / "server.log", timeout=600)
        rows = compare(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(rows) == len(short_trace())
    assert [(tag, p) for tag, p, _ in rows] == [(tag, s) for tag, _, s in rows], rows
    assert sum(p for _, p, _ in rows) > 0


def test_v4_flash_costs_and_upstream_pool_sizing():
    from benchmarks.prefix_sim.upstream import pool_pages

    c = V4Costs.flash()
    assert c.ours_token == 3850.25
    assert c.ours_snapshot == 3_289_088 + 21 * 80 * 1024 + 20 * 6 * 1024
    assert c.up_full_token == 179.25 * 21 + 6.75 * 20 == 3899.25
    assert c.up_swa_token == 585 * 43 + 320 * 21 == 31875
    full, swa = pool_pages(8 * 2**30, c)
    assert swa == int(full * 0.1)
    spent = full * 256 * c.up_full_token + swa * 256 * c.up_swa_token
    assert 8 * 2**30 - 300 * 256 * 7100 < spent <= 8 * 2**30


# ---- the end-to-end run's shortened traces (benchmarks/prefix_sim/serve.py) ------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_serve_short_traces_fit_the_micro_context(seed):
    """The e2e run starts two servers before sending anything: its traces must fit the micro model's
    context, keep the forks and n>1 prefills (max_new_tokens=0), and have prefixes to share."""
    from benchmarks.prefix_sim.serve import CONTEXT, SHORT, check_fits, short_specs, simulate

    for name in SHORT:
        specs = short_specs(name, seed)
        check_fits(name, specs)
        trace = traces.realize(specs, traces.seeded_outputs(seed))
        assert max(len(r.history) for r in trace) <= CONTEXT
        assert sum(simulate(trace)[0]) > 0
        if name in ("fork_tree", "n_sampling"):
            assert any(s.output_len == 0 for s in specs)
    with pytest.raises(SystemExit):
        check_fits("agentic", short_specs("agentic", 0, scale=1.0))
