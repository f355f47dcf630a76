"""``bench_decode --rounds``: a case's paths timed in turns, each with its own switches, the
medians over the rounds and the pipelined time's spread (the timing itself needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import bench_decode
from sglang_dsv4.kernels import hc_split


def test_paths_are_timed_in_turns_with_their_own_switches(monkeypatch):
    monkeypatch.setattr(bench_decode, "_AS_STARTED", {})
    monkeypatch.setattr(hc_split, "FUSED_PRE", False)
    make = lambda: SimpleNamespace(name="graphs")  # noqa: E731
    a = bench_decode.switched("hc_fused_pre", make)
    b = bench_decode.switched("none", make)
    seen = []
    piped = {("a", 0): 0.010, ("b", 0): 0.020, ("a", 1): 0.012, ("b", 1): 0.021, ("a", 2): 0.011, ("b", 2): 0.019}
    rounds = {"a": 0, "b": 0}

    def fake_steps(path, steps):
        seen.append((path is a and "a" or "b", hc_split.FUSED_PRE, steps))
        return 0.005 if path is a else 0.006

    def fake_piped(path, steps):
        key = "a" if path is a else "b"
        t = piped[(key, rounds[key])]
        rounds[key] += 1
        return t

    monkeypatch.setattr(bench_decode, "time_steps", fake_steps)
    monkeypatch.setattr(bench_decode, "time_pipelined", fake_piped)
    out = bench_decode.time_in_turns([a, b], steps=7, rounds=3)
    assert seen == [("a", True, 7), ("b", False, 7)] * 3  # in turns, each under its own switch set
    (ms_a, piped_a, spread_a), (ms_b, piped_b, spread_b) = out
    assert (ms_a, ms_b) == (5.0, 6.0)
    assert abs(piped_a - 11.0) < 1e-9 and abs(piped_b - 20.0) < 1e-9  # medians, in ms
    assert abs(spread_a - 100 * 2 / 11) < 1e-9 and abs(spread_b - 100 * 2 / 20) < 1e-9


def test_a_path_made_outside_switched_keeps_the_switches_as_they_are(monkeypatch):
    monkeypatch.setattr(hc_split, "FUSED_PRE", True)
    bench_decode.apply_switches(SimpleNamespace(name="before"))
    assert hc_split.FUSED_PRE is True


def test_a_paths_cache_holds_every_round():
    # rounds x (3 warm-up + steps drained + steps pipelined) + the profiler's 3
    assert bench_decode.steps_needed(10, 1) == 26 and bench_decode.steps_needed(10, 3) == 72


def test_a_path_that_fails_leaves_the_others_timed(monkeypatch):
    a, b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    calls, errors = [], []

    def fake_steps(path, steps):
        calls.append(path.name)
        if path is b:
            raise RuntimeError("capture failed")
        return 0.004

    monkeypatch.setattr(bench_decode, "time_steps", fake_steps)
    monkeypatch.setattr(bench_decode, "time_pipelined", lambda path, steps: 0.003)
    out = bench_decode.time_in_turns([a, b], steps=2, rounds=3, failed=errors.append)
    assert calls == ["a", "b", "a", "a"]  # b is dropped after its failure
    assert out[1] is None and out[0] == (4.0, 3.0, 0.0) and len(errors) == 1
