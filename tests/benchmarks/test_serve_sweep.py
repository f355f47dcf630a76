"""``benchmarks.serve_sweep``'s tables: the cache-hit rows after the concurrencies, or before them
with ``--hits-first`` (the requests themselves need a server: ``tests/srt/test_server_e2e.py``)."""

from __future__ import annotations

from benchmarks import serve_sweep


def _fake_server(monkeypatch) -> list[str]:
    """Records what the sweep asks for, in order, and answers with fixed figures."""
    asked: list[str] = []

    def sweep(port, concurrency, input_len, output_len, per_client, seed):
        asked.append(f"sweep c={concurrency} out={output_len}")
        return {"tok_s": 100.0, "ttft_ms": 20.0, "tpot_ms": 3.0, "itl_ms": 3.0, "e2e_s": 0.2,
                "requests": concurrency * per_client}

    def hit_ttft(port, n, new, seed):
        asked.append(f"hit n={n}")
        return {"cold_ms": 50.0, "hit_ms": 10.0, "cached": n}

    monkeypatch.setattr(serve_sweep, "sweep", sweep)
    monkeypatch.setattr(serve_sweep, "hit_ttft", hit_ttft)
    monkeypatch.setattr(serve_sweep, "cache_counters", lambda port: None)
    return asked


def test_hit_rows_follow_the_concurrencies_by_default(monkeypatch, capsys):
    asked = _fake_server(monkeypatch)
    assert serve_sweep.main(["--concurrency", "1,8", "--hit-lengths", "1024", "--label", "x"]) == 0
    timed = [a for a in asked if a != "sweep c=2 out=8"]  # the start's warm-up round
    assert timed == ["sweep c=1 out=16", "sweep c=1 out=64", "sweep c=8 out=16", "sweep c=8 out=64",
                     "hit n=1024", "hit n=1024", "hit n=1024"]
    out = capsys.readouterr().out
    assert out.index("| concurrency |") < out.index("| prompt tokens |")
    assert "| x | 1024 | 50.0 | 10.0 | 1024 |" in out


def test_hits_first_prints_the_hit_rows_before_the_concurrencies(monkeypatch, capsys):
    asked = _fake_server(monkeypatch)
    assert serve_sweep.main(["--concurrency", "256", "--hit-lengths", "1024,65536", "--hits-first"]) == 0
    assert asked[1:] == ["hit n=1024"] * 3 + ["hit n=65536"] * 3 + ["sweep c=256 out=16", "sweep c=256 out=64"]
    out = capsys.readouterr().out
    assert out.index("| prompt tokens |") < out.index("| concurrency |")
    assert "|  | 256 | 100.0 | 20.0 | 3.00 | 3.00 | 0.20 | 768 | - |" in out  # 3 requests a client by default
